"""The split-half test: directions of a half-sum kernel above its half-difference's largest, by a margin."""

import numpy as np

from ..calibration import DEFAULT_CALIBRATION
from ..spectral import entropy_effective_rank_from_singular_values
from ..inversions._statistic import split_half_counts  # noqa: F401  (the rule's count, handed to the factored fit)
from ._base import RuleResult
from .identifiability import covering, rule_verdict

__all__ = ["split_half_counts", "split_half_result"]

def split_half_result(ws, max_rank=None, *, calibration=DEFAULT_CALIBRATION):
    """The rule's result on a statistic with a :class:`~rstar.inversions.SplitHalfNull`.

    ``rank`` counts the directions above ``margin`` times the null's largest singular value (the null's
    ``margin``: the calibration's ``split_half_margin`` the inversion was given); those between the calibration's
    ``split_half_noise_edge`` and ``margin`` times it are warned, and where there are any the upper end of
    ``rank_interval`` is the rank q the halves were fitted at (the null's ``fitted_rank``; at least their
    count): a spectrum with no gap at the noise edge does not resolve the weaker directions below it either.

    Parameters
    ----------
    ws : WhitenedStatistic
    max_rank : int or None
        Count at most this many.
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``split_half_noise_edge`` (:mod:`rstar.calibration`).

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
    noise_edge = calibration.split_half_noise_edge
    lenient = int(min(np.sum(lam > noise_edge**2 * edge), cap)) if edge > 0 else rank
    lenient = max(lenient, rank)
    warnings = []
    if lenient > rank:
        # no gap at the noise edge: directions weaker than the band are not resolved either (planted 8 on MiniLM
        # tokens at T = 8, d = 384, V fitted: 1.31 and 1.27 in the band, the eighth at 1.17), so the interval
        # reaches the rank q the halves were fitted at, where the fit stopped finding more
        warnings.append(rule_verdict("split_half_band", rank=rank, lenient=lenient, fitted_rank=null.fitted_rank,
                                     upper=max(lenient, min(cap, int(null.fitted_rank))), margin=null.margin,
                                     noise_edge=noise_edge))
    theta = lam[:rank] / edge if edge > 0 else np.full(rank, np.inf)
    if null.fitted_rank and lenient >= null.fitted_rank - 1 and null.fitted_rank >= null.rank_cap:
        warnings.append(rule_verdict("split_half_at_cap", fitted_rank=null.fitted_rank, lenient=lenient,
                                     dim=ws.dim))
    energies = np.sqrt(np.maximum(lam[:rank] - edge, 0.0)) if rank else np.zeros(0)
    eff = entropy_effective_rank_from_singular_values(energies) if rank and np.any(energies > 0) else 0.0
    # the "noise level" reported is the null's largest eigenvalue (the statistic's units), as a bulk edge would be
    return RuleResult(rank, strict, float(eff), edge, theta, np.zeros(0), warnings,
                      covering((rank, rank), warnings))
