"""Sequential spike tests on a whitened spectrum: from the top, top-down, against a residual floor, and on a
coherent second statistic (theory §5)."""

import numpy as np

from ..calibration import DEFAULT_CALIBRATION
from ..marchenko_pastur import (
    debias_spike,
    estimate_noise_variance,
    fit_mp_bulk,
    largest_eigenvalue_quantile,
    largest_eigenvalue_sf,
)
from ..spectral import entropy_effective_rank_from_singular_values
from ._base import RuleResult, _check_number, _checked_spectrum, _count_below, _roundoff_floor, _test_dof, interval_levels
from .identifiability import covering, rule_verdict

__all__ = ["top_down_p_values", "coherent_p_values", "residual_floor_p_values", "sequential_spike_test"]


def top_down_p_values(eigenvalues, n_columns, min_bulk_columns=None, max_rank=None, *, calibration=DEFAULT_CALIBRATION):
    """Multiplicity-adjusted evidence that at least ``k + 1`` spikes exist, from the bulk below each eigenvalue.

    For every ``k`` that leaves at least the calibration's ``top_down_min_bulk`` (4) eigenvalues
    from ``k + 1`` down, eigenvalue ``k + 1`` is tested against an MP law
    whose level *and* width are fitted to the quartiles of those eigenvalues
    alone (not to any above it)
    (:func:`rstar.marchenko_pastur.fit_mp_bulk`). The sequential test looks
    from the top, so when most of the spectrum is signal its noise level (from
    the middle of the spectrum, or a residual that holds structured terms) is
    a spike's, and it stops early even where a wide gap separates the last
    spike from the bulk; this scan sees that gap. Its ``K`` tests are
    Bonferroni-adjusted (``K p_k``), and ``q_k = min(1, K min_{j >= k} p_j)``:
    eigenvalue ``j + 1`` significant implies at least ``j + 1`` spikes, hence
    at least ``k + 1`` for every ``k <= j``. Were each raw p-value exact,
    ``P(min_k q_k < alpha) <= alpha`` under pure noise (family-wise); the
    lower part of an MP bulk is not an MP bulk, but its fitted width is never
    below the nominal one, and on white Wishart nulls the scan adds no false
    alarms (``tests/rules/test_intervals.py``). When the scan makes the count,
    :func:`sequential_spike_test` reports the noise level, width and cut of
    the bulk below it.

    Parameters
    ----------
    eigenvalues : ndarray of shape (p,)
        Descending.
    n_columns : float
        Nominal number of columns (the fitted bulk is never narrower).
    min_bulk_columns : float or None
        Lower bound on the fitted bulk's columns (see ``fit_mp_bulk``).
    max_rank : int or None
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``top_down_min_bulk`` (:mod:`rstar.calibration`).

    Returns
    -------
    ndarray of shape (K,)
        ``q_k`` for ``k = 0 .. K - 1``, non-decreasing (empty when
        ``p < top_down_min_bulk``).

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.rules import top_down_p_values
    >>> rng = np.random.default_rng(0)
    >>> W = rng.standard_normal((40, 2000))
    >>> W[:30] *= 2.0            # 30 of 40 directions are signal (theta = 3)
    >>> lam = np.linalg.eigvalsh(W @ W.T / 2000)[::-1]
    >>> q = top_down_p_values(lam, 2000)
    >>> int(np.sum(q < 0.01))
    30
    """
    lam = _checked_spectrum(eigenvalues)
    _check_number("n_columns", n_columns, 1)
    p = lam.size
    k_hi = p - calibration.top_down_min_bulk
    if max_rank is not None:
        k_hi = min(k_hi, int(max_rank) - 1)
    if k_hi < 0:
        return np.zeros(0)
    raw = np.ones(k_hi + 1)
    for k in range(k_hi + 1):
        sigma2, m_k = fit_mp_bulk(lam, n_columns, n_spikes=k, min_columns=min_bulk_columns)
        if sigma2 is not None and np.isfinite(sigma2) and sigma2 > 0:
            raw[k] = largest_eigenvalue_sf(lam[k], p - k, m_k, sigma2)
    adjusted = np.minimum(1.0, raw.size * np.minimum.accumulate(raw[::-1])[::-1])
    return adjusted


