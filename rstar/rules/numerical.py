"""The numerical rule: eigenvalues above a fixed tolerance (the paper's numerical rank)."""

import numpy as np

from ..calibration import DEFAULT_CALIBRATION

from ..marchenko_pastur import estimate_noise_variance
from ..spectral import entropy_effective_rank_from_singular_values
from ._base import RankRule, RuleResult, _roundoff_floor
from .marchenko_pastur import MarchenkoPasturRule
from .identifiability import Verdict, covering, rule_verdict

__all__ = ["NumericalRule"]


class NumericalRule(RankRule):
    """Eigenvalues above a fixed tolerance (the paper's numerical rank).

    Parameters
    ----------
    tol : float or None
        Absolute tolerance in the units of the whitened spectrum.
    rtol : float, default=1e-2
        Relative tolerance: the cut is ``rtol * lambda_1`` when ``tol`` is None.
        Not noise-aware: pure noise gives full rank.

    alpha : float in (0, 1), default=0.01
        Level of the noise-aware test reported beside the count.
    calibration : Calibration or None, default=None
        The tuned values of that test (:mod:`rstar.calibration`); None: ``DEFAULT_CALIBRATION``.

    ``p_values`` are those of the noise-aware sequential test
    (:class:`MarchenkoPasturRule` at ``alpha``), reported beside the
    numerical count. ``rank_interval`` is the range of the noise-aware
    counts at the strict and lenient levels, widened to contain ``rank``:
    where ``rank`` falls outside the noise-aware range the tolerance counts
    noise (or misses spikes) at this noise level, and an
    ``UnidentifiableRankWarning`` says so; the noise-aware test's own
    warnings (a range it could not identify) are passed on. It supports the null models of
    :class:`MarchenkoPasturRule`.
    """

    supported_nulls = MarchenkoPasturRule.supported_nulls

    def __init__(self, tol=None, rtol=1e-2, alpha=0.01, calibration=None):
        self.tol, self.rtol, self.alpha = tol, rtol, alpha
        self.calibration = DEFAULT_CALIBRATION if calibration is None else calibration

    def _call(self, ws, noise_variance, max_rank):
        lam = ws.eigenvalues
        p = lam.size
        floor = _roundoff_floor(lam)
        top = lam[0] if p else 0.0
        threshold = self.tol if self.tol is not None else max(self.rtol * top, floor)
        threshold = max(threshold, floor)
        k = int(np.sum(lam > threshold))
        if max_rank is not None:
            k = min(k, int(max_rank))
        noise_aware = MarchenkoPasturRule(self.alpha, calibration=self.calibration)(ws, noise_variance, max_rank)
        if noise_variance is None:
            noise_variance = ws.noise_variance
        if noise_variance is None:
            noise_variance = estimate_noise_variance(lam, ws.n_columns, n_spikes=k) if p - k >= 1 else float("nan")
        lo, hi = noise_aware.rank_interval
        # where the noise-aware range itself is not identified, the count inside it is not either: say so
        warnings = [rule_verdict("noise_aware", verdict=v) for v in noise_aware.warnings
                    if isinstance(v, Verdict)]
        outside = rule_verdict("numerical_outside", k=k, threshold=threshold, lo=lo, hi=hi)
        if not lo <= k <= hi:
            warnings.append(outside)
        return RuleResult(k, float(threshold), entropy_effective_rank_from_singular_values(np.sqrt(np.maximum(
            lam[:k], 0))), float(noise_variance), np.maximum(lam[:k], 0.0), noise_aware.p_values, warnings,
            covering((lo, hi), [outside]))
