"""The energy rule: the energy effective rank of the de-biased spikes, rounded (the paper's choice for softmax)."""

import numpy as np

from ..marchenko_pastur import debias_spike
from ..spectral import energy_effective_rank_from_singular_values
from .marchenko_pastur import MarchenkoPasturRule
from .identifiability import rule_verdict

__all__ = ["EnergyRule"]


class EnergyRule(MarchenkoPasturRule):
    """Energy effective rank R̃_eff of the de-biased spikes, rounded half up.

    Spikes are detected as by :class:`MarchenkoPasturRule`; the rank is
    ``floor(R̃_eff + 1/2)`` of their strengths, which discounts weak spikes
    (the paper's choice for softmax kernels). ``rank_interval`` runs from the
    energy rank of the spikes counted at the strict level to the count
    itself at the lenient level: where the energy rank is below the count at
    ``alpha`` an ``UnidentifiableRankWarning`` says so, since the discounted
    spikes are above the noise and may belong to r*.
    It supports the null models of :class:`MarchenkoPasturRule`.

    Parameters
    ----------
    alpha : float in (0, 1), default=0.01
    calibration : Calibration or None, default=None
        See :class:`MarchenkoPasturRule`.
    """

    def _call(self, ws, noise_variance, max_rank):
        res = super()._call(ws, noise_variance, max_rank)
        count = res.rank  # the noise-aware count at alpha, before the energy rank replaces it
        energy = energy_effective_rank_from_singular_values(np.sqrt(res.spike_strengths))
        res.effective_rank = energy
        res.rank = int(np.floor(energy + 0.5))
        lo, hi = res.rank_interval
        sigma2 = res.noise_variance
        lam = ws.eigenvalues
        if np.isfinite(sigma2) and sigma2 > 0:
            theta = debias_spike(lam[:lo] / sigma2, lam.size / ws.n_columns)
        else:
            theta = np.maximum(lam[:lo], 0.0)
        theta = np.maximum(theta, 0.0)
        # lower end: the energy rank of the spikes counted at the strict level; upper end: the count
        # itself at the lenient level. The energy rank discounts weak spikes by design, so r* (the number
        # of directions above the noise) can sit anywhere up to the count: the interval must reach it.
        strict = min(int(np.floor(energy_effective_rank_from_singular_values(np.sqrt(theta[:lo])) + 0.5)), lo)
        res.rank_interval = (min(strict, res.rank), max(hi, res.rank))
        if res.rank < count:
            res.warnings.append(rule_verdict("energy_discounts", rank=res.rank, count=count, lo=lo, hi=hi))
        return res
