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

import numpy as np

__all__ = ["centred_sums", "total_sum_of_squares", "operator_residual_sum", "relative_excess_risk",
           "excess_risk_standard_error", "excess_risk_upper_bound", "rank_at_tolerance"]

#: A curve measured on models fitted on half the samples (the factored least squares) resolves a tolerance only
#: where the two halves' full models disagree by at most this fraction of it (relative to Var(Y), a quarter of
#: their mean squared difference: see :func:`rstar.inversions.softmax_factored.factored_half_disagreement`);
#: beyond it the reading is warned and its interval reaches d. Settled MiniLM heads: 1e-6 to 1e-5 of Var(Y); a head
#: whose halves settled on different optima (layer 3 head 8, r*(1%) read 8, held out 1.46%): 0.026.
CURVE_RESOLUTION_FRACTION = 0.5


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
