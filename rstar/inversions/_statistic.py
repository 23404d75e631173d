"""The statistic contract between inversions and rank rules.

An inversion returns a :class:`WhitenedStatistic`: a small core (the
whitened eigen-decomposition, the unwhitening map, the effective column
count, the name of the inversion that produced it) plus exactly one *null
model*, the law of the statistic under "no more spikes", and any extra
evidence as typed objects. A rank rule dispatches once on the type of the
null model and raises :class:`UnsupportedNullModelError` for one it does
not support; it never asks which inversion produced the statistic.

Null models
-----------
:class:`WishartNull`
    The bulk is a white Wishart (Marchenko–Pastur law with ``n_columns``
    columns) at a noise level known from a residual, or to be estimated
    from the bulk.
:class:`StructuredBulkNull`
    The bulk holds more than white noise (the higher-order terms of the
    first-order softmax inversion, or a clipped log-domain bulk): rules fit
    its level *and* width.
:class:`SimulatedNull`
    Exact (or first-order) Gaussian draws of the whitened statistic's noise
    are available: rules test against them (a parametric bootstrap).
:class:`CrossFitNull`
    Two simulated nulls, one per half of the samples (the cross-fitted
    query–key inversion), combined by a Bonferroni union.
:class:`SplitHalfNull`
    The spectrum of the half-difference of two kernels fitted on the two
    halves of the samples (the factored softmax least squares): one draw of
    the half-sum's noise.

Evidence
--------
:class:`CoherentEvidence`
    A second, coherent spectrum whose noise is a white Wishart and whose
    signal has rank at most r*.
:class:`SplitHalfEvidence`
    The split-half noise draw behind the exact softmax inversion's noise
    level, and its log-domain residual variance (reported only).
"""

from dataclasses import dataclass, field

import numpy as np

from ..calibration import DEFAULT_CALIBRATION
from ._numerics.linalg import orthonormal_rows

__all__ = [
    "Finding",
    "WhitenedStatistic",
    "NullModel",
    "WishartNull",
    "StructuredBulkNull",
    "SimulatedNull",
    "CrossFitNull",
    "SplitHalfNull",
    "CoherentEvidence",
    "SplitHalfEvidence",
    "UnsupportedNullModelError",
]


class UnsupportedNullModelError(TypeError):
    """A rank rule was given a statistic whose null model it does not know how to test."""


class NullModel:
    """Base class of the null models. ``kind`` names it in fitted attributes (``null_model_``)."""

    kind = "null"


@dataclass
class _BulkNull(NullModel):
    """The fields the two bulk null models share (see :class:`WishartNull`)."""

    noise_variance: float = None
    noise_dof: float = 0.0
    noise_source: str = "bulk"
    min_bulk_columns: float = None


@dataclass
class WishartNull(_BulkNull):
    """White-noise bulk: Marchenko–Pastur with the statistic's ``n_columns`` columns.

    Attributes
    ----------
    noise_variance : float or None
        An estimate of ``sigma2`` independent of the spectrum (a residual of
        a model that holds under the operator), or None (estimate it from
        the bulk).
    noise_dof : float
        Degrees of freedom of ``noise_variance``.
    noise_source : str
        Where ``noise_variance`` comes from (``"bulk"`` when it is None).
    min_bulk_columns : float or None
        Fewest independent columns a bulk the statistic sums can have
        (``(sum w_i)^2 / sum w_i^2``), or None.
    leak_ratio : float or None
        Query–key statistic with fewer (effective) tokens than features: the
        relative power ``(d - t) / (d t)`` with which the signal leaks out
        of range(K*) through the random projectors ``X_i^+ X_i``; rules
        decide from it whether the bulk must be fitted as structured
        (:func:`rstar.rules.leak_is_visible`). None otherwise.
    mp_shaped_bulk : bool
        Whether the eigenvalues below the spikes follow an MP law, so that
        the part of the bulk below any eigenvalue can be fitted on its own
        (:func:`rstar.rules.top_down_p_values`).
    """

    leak_ratio: float = None
    mp_shaped_bulk: bool = True
    kind = "wishart"


@dataclass
class StructuredBulkNull(_BulkNull):
    """A bulk wider than white noise, whose level and width rules fit.

    Attributes
    ----------
    noise_variance, noise_dof, min_bulk_columns
        As for :class:`WishartNull`; a given ``noise_variance`` fixes the
        bulk's level (only its width is then fitted), and
        ``min_bulk_columns`` bounds the fitted width.
    noise_source : str
        ``"fitted bulk"`` unless ``noise_variance`` is given.
    residual_power : float or None
        First-order softmax inversion with ``T - 1 > d``: the power per
        degree of freedom of the part of ``Y_i`` outside ``col(X_i)``, an
        upper reference for the bulk inside it
        (:func:`rstar.rules.residual_floor_p_values`). None otherwise.
    mp_shaped_bulk : bool
    """

    noise_source: str = "fitted bulk"
    residual_power: float = None
    mp_shaped_bulk: bool = True
    kind = "structured_bulk"


