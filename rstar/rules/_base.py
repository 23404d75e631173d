"""What every rank rule shares: its result, its base class, and the levels behind ``rank_interval_``.

A rule is a callable ``rule(ws, noise_variance=None, max_rank=None) -> RuleResult`` where ``ws`` is an
:class:`rstar.inversions.WhitenedStatistic`. It dispatches once on the type of ``ws.null`` (the null model)
and raises :class:`rstar.inversions.UnsupportedNullModelError` for a null it does not support; it never asks
which inversion produced the statistic.
"""

from dataclasses import dataclass, field

import numpy as np

from ..calibration import DEFAULT_CALIBRATION
from ..inversions._statistic import UnsupportedNullModelError
from ..marchenko_pastur import MEDIAN_EFFICIENCY

__all__ = ["RuleResult", "RankRule", "interval_levels"]


@dataclass
class RuleResult:
    """What a rank rule returns.

    Attributes
    ----------
    rank : int
    threshold : float
        The cut applied to the spectrum (same units as the eigenvalues).
    effective_rank : float
    noise_variance : float
        Noise variance used or estimated (nan if it could not be estimated).
    spike_strengths : ndarray of shape (rank,)
        BBP-debiased population spikes ``theta_i`` (units of noise variance).
    p_values : ndarray of shape (n_tested,)
        Approximate Tracy–Widom p-value of each sequential test
        (``k``-th entry: is eigenvalue ``k+1`` above the noise edge?), up to
        the first one not significant at the lenient level of
        :func:`interval_levels`.
    warnings : list of (Warning subclass, str)
    rank_interval : tuple of two ints
        Counts at the strict and lenient levels of :func:`interval_levels`
        (``(rank, rank)`` for rules without a noise model).
    """

    rank: int
    threshold: float
    effective_rank: float
    noise_variance: float
    spike_strengths: np.ndarray = field(default_factory=lambda: np.zeros(0))
    p_values: np.ndarray = field(default_factory=lambda: np.zeros(0))
    warnings: list = field(default_factory=list)
    rank_interval: tuple = None

    def __post_init__(self):
        if self.rank_interval is None:
            self.rank_interval = (self.rank, self.rank)


def _roundoff_floor(lam):
    top = lam[0] if lam.size and lam[0] > 0 else 0.0
    return top * max(lam.size, 1) * np.finfo(np.float64).eps * 10


def interval_levels(alpha, *, calibration=DEFAULT_CALIBRATION):
    """The strict and lenient false-alarm levels behind ``rank_interval_``.

    Parameters
    ----------
    alpha : float in (0, 1)
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``interval_factor`` F (10; :mod:`rstar.calibration`).

    Returns
    -------
    (float, float)
        ``(alpha / F, min(F alpha, 1/2))``: ``(alpha / 10, min(10 alpha, 1/2))`` by default.
    """
    factor = calibration.interval_factor
    return alpha / factor, max(min(alpha * factor, 0.5), alpha)


def _count_below(p_values, level):
    """Number of leading sequential p-values below ``level`` (the count at that level)."""
    above = np.flatnonzero(np.asarray(p_values) >= level)
    return int(above[0]) if above.size else len(p_values)


def _test_dof(known, fit_bulk_width, noise_dof, p_k, m_k):
    """Degrees of freedom of the noise variance used by one sequential test."""
    if known:
        return noise_dof
    if fit_bulk_width:
        return None
    return MEDIAN_EFFICIENCY * p_k * m_k  # the MP-median estimate's degrees of freedom


def _checked_spectrum(eigenvalues):
    """The eigenvalues as a float array; ValueError unless finite and 1-D."""
    lam = np.asarray(eigenvalues, dtype=np.float64)
    if lam.ndim != 1 or not np.all(np.isfinite(lam)):
        raise ValueError(f"eigenvalues must be a finite 1-D array, got shape {lam.shape}.")
    return lam


def _check_number(name, value, low, strict=False):
    """ValueError unless ``value`` is finite and ``>= low`` (``> low`` when ``strict``)."""
    v = float(value)
    if not (np.isfinite(v) and (v > low if strict else v >= low)):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}.")



class RankRule:
    """Base class of rank rules.

    Subclasses list the null models they test in ``supported_nulls`` and implement ``_call``;
    ``__call__`` checks the null model's type once. The tuned values a rule reads are those of its
    ``calibration`` (:mod:`rstar.calibration`; ``DEFAULT_CALIBRATION`` unless the rule was given another).
    """

    #: the null-model classes this rule can test
    supported_nulls = ()
    #: the tuned values the rule reads (a subclass's ``calibration=None`` stores DEFAULT_CALIBRATION)
    calibration = DEFAULT_CALIBRATION

    def __call__(self, ws, noise_variance=None, max_rank=None):
        if not isinstance(ws.null, self.supported_nulls):
            names = ", ".join(cls.__name__ for cls in self.supported_nulls)
            raise UnsupportedNullModelError(
                f"{type(self).__name__} tests statistics whose null model is one of ({names}); this one's is "
                f"{type(ws.null).__name__} (inversion {ws.inversion!r}). Use a rule that supports it, e.g. "
                "rstar.rules.MarchenkoPasturRule.")
        return self._call(ws, noise_variance, max_rank)

    def _call(self, ws, noise_variance, max_rank):  # pragma: no cover - abstract
        raise NotImplementedError
