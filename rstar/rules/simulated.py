"""Tests against simulated null draws (least-squares inversions), and the cross-fit's Bonferroni union."""

import numpy as np

from ..calibration import DEFAULT_CALIBRATION
from ..marchenko_pastur import debias_spike
from ..spectral import entropy_effective_rank_from_singular_values
from ._base import RuleResult, _check_number, _count_below, interval_levels

__all__ = ["simulated_null_p_values", "simulated_null_result", "cross_fit_union_result"]


def simulated_null_p_values(matrix, null_draws, alpha=0.01, max_rank=None, null_shift=None, *,
                            calibration=DEFAULT_CALIBRATION):
    """Sequential p-values of the eigenvalues of ``M M^T / p`` against simulated noise draws.

    For a statistic ``M = S + N`` (``p x q``) whose noise ``N`` can be drawn
    exactly (the least-squares query–key inversion,
    :class:`rstar.inversions.QueryKeyLeastSquaresInversion`), test ``k``
    asks whether the ``(k+1)``-th eigenvalue ``s_{k+1}^2 / p`` is larger than
    under the hypothesis ``rank S = k``: a parametric bootstrap of that
    hypothesis, with ``S`` taken as the rank-``k`` truncation ``S_k`` of
    ``M`` and the null law that of ``s_{k+1}(S_k + N_j)^2 / p`` over the
    ``B`` draws ``N_j``. The p-value is the Monte Carlo
    ``(1 + #{null >= observed}) / (B + 1)`` (no asymptotic law of the
    largest eigenvalue is assumed, so it holds for any noise covariance that
    the draws reproduce; its smallest value is ``1 / (B + 1)``).
    Where the eigenvalue exceeds the largest ``s_1(N_j)^2 / p`` (Weyl:
    ``s_{k+1}(S_k + N) <= s_1(N)``), the test rejects with that smallest
    p-value without the draws being deflated. The tests run on up to the
    first p-value at or above the lenient level of :func:`interval_levels`.

    Parameters
    ----------
    matrix : ndarray of shape (p, q)
    null_draws : ndarray of shape (B, p, q)
        Draws of the noise ``N``.
    alpha : float in (0, 1), default=0.01
    max_rank : int or None, default=None
    null_shift : object or None, default=None
        Noise that grows with the signal, linear in it: ``null_shift.start()``
        returns an accumulator with ``add(u, w, weight)`` (add the signal
        ``weight * u w^T``) and ``draws()`` (``B`` draws, shape
        ``(B, p, q)``, of what the signal so far adds to the noise);
        ``null_shift.scaled(f)``
        is the same with draws ``f`` times as large (rules rescale the
        noise level with it). Test ``k`` then draws
        ``S_k + N_j + L_j(S_k)`` (the cross-fitted query–key inversion: the
        error of the fitted value map,
        :class:`rstar.inversions._numerics.value_error.ValueMapErrorLeak`). Test 0 is unchanged.
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``interval_factor`` (the lenient level the tests run to; :mod:`rstar.calibration`).

    Returns
    -------
    p_values : ndarray of shape (n_tested,)
    cuts : ndarray of shape (n_tested,)
        The ``1 - alpha`` quantile of each test's null law (eigenvalue units).

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.rules import simulated_null_p_values
    >>> rng = np.random.default_rng(0)
    >>> S = np.zeros((10, 10)); S[0, 0], S[1, 1] = 8.0, 6.0
    >>> M = S + rng.standard_normal((10, 10))
    >>> q, cuts = simulated_null_p_values(M, rng.standard_normal((500, 10, 10)))
    >>> int(np.sum(np.cumprod(q < 0.01)))
    2
    """
    M = np.asarray(matrix, dtype=np.float64)
    Z = np.asarray(null_draws, dtype=np.float64)
    if M.ndim != 2 or M.size == 0 or not np.all(np.isfinite(M)):
        raise ValueError(f"matrix must be a finite, non-empty 2-D array, got shape {M.shape}.")
    if Z.ndim != 3 or Z.shape[1:] != M.shape or Z.shape[0] < 1 or not np.all(np.isfinite(Z)):
        raise ValueError(f"null_draws must be a finite array of shape (B, {M.shape[0]}, {M.shape[1]}) with B >= 1, "
                         f"got shape {Z.shape}.")
    _check_number("alpha", alpha, 0.0, strict=True)
    p, q = M.shape
    B = Z.shape[0]
    U, s, Wt = np.linalg.svd(M)
    lam = np.zeros(p)
    lam[: s.size] = s**2 / p
    top = np.linalg.svd(Z, compute_uv=False)[:, 0] ** 2 / p
    stop_level = max(alpha, interval_levels(alpha, calibration=calibration)[1])
    k_max = min(p, q) if max_rank is None else min(p, q, int(max_rank))
    p_values, cuts = [], []
    shift = null_shift.start() if null_shift is not None else None
    for k in range(k_max):
        draws = Z
        if shift is not None and k > 0:
            shift.add(U[:, k - 1], Wt[k - 1], s[k - 1])
            draws = Z + shift.draws()
            top = np.linalg.svd(draws, compute_uv=False)[:, 0] ** 2 / p
        if lam[k] > top.max():
            null = top
        else:
            S_k = (U[:, :k] * s[:k]) @ Wt[:k]
            null = np.linalg.svd(S_k + draws, compute_uv=False)[:, k] ** 2 / p
        p_values.append((1.0 + np.sum(null >= lam[k])) / (B + 1.0))
        cuts.append(float(np.quantile(null, 1.0 - alpha)))
        if p_values[-1] >= stop_level:
            break
    return np.asarray(p_values), np.asarray(cuts)


