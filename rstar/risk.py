"""Risk against rank: the data-only curve behind the tolerance rank r*(ε) (theory §2, paper eq. 4).

With a tolerance ε, r*(ε) is the smallest rank r whose best rank-r model has a risk within ``ε Var(Y)`` of the
unconstrained model's. A data-only estimator fits, for every rank r, a rank-r operator (the inversion's
closed-form operator in the span of its top-r components, or the truncation of its full-rank kernel: see
each inversion's ``rank_residuals``) and measures its residual sum of squares on the samples it was fitted on.
The *relative excess risk*::

    curve[r] = (RSS(r) - RSS(full)) / TSS,   TSS = sum over entries of (Y - column mean of Y)^2

is then read at any ε: ``r(ε) = min{r : curve[r] <= ε}``. A rank-r model that is not the best one only
raises ``RSS(r)``, so ``r(ε)`` errs towards ranks that suffice.

Pure functions on arrays and per-chunk sums (so a source read in passes, :mod:`rstar.streaming`, gives the same
curve).
"""

from dataclasses import dataclass

import numpy as np

__all__ = ["centred_sums", "total_sum_of_squares", "operator_residual_sum", "relative_excess_risk",
           "excess_risk_standard_error", "excess_risk_fit_standard_error", "excess_risk_upper_bound",
           "rank_at_tolerance", "held_out_reach", "floor_margin", "rank_read_again", "tolerance_interval",
           "tolerance_reading", "ToleranceReading"]



def centred_sums(X, Y):
    """A chunk's ``(sum Y**2 per column, sum Y per column, number of rows)`` (for :func:`total_sum_of_squares`)."""
    Yf = np.asarray(Y, dtype=float).reshape(-1, Y.shape[-1])
    return (Yf**2).sum(axis=0), Yf.sum(axis=0), float(Yf.shape[0])


def total_sum_of_squares(sums):
    """``sum (Y - column mean)^2`` from the summed :func:`centred_sums` (n T rows of Y)."""
    sq, s, m = sums
    return float(np.sum(sq - s**2 / max(m, 1.0)))


def operator_residual_sum(X, Y, operator):
    """A chunk's residual sum of squares ``sum (Y - operator.predict(X))^2``."""
    return float(np.sum((Y - operator.predict(X)) ** 2))


def relative_excess_risk(rss, rss_full, tss):
    """``(rss - rss_full) / tss`` for each rank (clipped at 0: an in-sample full model fits at least as well).

    Parameters
    ----------
    rss : array-like of shape (n_ranks,)
        Residual sums of squares of the rank-r models, r = 0, 1, ...
    rss_full : float
        That of the unconstrained (full-rank) model.
    tss : float
        Total sum of squares of Y about its column means.

    Returns
    -------
    curve : ndarray of shape (n_ranks,)

    Examples
    --------
    >>> relative_excess_risk([10.0, 4.0, 1.2, 1.0], 1.0, 10.0)
    array([0.9 , 0.3 , 0.02, 0.  ])
    """
    rss = np.asarray(rss, dtype=float)
    if not tss > 0:
        return np.zeros_like(rss)
    return np.clip((rss - float(rss_full)) / float(tss), 0.0, None)


def excess_risk_standard_error(sample_rss, sample_rss_full, tss):
    """Standard error of each rank's relative excess risk over the samples it was measured on.

    The excess is a sum over samples, ``sum_i (rss_i(r) - rss_i(full)) / TSS``; with independent samples its
    standard error is ``sqrt(n) std_i(rss_i(r) - rss_i(full)) / TSS`` (the sampling error of the curve, not of the
    models behind it).

    Parameters
    ----------
    sample_rss : array-like of shape (n_ranks, n)
        Each sample's residual sum of squares under the rank-r models.
    sample_rss_full : array-like of shape (n,)
        Under the full-rank model.
    tss : float

    Returns
    -------
    se : ndarray of shape (n_ranks,)

    Examples
    --------
    >>> excess_risk_standard_error([[3.0, 1.0], [1.0, 1.0]], [1.0, 1.0], 4.0)
    array([0.5, 0. ])
    """
    diff = np.asarray(sample_rss, dtype=float) - np.asarray(sample_rss_full, dtype=float)[None, :]
    n = diff.shape[1]
    if n < 2 or not tss > 0:
        return np.zeros(diff.shape[0])
    return np.sqrt(n) * diff.std(axis=1, ddof=1) / float(tss)


