"""MP-corrected rank of a learned operator (theory §6). Pure numpy, no torch.

A trained student's operator ``K_hat`` (the T x T mixing matrix of B0 or the
d x d query–key kernel of B1–B3) is the population operator plus a
finite-sample estimation error. Near the optimum the error is Gaussian with
covariance ``sigma^2 F^{-1}`` (the least-squares / Fisher information
covariance), where ``F = J^T J`` and ``J`` is the Jacobian of all n·T·d_v
predictions with respect to the entries of the operator, the other weights
held at their fitted values, and ``sigma^2`` is the per-entry noise variance
of Y (estimated by the training residual). We replace that error by the
isotropic Gaussian matrix with the same total variance, i.e. i.i.d. entries
of variance

    s^2 = sigma^2 tr(F^{-1}) / (p q)            (p x q operator),

whose largest singular value is at ``s (sqrt(p) + sqrt(q))`` (the square root
of the Marchenko–Pastur bulk edge, :func:`rstar.marchenko_pastur.mp_edges`)
and fluctuates on the Tracy–Widom scale. The *noise threshold* is its
``1 - alpha`` quantile,

    tau = sqrt(q * lambda_{1-alpha}),  lambda from
    :func:`rstar.marchenko_pastur.largest_eigenvalue_quantile` (Johnstone 2001),

and only singular values of ``K_hat`` above ``tau`` count: ``rank`` is their
number and the effective rank (R_eff or R̃_eff, :mod:`rstar.spectral`) is
computed on them alone. Singular values that an estimator of the operator's
own size would produce from noise alone are thereby discarded, which is the
Marchenko–Pastur correction of Theorem 4 of the paper.

References
----------
Johnstone, I. M. (2001). On the distribution of the largest eigenvalue in
principal components analysis. Ann. Statist. 29(2).
Marchenko, V. A. and Pastur, L. A. (1967). Math. USSR-Sbornik 1(4).
Seber, G. A. F. and Wild, C. J. (1989). Nonlinear Regression, §2.1
(asymptotic covariance ``sigma^2 (J^T J)^{-1}`` of least-squares estimates).
"""

import numpy as np
from sklearn.utils import Bunch

from ..marchenko_pastur import largest_eigenvalue_quantile
from ..spectral import (energy_effective_rank_from_singular_values, entropy_effective_rank_from_singular_values,
                        singular_values)

__all__ = ["kronecker_entry_variance", "operator_entry_variance", "operator_noise_threshold", "mp_corrected_rank"]


def operator_entry_variance(fisher, noise_variance):
    """Average per-entry variance ``sigma^2 tr(F^{-1}) / m`` of an estimated operator.

    Parameters
    ----------
    fisher : array-like of shape (m, m)
        ``F = J^T J`` for the m = p·q entries of the operator (symmetric,
        positive semi-definite). Directions with eigenvalue below
        ``1e-10 * max`` are unidentified and left out of the trace (pseudo-inverse).
    noise_variance : float
        sigma^2, the per-entry noise variance of the targets (>= 0).

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.students import operator_entry_variance
    >>> operator_entry_variance(100.0 * np.eye(4), 0.25)
    0.0025
    """
    F = _symmetric_psd(fisher, "fisher")
    return _mean_inverse(np.linalg.eigvalsh(F), _noise_variance(noise_variance))


def kronecker_entry_variance(query_factor, key_factor, noise_variance):
    """:func:`operator_entry_variance` for a Fisher information ``F = A (x) B`` given by its two factors.

    ``tr((A (x) B)^{-1}) = sum_ij 1 / (a_i b_j)`` over the products of their eigenvalues (those below
    ``1e-10`` times the largest product are left out, as the pseudo-inverse does), divided by the ``p q`` entries:
    nothing of size ``p q x p q`` is formed.

    Parameters
    ----------
    query_factor : array-like of shape (p, p)
    key_factor : array-like of shape (q, q)
        Symmetric positive semi-definite.
    noise_variance : float

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.students import kronecker_entry_variance, operator_entry_variance
    >>> A, B = np.diag([1.0, 2.0]), np.diag([3.0, 4.0, 5.0])
    >>> bool(np.isclose(kronecker_entry_variance(A, B, 0.5), operator_entry_variance(np.kron(A, B), 0.5)))
    True
    """
    a = np.linalg.eigvalsh(_symmetric_psd(query_factor, "query_factor"))
    b = np.linalg.eigvalsh(_symmetric_psd(key_factor, "key_factor"))
    return _mean_inverse(np.outer(a, b).ravel(), _noise_variance(noise_variance))