def coherent_p_values(eigenvalues, n_columns, noise_variance, noise_dof=None, alpha=0.01, max_rank=None, *,
                      calibration=DEFAULT_CALIBRATION):
    r"""Sequential p-values on the coherent query–key spectrum, Bonferroni-adjusted for combination.

    The whitened first moment of the linear query–key inversion
    (:func:`rstar.inversions.coherent_spectrum`) is a white Wishart with
    ``n_columns`` columns at ``noise_variance`` plus a signal of rank at most
    r\*, so its k-th sequential Tracy–Widom p-value tests the same
    hypothesis as the main statistic's (at least ``k + 1`` spikes). Its
    p-values are multiplied by the calibration's ``coherent_bonferroni`` (4: two statistics test
    each hypothesis, and the Tracy–Widom tail is liberal for small square
    Wisharts) and made monotone, so that the smaller of the two p-values
    keeps the false-alarm level (measured: 1.0% of 1000 linear-QK nulls at
    alpha = 1%, T = 24, d = d_v = 8, n = 150).

    Parameters
    ----------
    eigenvalues : ndarray of shape (p,)
        Descending.
    n_columns : float
    noise_variance : float
        The residual noise variance (same units).
    noise_dof : float or None
        Its degrees of freedom (None: exact).
    alpha : float, default=0.01
    max_rank : int or None
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``coherent_bonferroni`` and ``interval_factor`` (:mod:`rstar.calibration`).

    Returns
    -------
    ndarray
        Non-decreasing adjusted p-values, one per test run.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.rules import coherent_p_values
    >>> lam = np.array([60.0, 25.0, 3.1, 1.9, 1.2, 0.6, 0.3, 0.1])   # 8 x 8 white Wishart (edge 4) + 2 spikes
    >>> q = coherent_p_values(lam, 8, noise_variance=1.0)
    >>> int(np.sum(q < 0.01))
    2
    """
    lam = _checked_spectrum(eigenvalues)
    _check_number("n_columns", n_columns, 1)
    _check_number("noise_variance", noise_variance, 0, strict=True)
    factor = calibration.coherent_bonferroni
    res = sequential_spike_test(lam, n_columns, alpha / factor, noise_variance, max_rank,
                                noise_dof=noise_dof, calibration=calibration)
    q = np.minimum(1.0, factor * np.asarray(res.p_values, dtype=np.float64))
    return np.maximum.accumulate(q) if q.size else q


def residual_floor_p_values(eigenvalues, residual_power, min_bulk_columns, margin=None, max_rank=None, *,
                            calibration=DEFAULT_CALIBRATION):
    """Evidence that at least ``k + 1`` spikes stand above a bulk no higher than the residual's level.

    For the first-order softmax inversion the part of ``Y_i`` outside
    ``col(X_i)`` holds the noise and the higher-order terms; its power per
    degree of freedom ``rho`` measures the level of the bulk they leave
    inside ``col(X_i)`` (within 5% of the fitted bulk's median on average,
    above it when most of the spectrum is signal). That bulk is a sum of
    per-sample terms, so it has at least ``min_bulk_columns`` independent
    columns: no bulk at level ``rho`` is wider than MP with ratio
    ``p / min_bulk_columns``. Eigenvalue ``k + 1`` is tested against the
    largest eigenvalue of a ``(p - k) x min_bulk_columns`` Wishart at level
    ``margin * rho`` (Tracy–Widom tail,
    :func:`rstar.marchenko_pastur.largest_eigenvalue_sf`); the margin covers
    the residual's level missing the bulk's (on the held-out recovery grid
    the largest non-signal eigenvalue exceeded ``rho`` times that edge in 10%
    of softmax tasks, ``1.5 rho`` times it in 5%). The ``K`` p-values are
    Bonferroni-adjusted and made monotone like :func:`top_down_p_values`.

    Unlike the fitted-bulk tests this one needs no bulk at all, so it can
    count up to full rank: when every direction is signal the spectrum has
    no bulk to estimate the noise from, but the residual still has one.

    Parameters
    ----------
    eigenvalues : ndarray of shape (p,)
        Descending.
    residual_power : float
        The residual's power per degree of freedom, in the eigenvalues' units.
    min_bulk_columns : float
        Fewest independent columns the bulk can have (``>= 1``).
    margin : float or None, default=None
        Factor on ``residual_power`` (``>= 1``; None: the calibration's ``residual_floor_margin``, 2, chosen on
        the held-out recovery grid).
    max_rank : int or None
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``residual_floor_margin`` (:mod:`rstar.calibration`).

    Returns
    -------
    ndarray of shape (K,)
        Adjusted p-values ``q_k``, ``k = 0 .. K - 1``, non-decreasing
        (``K = p``, or ``max_rank``).

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.rules import residual_floor_p_values
    >>> lam = np.array([9.0, 7.0, 6.0, 5.0])      # every direction far above a residual level of 1
    >>> q = residual_floor_p_values(lam, 1.0, min_bulk_columns=200)
    >>> int(np.sum(q < 0.01))
    4
    """
    lam = _checked_spectrum(eigenvalues)
    _check_number("residual_power", residual_power, 0, strict=True)
    _check_number("min_bulk_columns", min_bulk_columns, 1)
    margin = calibration.residual_floor_margin if margin is None else margin
    _check_number("margin", margin, 1)
    p = lam.size
    K = p if max_rank is None else min(p, int(max_rank))
    if K <= 0:
        return np.zeros(0)
    level = float(margin) * float(residual_power)
    raw = np.array([largest_eigenvalue_sf(lam[k], p - k, float(min_bulk_columns), level) for k in range(K)])
    return np.minimum(1.0, K * np.minimum.accumulate(raw[::-1])[::-1])