def excess_risk_upper_bound(curve, se, level):
    """The one-sided ``1 - level`` upper confidence bound ``curve + z se`` (z the normal quantile); ``level = 0.5``
    gives the curve itself.

    Examples
    --------
    >>> excess_risk_upper_bound([0.3, 0.02], [0.01, 0.01], 0.5)
    array([0.3 , 0.02])
    """
    from scipy.stats import norm

    z = max(float(norm.ppf(1.0 - float(level))), 0.0)
    return np.asarray(curve, dtype=float) + z * np.asarray(se, dtype=float)


def rank_at_tolerance(curve, tolerance):
    """The smallest rank r with ``curve[r] <= tolerance``, or None if no rank of the curve reaches it.

    Examples
    --------
    >>> rank_at_tolerance([0.9, 0.3, 0.02, 0.0], 0.05)
    2
    >>> rank_at_tolerance([0.9, 0.3], 0.05) is None
    True
    """
    hits = np.flatnonzero(np.asarray(curve, dtype=float) <= float(tolerance))
    return int(hits[0]) if hits.size else None


def held_out_reach(upper, floor, floor_in_sample, tolerance, floor_margin=0.0):
    """The smallest rank whose models' own held-out risk reaches ``tolerance``:
    ``upper[r] + floor + floor_margin <= tolerance`` (None where no rank of the curve does, or where the curve is
    not cross-fitted: ``floor_in_sample`` None).

    A cross-fitted curve's excess is measured from the full models' held-out residual, ``floor``; adding it back
    gives each rank-r model's own risk on samples it was not fitted on, relative to Var(Y), with the curve's
    confidence margin and the floor's own, ``floor_margin`` (the same quantile times the floor's standard error
    over samples, ``risk_curve_floor_se``: the standard error of a sum is at most the sum of its terms', so the
    two margins added bound the own risk's at that level). The best unconstrained model's risk is at least zero, so
    a rank-r model within the tolerance there has an excess within it over any floor: r*(tolerance) is at most
    this rank, whether or not the full model the curve subtracts was the best one, up to the held-out estimate's
    sampling error. An in-sample curve has no such bound (a model does better on its own samples). The curve is
    measured up to where its upper bound reaches half the tolerance (:func:`tolerance_reading`), so a rank beyond
    that is not found (None).

    Examples
    --------
    >>> held_out_reach([0.3, 0.04, 0.01, 0.0], 0.02, 0.0, 0.05)
    2
    >>> held_out_reach([0.3, 0.04, 0.01, 0.0], 0.02, 0.0, 0.05, floor_margin=0.025)
    3
    >>> held_out_reach([0.3, 0.04], 0.02, None, 0.05) is None
    True
    """
    if floor_in_sample is None:
        return None
    return rank_at_tolerance(np.asarray(upper, dtype=float) + float(floor) + float(floor_margin), tolerance)


def floor_margin(floor_se, level):
    """The floor's confidence margin at ``level`` (:func:`excess_risk_upper_bound`'s quantile times
    ``floor_se``; 0 where the floor's standard error is not known)."""
    if floor_se is None:
        return 0.0
    return float(excess_risk_upper_bound([0.0], [float(floor_se)], level)[0])