def _union_p_values(q1, q2, alpha, calibration=DEFAULT_CALIBRATION):
    """Bonferroni union of two sequential p-value lists: element-wise ``min(1, 2 min(q1, q2))`` (a missing entry
    is 1: that list stopped)."""
    k = max(len(q1), len(q2))
    a, b = np.ones(k), np.ones(k)
    a[:len(q1)], b[:len(q2)] = q1, q2
    q = np.minimum(1.0, 2.0 * np.minimum(a, b))
    # keep the entries up to the first one not significant at the lenient level, as each list does
    lenient = interval_levels(alpha, calibration=calibration)[1]
    stop = np.flatnonzero(q >= lenient)
    return q[:stop[0] + 1] if stop.size else q


def _direction_p_values(null, noise_variance, alpha, max_rank, calibration):
    """Sequential p-values, null quantiles and noise variance of one :class:`SimulatedNull`."""
    sigma2 = float(null.noise_variance)
    draws, shift = null.draws, null.shift
    if noise_variance is not None and sigma2 > 0:
        # the user's noise level: rescale the draws (made at the residual estimate), and the value map's error
        factor = float(np.sqrt(noise_variance / sigma2))
        draws = draws * factor
        shift = shift.scaled(factor) if shift is not None else None
        sigma2 = float(noise_variance)
    q, cuts = simulated_null_p_values(null.statistic_matrix, draws, alpha, max_rank, null_shift=shift,
                                      calibration=calibration)
    return q, cuts, sigma2, draws.shape[0]


def _check_draws_can_reject(n_draws, n_tests, alpha, calibration):
    """ValueError unless the smallest Monte Carlo p-value, ``n_tests / (n_draws + 1)``, is below ``alpha``."""
    smallest = n_tests / (n_draws + 1.0)
    if smallest >= alpha:
        need = int(np.ceil(n_tests / alpha))
        raise ValueError(f"n_null_draws={n_draws} gives p-values of at least {smallest:.4g} "
                         f"({n_tests} / (n_null_draws + 1)), not below alpha={alpha:g}: no spike could ever be "
                         f"detected. Use n_null_draws >= {need} ({calibration.default_null_draws} is the default).")


def simulated_null_result(null, noise_variance, alpha, max_rank, *, calibration=DEFAULT_CALIBRATION):
    """The rule's result on a statistic with a :class:`~rstar.inversions.SimulatedNull`."""
    _check_draws_can_reject(null.n_draws, 1, alpha, calibration)
    q, cuts, sigma2, n_draws = _direction_p_values(null, noise_variance, alpha, max_rank, calibration)
    return _result_from_p_values(null, q, cuts, sigma2, alpha, 1, n_draws, calibration)


def cross_fit_union_result(null, noise_variance, alpha, max_rank, *, calibration=DEFAULT_CALIBRATION):
    """The rule's result on a :class:`~rstar.inversions.CrossFitNull`: a Bonferroni union of its directions.

    Each direction's test carries its fitted V's error (its ``shift``), so each is a level-alpha test on its
    own; a spike counts where either counts it at alpha / 2. A direction whose V is a poor local optimum of its
    half's fit (``poor_fit``) is left out, the other still at alpha / 2, so that the rejections stay a subset
    of the union's.
    """
    _check_draws_can_reject(min(d.n_draws for d in null.directions), 2, alpha, calibration)
    directions = [w for w in null.directions if not w.poor_fit] or list(null.directions)
    tested = [_direction_p_values(w, noise_variance, alpha, max_rank, calibration) for w in directions]
    q = _union_p_values(tested[0][0], tested[1][0] if len(tested) > 1 else np.ones(1), alpha, calibration)
    _, cuts, sigma2, n_draws = tested[0]
    return _result_from_p_values(directions[0], q, cuts, sigma2, alpha, 2, n_draws, calibration)


def _result_from_p_values(ws, q, cuts, sigma2, alpha, n_tests, n_draws, calibration):
    """The rule's result from the sequential p-values ``q`` (the union of ``n_tests`` directions) and the null
    quantiles ``cuts`` of the statistic ``ws`` they test."""
    rank = _count_below(q, alpha)
    lo, hi = interval_levels(alpha, calibration=calibration)
    # B draws give Monte Carlo p-values of at least 1/(B+1), times n_tests for a union: a strict level below
    # n_tests/B could never reject, so it is floored there (1/B = alpha/10 at alpha = 1% and B = 1000)
    lo = min(max(lo, n_tests / n_draws), alpha)
    lam = ws.eigenvalues
    p = lam.size
    threshold = float(cuts[min(rank, len(cuts) - 1)]) if len(cuts) else float(lam[0]) if p else 0.0
    if sigma2 > 0:
        theta = debias_spike(lam[:rank] / sigma2, p / ws.n_columns)
    else:
        theta = np.maximum(lam[:rank], 0.0)
    return RuleResult(rank, threshold, entropy_effective_rank_from_singular_values(np.sqrt(np.maximum(theta, 0.0))),
                      sigma2, theta, q, [], (_count_below(q, lo), _count_below(q, hi)))