def _mean_inverse(eigenvalues, noise_variance):
    """``noise_variance`` times the mean of ``1 / eigenvalue`` over all m of them, those below ``1e-10`` times the
    largest left out of the sum (the pseudo-inverse's trace over m)."""
    top = eigenvalues.max(initial=0.0)
    if top <= 0:
        return float("inf") if noise_variance > 0 else 0.0
    kept = eigenvalues[eigenvalues > 1e-10 * top]
    return float(noise_variance * np.sum(1.0 / kept) / eigenvalues.size)


def _noise_variance(value):
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"noise_variance must be a finite non-negative number, got {value!r}.")
    return value


def _symmetric_psd(M, name):
    M = np.asarray(M, dtype=np.float64)
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {M.shape}.")
    if not np.all(np.isfinite(M)):
        raise ValueError(f"{name} contains NaN or infinity.")
    return (M + M.T) / 2


def operator_noise_threshold(shape, entry_variance, alpha=0.01):
    """Largest singular value that noise alone reaches with probability ``1 - alpha``.

    For a ``p x q`` matrix of i.i.d. N(0, s^2) entries: the ``1 - alpha``
    quantile of its top singular value, ``sqrt(q * lambda)`` with ``lambda`` the
    Tracy–Widom-corrected quantile of the top eigenvalue of ``W W^T / q``
    (``p <= q``), which tends to the Marchenko–Pastur edge
    ``s (sqrt(p) + sqrt(q))``.

    Parameters
    ----------
    shape : tuple of int (p, q)
    entry_variance : float
        s^2 (>= 0).
    alpha : float in (0, 1), default=0.01
        False-alarm probability of counting a pure-noise direction.

    Returns
    -------
    float

    Examples
    --------
    >>> from rstar.students import operator_noise_threshold
    >>> tau = operator_noise_threshold((12, 12), 1.0)
    >>> bool(2 * 12 ** 0.5 < tau < 2 * 12 ** 0.5 + 1.5)
    True
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}.")
    p, q = sorted(int(k) for k in shape)
    if p < 1:
        return 0.0
    entry_variance = float(entry_variance)
    if np.isnan(entry_variance) or entry_variance < 0:
        raise ValueError(f"entry_variance must be a non-negative number, got {entry_variance!r}.")
    if entry_variance == 0 or np.isinf(entry_variance):
        return entry_variance  # no noise: every non-zero value counts; unidentified: none does
    lam = largest_eigenvalue_quantile(p, q, 1 - alpha, sigma2=entry_variance)
    return float(np.sqrt(q * lam))


def mp_corrected_rank(operator, entry_variance, alpha=0.01, measure="entropy"):
    """Rank and effective rank of a learned operator, counting only singular values above noise.

    Parameters
    ----------
    operator : array-like of shape (p, q)
        The learned operator (``A`` or ``W_Q W_K^T``).
    entry_variance : float
        Per-entry variance s^2 of its estimation error
        (:func:`operator_entry_variance`).
    alpha : float, default=0.01
        False-alarm level of :func:`operator_noise_threshold`.
    measure : {"entropy", "energy"}, default="entropy"
        ``"entropy"``: R_eff (Roy & Vetterli 2007, eq. 1), used for the linear
        students; ``"energy"``: R̃_eff (eq. 2), used for softmax students.

    Returns
    -------
    Bunch
        ``rank`` (int), ``effective_rank`` (float, 0 when nothing is above
        noise), ``threshold`` (tau), ``singular_values`` (all, descending),
        ``raw_effective_rank`` (the same measure on all singular values, no
        correction).

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.students import mp_corrected_rank
    >>> rng = np.random.default_rng(0)
    >>> K = np.diag([1.0, 1.0, 1.0, 0, 0, 0, 0, 0]) + 1e-3 * rng.standard_normal((8, 8))
    >>> out = mp_corrected_rank(K, entry_variance=1e-6)
    >>> out.rank, round(out.effective_rank, 2)
    (3, 3.0)
    """
    if measure not in ("entropy", "energy"):
        raise ValueError(f"measure must be 'entropy' or 'energy', got {measure!r}.")
    s = singular_values(operator)
    tau = operator_noise_threshold(np.shape(operator), entry_variance, alpha)
    kept = s[s > tau]
    measure_fn = (entropy_effective_rank_from_singular_values if measure == "entropy"
                  else energy_effective_rank_from_singular_values)
    return Bunch(rank=int(kept.size), effective_rank=float(measure_fn(kept)), threshold=tau,
                 singular_values=s, raw_effective_rank=float(measure_fn(s)))
