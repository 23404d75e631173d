"""Spectral complexity measures of a matrix (theory §1, paper eqs. 1–3).

Every measure is a pure function of the singular values
``s_1 >= ... >= s_q >= 0``. Each ``*_rank(M)`` function takes a matrix; the
``*_from_singular_values`` forms take the singular values directly, which is
what the rank rules use on eigenvalue spectra.

The zero matrix has rank 0 and every effective rank 0 (no division by 0).
For any non-zero ``M``::

    1 <= stable_rank(M) <= energy_effective_rank(M)
      <= entropy_effective_rank(M) <= numerical_rank(M)

References
----------
Roy, O. and Vetterli, M. (2007). The effective rank: a measure of effective
dimensionality. EUSIPCO.
"""

import numpy as np

__all__ = [
    "singular_values",
    "entropy_effective_rank",
    "energy_effective_rank",
    "stable_rank",
    "numerical_rank",
    "epsilon_energy_rank",
    "entropy_effective_rank_from_singular_values",
    "energy_effective_rank_from_singular_values",
    "stable_rank_from_singular_values",
]


def singular_values(M):
    """Singular values of a real matrix, in descending order.

    Parameters
    ----------
    M : array-like of shape (p, q)
        A finite real matrix.

    Returns
    -------
    s : ndarray of shape (min(p, q),)
        Singular values, descending, non-negative.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.spectral import singular_values
    >>> singular_values(np.diag([3.0, 1.0])).tolist()
    [3.0, 1.0]
    """
    M = _as_matrix(M)
    if M.size == 0:
        return np.zeros(0)
    return np.linalg.svd(M, compute_uv=False)


def _as_matrix(M):
    M = np.asarray(M)
    if M.dtype.kind not in "biuf":
        raise TypeError(f"M must be a real numeric matrix, got dtype {M.dtype}.")
    M = M.astype(np.float64, copy=False)
    if M.ndim != 2:
        raise ValueError(f"M must be a 2-D matrix, got an array with shape {M.shape}.")
    if not np.all(np.isfinite(M)):
        raise ValueError("M contains NaN or infinity.")
    return M


def _as_spectrum(s):
    s = np.asarray(s, dtype=np.float64).ravel()
    if not np.all(np.isfinite(s)):
        raise ValueError("singular values contain NaN or infinity.")
    if np.any(s < 0):
        raise ValueError("singular values must be non-negative.")
    return s


def _exp_entropy(p_unnormalised):
    """exp of the Shannon entropy of a non-negative weight vector; 0 if all zero."""
    total = p_unnormalised.sum()
    if total <= 0:
        return 0.0
    p = p_unnormalised / total
    p = p[p > 0]   # after the division: a subnormal weight can underflow to 0 (and contributes 0 * log 0 = 0)
    return float(np.exp(-np.sum(p * np.log(p))))


def _scaled(s):
    # Divide by the largest value first so that squaring cannot overflow or
    # underflow for matrices scaled by 1e±150.
    top = s.max() if s.size else 0.0
    return s / top if top > 0 else s


def entropy_effective_rank_from_singular_values(s):
    """Entropy effective rank exp(-sum p_i log p_i), p_i = s_i / sum s_j (eq. 1).

    Parameters
    ----------
    s : array-like of shape (q,)
        Non-negative singular values (any order).

    Returns
    -------
    float
        In ``[1, #nonzero]`` for a non-zero spectrum, 0 for an all-zero one.

    Examples
    --------
    >>> from rstar.spectral import entropy_effective_rank_from_singular_values
    >>> entropy_effective_rank_from_singular_values([2.0, 2.0, 0.0])
    2.0
    """
    return _exp_entropy(_scaled(_as_spectrum(s)))