@dataclass
class SimulatedNull(NullModel):
    """Draws of the noise of a whitened kernel estimate ``K~`` (statistic ``K~ K~^T / d``).

    Attributes
    ----------
    statistic_matrix : ndarray of shape (p, p)
        The whitened kernel estimate ``K~``.
    eigenvalues : ndarray of shape (p,)
        Descending eigenvalues of ``K~ K~^T / p``.
    n_columns : float
    draws : ndarray of shape (B, p, p)
        ``B`` draws of the whitened estimate's noise at ``noise_variance``.
    noise_variance : float
    noise_dof : float
    noise_source : str
    factors : tuple
        ``(L, A^{1/2}, B^{1/2}, A^{-1/2}, B^{-1/2})``: the Cholesky factor of
        the normal matrix (or information) and the whitening factors.
    shift : object or None
        Noise that grows with the signal (the fitted value map's error of
        the cross-fit, :class:`rstar.inversions._numerics.value_error.ValueMapErrorLeak`), the
        ``null_shift`` of :func:`rstar.rules.simulated_null_p_values`.
    poor_fit : bool
        Cross-fit only: the value map this direction is tested with comes
        from a fit that is provably not its half's least squares and that
        misfits the other half; the union leaves it out.
    """

    statistic_matrix: np.ndarray
    eigenvalues: np.ndarray
    n_columns: float
    draws: np.ndarray
    noise_variance: float
    noise_dof: float
    noise_source: str = "least-squares residual"
    factors: tuple = None
    shift: object = None
    poor_fit: bool = False
    kind = "simulated"

    @property
    def n_draws(self):
        return int(self.draws.shape[0])


@dataclass
class CrossFitNull(NullModel):
    """Two simulated nulls, one per cross-fitted direction; a spike counts where either counts it at ``alpha / 2``.

    Attributes
    ----------
    directions : tuple of two SimulatedNull
        The first is the statistic's own (its eigenvalues are the core's).
    """

    directions: tuple
    kind = "cross_fit_union"

    @property
    def noise_variance(self):
        return self.directions[0].noise_variance

    @property
    def noise_dof(self):
        return self.directions[0].noise_dof

    @property
    def noise_source(self):
        return self.directions[0].noise_source


@dataclass
class CoherentEvidence:
    r"""A coherent spectrum whose noise is a white Wishart with ``n_columns`` columns and whose signal has rank <= r\*.

    Attributes
    ----------
    eigenvalues : ndarray
        Descending.
    n_columns : float
    noise_variance : float or None
        A noise level for this statistic alone (None: the main statistic's).
    noise_dof : float or None
    """

    eigenvalues: np.ndarray
    n_columns: float
    noise_variance: float = None
    noise_dof: float = None


@dataclass
class SplitHalfEvidence:
    """The exact softmax inversion's split-half noise draw and log-domain residual variance (reported only)."""

    null_spectrum: np.ndarray = None
    residual_variance: float = None


def curve_resolution_misses(tolerance, disagreement, floor_gap, calibration=DEFAULT_CALIBRATION):
    """Whether a cross-fitted risk curve fails to resolve ``tolerance``: ``(halves, floor)`` — its halves' full
    models disagree by more than the calibration's ``curve_resolution_fraction`` times it, and its floor is known
    only within more than it (``floor_gap``, the full models' residual held out less in sample), each relative to
    Var(Y) and False where not measured (None). The identifiability rules warn on either
    (:func:`rstar.rules.identifiability.tolerance_verdicts`); the factored fit refits wider on either."""
    tol = float(tolerance)
    return (disagreement is not None and disagreement > calibration.curve_resolution_fraction * tol,
            floor_gap is not None and floor_gap > tol)


def split_half_counts(singular_values, edge, margin):
    """The split-half test's counts of a half-sum's ``singular_values`` against the half-difference's largest,
    ``edge``: ``(directions above margin x edge, directions above edge)``. The split-half rule
    (:func:`rstar.rules.split_half.split_half_counts`) hands it to the factored fit as its stopping test."""
    s = np.asarray(singular_values)
    return (int(np.sum(s > margin * edge)), int(np.sum(s > edge)))


@dataclass(frozen=True)
class Finding:
    """A fact an inversion reports about its statistic (``kind``, with its ``values``), for
    :mod:`rstar.rules.identifiability` to judge."""

    kind: str
    values: dict = field(default_factory=dict)