@dataclass
class ToleranceReading:
    """r*(ε) read off the risk curve of one fit (:func:`tolerance_reading`).

    Attributes
    ----------
    rank : int
        The smallest rank whose upper bound reaches the tolerance (d where none does).
    interval : tuple of two ints
        ``(r(2 ε)`` off the curve, ``r(ε / 2)`` off its upper bound), d for an end not reached.
    risk_curve, risk_curve_se, risk_curve_upper, risk_curve_distance : ndarray or None
        The curve, its standard error over samples (None where not measured per sample), the upper bound read,
        and the distance of ``predict``'s models from the curve's (None where they are the same models).
    risk_curve_resolution : float or None
        The halves' disagreement (the factored least squares), relative to Var(Y).
    risk_curve_floor : float
        The unconstrained model's residual sum of squares that the curve subtracts, ``RSS(full) / TSS``: out of
        sample where the curve is cross-fitted (each half's full model on the other half), in sample elsewhere.
    risk_curve_floor_in_sample : float or None
        Where the curve is cross-fitted: the same full models on the halves they were fitted on, ``RSS / TSS``.
        The best unconstrained model's risk is at most the held-out side in expectation (any fitted model does
        worse on other samples), and at least the in-sample side where the fit minimises the squared error on Y
        (the factored least squares; a fit on the log-attention minimises another loss), so the curve, measured
        against the held-out side, may understate the excess by up to their difference. None elsewhere.
    risk_curve_fit_se : ndarray or None
        Where the curve is cross-fitted and measured per sample: its standard error with the fits' own
        variability (:func:`excess_risk_fit_standard_error`), at least ``risk_curve_se``; reported, not read.
    full_rank : int or None
        d where the curve reached the rank beyond which its models no longer change without reaching the
        tolerance (only the full model is then known to reach it).
    risk_curve_floor_se : float or None
        Where the curve is measured per sample: the floor's standard error over the samples,
        ``sqrt(n) std_i(RSS_i(full)) / TSS`` (:func:`held_out_reach`'s margin on it). None elsewhere.
    risk_curve_floor_fit_se : float or None
        Where the curve is cross-fitted and measured per sample: the floor's standard error with the full models'
        own variability (:func:`excess_risk_fit_standard_error` of the full models' residuals: each block's floor
        is scored by the model fitted on the other block), at least ``risk_curve_floor_se``. What another model
        fitted on these samples (``predict``'s, from both halves) may leave held out is uncertain by at least
        this much; reported, not read.
    """

    rank: int
    interval: tuple
    risk_curve: np.ndarray
    risk_curve_se: object
    risk_curve_upper: np.ndarray
    risk_curve_distance: object
    risk_curve_resolution: object
    risk_curve_floor: float
    risk_curve_floor_in_sample: object
    full_rank: object
    risk_curve_fit_se: object = None
    risk_curve_floor_se: object = None
    risk_curve_floor_fit_se: object = None


def excess_risk_fit_standard_error(sample_rss, sample_rss_full, tss, blocks):
    """Standard error of each rank's relative excess risk with the models' own variability, where the curve is
    cross-fitted: the samples come in two blocks, each scored by a model fitted on the other block.

    :func:`excess_risk_standard_error` treats the models as fixed; here each block's mean excess per sample,
    ``m_b = sum_{i in b} (rss_i(r) - rss_i(full)) / n_b``, is one replicate of fit and measurement together, and
    the total (``n_1 m_1 + n_2 m_2``, about ``n (m_1 + m_2) / 2``) has the standard error ``n |m_1 - m_2| / 2``
    (relative to TSS), an estimate with one degree of freedom (for equal blocks: the blocks' excess sums'
    difference; its root mean square is the standard error, its typical value about a fifth below). Two-fold
    cross-validation has no unbiased estimate of its variance (Bengio & Grandvalet, 2004, JMLR 5: the folds'
    models share samples with each other's scores), so this is a scale, not an interval: it is reported at least
    the sampling error.

    Parameters
    ----------
    sample_rss : array-like of shape (n_ranks, n)
    sample_rss_full : array-like of shape (n,)
    tss : float
    blocks : tuple of two ints
        The sizes of the two blocks, in the samples' order (positive, summing to n: else ValueError).

    Returns
    -------
    se : ndarray of shape (n_ranks,)

    Examples
    --------
    >>> excess_risk_fit_standard_error([[2.0, 2.0, 1.0, 1.0]], [1.0, 1.0, 1.0, 1.0], 4.0, (2, 2))
    array([0.5])
    """
    diff = np.asarray(sample_rss, dtype=float) - np.asarray(sample_rss_full, dtype=float)[None, :]
    n1, n2 = (int(b) for b in blocks)
    n = diff.shape[1]
    if n1 < 1 or n2 < 1 or n1 + n2 != n:
        raise ValueError(f"blocks {tuple(blocks)} do not split the {n} samples into two")
    sampling = excess_risk_standard_error(sample_rss, sample_rss_full, tss)
    if not tss > 0:
        return sampling
    between = n * np.abs(diff[:, :n1].mean(axis=1) - diff[:, n1:].mean(axis=1)) / (2.0 * float(tss))
    return np.maximum(sampling, between)


