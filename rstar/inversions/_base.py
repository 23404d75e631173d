"""What every inversion shares: the base class, sums over samples, and their merge (map-reduce)."""

from dataclasses import dataclass

import numpy as np

from ._numerics.linalg import psd_power, sym
from ..budgets import DEFAULT_BUDGET
from ..calibration import DEFAULT_CALIBRATION
from ..risk import operator_residual_sum
from ._statistic import Finding
from ..streaming import (drop_samples_over_budget, keep_half_samples, kept_half, sample_capacity,  # noqa: F401
                         start_keeping_samples, truncate_kept_samples)

__all__ = ["Inversion"]


@dataclass(frozen=True)
class Capabilities:
    """What an inversion's sums can do (:attr:`Inversion.capabilities`).

    Attributes
    ----------
    reads_sample_passes : bool
        Its fit can read a source of samples again in passes (over the memory budget).
    keeps_halves : bool
        It keeps its samples in halves by the parity of their global index.
    keeps_sample_prefix : bool
        Beyond the memory budget it keeps the first samples that fit it.
    predict_sums : bool
        It accumulates the moment sums behind ``predict``.
    """

    reads_sample_passes: bool = False
    keeps_halves: bool = False
    keeps_sample_prefix: bool = False
    predict_sums: bool = False


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
        Seed of its simulations (None: the calibration's ``default_seed``).
    n_null_draws : int or None
        Draws of simulated nulls (None: the calibration's ``default_null_draws``).
    calibration : Calibration or None
        The tuned values it reads (:mod:`rstar.calibration`; None: ``DEFAULT_CALIBRATION``).
    """

    #: which space ``components_`` live in: "tokens" (T) or "features" (d)
    space = "features"
    #: the name of this inversion (``inversion_``)
    name = ""
    #: whether its fit can read a source of samples again in passes (over the memory budget)
    reads_sample_passes = False

    @property
    def capabilities(self):
        """What its sums can do (:class:`Capabilities`): read samples in passes, keep samples in halves (or their
        prefix), accumulate the moment sums behind ``predict``."""
        return Capabilities(reads_sample_passes=bool(self.reads_sample_passes),
                            keeps_halves=isinstance(self, KeptSamplesMixin),
                            keeps_sample_prefix=bool(getattr(self, "keeps_sample_prefix", False)),
                            predict_sums=bool(getattr(self, "predict_sums", False)))

    def __init__(self, value_map=None, *, budget=None, seed=None, n_null_draws=None, calibration=None):
        self.value_map = value_map
        self.calibration = DEFAULT_CALIBRATION if calibration is None else calibration
        self.budget = DEFAULT_BUDGET if budget is None else budget
        self.seed = self.calibration.default_seed if seed is None else int(seed)
        self.n_null_draws = self.calibration.default_null_draws if n_null_draws is None else int(n_null_draws)

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

    def full_model_in_sample_residual_samples(self, stats, ws):
        """Where the curve's full model is measured out of sample (the factored fit's half models, each scored on
        the other half): each sample's residual sum of squares under the full model fitted on its own half (an
        array of shape (n,), its samples in any order: only its sum is read); None here (the curve is measured in
        sample)."""
        return None

    def cross_fit_blocks(self, stats, ws):
        """Where the curve is cross-fitted (the factored fit's half models, each scored on the other half): the
        sizes of the two blocks of :meth:`rank_residual_samples`' arrays that one model scored, in their order;
        None here."""
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


def fell_back(ws, reason, **facts):
    """``ws``, a fallback's whitened statistic, with why it is in use (``reason``, a key of
    :data:`rstar.rules.identifiability.REASONS`, and its facts): the verdict is decided there."""
    ws.fallback = Finding(reason, facts)
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