@dataclass
class WhitenedStatistic:
    r"""The output of an inversion: a whitened symmetric statistic and its null model.

    Attributes
    ----------
    eigenvalues : ndarray of shape (p,)
        Descending eigenvalues of ``N^{-1/2} C N^{-1/2}``.
    eigenvectors : ndarray of shape (p, p)
        Matching eigenvectors (columns), in whitened coordinates.
    unwhiten : ndarray of shape (p, p)
        ``N^{1/2}``: maps whitened directions back to the original space.
    n_columns : float
        Effective number of independent columns ``m`` of the noise.
    null : NullModel
        The law of the statistic without (further) signal.
    inversion : str
        Name of the inversion that produced it (after any fallback).
    evidence : tuple
        Extra typed evidence (:class:`CoherentEvidence`, :class:`SplitHalfEvidence`).
    warnings : list of (Warning subclass, str)
        Conditions the estimator must report.
    units : {"Y^2", "log-attention"}
        Units of the eigenvalues: those of Y squared (after the estimator's
        rescaling), or log-attention units (the exact softmax inversion),
        which do not scale with Y.
    findings : list of Finding
        Facts about the statistic that bear on whether it identifies r* (its
        shape, whether its fit settled, what ran out): what they mean is
        :func:`rstar.rules.identifiability.statistic_verdicts`'s to decide.
    fallback : Finding or None
        Where a least-squares fit fell back to the first order: why (its
        ``kind`` a reason of :data:`rstar.rules.identifiability.REASONS`).
    """

    eigenvalues: np.ndarray
    eigenvectors: np.ndarray
    unwhiten: np.ndarray
    n_columns: float
    null: NullModel
    inversion: str = ""
    evidence: tuple = ()
    warnings: list = field(default_factory=list)
    units: str = "Y^2"
    findings: list = field(default_factory=list)
    fallback: "Finding" = None

    @property
    def dim(self):
        return self.eigenvalues.size

    @property
    def noise_variance(self):
        """The null model's noise level (None where the bulk sets it)."""
        return self.null.noise_variance

    def evidence_of(self, kind):
        """The piece of evidence of type ``kind``, or None."""
        for item in self.evidence:
            if isinstance(item, kind):
                return item
        return None

    def components(self, k):
        """Orthonormal basis (rows) of the top-``k`` subspace in original coordinates."""
        return orthonormal_rows(self.unwhiten @ self.eigenvectors[:, :k])


@dataclass
class SplitHalfNull(NullModel):
    """The null of a kernel fitted on each half of the samples: the half-difference's spectrum.

    The two halves' kernels ``K_1, K_2`` share the signal and carry independent noise of one law, so the
    half-difference ``(K_1 - K_2) / 2`` is a draw of the noise of the half-sum ``(K_1 + K_2) / 2`` (the
    statistic): a direction of the half-sum counts as signal where it exceeds the half-difference's largest by
    a margin (:func:`rstar.rules.split_half_result`).

    Attributes
    ----------
    null_eigenvalues : ndarray of shape (p,)
        Descending eigenvalues of ``D~ D~^T / p``, ``D~`` the whitened half-difference (the statistic's units).
    margin : float
        A spike must exceed ``margin**2`` times the largest null eigenvalue (singular values: ``margin`` times);
        by default the calibration's ``split_half_margin`` (:mod:`rstar.calibration`).
    noise_variance : float
        Residual variance of the fits (reported; the test does not use it).
    noise_dof : float
    fitted_rank : int
        Columns q of each half's factors: the statistic holds at most 2q directions, r* >= q cannot be read.
    rank_cap : int
        The largest q the budget allowed; a count that fills ``fitted_rank == rank_cap`` is warned.
    kernel, value_map : ndarray
        The half-sum kernel ``(d, d)`` and the value map (known, or the mean of the halves' fits), internal units.
    metric : tuple of ndarray
        ``(M_q^{1/2}, M_q^{-1/2}, M_k^{1/2}, M_k^{-1/2})`` (:func:`rstar.inversions._numerics.softmax_factored.token_metric_roots`).
    singular_vectors : tuple of ndarray
        ``(U, S, W)``: the thin SVD of the whitened half-sum ``M_q^{1/2} K M_k^{1/2}``.
    half_kernels : tuple of two (A, B)
        Each half's factors (odd, then even samples), for the cross-fitted risk curve.
    rotary : RotaryPositions or None
        A rotary fit's positions (:mod:`rstar.inversions.softmax_rotary`: ``kernel`` is None and
        ``singular_vectors`` are the half-sum's directions on the query and the key side ``(U_q, U_k)``).
    """

    null_eigenvalues: np.ndarray = None
    margin: float = DEFAULT_CALIBRATION.split_half_margin
    noise_variance: float = None
    noise_dof: float = 0.0
    noise_source: str = "split-half difference"
    fitted_rank: int = 0
    rank_cap: int = 0
    kernel: np.ndarray = None
    value_map: np.ndarray = None
    metric: tuple = None
    singular_vectors: tuple = None
    half_kernels: tuple = None
    rotary: object = None
    kind = "split_half"