def tolerance_reading(inv, stats, ws, samples, tolerance, tolerance_level, noise_floor, **kw):
    """Measure the risk curve of the inversion ``inv``'s rank-r models on ``samples`` and read r*(``tolerance``).

    The curve is measured from rank 0 up to the noise floor's upper end (``noise_floor = (rank, upper)`` of the
    rule), then further, doubling, until its upper bound reaches half the tolerance or the rank beyond which the
    inversion's models no longer change (``inv.curve_rank_limit``). Where the inversion measures it per sample,
    the upper bound is the curve plus the normal quantile at ``tolerance_level`` times its standard error; where
    ``predict``'s models are not the curve's (the factored fit's halves), the bound covers their distance too.
    ``kw`` go to the inversion's residual methods (``ops``). Whether the reading is identified is
    :func:`rstar.rules.identifiability.tolerance_verdicts`'s to decide.
    """
    tol = float(tolerance)
    # the rank beyond which the curve's models no longer change (ws.dim, or the factored fit's q)
    limit = inv.curve_rank_limit(ws)
    top = min(limit, max(int(noise_floor[1]), int(noise_floor[0])))
    first = [None, *range(top + 1)]
    # each sample's residuals where the inversion measures its curve per sample (for its standard error)
    parts = inv.rank_residual_samples(stats, ws, first, samples, **kw)
    per_sample = parts is not None

    def residuals(ranks):
        # the totals (and each sample's, where measured) of the rank-r models for r in ranks
        if per_sample:
            parts = inv.rank_residual_samples(stats, ws, list(ranks), samples, **kw)
            return [float(np.sum(p)) for p in parts], parts
        return inv.rank_residuals(stats, ws, list(ranks), samples, **kw), None

    rss = [float(np.sum(p)) for p in parts] if per_sample else residuals(first)[0]
    if rss is None:
        raise ValueError("tolerance needs the closed-form operators of every rank, whose moment sums were not "
                         "accumulated (predict_sums=False, or over the memory budget for this T, d and d_v).")
    full, rss = rss[0], rss[1:]
    full_parts, parts = (parts[0], parts[1:]) if per_sample else (None, None)
    tss = total_sum_of_squares(inv.risk_samples(stats, ws, samples).map_sum(centred_sums, 1))
    # the floor the curve subtracts, and (cross-fitted curves) the same full models on their own samples
    in_sample = inv.full_model_in_sample_residual_samples(stats, ws)
    floor = full / tss if tss > 0 else 0.0
    floor_in_sample = None if in_sample is None else (float(np.sum(in_sample)) / tss if tss > 0 else 0.0)
    # where the curve is measured on other models than predict's (the factored fit's halves): predict's rank-r
    # model's output distance from its full one, per sample; the rank is read where both bounds reach it
    distance_parts = inv.rank_output_distance_samples(stats, ws, list(range(len(rss))))

    def read(rss, parts, distance_parts):
        curve = relative_excess_risk(rss, full, tss)
        se = excess_risk_standard_error(parts, full_parts, tss) if per_sample else np.zeros_like(curve)
        upper = excess_risk_upper_bound(curve, se, tolerance_level)
        if distance_parts is None:
            return curve, se, None, upper
        distance = np.array([float(np.sum(p)) for p in distance_parts]) / tss
        distance_se = excess_risk_standard_error(distance_parts, np.zeros_like(distance_parts[0]), tss)
        return curve, se, distance, np.maximum(upper, excess_risk_upper_bound(distance, distance_se, tolerance_level))

    curve, se, distance, upper = read(rss, parts, distance_parts)
    blocks = inv.cross_fit_blocks(stats, ws) if per_sample else None
    # go on until half the tolerance is reached (the interval's upper end), or the limit
    while rank_at_tolerance(upper, tol / 2) is None and len(curve) <= limit:
        more = range(len(curve), min(limit, 2 * len(curve)) + 1)
        more_rss, more_parts = residuals(more)
        rss = rss + more_rss
        parts = parts + more_parts if per_sample else None
        if distance_parts is not None:
            distance_parts = distance_parts + inv.rank_output_distance_samples(stats, ws, list(more))
        curve, se, distance, upper = read(rss, parts, distance_parts)
    rank = rank_at_tolerance(upper, tol)
    rank = ws.dim if rank is None else rank
    return ToleranceReading(rank=rank, interval=tolerance_interval(curve, upper, rank, tol, ws.dim),
                            risk_curve=curve,
                            risk_curve_se=se if per_sample else None, risk_curve_upper=upper,
                            risk_curve_distance=distance, risk_curve_resolution=inv.half_disagreement(stats, ws),
                            risk_curve_floor=float(floor), risk_curve_floor_in_sample=floor_in_sample,
                            # a curve that reaches the limit and not a tolerance: only the full model (rank d) is
                            # known to reach it
                            full_rank=int(ws.dim) if len(curve) > limit else None,
                            risk_curve_fit_se=(None if blocks is None
                                               else excess_risk_fit_standard_error(parts, full_parts, tss, blocks)),
                            risk_curve_floor_se=(None if not per_sample else float(excess_risk_standard_error(
                                [full_parts], np.zeros_like(full_parts), tss)[0])),
                            risk_curve_floor_fit_se=(None if blocks is None else float(excess_risk_fit_standard_error(
                                [full_parts], np.zeros_like(full_parts), tss, blocks)[0])))


