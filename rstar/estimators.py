"""Data-only r* estimators: an inversion composed with a rank rule at a level.

The five public classes are presets of one estimator, :class:`_RankEstimator`
(inversion method x rank rule x level): they validate their parameters
(scikit-learn's ``_parameter_constraints``), rescale the data, let
:func:`rstar.inversions.choose_inversion` decide the inversion (once per fit,
recorded as ``inversion_``), call it and the rule, and store the fitted
attributes. The numerics live in :mod:`rstar.inversions` and :mod:`rstar.rules`.

| class | inversion method | rule | default level |
|---|---|---|---|
| ``NumericalRankEstimator`` | ``"auto"`` | :class:`~rstar.rules.NumericalRule` | (``tol``) |
| ``MPRankEstimator`` | ``"auto"`` | :class:`~rstar.rules.MarchenkoPasturRule` | 0.01 |
| ``EnergyRankEstimator`` | ``"auto"`` | :class:`~rstar.rules.EnergyRule` | 0.01 |
| ``SoftmaxInversionEstimator`` | ``method`` (``"auto"``) | :class:`~rstar.rules.MarchenkoPasturRule` | 0.01 |
| ``RStarEstimator`` | ``"least_squares"`` (softmax), ``"auto"`` | :class:`~rstar.rules.MarchenkoPasturRule` | 0.003 |
"""

import copy
import warnings
from numbers import Integral, Real

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_is_fitted

from ._backend import check_device, resolve_backend
from ._validation import check_positive, check_rank_param, check_tokens, check_value_map, check_X_Y
from .budgets import DEFAULT_COMPUTE_BUDGET, DEFAULT_MEMORY_BUDGET, CostBudget
from .exceptions import InversionFallbackWarning, OperatorMisfitWarning, UnidentifiableRankWarning
from .inversions import DEFAULT_NULL_DRAWS, DEFAULT_SEED, choose_inversion, make_inversion
from .inversions._base import sample_capacity
from .metrics import token_r2_score
from .model_check import operator_class_check
from .risk import (CURVE_RESOLUTION_FRACTION, centred_sums, excess_risk_standard_error, excess_risk_upper_bound,
                   rank_at_tolerance, relative_excess_risk, total_sum_of_squares)
from .rules import EnergyRule, MarchenkoPasturRule, NumericalRule
from .streaming import ArraySamples, BatchSamples, DaskSamples, is_dask_collection, merge_stats, stop_keeping_samples

__all__ = [
    "NumericalRankEstimator",
    "MPRankEstimator",
    "EnergyRankEstimator",
    "SoftmaxInversionEstimator",
    "RStarEstimator",
    "make_inversion",
]

#: RStarEstimator's default false-alarm level per sequential test: the level with the highest exact
#: recovery of r* on a held-out grid (seed 1 of benchmarks/recovery.py, recounted by
#: benchmarks/alpha_calibration.py from the p-values at 0.01; docs/validation.md)
RSTAR_ALPHA = 0.003

_FIRST_ORDER = ("query_key_first_order", "softmax_first_order")

#: The attributes :meth:`_RankEstimator._finalize` sets, computed on first access after ``partial_fit``.
_LAZY_FITTED = ("rank_", "effective_rank_", "spectrum_", "threshold_", "noise_variance_", "spike_strengths_",
                "p_values_", "rank_interval_", "n_columns_", "components_", "inversion_", "inversion_reason_",
                "null_model_", "noise_source_", "noise_floor_rank_", "noise_floor_interval_", "_operator_cache")

#: A batch is added to the sums in chunks of at most this many entries (32 MiB) of (X, Y) or of the per-sample
#: d x d temporaries (pseudo-inverse Grams), whichever is larger per sample: an update's temporaries are a few times
#: its chunk, so they do not grow with the batch (d = 768, T = 8: 200 samples peaked at 1.9 GiB when only X and Y
#: were counted).
UPDATE_CHUNK_ENTRIES = 2**22

_SHARED_CONSTRAINTS = {
    "operator": [StrOptions({"linear_proxy", "linear_qk", "softmax"})],
    "value_map": ["array-like", None],
    "rank": [Interval(Integral, 0, None, closed="left"), None],
    "max_rank": [Interval(Integral, 0, None, closed="left"), None],
    "tolerance": [Interval(Real, 0, 1, closed="left"), None],
    "tolerance_level": [Interval(Real, 0, 0.5, closed="right")],
    "noise_variance": [Interval(Real, 0, None, closed="neither"), None],
    "random_state": ["random_state"],
    "n_null_draws": [Interval(Integral, 1, None, closed="left")],
    "memory_budget": [Interval(Integral, 1, None, closed="left")],
    "compute_budget": [Interval(Real, 1, None, closed="left")],
    "predict_sums": ["boolean"],
    "device": "no_validation",   # validated by rstar._backend.check_device (imports torch only when needed)
}


def _resolve_seed(random_state):
    """The integer seed of a fit's simulations: ``DEFAULT_SEED`` for None (a fit is then a deterministic function
    of the data), the int itself, or one draw from a ``RandomState``."""
    if random_state is None:
        return DEFAULT_SEED
    if isinstance(random_state, Integral) and not isinstance(random_state, bool):
        return int(random_state)
    return int(check_random_state(random_state).randint(0, 2**31 - 2))


