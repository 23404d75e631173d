"""rstar: the intrinsic rank r* of attention tasks, estimated from data alone.

Data-only estimators (an inversion composed with a rank rule, :mod:`rstar.inversions` and
:mod:`rstar.rules`; their cost budgets in :mod:`rstar.budgets`) are importable
from the top level; trained students live in :mod:`rstar.students` (needs the
``torch`` extra, imported lazily).
"""

from .estimators import (
    EnergyRankEstimator,
    MPRankEstimator,
    NumericalRankEstimator,
    RStarEstimator,
    SoftmaxInversionEstimator,
)
from .exceptions import (IllConditionedInversionWarning, InversionFallbackWarning, OperatorMisfitWarning,
                         UnidentifiableRankWarning)
from .inversions._numerics.rotary import RotaryPositions

__version__ = "0.1.0"

__all__ = [
    "NumericalRankEstimator",
    "MPRankEstimator",
    "EnergyRankEstimator",
    "SoftmaxInversionEstimator",
    "RStarEstimator",
    "RotaryPositions",
    "IllConditionedInversionWarning",
    "InversionFallbackWarning",
    "OperatorMisfitWarning",
    "UnidentifiableRankWarning",
    "__version__",
]
