"""What every inversion shares: the base class, sums over samples, and their merge (map-reduce)."""

import numpy as np

from ._numerics.linalg import psd_power, sym
from ..budgets import DEFAULT_BUDGET
from ..risk import operator_residual_sum
from ..streaming import (drop_samples_over_budget, keep_half_samples, kept_half, sample_capacity,  # noqa: F401
                         start_keeping_samples, truncate_kept_samples)

__all__ = ["Inversion"]

#: Residual degrees of freedom needed before a residual noise estimate is used.
MIN_NOISE_DOF = 50
#: Aspect ratio min(T, d) / max(T, d) above which X_i^+ is ill-conditioned
#: (hard edge of the MP law at ratio 1).
ILL_CONDITIONED_ASPECT = 0.9
#: The first-order softmax statistic identifies r* only while d <= this many times the T - 1 centred tokens:
#: beyond it the higher-order terms of the expansion fill a bulk its null does not model (measured, r* read by
#: RStarEstimator's fallback: d = 128, T = 64 exact; d = 384, T = 64 read 10 for 8 on Gaussian tokens; d = 384,
#: T = 32 read 56 for 3 on MiniLM hidden states; docs/user_guide/real_models.md).
FIRST_ORDER_MAX_ASPECT = 3.0
#: The first-order query-key statistic (no centring) with T < d sees each kernel through the random projections
#: X_i^+ X_i, whose signal leaks into a bulk the Wishart null models only on average: beyond d > this many times T
#: its count is warned with (0, d). Measured (MPRankEstimator("linear_qk") on the first order, planted r* = 3,
#: Gaussian tokens, 3 seeds): T = 8, n = 500: d = 10 - 32 read 3 on every seed, d = 48 read 4, 3, 5, d = 64 5, 3, 3,
#: d = 96 5, 4, 4 (n = 2000: 4, 3, 4); T = 16, n = 500: d = 64 and 96 read 3; T = 16, d = 128: 5 and 7 (n = 500);
#: T = 8, d = 192, n = 200: 14 and 12; pure noise at T = 8, d = 384 - 768, n = 100 - 800: up to 6.
FIRST_ORDER_QK_MAX_ASPECT = 4.0
#: The first-order softmax model does not hold where its operator leaves, per sample, more than this many times the
#: residual power per degree of freedom outside col(P X_i) (noise plus higher-order terms), on average over samples.
#: Measured (MPRankEstimator, T = 32, d = 16, logits of standard deviation 2): 0.2-0.3 on Gaussian tokens with a
#: signal and 1.0 without one (n = 1000); 1.7 and 2.1 on Student-t(3) tokens (r* = 3 read 3, r* = 6 read 7); on
#: MiniLM hidden states projected to d = 16 (n = 2000), 6.4 and 53 (r* = 8 and 3 read 9 and 8).
FIRST_ORDER_MISFIT = 3.0
#: Where T - 1 <= d there is no residual outside col(P X_i) for that check, and the first-order statistic's null
#: holds for Gaussian tokens only: its count is warned where the centred tokens' multivariate kurtosis (Mardia's,
#: over its Gaussian value p (p + 2)) exceeds 1 + this margin, by more than 3 standard errors. Measured
#: (MPRankEstimator, T = 32, d = 64, n = 2000, logits of standard deviation 2, planted r* = 3 and 8): Gaussian
#: tokens 1.000 and tokens on a sphere 0.972 read 3 and 8; Student-t tokens with 10 degrees of freedom 1.014 read
#: 4 (interval (3, 4)) and 8; with 5, 1.066, read 4 (4, 7) and 9 (9, 11); MiniLM's inputs of layers 0, 1, 3 and 5
#: on their top 64 principal directions 1.149, 1.074, 1.091, 1.575 read 5-7 for 3, unwarned before this check.
FIRST_ORDER_MAX_KURTOSIS = 0.03
#: Seed of the simulations (null draws, random starts) when the estimator's ``random_state`` is None, so that
#: ``fit`` is a deterministic function of the data and ``partial_fit`` equals ``fit``.
DEFAULT_SEED = 20260
#: Default number of simulated null draws (``n_null_draws``).
DEFAULT_NULL_DRAWS = 1000