def tolerance_interval(curve, upper, rank, tolerance, dim):
    """The interval of r*(``tolerance``) read as ``rank``: from the rank where the curve itself reaches twice the
    tolerance (no confidence margin, no distance) to where its upper bound reaches half of it; ``dim`` for an end
    the curve does not reach."""
    tol = float(tolerance)
    low = rank_at_tolerance(curve, min(2 * tol, 1.0))
    high = rank_at_tolerance(curve if upper is None else upper, tol / 2)
    return (int(min(rank, dim if low is None else low)), int(max(rank, dim if high is None else high)))


def rank_read_again(curve, upper, full_rank, tolerance):
    """r*(``tolerance``) off a fitted curve as the fit reads it (its ``upper`` bound, or the curve itself where
    there is none); ``full_rank`` where the curve reached its limit without reaching the tolerance.

    Raises
    ------
    ValueError
        Where the curve was computed only up to ranks that do not reach ``tolerance``.
    """
    upper = curve if upper is None else upper
    rank = rank_at_tolerance(upper, tolerance)
    if rank is None and full_rank is not None:
        return full_rank
    if rank is None:
        raise ValueError(f"the risk curve was computed up to rank {len(curve) - 1}, where the excess "
                         f"risk is still {upper[-1]:.3g} > {tolerance:g}: fit with "
                         f"tolerance={tolerance:g}.")
    return rank