def energy_effective_rank_from_singular_values(s):
    """Energy effective rank, p_i = s_i**2 / sum s_j**2 (eq. 2).

    Parameters
    ----------
    s : array-like of shape (q,)
        Non-negative singular values (any order).

    Returns
    -------
    float

    Examples
    --------
    >>> from rstar.spectral import energy_effective_rank_from_singular_values
    >>> round(energy_effective_rank_from_singular_values([1.0, 1.0, 1.0]), 6)
    3.0
    """
    return _exp_entropy(_scaled(_as_spectrum(s)) ** 2)


def stable_rank_from_singular_values(s):
    """Stable rank sum s_i**2 / max s_i**2 (eq. 3); 0 for an all-zero spectrum.

    Parameters
    ----------
    s : array-like of shape (q,)

    Returns
    -------
    float

    Examples
    --------
    >>> from rstar.spectral import stable_rank_from_singular_values
    >>> stable_rank_from_singular_values([2.0, 1.0])
    1.25
    """
    s = _scaled(_as_spectrum(s))
    if s.size == 0 or s.max() <= 0:
        return 0.0
    return float(np.sum(s**2))


def entropy_effective_rank(M):
    """Entropy effective rank R_eff of a matrix (Roy & Vetterli 2007, eq. 1).

    Parameters
    ----------
    M : array-like of shape (p, q)

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.spectral import entropy_effective_rank
    >>> entropy_effective_rank(np.eye(4))
    4.0
    """
    return entropy_effective_rank_from_singular_values(singular_values(M))


def energy_effective_rank(M):
    """Energy effective rank R̃_eff of a matrix (eq. 2).

    Parameters
    ----------
    M : array-like of shape (p, q)

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.spectral import energy_effective_rank
    >>> round(energy_effective_rank(np.diag([1.0, 1.0, 0.0])), 6)
    2.0
    """
    return energy_effective_rank_from_singular_values(singular_values(M))


def stable_rank(M):
    """Stable rank ||M||_F**2 / ||M||_2**2 (eq. 3).

    Parameters
    ----------
    M : array-like of shape (p, q)

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.spectral import stable_rank
    >>> stable_rank(np.eye(3))
    3.0
    """
    return stable_rank_from_singular_values(singular_values(M))


def numerical_rank(M, tol=None):
    """Number of singular values above a tolerance.

    Parameters
    ----------
    M : array-like of shape (p, q)
    tol : float or None, default=None
        Absolute tolerance. ``None`` uses numpy's default
        ``s_1 * max(p, q) * eps``.

    Returns
    -------
    int

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.spectral import numerical_rank
    >>> numerical_rank(np.outer([1.0, 2.0], [3.0, 4.0]))
    1
    """
    M = _as_matrix(M)
    s = singular_values(M)
    if s.size == 0:
        return 0
    if tol is None:
        tol = s[0] * max(M.shape) * np.finfo(np.float64).eps
    elif not np.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a finite non-negative number, got {tol!r}.")
    return int(np.sum(s > tol))


def epsilon_energy_rank(M, eps=0.1):
    """Smallest k whose leading singular values hold a (1 - eps**2) energy share.

    ``min{k : sum_{i<=k} s_i**2 >= (1 - eps**2) ||M||_F**2}`` (seed 003).

    Parameters
    ----------
    M : array-like of shape (p, q)
    eps : float in [0, 1], default=0.1

    Returns
    -------
    int
        0 for the zero matrix.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.spectral import epsilon_energy_rank
    >>> epsilon_energy_rank(np.diag([10.0, 1.0, 0.01]), eps=0.2)
    1
    """
    if not (np.isscalar(eps) and 0 <= eps <= 1):
        raise ValueError(f"eps must be a number in [0, 1], got {eps!r}.")
    s = _scaled(singular_values(M))
    energy = s**2
    total = energy.sum()
    if total <= 0:
        return 0
    cumulative = np.cumsum(energy) / total
    # tolerance for round-off in the cumulative sum
    return int(np.searchsorted(cumulative, (1 - eps**2) * (1 - 1e-12)) + 1)