class Inversion:
    """Base class of the inversions: samples -> sums over samples -> a :class:`WhitenedStatistic`.

    Subclasses implement ``new_stats(T, d, d_v)`` (a dict of zeroed sums),
    ``update(stats, X, Y)`` (add a batch), ``whiten(stats, run=None)`` (the
    statistic of the inversion named ``run``, one of ``self.produces``) and
    ``fit_operator(stats, basis)`` (the closed-form operator at a rank, for
    ``predict``). Sums merge by :func:`merge_stats`.

    Parameters
    ----------
    value_map : ndarray of shape (d, d_v) or None
        Known value matrix V (already in the estimator's internal units).
    budget : CostBudget or None
        What the inversion may spend (:mod:`rstar.budgets`; None: the defaults).
    seed : int or None
        Seed of its simulations (None: ``DEFAULT_SEED``).
    n_null_draws : int or None
        Draws of simulated nulls (None: ``DEFAULT_NULL_DRAWS``).
    """

    #: which space ``components_`` live in: "tokens" (T) or "features" (d)
    space = "features"
    #: the name of this inversion (``inversion_``)
    name = ""

    def __init__(self, value_map=None, *, budget=None, seed=None, n_null_draws=None):
        self.value_map = value_map
        self.budget = DEFAULT_BUDGET if budget is None else budget
        self.seed = DEFAULT_SEED if seed is None else int(seed)
        self.n_null_draws = DEFAULT_NULL_DRAWS if n_null_draws is None else int(n_null_draws)

    @property
    def produces(self):
        """Names of the inversions whose statistic this accumulator can produce (the first is its own)."""
        return (self.name,)

    def statistic_dim(self, T, d):
        return d

    def min_samples(self, T, d, d_v):
        """Fewest samples for which the statistic and its noise Gram are defined."""
        return 2

    def new_stats(self, T, d, d_v):  # pragma: no cover - abstract
        raise NotImplementedError

    def update(self, stats, X, Y):  # pragma: no cover - abstract
        raise NotImplementedError

    def whiten(self, stats, run=None):  # pragma: no cover - abstract
        raise NotImplementedError

    def fit_operator(self, stats, basis):  # pragma: no cover - abstract
        raise NotImplementedError

    def rank_residuals(self, stats, ws, ranks, samples, ops=None):
        """Residual sums of squares of the rank-r operators for r in ``ranks`` (None: the full-rank one alone)
        on ``samples`` (a :class:`rstar.streaming.Samples` source in internal units), a list; None if there are
        no such operators.

        Here the rank-r operator is :meth:`fit_operator` in the span of ``ws``'s top-r components (None if the
        moment sums it needs were not accumulated).
        """
        return operator_residuals(lambda basis: self.fit_operator(stats, basis), ws, ranks, samples)

    def rank_residual_samples(self, stats, ws, ranks, samples, ops=None):
        """Each sample's residual sum of squares under the rank-r operators (a list of arrays of shape (n,), in
        the order of :meth:`risk_samples`), where this inversion measures its curve per sample; None here (the
        curve's sampling error is then not measured)."""
        return None

    def rank_output_distance_samples(self, stats, ws, ranks):
        """Where the curve is measured on models other than the ones ``predict`` uses (the factored fit's half
        models): each sample's squared distance between the outputs of predict's rank-r model and its full one
        (a list of arrays of shape (n,), in the order of :meth:`risk_samples`); None here."""
        return None

    def half_disagreement(self, stats, ws):
        """Where the curve is measured on models fitted on half the samples: how far the two halves' full models
        disagree, relative to Var(Y) (the curve's resolution); None here."""
        return None

    def curve_rank_limit(self, ws):
        """The rank from which the curve's rank-r models (and predict's) equal their full ones: here
        ``ws.dim``."""
        return int(ws.dim)

    def risk_samples(self, stats, ws, samples):
        """The samples :meth:`rank_residuals` measures its sums on (the total sum of squares must be of the
        same ones): here ``samples`` itself."""
        return samples

    def _check_run(self, run):
        run = self.name if run is None else run
        if run not in self.produces:
            raise ValueError(f"{type(self).__name__} produces {self.produces}, not {run!r}.")
        return run


def operator_residuals(fit, ws, ranks, samples):
    """Residual sums of squares of ``fit(basis)`` in the span of ``ws``'s top-r components for r in ``ranks``
    (None: the whole space), each measured in one pass over ``samples``; None if ``fit`` gives no operator."""
    out = []
    for r in ranks:
        operator = fit(ws.components(ws.dim if r is None else r))
        if operator is None:
            return None
        out.append(float(samples.map_sum(operator_residual_sum, 1, operator)))
    return out


def eigh_descending(W):
    """Eigenvalues (descending) and eigenvectors of the symmetric part of ``W``."""
    w, Q = np.linalg.eigh(sym(W))
    return w[::-1].copy(), Q[:, ::-1].copy()


def whiten_pair(C, N):
    """Eigen-decomposition of ``N^{-1/2} C N^{-1/2}`` and the map ``N^{1/2}``."""
    N_isqrt = psd_power(N, -0.5)
    lam, vecs = eigh_descending(N_isqrt @ C @ N_isqrt)
    return lam, vecs, psd_power(N, 0.5)


def with_warning(ws, category, message):
    """``ws`` (a fallback's whitened statistic) with the warning that says why it is in use."""
    ws.warnings.append((category, message))
    return ws


class KeptSamplesMixin:
    """Mixin for an inversion that also keeps its samples, in halves by the parity of their global index
    (:func:`keep_half_samples`; beyond the memory budget only the other sums remain, or, with
    ``keeps_sample_prefix``, the first samples that fit it)."""

    #: beyond the memory budget keep the first samples that fit it (True) or none (False)
    keeps_sample_prefix = False

    def new_stats(self, T, d, d_v):
        stats = super().new_stats(T, d, d_v)
        start_keeping_samples(stats, self.budget, prefix=self.keeps_sample_prefix)
        return stats

    def n_samples_kept(self, stats):
        """How many samples are kept (all of them, a leading part, or 0 once dropped)."""
        if stats.get("samples_odd") is None:
            return 0
        return stats.get("n_kept", stats["n"])

    def update(self, stats, X, Y):
        odd = (stats["n"] + np.arange(X.shape[0])) % 2 == 1
        super().update(stats, X, Y)
        keep_half_samples(stats, X, Y, odd)   # over budget: the other sums only

    def samples_kept(self, stats):
        """Whether the samples are still kept (within the memory budget)."""
        return stats.get("samples_odd") is not None
