"""Rank rules: a whitened statistic -> (rank, threshold, effective rank, p-values, interval) (theory §5).

A rule is a callable ``rule(ws, noise_variance=None, max_rank=None) -> RuleResult`` on an
:class:`rstar.inversions.WhitenedStatistic`. It dispatches once on the type of the statistic's null model
(``ws.null``) and raises :class:`rstar.inversions.UnsupportedNullModelError` for one it does not support. New
rules plug in by subclassing :class:`RankRule`; the estimators never look inside.

Every rule reports ``effective_rank`` on the *noise-corrected* spectrum: detected spikes are de-biased through
the inverse BBP map (their population strengths ``theta_i`` in units of the noise variance) and everything
inside the bulk counts as zero. The operator's singular values are proportional to ``sqrt(theta_i)``, so the
entropy effective rank R_eff uses ``sqrt(theta)`` and the energy effective rank R̃_eff uses ``theta`` as
energies — the paper's "MP-corrected" effective ranks.

One module per rule, the tests they share apart:

- :mod:`~rstar.rules.marchenko_pastur` — :class:`MarchenkoPasturRule` (every null model).
- :mod:`~rstar.rules.energy` — :class:`EnergyRule`.
- :mod:`~rstar.rules.numerical` — :class:`NumericalRule`.
- :mod:`~rstar.rules.sequential` — the sequential Tracy–Widom tests on a spectrum.
- :mod:`~rstar.rules.simulated` — the tests against simulated null draws.
- :mod:`~rstar.rules.split_half` — the test against a split-half difference.
"""

# the tuned values (margins, factors, levels) are the fields of rstar.calibration.Calibration
from ._base import RankRule, RuleResult, interval_levels
from ._base import _count_below as count_below
from .energy import EnergyRule
from .marchenko_pastur import MarchenkoPasturRule, leak_is_visible
from .numerical import NumericalRule
from .sequential import (
    coherent_p_values,
    residual_floor_p_values,
    sequential_spike_test,
    top_down_p_values,
)
from .simulated import simulated_null_p_values
from .split_half import split_half_result

__all__ = [
    "RuleResult",
    "RankRule",
    "MarchenkoPasturRule",
    "EnergyRule",
    "NumericalRule",
    "interval_levels",
    "count_below",
    "leak_is_visible",
    "sequential_spike_test",
    "top_down_p_values",
    "residual_floor_p_values",
    "coherent_p_values",
    "simulated_null_p_values",
    "split_half_result",
]
