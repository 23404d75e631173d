"""The split-half test: directions of a half-sum kernel above its half-difference's largest, by a margin."""

import numpy as np

from ..exceptions import UnidentifiableRankWarning
from ..spectral import entropy_effective_rank_from_singular_values
from ._base import RuleResult

__all__ = ["split_half_result"]

#: A direction of the half-sum counts where its singular value exceeds this many times the half-difference's
#: largest (``rank_``). Measured on null directions (``benchmarks/factored_calibration.py``; Gaussian tokens,
#: T = 8 and 16, d = 48 and 96, n = 600, r* = 0 and 2, V known and unknown, 8 seeds each, 64 fits): the first
#: null direction of the half-sum over the half-difference's largest ranged 0.83-1.11; planted directions of
#: logit scale 2 stood at 100-150 times it.
SPLIT_HALF_MARGIN = 1.5
#: Directions between this many times the half-difference's largest and ``SPLIT_HALF_MARGIN`` times it are not
#: told from noise: they widen ``rank_interval_`` and are warned (no null direction measured reached 1.12).
SPLIT_HALF_NOISE_EDGE = 1.25


def split_half_result(ws, max_rank=None):
    """The rule's result on a statistic with a :class:`~rstar.inversions.SplitHalfNull`.

    ``rank`` counts the directions above ``margin`` times the null's largest singular value; those between
    ``SPLIT_HALF_NOISE_EDGE`` and ``margin`` times it are warned, and where there are any the upper end of
    ``rank_interval`` is the rank q the halves were fitted at (the null's ``fitted_rank``; at least their
    count): a spectrum with no gap at the noise edge does not resolve the weaker directions below it either.

    Parameters
    ----------
    ws : WhitenedStatistic
    max_rank : int or None
        Count at most this many.

    Returns
    -------
    RuleResult
        ``spike_strengths`` are the squared ratios of the counted singular values to the half-difference's
        largest; there are no p-values (the test is a margin, not a level).
    """
    null = ws.null
    lam = np.asarray(ws.eigenvalues, dtype=float)
    edge = float(null.null_eigenvalues[0]) if null.null_eigenvalues.size else 0.0
    cap = lam.size if max_rank is None else min(int(max_rank), lam.size)
    strict = null.margin**2 * edge
    rank = int(min(np.sum(lam > strict), cap)) if edge > 0 else int(min(np.sum(lam > 0), cap))
    lenient = int(min(np.sum(lam > SPLIT_HALF_NOISE_EDGE**2 * edge), cap)) if edge > 0 else rank
    lenient = max(lenient, rank)
    upper = lenient
    warnings = []
    if lenient > rank:
        # no gap at the noise edge: directions weaker than the band are not resolved either (planted 8 on MiniLM
        # tokens at T = 8, d = 384, V fitted: 1.31 and 1.27 in the band, the eighth at 1.17), so the interval
        # reaches the rank q the halves were fitted at, where the fit stopped finding more
        upper = max(lenient, min(cap, int(null.fitted_rank)))
        warnings.append((UnidentifiableRankWarning,
                         f"{lenient - rank} direction(s) of the half-sum kernel stand between "
                         f"{SPLIT_HALF_NOISE_EDGE:g} and {null.margin:g} times the largest of the half-difference "
                         "(the split-half noise): they are not told from noise, and weaker directions below them "
                         f"are not resolved either, so r* lies in ({rank}, {upper})"
                         + (f" (the fitted rank q = {null.fitted_rank})" if upper > lenient else "")
                         + ". More samples, longer sequences or a known value_map would separate them."))
    theta = lam[:rank] / edge if edge > 0 else np.full(rank, np.inf)
    if null.fitted_rank and lenient >= null.fitted_rank - 1 and null.fitted_rank >= null.rank_cap:
        warnings.append((UnidentifiableRankWarning,
                         f"the factored least squares was fitted at its largest rank q = {null.fitted_rank} "
                         f"(the compute budget, or d) and {lenient} of its directions stand above the split-half "
                         "null: r* may exceed q. rank_interval_ reaches d. What would help: a larger "
                         "compute_budget (or fewer samples per fit), or max_rank if r* is known to be small."))
        upper = ws.dim
    energies = np.sqrt(np.maximum(lam[:rank] - edge, 0.0)) if rank else np.zeros(0)
    eff = entropy_effective_rank_from_singular_values(energies) if rank and np.any(energies > 0) else 0.0
    # the "noise level" reported is the null's largest eigenvalue (the statistic's units), as a bulk edge would be
    return RuleResult(rank, strict, float(eff), edge, theta, np.zeros(0), warnings,
                      (rank, max(rank, upper)))