class _RankEstimator(RegressorMixin, BaseEstimator):
    """The data-only estimator: inversion (``_method``) x rule (``_make_rule``) x level; the public classes are presets."""

    _parameter_constraints = dict(_SHARED_CONSTRAINTS)

    # -- the preset -------------------------------------------------------------
    def _get_operator(self):
        return self.operator

    def _method(self):
        """The inversion method handed to :func:`rstar.inversions.choose_inversion`."""
        return "auto"

    def _make_rule(self, unit):  # pragma: no cover - abstract
        raise NotImplementedError

    def _clip(self):
        return 1e-3

    def _causal(self):
        """Causal attention (RStarEstimator's ``causal``; False for the other estimators)."""
        return False

    # -- validation --------------------------------------------------------
    def _validate_params_(self):
        self._validate_params()   # scikit-learn's _parameter_constraints
        for name in ("rank", "max_rank"):
            check_rank_param(getattr(self, name), name)   # bools are refused
        check_positive(self.noise_variance, "noise_variance")
        if self.tolerance is not None and self.rank is not None:
            raise ValueError(f"rank={self.rank} forces the rank and tolerance={self.tolerance} asks for r*(tolerance): "
                             "give one of them (the other None).")
        check_device(self.device)
        if self._causal() and self._get_operator() != "softmax":
            raise ValueError(f"causal=True is the softmax operator's (a decoder head's mask); got "
                             f"operator={self._get_operator()!r}.")
        self._validate_rule_params()

    def _validate_rule_params(self):
        pass

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        tags.target_tags.single_output = True
        tags.input_tags.three_d_array = True
        try:
            op = self._get_operator()
        except AttributeError:
            op = None
        # With 2-D data (T = 1) only the linear proxy is an ordinary linear
        # regression; attention operators are cubic / softmax of one token.
        tags.regressor_tags.poor_score = op != "linear_proxy"
        return tags

    # -- fitting -----------------------------------------------------------
    def fit(self, X, Y):
        """Estimate r* from samples.

        Parameters
        ----------
        X : array-like of shape (n_samples, T, d) or (n_samples, d)
            Tokens. A 2-D array is read as T = 1.
        Y : array-like of shape (n_samples, T, d_v), (n_samples, d_v) or (n_samples,)
            Outputs (1-D only with a 2-D X: single-output regression).

        Returns
        -------
        self

        Notes
        -----
        ``X`` and ``Y`` may be ``dask.array`` arrays (chunked along the
        samples): each chunk's sums are then computed where it lives and
        reduced by dask's tree reduction (a ``distributed`` cluster
        included), and an inversion that needs more than the sums reads the
        chunks again in passes (:meth:`fit_batches`).
        """
        self._reset()
        if is_dask_collection(X) or is_dask_collection(Y):
            import dask.array as da

            X, Y = (A if is_dask_collection(A) else da.from_array(np.asarray(A)) for A in (X, Y))
            return self._fit_samples(DaskSamples(X, Y))
        return self._fit_batch(X, Y)

    def _reset(self):
        for attr in ("_stats", "_inv", "_whitened", "_shared_statistic", "_samples_read_in_passes"):
            if hasattr(self, attr):
                delattr(self, attr)

    def fit_batches(self, batches):
        """Estimate r* from samples given in batches, read in as many passes as the inversion needs.

        The first pass accumulates the sums every inversion is built on
        (memory independent of the number of samples, as with
        :meth:`partial_fit`). Where the inversion needs the samples
        themselves, they are kept if they fit ``memory_budget`` (the result is
        then that of ``partial_fit`` over the same batches); if they do not,
        the least-squares softmax fit reads the batches again at every
        evaluation of its loss (``O(n T^2 (d + d_v))`` each, usually tens to a
        few hundred passes) instead of falling back to first order, and the
        other inversions that need their samples (the query–key cross-fit,
        the linear proxy's split-half statistic beyond its moment sums) fall
        back with an :class:`~rstar.exceptions.InversionFallbackWarning` as
        ``partial_fit`` does. The internal units are set by the first batch.

        Parameters
        ----------
        batches : list of (X, Y) pairs, or callable
            ``(X_b, Y_b)`` pairs of shapes ``(n_b, T, d)`` and
            ``(n_b, T, d_v)``, or a function of no arguments returning a fresh
            iterable of them at each call (e.g. ``lambda: read(files)``); every
            pass must yield the same samples in the same order
            (:class:`rstar.streaming.BatchSamples`).

        Returns
        -------
        self

        Examples
        --------
        >>> from rstar import RStarEstimator
        >>> from rstar.datasets import make_attention_task
        >>> X, Y = make_attention_task(1000, seq_len=32, n_features=16, rank=3, random_state=0)
        >>> batches = lambda: ((X[i:i + 250], Y[i:i + 250]) for i in range(0, 1000, 250))
        >>> est = RStarEstimator(memory_budget=2**20).fit_batches(batches)   # 1 MiB: the samples are not kept
        >>> est.rank_, est.inversion_
        (3, 'softmax_least_squares')
        """
        self._reset()
        return self._fit_samples(BatchSamples(batches))

    def new_shard(self):
        """An empty copy of this fitted estimator, in its units and configuration, to ``partial_fit`` on a shard
        of the data and :meth:`merge` back (map-reduce).

        Returns
        -------
        shard : estimator
            Unfitted sums (no sample seen) with this estimator's internal units
            and inversion.

        Examples
        --------
        >>> from rstar import MPRankEstimator
        >>> from rstar.datasets import make_linear_proxy
        >>> X, Y = make_linear_proxy(900, rank=3, random_state=0)
        >>> est = MPRankEstimator().partial_fit(X[:300], Y[:300])
        >>> shard = est.new_shard().partial_fit(X[300:], Y[300:])   # e.g. on another machine
        >>> est.merge(shard).n_samples_seen_, est.rank_ == MPRankEstimator().fit(X, Y).rank_
        (900, True)
        """
        check_is_fitted(self, "rank_")
        shard = copy.copy(self)
        shard._stats = self._inv.new_stats(*self._dims)
        shard._shared_statistic = False
        shard._whitened = None
        shard._samples_read_in_passes = False
        for attr in [a for a in vars(shard) if a.endswith("_") and not a.startswith("_") and a != "n_features_in_"]:
            delattr(shard, attr)
        return shard

    def merge(self, *shards):
        """Add the sums of other estimators fitted on other samples: afterwards this estimator is fitted on all
        of them (equal to :meth:`fit` on the union up to round-off and the order of the samples).

        Parameters
        ----------
        *shards : estimators
            Made by :meth:`new_shard` of this estimator (or of one of its
            shards) and fitted with ``partial_fit``: the same units and
            inversion.

        Returns
        -------
        self

        Raises
        ------
        ValueError
            A shard in other units or with another inversion.
        """
        check_is_fitted(self, "rank_")
        for shard in (self,) + shards:
            if getattr(shard, "_samples_read_in_passes", False):
                raise ValueError("cannot merge an estimator that read its samples in passes (fit_batches or dask "
                                 "arrays): its least-squares fit needs them, and they were not kept.")
        for shard in shards:
            if not isinstance(shard, _RankEstimator) or not hasattr(shard, "_stats"):
                raise ValueError(f"merge needs shards fitted with partial_fit, got {type(shard).__name__}.")
            if (shard._x_scale, shard._y_scale) != (self._x_scale, self._y_scale) or not _same_config(
                    shard._config, self._config):
                raise ValueError("cannot merge a shard in other units or with another inversion: make each shard "
                                 "with new_shard() of one fitted estimator, then partial_fit it.")
        if self._shared_statistic:
            self._stats = copy.deepcopy(self._stats)
            self._shared_statistic = False
        for shard in shards:
            self._stats = merge_stats(self._stats, shard._stats)
        self._whitened = None
        self._finalize()
        return self

    def _fit_samples(self, samples):
        """Fit from a :class:`rstar.streaming.Samples` source: one pass of sums, then the kept samples or the
        source read in passes."""
        self._validate_params_()
        if isinstance(samples, DaskSamples):
            self._start(*self._validated(*samples.block(0)))
            stats = samples.statistic(self._inv, self._x_scale, self._y_scale)
            self._stats = merge_stats(self._stats, stats)
        else:
            for k, (X, Y) in enumerate(samples.batches()):
                X, Y, y_ndim = self._validated(X, Y)
                if k == 0:
                    self._start(X, Y, y_ndim)
                    stop_keeping_samples(self._stats)
                else:
                    self._check_next(X, Y)
                self._update(X, Y)
            if not hasattr(self, "_stats"):
                raise ValueError("batches gave no (X, Y) batch.")
        n = self._stats["n"]
        samples.set_shape(n, self._dims).with_scales(self._x_scale, self._y_scale)
        passes = False
        stats = self._stats
        if "samples_odd" in stats:
            capacity = (sample_capacity(stats) if "sample_budget_bytes" in stats
                        else self._budget.max_samples(*self._dims))
            reads_passes = bool(getattr(self._inv, "reads_sample_passes", False))
            if n <= capacity:
                # within the budget: keep them, as partial_fit would
                stats["samples_odd"], stats["samples_even"] = samples.halves()
                if "n_kept" in stats:
                    stats["n_kept"] = n
            elif reads_passes and self._inv.fit_possible(stats, samples):
                passes = True   # over the memory budget only: the least squares reads them in passes
            elif "n_kept" in stats:
                # over the compute budget: the first samples within it, as partial_fit would keep
                stats["samples_odd"], stats["samples_even"] = samples.halves(capacity)
                stats["n_kept"] = capacity
        self._samples_read_in_passes = passes
        self._check_enough_samples()
        self._finalize(samples if passes else None, curve_samples=samples)
        if passes and self.predict_sums:
            # the operator needs the samples too: fitted now, while they can be read
            self._operator_cache["operator"] = self._inv.fit_operator(
                self._stats, self.components_, samples=samples, ops=resolve_backend(self.device))
        return self

    def partial_fit(self, X, Y):
        """Add a batch of samples; after the last batch the fitted attributes
        equal those of :meth:`fit` on all batches together (up to round-off).

        Parameters
        ----------
        X : array-like of shape (n_batch, T, d)
        Y : array-like of shape (n_batch, T, d_v)

        Returns
        -------
        self

        Notes
        -----
        The fitted attributes (``rank_``, ``spectrum_``, ``inversion_`` …)
        are computed when first read after a batch, not at every batch: a
        stream of many batches then costs one inversion and rule, not one per
        batch (the least-squares softmax fit on all samples so far would
        otherwise run again at each). The warnings of that computation are
        issued then. ``n_samples_seen_`` is updated at once, and errors about
        the data (shapes, values, too few samples, a ``rank`` or ``max_rank``
        beyond the statistic's dimension) are raised by ``partial_fit``
        itself.
        """
        return self._fit_batch(X, Y, lazy=True)

    def __getattr__(self, name):
        # after partial_fit the fitted attributes are computed on first access (see partial_fit)
        if name in _LAZY_FITTED and self.__dict__.get("_pending_finalize", False):
            self._finalize()
            return getattr(self, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def fit_from(self, fitted):
        """Fit this estimator's rule on the statistic another estimator has accumulated.

        The rule runs on ``fitted``'s sums and whitened statistic without a
        pass over the data: the result equals ``fit`` on the same data.
        ``fitted`` must have been fitted with the same inversion (operator,
        method, value map, budgets, ``random_state``, ``n_null_draws``,
        ``predict_sums``); later ``partial_fit`` calls on either continue
        from a copy of the sums.

        Parameters
        ----------
        fitted : fitted rstar data-only estimator

        Returns
        -------
        self

        Raises
        ------
        ValueError
            If ``fitted`` would not build the same inversion.

        Examples
        --------
        >>> from rstar import MPRankEstimator, RStarEstimator
        >>> from rstar.datasets import make_linear_proxy
        >>> X, Y = make_linear_proxy(500, rank=3, random_state=0)
        >>> ref = RStarEstimator(operator="linear_proxy").fit(X, Y)
        >>> MPRankEstimator(alpha=0.003).fit_from(ref).rank_ == MPRankEstimator(alpha=0.003).fit(X, Y).rank_
        True
        """
        check_is_fitted(fitted, "rank_")
        if not isinstance(fitted, _RankEstimator):
            raise ValueError(f"fit_from needs a fitted rstar data-only estimator, got {type(fitted).__name__}.")
        self._validate_params_()
        if self.tolerance is not None:
            raise ValueError("tolerance needs the samples (its risk curve measures each rank's model on them), "
                             "which fit_from does not read: fit on the data instead.")
        mine = self._inversion_config(fitted._dims, fitted._x_scale, fitted._y_scale)
        # what fitted's statistic was built with (its parameters may have changed since)
        theirs = fitted._config
        if not _same_config(mine, theirs):
            raise ValueError(f"{type(self).__name__} would build a different inversion than {type(fitted).__name__} "
                             "(operator, method, value map, budgets, random_state, n_null_draws or predict_sums "
                             "differ): fit it on the data instead.")
        for attr in ("n_features_in_", "_dims", "_y_ndim", "_x_scale", "_y_scale", "_inv", "_stats", "_budget",
                     "_seed", "_value_map_internal", "_config", "_samples_read_in_passes"):
            setattr(self, attr, getattr(fitted, attr))
        self._whitened = getattr(fitted, "_whitened", None)
        self._shared_statistic = fitted._shared_statistic = True
        self._finalize()
        return self

    def _inversion_config(self, dims, x_scale, y_scale):
        """Everything that defines the inversion this estimator builds for data of this shape and scale."""
        T, d, d_v = dims
        V = check_value_map(self.value_map, d, d_v)
        return dict(operator=self._get_operator(), method=self._method(), clip=self._clip(), causal=self._causal(),
                    value_map=None if V is None else V * (x_scale / y_scale),
                    budget=(int(self.memory_budget), float(self.compute_budget)),
                    seed=_resolve_seed(self.random_state) if not hasattr(self.random_state, "randint") else None,
                    n_null_draws=int(self.n_null_draws), predict_sums=bool(self.predict_sums))

    def _validated(self, X, Y):
        """``(X, Y, y_ndim)``: X and Y as 3-D float arrays (a 2-D X read as T = 1, a 1-D Y as one output) and
        the number of dimensions of the Y given (what ``predict`` returns)."""
        if Y is not None and not hasattr(Y, "ndim"):
            Y = np.asarray(Y)
        if X is not None and not hasattr(X, "ndim"):
            X = np.asarray(X)
        y_ndim = None if Y is None else np.asarray(Y).ndim
        if y_ndim == 1 and np.asarray(X).ndim == 2:
            Y = np.asarray(Y)[:, None]
        X, Y = check_X_Y(X, Y)
        return X, Y, 3 if y_ndim == 3 else y_ndim

    def _start(self, X, Y, y_ndim=3):
        """Set up from the first (validated) batch: dimensions, internal units, the frozen configuration and the
        inversion."""
        n, T, d = X.shape
        d_v = Y.shape[2]
        self.n_features_in_ = d
        self._dims = (T, d, d_v)
        self._y_ndim = y_ndim
        self._x_scale = _rms(X)
        self._y_scale = _rms(Y)
        # what defines the inversion is frozen at the first batch (set_params between batches cannot change it)
        self._config = config = self._inversion_config(self._dims, self._x_scale, self._y_scale)
        self._value_map_internal = config["value_map"]
        self._budget = CostBudget(*config["budget"])
        self._seed = _resolve_seed(self.random_state)
        self._inv = make_inversion(config["operator"], config["value_map"], shape=(T, d, d_v),
                                   method=config["method"], clip=config["clip"], budget=self._budget,
                                   seed=self._seed, n_null_draws=config["n_null_draws"],
                                   predict_sums=config["predict_sums"], causal=config["causal"])
        self._stats = self._inv.new_stats(T, d, d_v)
        self._shared_statistic = False
        self._samples_read_in_passes = False

    def _check_next(self, X, Y):
        """A later batch must match the first one's shape and the configuration frozen then."""
        n, T, d = X.shape
        d_v = Y.shape[2]
        T0, d0, dv0 = self._dims
        if d != d0:
            raise ValueError(f"X has {d} features, but {type(self).__name__} is expecting {d0} features "
                             "as input (from the first partial_fit batch).")
        if d_v != dv0:
            raise ValueError(f"Y has {d_v} output features, but earlier batches had d_v={dv0}.")
        if T != T0:
            raise ValueError(f"X has T={T} tokens, but earlier batches had T={T0}; partial_fit batches "
                             "must share the sequence length.")
        if not _same_config(self._inversion_config(self._dims, self._x_scale, self._y_scale), self._config):
            raise ValueError("a parameter that defines the inversion (operator, method, value_map, budgets, "
                             "random_state, n_null_draws, predict_sums) changed since the first partial_fit "
                             "batch: call fit to start again with the new parameters.")

    def _update(self, X, Y):
        """Add a batch to the sums, ``UPDATE_CHUNK_ENTRIES`` entries of (X, Y) at a time (so an update's
        temporaries stay bounded whatever the batch size)."""
        T, d, d_v = self._dims
        step = max(1, UPDATE_CHUNK_ENTRIES // max(T * (d + d_v), d * d))
        for start in range(0, X.shape[0], step):
            part = slice(start, start + step)
            self._inv.update(self._stats, X[part] / self._x_scale, Y[part] / self._y_scale)

    def _check_enough_samples(self):
        n_total = self._stats["n"]
        need = self._inv.min_samples(*self._dims)
        if n_total < need:
            raise ValueError(f"Found {n_total} sample(s) so far, but {type(self).__name__} needs at least {need} "
                             f"samples for this inversion at T={self._dims[0]}, d={self._dims[1]} (got {n_total} "
                             "sample(s)).")

    def _fit_batch(self, X, Y, lazy=False):
        self._validate_params_()
        if lazy and self.tolerance is not None:
            raise ValueError("tolerance needs the samples at the end of the fit (its risk curve measures each rank's "
                             "model on them), which partial_fit does not keep: use fit, or fit_batches with every "
                             "batch.")
        X, Y, y_ndim = self._validated(X, Y)
        if not hasattr(self, "_stats"):
            self._start(X, Y, y_ndim)
        else:
            self._check_next(X, Y)
            if getattr(self, "_samples_read_in_passes", False):
                raise ValueError("this estimator read its samples in passes (fit_batches or dask arrays) and did "
                                 "not keep them, so partial_fit cannot add to its least-squares fit: call "
                                 "fit_batches again with every batch.")
            if self._shared_statistic:
                # the sums came from another estimator (fit_from): continue from a copy
                self._stats = copy.deepcopy(self._stats)
                self._shared_statistic = False
        self._update(X, Y)
        self._whitened = None
        self._check_enough_samples()
        if lazy:
            self._check_rank_params(self._inv.statistic_dim(*self._dims[:2]))
            for attr in _LAZY_FITTED:
                self.__dict__.pop(attr, None)
            self.n_samples_seen_ = int(self._stats["n"])
            self._pending_finalize = True
        else:
            self._finalize(curve_samples=ArraySamples(X / self._x_scale, Y / self._y_scale))
        return self

    def _choose(self):
        """The inversion for the samples seen so far (:func:`rstar.inversions.choose_inversion`)."""
        config = self._config
        choice = choose_inversion(config["operator"], value_map_known=config["value_map"] is not None,
                                  shape=self._dims, n_samples=self._stats["n"], method=config["method"],
                                  budget=self._budget,
                                  samples_in_memory=not getattr(self, "_samples_read_in_passes", False),
                                  causal=config.get("causal", False))
        if choice.name not in self._inv.produces:   # pragma: no cover - a bug, not a user error
            raise RuntimeError(f"{type(self._inv).__name__} cannot produce the {choice.name} statistic.")
        return choice

    def _whiten(self, choice, samples=None):
        """The whitened statistic of the chosen inversion, computed once per state of the sums."""
        key = (self._stats["n"], choice.name)
        cached = getattr(self, "_whitened", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if getattr(self._inv, "reads_sample_passes", False):
            if samples is None and getattr(self, "_samples_read_in_passes", False):   # pragma: no cover - kept
                raise ValueError("the statistic of a fit that read its samples in passes cannot be recomputed "
                                 "without them: fit again.")
            ws = self._inv.whiten(self._stats, choice.name, samples=samples, ops=resolve_backend(self.device))
        else:
            ws = self._inv.whiten(self._stats, choice.name)
        self._whitened = (key, ws)
        return ws

    def _check_rank_params(self, p):
        if self.max_rank is not None and self.max_rank > p:
            raise ValueError(f"max_rank must be <= {p} (the dimension of the statistic), got {self.max_rank}.")
        if self.rank is not None and self.rank > p:
            raise ValueError(f"rank must be <= {p} (the dimension of the statistic: "
                             f"{'T' if self._inv.space == 'tokens' else 'd'}), got {self.rank}.")

    def _finalize(self, samples=None, curve_samples=None):
        self._pending_finalize = False
        choice = self._choose()
        ws = self._whiten(choice, samples)
        notes = [(InversionFallbackWarning, message) for message in choice.messages()]
        log_domain = ws.units in ("log-attention", "logit")
        unit = 1.0 if log_domain else self._y_scale**2
        user_noise = None
        if self.noise_variance is not None:
            if log_domain:
                notes.append((UserWarning, f"noise_variance is in units of Y**2 and does not apply to the {ws.inversion} "
                              f"inversion, whose spectrum is in {ws.units} units: it is ignored (the split-half "
                              "noise level is used). Use method='first_order' to test at a given noise level."))
            else:
                user_noise = self.noise_variance / unit
        if self._value_map_internal is not None and ws.inversion in _FIRST_ORDER:
            notes.append((UserWarning, f"the known value_map is not used by the {ws.inversion} inversion's statistic "
                          "(only by predict): the rank is estimated as with V unknown. The least-squares inversions "
                          "use it (see inversion_reason_ and the fallback warning, if any)."))
        if not (isinstance(self.device, str) and self.device == "cpu"):
            on_device = getattr(self._inv, "reads_sample_passes", False) and ws.inversion == self._inv.name
            if not on_device and resolve_backend(self.device).device.type != "cpu":
                notes.append((UserWarning, f"device={self.device!r} is used only by the least-squares softmax fit; "
                              f"the {ws.inversion} inversion ran on numpy on the CPU."))
        self._check_rank_params(ws.dim)
        bounds = ws.rank_bounds
        if bounds is None and ws.n_columns < ws.dim:
            # fewer noise columns than dimensions: the statistic's rank is at most n_columns, no bulk of the
            # full dimension is left to set the noise level, and the rules would read every eigenvalue as signal
            bounds = (0, ws.dim)
            need = ws.dim / max(ws.n_columns / self._stats["n"], 1e-12)
            notes.append((UnidentifiableRankWarning,
                          f"the {ws.inversion} statistic has about {ws.n_columns:.0f} independent noise columns for "
                          f"{ws.dim} dimensions (too few samples: each sample adds about d_v columns), so its noise "
                          f"bulk cannot be told from signal and rank_ may be far off; rank_interval_ is (0, "
                          f"{ws.dim}). What would help: more than {need:.0f} "
                          "samples."))
        T = self._dims[0]
        if T == 1 and self._config["operator"] in ("softmax", "linear_qk"):
            # one token per sample: softmax attention of one token is 1 whatever K, and linear query-key
            # attention sees K only through x^T K x (its symmetric part), whose rank is not K's
            bounds = (0, ws.dim) if bounds is None else (min(bounds[0], 0), max(bounds[1], ws.dim))
            what = ("softmax attention over one token is 1 whatever K (Y does not depend on K)"
                    if self._config["operator"] == "softmax" else
                    "linear query-key attention over one token sees K only through x^T K x (its symmetric "
                    "part), whose rank is not K's")
            notes.append((UnidentifiableRankWarning,
                          f"X has T = 1 token per sample (a 2-D X of shape (n, d) is read as T = 1): {what}, so "
                          f"r* is not identified by these data; rank_interval_ is (0, {ws.dim}). What would "
                          "help: sequences of T >= 2 tokens, X of shape (n_samples, T, d) and Y of shape "
                          "(n_samples, T, d_v)."))
        res = self._make_rule(unit)(ws, user_noise, self.max_rank)
        for category, message in notes + list(ws.warnings) + list(res.warnings):
            warnings.warn(message, category, stacklevel=4)
        rank = res.rank if self.rank is None else self.rank
        interval = (int(res.rank_interval[0]), int(res.rank_interval[1]))
        if bounds is not None:
            # r* is not identified: the interval covers the range it is known to lie in
            interval = (min(interval[0], int(bounds[0])), max(interval[1], int(bounds[1])))
        self.noise_floor_rank_ = int(res.rank)
        self.noise_floor_interval_ = interval
        for attr in ("risk_curve_", "risk_curve_se_", "risk_curve_upper_", "risk_curve_distance_",
                     "risk_curve_resolution_", "_risk_curve_full_rank"):
            self.__dict__.pop(attr, None)
        if self.tolerance is not None:
            rank, interval = self._tolerance_rank(ws, res, curve_samples)
        self.rank_ = int(rank)
        self.effective_rank_ = float(res.effective_rank)
        self.spectrum_ = ws.eigenvalues * unit
        self.threshold_ = float(res.threshold * unit)
        self.noise_variance_ = float(res.noise_variance * unit)
        self.spike_strengths_ = np.asarray(res.spike_strengths, dtype=float)
        self.p_values_ = np.asarray(res.p_values, dtype=float)
        self.rank_interval_ = interval
        self.n_columns_ = float(ws.n_columns)
        self.components_ = ws.components(self.rank_)
        self.n_samples_seen_ = int(self._stats["n"])
        self.inversion_ = ws.inversion
        if ws.inversion != choice.name:
            self.inversion_reason_ = _fallback_message(ws)
        elif choice.is_fallback:
            self.inversion_reason_ = choice.messages()[0]
        else:
            self.inversion_reason_ = choice.reason
        self.null_model_ = ws.null.kind
        self.noise_source_ = "user" if user_noise is not None else ws.null.noise_source
        # the closed-form operator costs several times the rank estimate: built on first use
        self._operator_cache = {}
        if curve_samples is not None and ws.inversion == "softmax_first_order" and bounds is None:
            self._check_first_order_fit(ws, res, curve_samples)
        self.model_check_ = None
        if curve_samples is not None and bounds is None:
            self._check_operator_class(ws, curve_samples)

    def _check_operator_class(self, ws, samples):
        """Do the samples follow the operator's class (:func:`rstar.model_check.operator_class_check`)? If not,
        warn with what would fit and widen the intervals to (0, d).

        Runs for linear query-key attention with T > d (any inversion: its test needs no operator) and for
        softmax attention where the least squares ran (its full-rank fit is the class's least-squares operator;
        not the factored least squares at real sizes, and not the first order, which has model checks of its
        own). ``model_check_`` records the outcome (None where it did not run)."""
        operator_name = self._config["operator"]
        if operator_name == "linear_proxy" or self._inv.space == "tokens":
            return
        if operator_name == "softmax" and ws.inversion != "softmax_least_squares":
            return   # the check needs the class's least-squares fit; the first order has its own model checks
        if any(issubclass(w, UnidentifiableRankWarning) for w, _ in list(ws.warnings)):
            return   # already out of the class or not identified: said once, by the inversion
        if operator_name == "linear_qk":
            # the exact-in-span test needs no operator (a moment estimator's would not do for the baseline test)
            check = operator_class_check(samples, None, exact_in_span=True)
            if check["span_p"] is None:
                return   # T <= d: no span left outside col(X_i)
        else:
            operator = self._inv.full_rank_operator(self._stats)   # the fit whiten made: no second fit
            if operator is None:
                return
            check = operator_class_check(samples, operator, exact_in_span=False)
        self.model_check_ = check
        if not check["rejected"]:
            return
        reasons = []
        if "baseline" in check["rejected"]:
            reasons.append(f"a regression with no attention at all (each token's features, its sequence's and "
                           f"prefix's means and its position) leaves {100 * check['baseline_gain']:.1f}% less "
                           f"residual on samples it was not fitted on than the full-rank {operator_name} fit on "
                           f"its own samples (one-sided p = {check['baseline_p']:.2g})")
        if "span" in check["rejected"]:
            reasons.append(f"the power of Y outside the span of each sample's tokens, which this class leaves to "
                           f"the noise alone, grows with the tokens' norm (correlation "
                           f"{check['span_correlation']:.2f} over samples, one-sided p = {check['span_p']:.2g}): "
                           "there is signal outside the span")
        alternative = {"linear_qk": "operator='softmax' or 'linear_proxy'",
                       "softmax": "operator='linear_qk' or 'linear_proxy'"}[operator_name]
        what = f"the {operator_name} operator's class"
        wide = (0, int(ws.dim))
        warnings.warn(
            f"the data do not follow {what}: {'; and '.join(reasons)}. rank_ is a "
            f"count inside a class these data lie outside, so it may be far off; rank_interval_ is {wide}. Check "
            "that X holds the inputs (n, T, d) and Y the outputs (n, T, d_v), not swapped, and that the operator "
            f"matches how Y was made (try {alternative}; a decoder head needs causal=True).",
            OperatorMisfitWarning, stacklevel=5)
        for attr in ("rank_interval_", "noise_floor_interval_"):
            lo, hi = getattr(self, attr)
            setattr(self, attr, (min(lo, wide[0]), max(hi, wide[1])))

    def _check_first_order_fit(self, ws, res, samples):
        """Where the samples are at hand: does the first-order softmax model hold
        (:meth:`rstar.inversions.QueryKeyInversion.first_order_misfit`, its operator at the noise-floor rank)? If
        not, warn and widen the intervals to (0, d)."""
        # None without the moment sums (predict_sums=False or over the memory budget): then only the check that
        # needs no operator (the tokens' kurtosis, where T - 1 <= d) runs
        operator = self._inv.first_order_operator(self._stats, ws.components(int(res.rank)))
        if operator is not None and self.rank is None and ws.inversion == self._inv.name:
            self._operator_cache["operator"] = operator   # the very operator predict uses: fitted once
        misfit = self._inv.first_order_misfit(self._stats, operator, samples)
        if misfit is None:
            return
        warnings.warn(misfit[1], UnidentifiableRankWarning, stacklevel=5)
        wide = (0, int(ws.dim))
        for attr in ("rank_interval_", "noise_floor_interval_"):
            lo, hi = getattr(self, attr)
            setattr(self, attr, (min(lo, wide[0]), max(hi, wide[1])))

    def _tolerance_rank(self, ws, res, samples):
        """``(rank, interval)`` at ``tolerance`` from the risk curve on ``samples`` (sets ``risk_curve_``)."""
        tol = float(self.tolerance)
        inv = self._inv
        kw = {"ops": resolve_backend(self.device)} if getattr(inv, "reads_sample_passes", False) else {}
        # the rank beyond which the curve's models no longer change (ws.dim, or the factored fit's q)
        limit = inv.curve_rank_limit(ws)
        top = min(limit, max(int(res.rank_interval[1]), int(res.rank)))
        first = [None, *range(top + 1)]
        # each sample's residuals where the inversion measures its curve per sample (for its standard error)
        parts = inv.rank_residual_samples(self._stats, ws, first, samples, **kw)
        per_sample = parts is not None

        def residuals(ranks):
            # the totals (and each sample's, where measured) of the rank-r models for r in ranks
            if per_sample:
                parts = inv.rank_residual_samples(self._stats, ws, list(ranks), samples, **kw)
                return [float(np.sum(p)) for p in parts], parts
            return inv.rank_residuals(self._stats, ws, list(ranks), samples, **kw), None

        rss = [float(np.sum(p)) for p in parts] if per_sample else residuals(first)[0]
        if rss is None:
            raise ValueError("tolerance needs the closed-form operators of every rank, whose moment sums were not "
                             "accumulated (predict_sums=False, or over the memory budget for this T, d and d_v).")
        full, rss = rss[0], rss[1:]
        full_parts, parts = (parts[0], parts[1:]) if per_sample else (None, None)
        tss = total_sum_of_squares(inv.risk_samples(self._stats, ws, samples).map_sum(centred_sums, 1))
        # where the curve is measured on other models than predict's (the factored fit's halves): predict's rank-r
        # model's output distance from its full one, per sample; the rank is read where both bounds reach it
        distance_parts = inv.rank_output_distance_samples(self._stats, ws, list(range(len(rss))))

        def read(rss, parts, distance_parts):
            curve = relative_excess_risk(rss, full, tss)
            se = excess_risk_standard_error(parts, full_parts, tss) if per_sample else np.zeros_like(curve)
            upper = excess_risk_upper_bound(curve, se, self.tolerance_level)
            if distance_parts is None:
                return curve, se, None, upper
            distance = np.array([float(np.sum(p)) for p in distance_parts]) / tss
            distance_se = excess_risk_standard_error(distance_parts, np.zeros_like(distance_parts[0]), tss)
            return curve, se, distance, np.maximum(upper, excess_risk_upper_bound(distance, distance_se,
                                                                                   self.tolerance_level))

        curve, se, distance, upper = read(rss, parts, distance_parts)
        # go on until half the tolerance is reached (the interval's upper end), or the limit
        while rank_at_tolerance(upper, tol / 2) is None and len(curve) <= limit:
            more = range(len(curve), min(limit, 2 * len(curve)) + 1)
            more_rss, more_parts = residuals(more)
            rss = rss + more_rss
            parts = parts + more_parts if per_sample else None
            if distance_parts is not None:
                distance_parts = distance_parts + inv.rank_output_distance_samples(self._stats, ws, list(more))
            curve, se, distance, upper = read(rss, parts, distance_parts)
        self.risk_curve_ = curve
        self.risk_curve_se_ = se if per_sample else None
        self.risk_curve_upper_ = upper
        self.risk_curve_distance_ = distance
        # a curve that reaches the limit and not a tolerance: only the full model (rank d) is known to reach it
        self._risk_curve_full_rank = int(ws.dim) if len(curve) > limit else None
        rank = rank_at_tolerance(upper, tol)
        rank = ws.dim if rank is None else rank
        # the lower end off the curve itself (no confidence margin, no distance), the upper off the bound
        low = rank_at_tolerance(curve, min(2 * tol, 1.0))
        high = rank_at_tolerance(upper, tol / 2)
        interval = (min(rank, ws.dim if low is None else low), max(rank, ws.dim if high is None else high))
        if ws.rank_bounds is not None:
            # the inversion could not identify its statistic (e.g. a factored fit whose count had not settled):
            # the full model the curve is measured against may itself fall short, so r*(tolerance) is a lower end
            interval = (interval[0], int(ws.dim))
            warnings.warn(
                f"tolerance={tol:g} is read off a risk curve measured against the {ws.inversion} fit, which did not "
                f"identify its statistic (see the other warning): that fit may fall short of the unconstrained "
                f"model, so the rank read ({rank}) may be too small; rank_interval_ reaches {ws.dim}. What would "
                "help: the remedy the other warning names.", UnidentifiableRankWarning, stacklevel=5)
        disagreement = inv.half_disagreement(self._stats, ws)
        self.risk_curve_resolution_ = disagreement
        if disagreement is not None and disagreement > CURVE_RESOLUTION_FRACTION * tol:
            # the curve compares models fitted on half the samples; where those disagree by more than the
            # tolerance allows, it cannot say whether the half-sum model predict uses reaches it
            interval = (interval[0], int(ws.dim))
            warnings.warn(
                f"tolerance={tol:g} is finer than this risk curve resolves: it is measured on the two halves' "
                f"{ws.inversion} fits, whose outputs disagree by {disagreement:.3g} of Var(Y) (a quarter of their "
                "mean squared difference: the excess of a half's model over their mean), more than "
                f"{CURVE_RESOLUTION_FRACTION:g} times the tolerance, so the rank read ({rank}) may be too small "
                "(or larger than needed) for the model predict uses; rank_interval_ reaches "
                f"{ws.dim}. The halves settle on different optima where the rank fitted is too small for the task, "
                "or the samples too few: more samples, a larger tolerance, or a larger compute_budget would help.",
                UnidentifiableRankWarning, stacklevel=5)
        if rank > res.rank_interval[1]:
            warnings.warn(
                f"tolerance={tol:g} is finer than the noise resolves: the rank it reads ({rank}) exceeds the "
                f"noise-floor estimate's upper end ({res.rank_interval[1]}), so the ranks beyond that fit the noise "
                "of these samples, not the task. More samples, or a larger tolerance, would help.",
                UnidentifiableRankWarning, stacklevel=5)
        return rank, interval

    def rank_at_tolerance(self, tolerance):
        """r*(tolerance) from the fitted curve without refitting (read as the fit reads it: ``risk_curve_upper_``,
        the curve's upper bound at ``tolerance_level``).

        Parameters
        ----------
        tolerance : float in [0, 1)

        Returns
        -------
        int
            The smallest rank whose relative excess risk (its upper bound) is at most ``tolerance``; the number
            of features d where the curve reached the rank beyond which its models no longer change (the
            factored fit's q) without reaching ``tolerance``, as ``fit`` reads it.

        Raises
        ------
        ValueError
            If the estimator was fitted without a ``tolerance`` (no curve), or the curve was computed only up to
            ranks that do not reach this tolerance (fit again with it).
        """
        check_is_fitted(self, "rank_")
        if "risk_curve_" not in self.__dict__:
            raise ValueError("no risk curve: fit with tolerance=... (any value) to compute risk_curve_.")
        upper = self.__dict__.get("risk_curve_upper_", self.risk_curve_)
        rank = rank_at_tolerance(upper, tolerance)
        if rank is None and self.__dict__.get("_risk_curve_full_rank") is not None:
            return self._risk_curve_full_rank
        if rank is None:
            raise ValueError(f"the risk curve was computed up to rank {len(self.risk_curve_) - 1}, where the excess "
                             f"risk is still {upper[-1]:.3g} > {tolerance:g}: fit with "
                             f"tolerance={tolerance:g}.")
        return rank

    def __getstate__(self):
        # the cached whitened statistic holds the null draws and d^2 x d^2 factors: recomputed on demand
        # (deterministically, from the seed) rather than pickled
        state = super().__getstate__()
        if not state.get("_samples_read_in_passes", False):
            # (a fit that read its samples in passes keeps it: it could not be recomputed)
            state.pop("_whitened", None)
        return state

    @property
    def statistic_(self):
        """The :class:`rstar.inversions.WhitenedStatistic` the rule read: the whitened eigen-decomposition
        (``spectrum_`` is its ``eigenvalues`` in Y units), its null model and any extra evidence (internal units:
        the data rescaled to unit RMS)."""
        check_is_fitted(self, "rank_")
        return self._whiten(self._choose())

    @property
    def operator_(self):
        """The closed-form operator used by ``predict`` (built on first access, then cached)."""
        check_is_fitted(self, "rank_")
        cache = self._operator_cache
        if "operator" not in cache:
            if getattr(self._inv, "reads_sample_passes", False):
                cache["operator"] = self._inv.fit_operator(self._stats, self.components_,
                                                           ops=resolve_backend(self.device))
            else:
                cache["operator"] = self._inv.fit_operator(self._stats, self.components_)
        return cache["operator"]

    # -- prediction -----------------------------------------------------------
    def predict(self, X):
        """Ŷ from the operator fitted in closed form at rank ``rank_``.

        Parameters
        ----------
        X : array-like of shape (n_samples, T, d) or (n_samples, d)

        Returns
        -------
        Y_pred : ndarray of shape (n_samples, T, d_v)
            (or ``(n_samples, d_v)`` / ``(n_samples,)`` matching the ``Y`` given to fit).
        """
        check_is_fitted(self, "rank_")
        X = check_tokens(X, "X")
        n, T, d = X.shape
        if d != self.n_features_in_:
            raise ValueError(f"X has {d} features, but {type(self).__name__} is expecting "
                             f"{self.n_features_in_} features as input.")
        if self._inv.space == "tokens" and T != self._dims[0]:
            raise ValueError(f"X has T={T} tokens, but the linear-proxy operator A is {self._dims[0]} x "
                             f"{self._dims[0]} (fitted on T={self._dims[0]}).")
        operator = self.operator_
        if operator is None:
            raise ValueError("predict is not available: the moment sums for the closed-form operator were not "
                             "accumulated because they would exceed the memory budget for this T, d and d_v "
                             "(rank_ and the spectrum are unaffected).")
        Y = operator.predict(X / self._x_scale) * self._y_scale
        if self._y_ndim == 1:
            return Y.reshape(n)
        if self._y_ndim == 2:
            return Y.reshape(n, -1)
        return Y

    def score(self, X, y, sample_weight=None):
        """Token-wise R² of ``predict(X)`` (same as ``r2_score`` on ``(n*T, d_v)``).

        Parameters
        ----------
        X : array-like of shape (n_samples, T, d)
        y : array-like of shape (n_samples, T, d_v)
            The targets Y (named ``y`` as scikit-learn passes it by keyword).
        sample_weight : None
            Not supported; must be None.

        Returns
        -------
        float
        """
        if sample_weight is not None:
            raise ValueError("sample_weight is not supported by the token-wise R² score.")
        Y_pred = self.predict(X)
        Y = np.asarray(y, dtype=np.float64)
        if Y.shape != Y_pred.shape:
            raise ValueError(f"Y has shape {Y.shape}, but predict(X) has shape {Y_pred.shape}.")
        return token_r2_score(Y, Y_pred)


def _rms(A):
    top = float(np.max(np.abs(A)))
    if top == 0 or not np.isfinite(top):
        return 1.0
    return top * float(np.sqrt(np.mean((A / top) ** 2)))


_SHARED_PARAMS_DOC = """
    operator : {"linear_proxy", "linear_qk", "softmax"}, default=%(default)r
        The model class (theory §2): ``"linear_proxy"`` (Y = A X V, r* = rank A,
        components in token space), ``"linear_qk"`` (Y = (X K X^T) X V / c),
        ``"softmax"`` (Y = softmax(X K X^T / sqrt(d)) X V).
    value_map : array-like of shape (d, d_v) or None, default=None
        The value matrix V if known. None (unknown) is supported throughout."""

_COMMON_PARAMS_DOC = """
    rank : int or None, default=None
        None estimates r*; an int forces ``rank_`` (the rank of the fitted
        operator), e.g. for a data-only rank sweep with ``GridSearchCV``.
    max_rank : int or None, default=None
        Upper bound on the estimated rank.
    tolerance : float in [0, 1) or None, default=None
        None estimates the noise-floor r*. A float ε asks for r*(ε) (theory
        §2, paper eq. 4): the smallest rank r whose rank-r model's risk is
        within ``ε Var(Y)`` of the full-rank model's, read off the data-only
        curve ``risk_curve_`` (residuals of the inversion's rank-r models: in
        sample for the closed-form operators, cross-fitted for the factored
        least squares, whose bound also covers ``predict``'s own model,
        ``risk_curve_distance_``; :mod:`rstar.risk`). Needs the samples at
        the end of the fit: ``fit`` and ``fit_batches`` (``partial_fit`` and
        ``fit_from`` raise). Cannot be combined with a forced ``rank``.
    tolerance_level : float in (0, 0.5], default=0.05
        One-sided level of the r*(ε) reading: the rank read is the smallest
        whose excess risk's upper ``1 - tolerance_level`` confidence bound
        (``risk_curve_upper_`` = the curve plus the normal quantile times its
        standard error over samples) is within ε, where the inversion
        measures its curve per sample (the factored least squares, whose
        curve is cross-fitted); elsewhere the curve itself is read. 0.5 reads
        the curve itself everywhere.
    noise_variance : float or None, default=None
        Known variance sigma**2 of the noise entries of Y. None: estimated
        (residual of the model when identifiable, else the MP bulk median).
    random_state : int, RandomState instance or None, default=None
        Seeds the simulations (null draws, random starting kernels). None
        uses a fixed seed (``rstar.inversions.DEFAULT_SEED``), so that a fit
        is a deterministic function of the data and ``partial_fit`` equals
        ``fit``; a ``RandomState`` is drawn from once per fit.
    n_null_draws : int, default=1000
        Draws of the simulated null (least-squares inversions): the smallest
        p-value is ``1 / (n_null_draws + 1)`` (``2 / (n_null_draws + 1)`` for
        the cross-fitted union), so it must exceed about ``1 / alpha``
        (``2 / alpha``) or no spike could be detected: fit then raises.
        Time and memory grow linearly.
    memory_budget : int, default=536870912
        Bytes (512 MiB) an inversion may keep beyond its ``O(d^2)`` sums:
        the samples of a least-squares fit, or (half of it each) moment sums
        and ``d^2 x d^2`` matrices (:mod:`rstar.budgets`).
    compute_budget : float, default=2**39
        Multiply-adds one least-squares fit or information matrix may cost
        (minutes of one core at the default; :mod:`rstar.budgets`). Beyond
        either budget :func:`rstar.inversions.choose_inversion` falls back
        to the first-order inversion with an ``InversionFallbackWarning``.
    predict_sums : bool, default=True
        Accumulate the moment sums behind ``predict``'s closed-form operator
        (query–key inversions, ``d^4`` entries). False saves their memory and
        time; ``rank_`` is unchanged and ``predict`` raises.
    device : str or torch.device, default="cpu"
        Where the heavy numerics run (the least-squares softmax fit and its
        information, which cost ``O(n T^2 (d + d_v))`` per pass): ``"cpu"``
        is numpy; ``"auto"`` (CUDA when present), ``"cuda"``, ``"cuda:N"``
        or any ``torch.device`` (``torch.device("cpu")`` included) is torch
        in float64, which needs the ``torch`` extra. Results agree with the
        CPU path to round-off (the optimiser's path can then differ in its
        last iterations). The one-pass sums stay on numpy; a GPU asked for
        where the inversion that runs does not use it is reported with a
        ``UserWarning``."""


def _init_common(est, rank, max_rank, noise_variance, random_state, n_null_draws, memory_budget, compute_budget,
                 predict_sums, device="cpu", tolerance=None, tolerance_level=0.05):
    est.rank = rank
    est.max_rank = max_rank
    est.tolerance = tolerance
    est.tolerance_level = tolerance_level
    est.noise_variance = noise_variance
    est.random_state = random_state
    est.n_null_draws = n_null_draws
    est.memory_budget = memory_budget
    est.compute_budget = compute_budget
    est.predict_sums = predict_sums
    est.device = device


def _same_config(a, b):
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _fallback_message(ws):
    """The message of the warning that says why ``ws`` comes from a fallback inversion."""
    for _, message in reversed(ws.warnings):
        if "Fallback in use" in message:
            return message
    return "a fallback while the inversion ran"


_P_VALUES_HEAD = """
    p_values_ : ndarray of shape (n_tests,)
        p-values of the sequential spike tests, in order (entry k: is
        eigenvalue k+1 signal, given k spikes?); the first one at or above
        ``alpha`` stopped the count. Tests go on up to the first one not
        significant at the lenient level ``min(10 alpha, 0.5)``."""

_P_VALUES_DOC = _P_VALUES_HEAD + """ Their law
        follows ``null_model_``: ``"wishart"`` and ``"structured_bulk"``,
        approximate Tracy–Widom p-values, each the smaller of the test from
        the top and the multiplicity-adjusted top-down one
        (:func:`rstar.rules.top_down_p_values`; conservative with a fitted
        bulk); ``"simulated"`` (least-squares inversions), Monte Carlo
        p-values against ``n_null_draws`` draws of the noise,
        ``(1 + #{draws >= observed}) / (n_null_draws + 1)``
        (:func:`rstar.rules.simulated_null_p_values`), at least
        ``1 / (n_null_draws + 1)``; ``"cross_fit_union"`` (linear QK with V
        unknown and T <= d or d_v < d), twice the smaller of the two halves'
        Monte Carlo p-values, capped at 1, at least
        ``2 / (n_null_draws + 1)``; ``"split_half"`` (the factored least
        squares), none: an empty array (its test is a margin, not a level).
        Under pure noise ``p_values_[0]`` is close to uniform on (0, 1)
        (see docs/rules/marchenko_pastur.md)."""

# RStarEstimator's default inversions are tested against simulated nulls: its p-values say so first
_RSTAR_P_VALUES_DOC = _P_VALUES_HEAD + """ With the
        least-squares inversions (``softmax`` below the factored fit's
        sizes, and ``linear_qk`` with V known: ``null_model_ ==
        "simulated"``) they are Monte Carlo p-values against a simulated
        null, not Tracy–Widom ones: ``(1 + #{draws >= observed}) /
        (n_null_draws + 1)`` over ``n_null_draws`` draws of the fit's noise
        (:func:`rstar.rules.simulated_null_p_values`), so the smallest is
        ``1 / (n_null_draws + 1)`` (0.000999 = 1/1001 at the default 1000
        draws). With ``linear_qk``, V unknown and T <= d or d_v < d
        (``"cross_fit_union"``), each is twice the smaller of the two
        halves' Monte Carlo p-values, capped at 1 (smallest
        ``2 / (n_null_draws + 1)``). The ``linear_proxy`` and first-order
        inversions, and a fallback to them (``"wishart"``,
        ``"structured_bulk"``), give approximate Tracy–Widom p-values as
        :class:`MPRankEstimator` does. The factored least squares (real
        sizes, ``"split_half"``) gives none: an empty array (its test is a
        margin, not a level). Under pure noise ``p_values_[0]`` is close to
        uniform on (0, 1)."""

_FITTED_DOC = """
    Attributes
    ----------
    rank_ : int
        Estimated r* (or the forced ``rank``); 0 when there is no signal.
    effective_rank_ : float
        Effective rank of the noise-corrected spectrum (see the rule).
    spectrum_ : ndarray of shape (p,)
        Descending eigenvalues of the whitened statistic (p = T for the linear
        proxy, d otherwise), in units of Y**2 (log-attention units for the
        exact softmax inversion): pure noise of variance sigma**2 gives a
        Marchenko–Pastur bulk near sigma**2.
    threshold_ : float
        The cut applied to ``spectrum_``.
    noise_variance_ : float
        Noise variance used (given, residual-based or bulk-based; see ``noise_source_``).
    spike_strengths_ : ndarray of shape (n_spikes,)
        BBP-debiased population spikes (units of the noise variance).""" + _P_VALUES_DOC + """
    rank_interval_ : tuple of two ints
        ``(lower, upper)``: the counts of the same sequential test at the
        strict level ``alpha / 10`` and the lenient level ``min(10 alpha, 0.5)``
        (where the test is against ``B`` simulated noise draws, the strict
        level is at least ``1 / B``, the smallest it can reject at, or
        ``2 / B`` for the cross-fitted union; for the energy rule, the energy rank of the strict count
        and the lenient count itself; for the numerical rule, the noise-aware counts). A sensitivity range, not a coverage guarantee:
        ``lower < upper`` says that some eigenvalues sit near the detection
        edge, where r* is only partly identifiable. Under pure noise,
        ``lower > 0`` in about ``alpha / 10`` of data sets and ``upper > 0`` in
        about ``10 alpha``. Not affected by a forced ``rank``.
    noise_floor_rank_ : int
        The noise-floor estimate of r* (equal to ``rank_`` unless a
        ``tolerance`` or a forced ``rank`` is given).
    noise_floor_interval_ : tuple of two ints
        Its interval (equal to ``rank_interval_`` without a ``tolerance``).
    risk_curve_ : ndarray of shape (R + 1,)
        Only with a ``tolerance``: the relative excess risk of the rank-r
        model, r = 0 ... R, ``(RSS(r) - RSS(full)) / TSS`` on the samples
        fitted (:mod:`rstar.risk`); computed up to the rank that reaches half
        the tolerance. ``rank_at_tolerance(eps)`` reads it at any ε. With a
        tolerance ``rank_interval_`` is ``(r(2 ε), r(ε / 2))``, the lower
        end read off this curve, the upper off ``risk_curve_upper_``.
    risk_curve_se_ : ndarray of shape (R + 1,) or None
        Only with a ``tolerance``: the standard error of each point of
        ``risk_curve_`` over the samples it was measured on, where the
        inversion measures its curve per sample (the factored least squares);
        None elsewhere.
    risk_curve_upper_ : ndarray of shape (R + 1,)
        Only with a ``tolerance``: the curve that ``rank_`` and
        ``rank_interval_``'s upper end are read from, ``risk_curve_ + z
        risk_curve_se_`` with z the normal quantile at ``1 -
        tolerance_level`` (the curve itself where there is no standard
        error); where ``risk_curve_distance_`` is measured, the larger of
        that and the same bound on the distance.
    risk_curve_distance_ : ndarray of shape (R + 1,) or None
        Only with a ``tolerance``: where the curve is measured on other
        models than ``predict``'s (the factored least squares' half models),
        the squared distance of ``predict``'s rank-r model's outputs from
        its full model's on the samples fitted, over the total sum of
        squares: its excess risk where the full model reproduces Y, an
        overstatement of it with noise. None elsewhere.
    risk_curve_resolution_ : float or None
        Only with a ``tolerance``: where the curve is measured on models
        fitted on half the samples (the factored least squares), how far the
        two halves' full models disagree, a quarter of their mean squared
        difference over Var(Y) (a half model's excess risk over their mean).
        Above half the tolerance the reading is warned and
        ``rank_interval_`` reaches d. None elsewhere.
    n_columns_ : float
        Effective number of MP columns behind ``spectrum_``.
    components_ : ndarray of shape (``rank_``, T) or (``rank_``, d)
        Orthonormal basis of the recovered subspace (range of A, or of K).
    statistic_ : WhitenedStatistic
        The whitened statistic the rule read, with its null model
        (``statistic_.null``) and evidence, in the estimator's internal
        units (data rescaled to unit RMS).
    operator_ : object
        The closed-form operator used by ``predict``; fitted from the moment
        sums on first access (``predict``, ``score`` or reading it), since it
        costs several times the rank estimate itself.
    inversion_ : str
        The inversion that produced ``spectrum_``, after any fallback (a key
        of :data:`rstar.inversions.INVERSIONS`; decided by
        :func:`rstar.inversions.choose_inversion`).
    inversion_reason_ : str
        Why that inversion ran: the choice's reason, or, after a fallback,
        the message of the warning that says why the preferred one did not.
    model_check_ : dict or None
        The model check of the operator's class (:func:`rstar.model_check.operator_class_check`):
        ``baseline_gain``, ``baseline_p``, ``span_correlation``, ``span_p`` and ``rejected`` (the tests that
        reject the class; non-empty: an :class:`~rstar.OperatorMisfitWarning` was issued and
        ``rank_interval_`` is (0, d)). It runs for linear query-key attention with T > d and for softmax
        attention where the least squares ran (small d); None elsewhere: the linear proxy, ``partial_fit``
        (no samples at hand), the factored least squares (real sizes), the first order (its own model checks),
        and fits already warned as not identified.
    null_model_ : str
        The null model the rule tested against: ``"wishart"``,
        ``"structured_bulk"``, ``"simulated"``, ``"cross_fit_union"`` or
        ``"split_half"``.
    noise_source_ : str
        Where ``noise_variance_`` comes from (``"user"``, ``"regression
        residual"``, ``"residual outside col(X_i)"``, ``"least-squares
        residual"``, ``"split-half draw"``, ``"bulk"``, ``"fitted bulk"``).
    n_features_in_ : int
        d.
    n_samples_seen_ : int
"""


class MPRankEstimator(_RankEstimator):
    __doc__ = ("""Rank = eigenvalues of the whitened statistic above the Marchenko–Pastur edge.

    The edge carries a Tracy–Widom margin at false-alarm level ``alpha``
    (sequential tests, theory §5), so pure noise gives ``rank_ = 0`` with
    probability about ``1 - alpha``. ``effective_rank_`` is the entropy
    effective rank R_eff of the BBP-debiased spikes (the paper's MP-corrected
    R_eff). The inversion is :func:`rstar.inversions.choose_inversion`'s
    ``"auto"`` choice (the paper's for softmax); the rule is
    :class:`rstar.rules.MarchenkoPasturRule`.

    Parameters
    ----------""" + _SHARED_PARAMS_DOC % {"default": "linear_proxy"} + _COMMON_PARAMS_DOC + """
    alpha : float in (0, 1), default=0.01
        False-alarm level of each spike test.
""" + _FITTED_DOC + """
    Examples
    --------
    >>> from rstar import MPRankEstimator
    >>> from rstar.datasets import make_linear_proxy
    >>> X, Y = make_linear_proxy(500, rank=3, random_state=0)
    >>> est = MPRankEstimator().fit(X, Y)
    >>> est.rank_, est.inversion_, est.noise_source_
    (3, 'token', 'regression residual')
    """)

    _parameter_constraints = {**_SHARED_CONSTRAINTS, "alpha": [Interval(Real, 0, 1, closed="neither")]}

    def __init__(self, operator="linear_proxy", *, value_map=None, rank=None, max_rank=None, tolerance=None,
                 tolerance_level=0.05, noise_variance=None,
                 alpha=0.01, random_state=None, n_null_draws=DEFAULT_NULL_DRAWS, memory_budget=DEFAULT_MEMORY_BUDGET,
                 compute_budget=DEFAULT_COMPUTE_BUDGET, predict_sums=True, device="cpu"):
        self.operator = operator
        self.value_map = value_map
        self.alpha = alpha
        _init_common(self, rank, max_rank, noise_variance, random_state, n_null_draws, memory_budget, compute_budget,
                     predict_sums, device, tolerance, tolerance_level)

    def _validate_rule_params(self):
        check_positive(self.alpha, "alpha", allow_none=False, upper=1.0)

    def _make_rule(self, unit):
        return MarchenkoPasturRule(alpha=self.alpha)


class EnergyRankEstimator(MPRankEstimator):
    __doc__ = ("""Rank = energy effective rank R̃_eff of the noise-corrected spectrum, rounded.

    Spikes are detected as by :class:`MPRankEstimator`, de-biased through the
    inverse BBP map, and ``effective_rank_ = exp(H(theta / sum theta))``;
    ``rank_ = floor(effective_rank_ + 1/2)``. Weak spikes count for less: the
    paper's choice for softmax kernels; it under-counts spikes of very
    unequal strength. Where ``rank_`` is below the number of spikes found
    above the noise edge an ``UnidentifiableRankWarning`` says so and
    ``rank_interval_`` reaches that count. The rule is
    :class:`rstar.rules.EnergyRule`.

    Parameters
    ----------""" + _SHARED_PARAMS_DOC % {"default": "linear_proxy"} + _COMMON_PARAMS_DOC + """
    alpha : float in (0, 1), default=0.01
""" + _FITTED_DOC + """
    Examples
    --------
    >>> from rstar import EnergyRankEstimator
    >>> from rstar.datasets import make_linear_proxy
    >>> X, Y = make_linear_proxy(500, rank=3, random_state=0)
    >>> EnergyRankEstimator().fit(X, Y).rank_
    3
    """)

    def _make_rule(self, unit):
        return EnergyRule(alpha=self.alpha)


class NumericalRankEstimator(_RankEstimator):
    __doc__ = ("""Rank = eigenvalues of the whitened statistic above a tolerance.

    The paper's data-only numerical rank: not noise-aware (pure noise gives
    full rank unless ``tol`` sits above the noise), and broken by the
    softmax inversion's non-linear bulk. ``p_values_`` and the range of
    ``rank_interval_`` come from the noise-aware test beside it; a warning
    says when the tolerance's count falls outside that range
    (:class:`rstar.rules.NumericalRule`).

    Parameters
    ----------""" + _SHARED_PARAMS_DOC % {"default": "linear_proxy"} + _COMMON_PARAMS_DOC + """
    tol : float or None, default=None
        Absolute tolerance in the units of ``spectrum_`` (Y**2, or
        log-attention units for the exact softmax inversion).
    rtol : float in (0, 1], default=1e-2
        Used when ``tol`` is None: the cut is ``rtol * spectrum_[0]``.
""" + _FITTED_DOC + """
    Examples
    --------
    >>> from rstar import NumericalRankEstimator
    >>> from rstar.datasets import make_linear_proxy
    >>> X, Y = make_linear_proxy(500, rank=3, random_state=0)
    >>> NumericalRankEstimator().fit(X, Y).rank_
    3
    """)

    _parameter_constraints = {**_SHARED_CONSTRAINTS, "tol": [Interval(Real, 0, None, closed="left"), None],
                              "rtol": [Interval(Real, 0, 1, closed="right")]}

    def __init__(self, operator="linear_proxy", *, value_map=None, rank=None, max_rank=None, tolerance=None,
                 tolerance_level=0.05, noise_variance=None,
                 tol=None, rtol=1e-2, random_state=None, n_null_draws=DEFAULT_NULL_DRAWS,
                 memory_budget=DEFAULT_MEMORY_BUDGET, compute_budget=DEFAULT_COMPUTE_BUDGET, predict_sums=True, device="cpu"):
        self.operator = operator
        self.value_map = value_map
        self.tol = tol
        self.rtol = rtol
        _init_common(self, rank, max_rank, noise_variance, random_state, n_null_draws, memory_budget, compute_budget,
                     predict_sums, device, tolerance, tolerance_level)

    def _validate_rule_params(self):
        check_positive(self.tol, "tol", strict=False)
        check_positive(self.rtol, "rtol", allow_none=False, upper=1.0 + 1e-12)

    def _make_rule(self, unit):
        return NumericalRule(tol=None if self.tol is None else self.tol / unit, rtol=self.rtol)


class SoftmaxInversionEstimator(MPRankEstimator):
    __doc__ = ("""Invert softmax attention, then count spikes above the MP edge.

    - ``value_map=None`` (or ``T > 0.9 min(d, d_v)``): first-order inversion.
      Near uniform attention ``softmax(Z) ~ (11^T + Z P) / T``, so
      ``P Y ~ P X K X^T P X V / (T sqrt(d))`` and the query–key inversion is
      applied to ``(P X, P Y)``. The higher-order terms form a structured
      bulk that breaks the numerical rank; samples are weighted by the
      inverse of their residual power (heavy-tailed tokens).
    - known ``value_map`` with ``T <= 0.9 min(d, d_v)``: exact inversion,
      ``S_i = Y_i (X_i V)^+`` and weighted least squares of ``log S_i`` on
      the bilinear form (see :class:`rstar.inversions.SoftmaxExactInversion`).

    ``predict`` uses ``softmax(X K X^T / sqrt(d)) X V`` with K fitted at rank
    ``rank_`` (first order: K and V by alternating least squares on the
    moment sums, V's scale fixed by the token means).

    Parameters
    ----------
    value_map : array-like of shape (d, d_v) or None, default=None""" + _COMMON_PARAMS_DOC + """
    alpha : float in (0, 1), default=0.01
    method : {"auto", "first_order", "exact", "least_squares"}, default="auto"
        ``"auto"`` is the paper's choice above; ``"least_squares"`` is
        :class:`RStarEstimator`'s inversion (least squares on the model
        itself, :class:`rstar.inversions.SoftmaxLeastSquaresInversion`).
        See :func:`rstar.inversions.choose_inversion`.
    clip : float in (0, 1), default=1e-3
        Exact inversion: recovered attention weights are clipped at ``clip / T``.
""" + _FITTED_DOC + """
    Examples
    --------
    >>> from rstar import SoftmaxInversionEstimator
    >>> from rstar.datasets import make_attention_task
    >>> X, Y = make_attention_task(1000, seq_len=32, n_features=16, rank=3, random_state=0)
    >>> est = SoftmaxInversionEstimator().fit(X, Y)
    >>> est.rank_, est.inversion_, est.null_model_
    (3, 'softmax_first_order', 'structured_bulk')
    """)

    _parameter_constraints = {**{k: v for k, v in _SHARED_CONSTRAINTS.items() if k != "operator"},
                              "alpha": [Interval(Real, 0, 1, closed="neither")],
                              "method": [StrOptions({"auto", "first_order", "exact", "least_squares"})],
                              "clip": [Interval(Real, 0, 1, closed="neither")]}

    def __init__(self, *, value_map=None, rank=None, max_rank=None, tolerance=None,
                 tolerance_level=0.05, noise_variance=None, alpha=0.01,
                 method="auto", clip=1e-3, random_state=None, n_null_draws=DEFAULT_NULL_DRAWS,
                 memory_budget=DEFAULT_MEMORY_BUDGET, compute_budget=DEFAULT_COMPUTE_BUDGET, predict_sums=True, device="cpu"):
        self.value_map = value_map
        self.alpha = alpha
        self.method = method
        self.clip = clip
        _init_common(self, rank, max_rank, noise_variance, random_state, n_null_draws, memory_budget, compute_budget,
                     predict_sums, device, tolerance, tolerance_level)

    def _get_operator(self):
        return "softmax"

    def _method(self):
        return self.method

    def _clip(self):
        return self.clip

    def _validate_rule_params(self):
        super()._validate_rule_params()
        check_positive(self.clip, "clip", allow_none=False, upper=1.0)


class RStarEstimator(MPRankEstimator):
    __doc__ = ("""The package's recommended r* estimator for each operator.

    A preset: the Marchenko–Pastur rule at ``alpha = 0.003`` on the
    inversion below (``inversion_`` records what ran; every fallback warns).

    ============== ============================================================
    operator       inversion
    ============== ============================================================
    linear_proxy   ``token``: second moment and coherent split-half statistic
    linear_qk      ``query_key_least_squares`` (V known); ``query_key_cross_fit``
                   (V unknown, ``T <= d`` or ``d_v < d``); else
                   ``query_key_first_order``
    softmax        ``softmax_least_squares`` (V known or profiled out), tested
                   against draws of its noise; where its d^2 x d^2
                   information exceeds half the memory budget (d >= 80 by
                   default: real layers), ``softmax_factored_least_squares``
                   (K = A B^T on each half, tested against their difference)
    ============== ============================================================

    For the linear operators it is exactly ``MPRankEstimator(alpha=0.003)``.

    Parameters
    ----------""" + _SHARED_PARAMS_DOC % {"default": "softmax"} + _COMMON_PARAMS_DOC + """
    alpha : float in (0, 1), default=0.003
        False-alarm level of each sequential test: the level with the
        highest exact recovery of r* on a held-out recovery grid
        (``benchmarks/alpha_calibration.py``; docs/validation.md). The other
        estimators keep the conventional 0.01.
    causal : bool, default=False
        Causal (decoder) attention: token t attends to tokens ``s <= t``
        (``softmax`` only). Only the factored least squares models the mask,
        so it runs whatever d; where it cannot (too few samples, the budgets,
        samples read in passes) ``fit`` raises ``ValueError``.
""" + _FITTED_DOC.replace(_P_VALUES_DOC, _RSTAR_P_VALUES_DOC) + """
    Examples
    --------
    >>> from rstar import RStarEstimator
    >>> from rstar.datasets import make_attention_task
    >>> X, Y = make_attention_task(1000, seq_len=32, n_features=16, rank=3, random_state=0)
    >>> est = RStarEstimator().fit(X, Y)
    >>> est.rank_, est.inversion_, est.null_model_
    (3, 'softmax_least_squares', 'simulated')
    """)

    def __init__(self, operator="softmax", *, value_map=None, rank=None, max_rank=None, tolerance=None,
                 tolerance_level=0.05, noise_variance=None,
                 alpha=RSTAR_ALPHA, random_state=None, n_null_draws=DEFAULT_NULL_DRAWS,
                 memory_budget=DEFAULT_MEMORY_BUDGET, compute_budget=DEFAULT_COMPUTE_BUDGET, predict_sums=True, device="cpu",
                 causal=False):
        super().__init__(operator, value_map=value_map, rank=rank, max_rank=max_rank, tolerance=tolerance,
                         tolerance_level=tolerance_level, noise_variance=noise_variance,
                         alpha=alpha, random_state=random_state, n_null_draws=n_null_draws,
                         memory_budget=memory_budget, compute_budget=compute_budget, predict_sums=predict_sums,
                         device=device)
        self.causal = causal

    _parameter_constraints = {**MPRankEstimator._parameter_constraints, "causal": ["boolean"]}

    def _causal(self):
        return bool(self.causal)

    def _method(self):
        # softmax: least squares on the model itself (first order beyond its budget)
        return "least_squares" if self._get_operator() == "softmax" else "auto"
