"""The energy rule: the energy effective rank of the de-biased spikes, rounded (the paper's choice for softmax)."""

import numpy as np

from ..marchenko_pastur import debias_spike
from ..spectral import energy_effective_rank_from_singular_values
from .marchenko_pastur import MarchenkoPasturRule

__all__ = ["EnergyRule"]


class EnergyRule(MarchenkoPasturRule):
    """Energy effective rank R̃_eff of the de-biased spikes, rounded half up.

    Spikes are detected as by :class:`MarchenkoPasturRule`; the rank is
    ``floor(R̃_eff + 1/2)`` of their strengths, which discounts weak spikes
    (the paper's choice for softmax kernels). ``rank_interval`` holds the
    energy ranks of the spikes counted at the strict and lenient levels.
    It supports the null models of :class:`MarchenkoPasturRule`.

    Parameters
    ----------
    alpha : float in (0, 1), default=0.01
    """

    def _call(self, ws, noise_variance, max_rank):
        res = super()._call(ws, noise_variance, max_rank)
        energy = energy_effective_rank_from_singular_values(np.sqrt(res.spike_strengths))
        res.effective_rank = energy
        res.rank = int(np.floor(energy + 0.5))
        # the energy rank of the spikes counted at the strict and lenient levels
        # (it grows with every weaker spike added, so the interval holds rank)
        lo, hi = res.rank_interval
        sigma2 = res.noise_variance
        lam = ws.eigenvalues
        if np.isfinite(sigma2) and sigma2 > 0:
            theta = debias_spike(lam[:hi] / sigma2, lam.size / ws.n_columns)
        else:
            theta = np.maximum(lam[:hi], 0.0)
        theta = np.maximum(theta, 0.0)
        res.rank_interval = tuple(min(int(np.floor(energy_effective_rank_from_singular_values(
            np.sqrt(theta[:j])) + 0.5)), j) for j in (lo, hi))
        res.rank_interval = (min(res.rank_interval[0], res.rank), max(res.rank_interval[1], res.rank))
        return res