def sequential_spike_test(eigenvalues, n_columns, alpha=0.01, noise_variance=None, max_rank=None,
                          fit_bulk_width=False, noise_dof=None, min_bulk_columns=None, noise_quantile=0.5,
                          top_down=None, residual_floor=None, coherent=None, *, calibration=DEFAULT_CALIBRATION):
    r"""Count spikes above the noise edge by sequential Tracy–Widom tests.

    For ``k = 0, 1, ...``: estimate the noise variance from the ``p - k``
    smallest eigenvalues (MP-median matching, unless ``noise_variance`` is
    known), and accept eigenvalue ``k + 1`` as signal iff it exceeds the
    ``1 - alpha`` quantile of the largest eigenvalue of a ``(p - k) x m``
    white Wishart matrix (in the spirit of Kritchman & Nadler 2008), i.e.
    iff its p-value is below ``alpha``. Stop at the first failure. Under pure
    noise the false-alarm rate is about ``alpha``.

    A ``noise_variance`` estimated independently of the spectrum with
    ``noise_dof`` degrees of freedom (a regression residual) enters the
    p-values with its estimation error
    (:func:`rstar.marchenko_pastur.largest_eigenvalue_sf`); so does the
    MP-median estimate, with ``MEDIAN_EFFICIENCY * (p - k) * m`` degrees of
    freedom.

    The tests go on past ``alpha`` up to the lenient level of
    :func:`interval_levels`, so that ``rank_interval`` — the counts at
    ``alpha / 10`` and at ``10 alpha`` — comes from the same p-values.

    Parameters
    ----------
    eigenvalues : ndarray of shape (p,)
        Descending whitened eigenvalues.
    n_columns : float
        Effective number of columns ``m``.
    alpha : float in (0, 1), default=0.01
    noise_variance : float or None
    max_rank : int or None
    fit_bulk_width : bool, default=False
        Also fit the bulk's effective number of columns to the lower half of
        the remaining spectrum (:func:`rstar.marchenko_pastur.fit_mp_bulk`),
        for statistics whose bulk is wider than white noise; with a given
        ``noise_variance`` only the width is fitted (from the lower quartile).
    noise_dof : float or None, default=None
        Degrees of freedom of ``noise_variance`` when it is an estimate
        (None: known exactly).
    min_bulk_columns : float or None, default=None
        With ``fit_bulk_width``: lower bound on the fitted bulk's number of
        columns (``min_columns`` of :func:`rstar.marchenko_pastur.fit_mp_bulk`).
    noise_quantile : float in (0, 1), default=0.5
        Quantile of the remaining eigenvalues matched to the MP law for the
        unknown noise level (0.5: the MP median).
    top_down : ndarray or None, default=None
        Adjusted top-down p-values (:func:`top_down_p_values`): test ``k``
        then reports ``min(p_k, top_down[k])``, so the count also stops no
        earlier than the last eigenvalue that stands out from the bulk below it.
    residual_floor : tuple (q, residual_power, columns, margin) or None, default=None
        Adjusted p-values of :func:`residual_floor_p_values` and the values
        they were computed with: test ``k`` then reports the smallest of its
        p-values, so the count also stops no earlier than the last
        eigenvalue above the residual-level bulk (possibly the full rank).
    coherent : tuple (q, eigenvalues, n_columns[, noise_variance]) or None, default=None
        Adjusted p-values ``q`` of the same hypotheses from another statistic
        whose signal has rank at most r\* (the coherent query–key spectrum,
        see :func:`coherent_p_values`), with that statistic's eigenvalues and
        columns, and optionally the noise level its test used (else this
        test's): test ``k`` also reports ``q[k]`` when smaller. When it makes
        the count, the cut reported is the largest eigenvalue left uncounted
        and the spike strengths are the coherent statistic's, in units of
        its noise level.
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``interval_factor`` (the levels of ``rank_interval``; :mod:`rstar.calibration`).

    Returns
    -------
    RuleResult

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.rules import sequential_spike_test
    >>> rng = np.random.default_rng(0)
    >>> W = rng.standard_normal((30, 3000))
    >>> W[:2] *= 3.0                      # two population spikes, theta = 8
    >>> lam = np.linalg.eigvalsh(W @ W.T / 3000)[::-1]
    >>> res = sequential_spike_test(lam, 3000)
    >>> res.rank, round(res.noise_variance, 1), res.rank_interval
    (2, 1.0, (2, 3))
    """
    lam = np.asarray(eigenvalues, dtype=np.float64)
    p = lam.size
    m = float(n_columns)
    k_max = p if max_rank is None else min(p, int(max_rank))
    floor = _roundoff_floor(lam)
    known = noise_variance is not None and not fit_bulk_width
    given_noise = noise_variance if fit_bulk_width else None
    level_lo, level_hi = interval_levels(alpha, calibration=calibration)
    stop_level = max(alpha, level_hi)
    p_values, fits = [], []   # fits[k] = (sigma2_k, m_k) used by test k
    seq_p = []                # the tests from the top alone
    bulk_exhausted = None     # k at which the bulk became too small to estimate the noise
    sigma2, m_k = noise_variance, m
    k = 0
    while k < k_max:
        if not known and p - k < 2:
            bulk_exhausted = k
            if residual_floor is None or k >= len(residual_floor[0]):
                break
            # no bulk left to estimate the noise from: only the residual floor can decide
            fits.append((sigma2, m_k))
            seq_p.append(1.0)
            p_values.append(min(1.0, float(residual_floor[0][k])))
            if p_values[-1] >= stop_level:
                break
            k += 1
            continue
        if not known:
            if fit_bulk_width:
                sigma2, m_k = fit_mp_bulk(lam, m, n_spikes=k, sigma2=given_noise, min_columns=min_bulk_columns)
            else:
                sigma2 = estimate_noise_variance(lam, m, n_spikes=k, quantile=noise_quantile)
        fits.append((sigma2, m_k))
        if sigma2 is None or not np.isfinite(sigma2) or sigma2 <= 0:
            p_k = 0.0 if lam[k] > floor else 1.0
        elif lam[k] <= floor:
            p_k = 1.0
        else:
            p_k = largest_eigenvalue_sf(lam[k], p - k, m_k, sigma2, _test_dof(known, fit_bulk_width, noise_dof, p - k,
                                                                               m_k))
        seq_p.append(float(p_k))
        if top_down is not None and k < len(top_down):
            p_k = min(p_k, float(top_down[k]))
        if residual_floor is not None and k < len(residual_floor[0]):
            p_k = min(p_k, float(residual_floor[0][k]))
        if coherent is not None and k < len(coherent[0]):
            p_k = min(p_k, float(coherent[0][k]))
        p_values.append(float(p_k))
        if p_k >= stop_level:
            break
        k += 1
    p_values = np.asarray(p_values)
    rank = _count_below(p_values, alpha)
    interval = (_count_below(p_values, level_lo), _count_below(p_values, level_hi))
    warnings = []
    floor_decided = residual_floor is not None and bulk_exhausted is not None and rank >= bulk_exhausted
    if bulk_exhausted is not None and rank == bulk_exhausted and not floor_decided:
        exhausted = rule_verdict("bulk_exhausted", p=p, rank=rank)
        warnings.append(exhausted)
        interval = covering(interval, [exhausted])
    # noise level and threshold of the test that stopped the count (or of the last one run)
    if fits:
        sigma2, m_k = fits[min(rank, len(fits) - 1)]
    elif not known and p >= 1:
        sigma2 = estimate_noise_variance(lam, m, n_spikes=0) if p >= 2 else None
    threshold = np.inf
    by_top_down = (top_down is not None and 0 < rank <= len(seq_p) and seq_p[rank - 1] >= alpha
                   and rank - 1 < len(top_down) and top_down[rank - 1] < alpha and rank < p)
    by_coherent = (not by_top_down and coherent is not None and 0 < rank <= len(seq_p) and seq_p[rank - 1] >= alpha
                   and rank - 1 < len(coherent[0]) and coherent[0][rank - 1] < alpha)
    by_floor = not by_top_down and not by_coherent and residual_floor is not None and (
        floor_decided or (0 < rank <= len(seq_p) and seq_p[rank - 1] >= alpha))
    if not known and rank > p / 2 and p > 1 and not by_floor:
        # a noise level from a bulk this small decides nothing: the count may be mostly noise (MiniLM tokens at
        # T = 512, d = 384, planted 8: the first-order statistic's structured bulk read 346 of 384, with (346, 346))
        spikes = rule_verdict("mostly_spikes", p=p, rank=rank, by_coherent=by_coherent)
        warnings.append(spikes)
        # (a count the coherent statistic decided rests on its own noise level, not this bulk's)
        interval = covering(interval, [spikes])
    if by_floor:
        # the last spike counted stood above the residual-level bulk: report that level, the widest
        # bulk it can have, and its cut at the floor test's level
        q_floor, sigma2, m_k, margin = residual_floor
        rows = max(p - rank, 1)
        threshold = max(largest_eigenvalue_quantile(rows, m_k, 1 - alpha / len(q_floor), margin * sigma2), floor)
    elif by_top_down:
        # the last spike counted stood out from the bulk below it, not from the level seen from
        # the top: report that bulk's fit (level, width) and its cut at the scan's level
        sigma2, m_k = fit_mp_bulk(lam, m, n_spikes=rank, min_columns=min_bulk_columns)
        if sigma2 is not None and np.isfinite(sigma2) and sigma2 > 0:
            threshold = max(largest_eigenvalue_quantile(p - rank, m_k, 1 - alpha / len(top_down), sigma2), floor)
    elif by_coherent:
        # the last spike counted was seen in the coherent statistic, below this spectrum's edge:
        # the cut on this spectrum is the largest eigenvalue left uncounted
        threshold = float(lam[rank]) if rank < p else floor
    elif sigma2 is not None and np.isfinite(sigma2) and sigma2 > 0:
        j = min(rank, p - 1)
        threshold = max(largest_eigenvalue_quantile(p - j, m_k, 1 - alpha, sigma2,
                                                    _test_dof(known, fit_bulk_width, noise_dof, p - j, m_k)), floor)
    elif sigma2 is not None and np.isfinite(sigma2):
        threshold = floor
    sigma2 = float("nan") if sigma2 is None else float(sigma2)
    if by_coherent and np.isfinite(sigma2) and sigma2 > 0:
        # spikes below this spectrum's edge: their strengths are those of the coherent statistic
        coh_lam, coh_m = np.asarray(coherent[1], dtype=np.float64), float(coherent[2])
        coh_sigma2 = float(coherent[3]) if len(coherent) > 3 and coherent[3] and coherent[3] > 0 else sigma2
        theta = debias_spike(coh_lam[:rank] / coh_sigma2, coh_lam.size / coh_m)
    elif np.isfinite(sigma2) and sigma2 > 0:
        theta = debias_spike(lam[:rank] / sigma2, p / m_k)
    else:
        theta = np.maximum(lam[:rank], 0.0)
    if not np.isfinite(threshold):
        threshold = float(lam[0]) if p else 0.0
    return RuleResult(rank, float(threshold), entropy_effective_rank_from_singular_values(np.sqrt(theta)),
                      sigma2, theta, p_values, warnings, interval)


