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

import warnings
from numbers import Integral, Real

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions

from ._backend import check_device, resolve_backend
from ._validation import check_positive, check_rank_param, check_value_map
from .budgets import CostBudget
from .calibration import DEFAULT_CALIBRATION, Calibration
from .exceptions import InversionFallbackWarning
from .inversions import choose_inversion, make_inversion
from .inversions._numerics.rotary import RotaryPositions
from .model_check import model_check
from .risk import floor_margin, held_out_reach, tolerance_reading
from .rules import EnergyRule, MarchenkoPasturRule, NumericalRule, identifiability
from .rules.split_half import split_half_counts
from ._fitted import FittedOperatorMixin
from .streaming import StreamingFitMixin, is_dask_collection

__all__ = [
    "NumericalRankEstimator",
    "MPRankEstimator",
    "EnergyRankEstimator",
    "SoftmaxInversionEstimator",
    "RStarEstimator",
    "make_inversion",
]

_FIRST_ORDER = ("query_key_first_order", "softmax_first_order")

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
    "compute_budget": [Interval(Real, 1, None, closed="left"), StrOptions({"auto"})],
    "predict_sums": ["boolean"],
    "device": "no_validation",   # validated by rstar._backend.check_device (imports torch only when needed)
    "calibration": [Calibration, None],
}


#: The fitted attributes a tolerance reading sets (each the ``ToleranceReading`` field of its name without the
#: trailing underscore), cleared at every fit.
_RISK_CURVE_ATTRIBUTES = ("risk_curve_", "risk_curve_se_", "risk_curve_fit_se_", "risk_curve_upper_",
                          "risk_curve_distance_", "risk_curve_resolution_", "risk_curve_floor_",
                          "risk_curve_floor_in_sample_", "risk_curve_floor_se_",
                          "risk_curve_floor_fit_se_")


def _budget_config(memory_budget, compute_budget, calibration):
    """``(memory bytes, multiply-adds, the factored fit's multiply-adds)`` of :class:`rstar.budgets.CostBudget`:
    ``compute_budget="auto"`` chooses within the calibration's ``compute_budget`` and lets the factored fit run to
    its iteration caps (an unbounded allowance)."""
    if isinstance(compute_budget, str):
        return int(memory_budget), float(calibration.compute_budget), float("inf")
    return int(memory_budget), float(compute_budget), None


def _resolve_seed(random_state, calibration=DEFAULT_CALIBRATION):
    """The integer seed of a fit's simulations: the calibration's ``default_seed`` for None (a fit is then a
    deterministic function of the data), the int itself, or one draw from a ``RandomState``."""
    if random_state is None:
        return calibration.default_seed
    if isinstance(random_state, Integral) and not isinstance(random_state, bool):
        return int(random_state)
    return int(check_random_state(random_state).randint(0, 2**31 - 2))


class _RankEstimator(StreamingFitMixin, FittedOperatorMixin, RegressorMixin, BaseEstimator):
    """The data-only estimator: inversion (``_method``) x rule (``_make_rule``) x level; the public classes are presets.

    It validates, asks :func:`~rstar.inversions.choose_inversion`, accumulates the inversion's sums, whitens,
    applies the rule and the identifiability gates (:mod:`rstar.rules.identifiability`) and stores the fitted
    attributes. Batches, shards and dask arrays are :class:`~rstar.streaming.StreamingFitMixin`'s; the risk
    curve is :func:`rstar.risk.tolerance_reading`'s; the fitted operator, ``predict`` and ``score`` are
    :class:`rstar._fitted.FittedOperatorMixin`'s.
    """

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

    def _rotary(self):
        """A rotary head's positions (RStarEstimator's ``rotary``; None for the other estimators)."""
        return None

    def _calibration(self):
        return DEFAULT_CALIBRATION if self.calibration is None else self.calibration

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
        if self._rotary() is not None and self._get_operator() != "softmax":
            raise ValueError(f"rotary positions are the softmax operator's (a rotary head's); got "
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
            return self._fit_dask(X, Y)
        return self._fit_batch(X, Y)

    def _inversion_config(self, dims, x_scale, y_scale):
        """Everything that defines the inversion this estimator builds for data of this shape and scale."""
        T, d, d_v = dims
        V = check_value_map(self.value_map, d, d_v)
        return dict(operator=self._get_operator(), method=self._method(), clip=self._clip(), causal=self._causal(),
                    rotary=self._rotary(),
                    value_map=None if V is None else V * (x_scale / y_scale),
                    budget=_budget_config(self.memory_budget, self.compute_budget, self._calibration()),
                    seed=(_resolve_seed(self.random_state, self._calibration())
                          if not hasattr(self.random_state, "randint") else None),
                    n_null_draws=int(self.n_null_draws), predict_sums=bool(self.predict_sums),
                    rank_bound=self.max_rank, calibration=self._calibration(),
                    # the factored fit's halves must resolve the tolerance its curve will be read at
                    reading_tolerance=None if self.tolerance is None else float(self.tolerance))

    def _start(self, X, Y, y_ndim=3):
        """Set up from the first (validated) batch: dimensions, internal units, the frozen configuration and the
        inversion."""
        n, T, d = X.shape
        d_v = Y.shape[2]
        rotary = self._rotary()
        if rotary is not None and rotary.length != T:
            raise ValueError(f"rotary has the angles of {rotary.length} positions, but X has T={T} tokens per "
                             "sample: give the angles of the windows' own positions.")
        self.n_features_in_ = d
        self._dims = (T, d, d_v)
        self._y_ndim = y_ndim
        self._x_scale = _rms(X)
        self._y_scale = _rms(Y)
        # what defines the inversion is frozen at the first batch (set_params between batches cannot change it)
        self._config = config = self._inversion_config(self._dims, self._x_scale, self._y_scale)
        self._value_map_internal = config["value_map"]
        self._budget = CostBudget(*config["budget"])
        self._seed = _resolve_seed(self.random_state, config["calibration"])
        self._inv = make_inversion(config["operator"], config["value_map"], shape=(T, d, d_v),
                                   method=config["method"], clip=config["clip"], budget=self._budget,
                                   seed=self._seed, n_null_draws=config["n_null_draws"],
                                   predict_sums=config["predict_sums"], causal=config["causal"],
                                   calibration=config["calibration"], stopping_count=split_half_counts,
                                   rank_bound=config["rank_bound"], rotary=config["rotary"],
                                   reading_tolerance=config["reading_tolerance"])
        self._stats = self._inv.new_stats(T, d, d_v)
        self._shared_statistic = False
        self._samples_read_in_passes = False

    def _choose(self):
        """The inversion for the samples seen so far (:func:`rstar.inversions.choose_inversion`)."""
        config = self._config
        choice = choose_inversion(config["operator"], value_map_known=config["value_map"] is not None,
                                  shape=self._dims, n_samples=self._stats["n"], method=config["method"],
                                  budget=self._budget, samples_in_memory=not self._samples_read_in_passes,
                                  causal=config["causal"], calibration=config["calibration"],
                                  rotary=config["rotary"])
        if choice.name not in self._inv.produces:   # pragma: no cover - a bug, not a user error
            raise RuntimeError(f"{type(self._inv).__name__} cannot produce the {choice.name} statistic.")
        return choice

    def _whiten(self, choice, samples=None):
        """The whitened statistic of the chosen inversion, computed once per state of the sums."""
        key = (self._stats["n"], choice.name)
        cached = getattr(self, "_whitened", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if self._inv.capabilities.reads_sample_passes:
            if samples is None and self._samples_read_in_passes:   # pragma: no cover - kept
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
        cal = self._config["calibration"]
        log_domain = ws.units in ("log-attention", "logit")
        unit = 1.0 if log_domain else self._y_scale**2
        user_noise = None if self.noise_variance is None or log_domain else self.noise_variance / unit
        notes = _usage_notes(self, choice, ws)
        self._check_rank_params(ws.dim)
        res = self._make_rule(unit)(ws, user_noise, self.max_rank)
        # whether r* is identified: decided once, after the rule, by rstar.rules.identifiability
        found = identifiability.statistic_verdicts(ws, cal)
        identified = not any(v.bounds for v in found)
        gates = found + identifiability.estimator_verdicts(ws, self._stats["n"], self._dims[0],
                                                           self._config["operator"], identified)
        _warn(notes + list(ws.warnings) + list(res.warnings) + _issued(gates), stacklevel=5)
        interval = identifiability.covering((int(res.rank_interval[0]), int(res.rank_interval[1])), gates)
        self.noise_floor_rank_ = int(res.rank)
        self.noise_floor_interval_ = interval
        self.verdicts_ = list(gates) + [v for v in res.warnings if isinstance(v, identifiability.Verdict)]
        for attr in _RISK_CURVE_ATTRIBUTES + ("_risk_curve_full_rank", "_tolerance_gates", "_risk_curve_floor_margin"):
            self.__dict__.pop(attr, None)
        rank = res.rank if self.rank is None else self.rank
        if self.tolerance is not None:
            rank, interval = self._read_tolerance(ws, res, curve_samples, identified=identified, cal=cal)
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
        if ws.fallback is not None:
            # the fallback's verdict, made with the others above
            self.inversion_reason_ = next(v.message for v in found if v.reason == ws.fallback.kind)
        elif choice.is_fallback:
            self.inversion_reason_ = choice.messages()[0]
        else:
            self.inversion_reason_ = choice.reason
        self.null_model_ = ws.null.kind
        self.noise_source_ = "user" if user_noise is not None else ws.null.noise_source
        # the closed-form operator costs several times the rank estimate: built on first use
        self._operator_cache = {}
        self.model_check_ = None
        if curve_samples is not None and not any(v.bounds for v in gates):
            self._model_checks(ws, res, curve_samples, found, cal)

    def _read_tolerance(self, ws, res, samples, identified, cal):
        """``(rank, interval)`` at ``tolerance`` (:func:`rstar.risk.tolerance_reading`; sets ``risk_curve_``)."""
        kw = {"ops": resolve_backend(self.device)} if self._inv.capabilities.reads_sample_passes else {}
        reading = tolerance_reading(self._inv, self._stats, ws, samples, self.tolerance, self.tolerance_level,
                                    noise_floor=(int(res.rank), int(res.rank_interval[1])), **kw)
        for name in _RISK_CURVE_ATTRIBUTES:
            setattr(self, name, getattr(reading, name.rstrip("_")))
        self._risk_curve_full_rank = reading.full_rank
        # what the gates read, kept so that rank_at_tolerance reads another tolerance through them
        # every rank the class allows: max_rank where given (r*(eps) <= r* <= the class's bound), else the dimension
        dim = int(ws.dim) if self.max_rank is None else min(int(ws.dim), int(self.max_rank))
        self._tolerance_gates = dict(dim=dim, inversion=ws.inversion, identified=bool(identified),
                                     disagreement=reading.risk_curve_resolution,
                                     noise_lower=int(res.rank_interval[0]), noise_upper=int(res.rank_interval[1]),
                                     floor_gap=(None if reading.risk_curve_floor_in_sample is None
                                                else reading.risk_curve_floor - reading.risk_curve_floor_in_sample))
        # the floor's own margin at the curve's level (rank_at_tolerance reads other tolerances with it)
        self._risk_curve_floor_margin = floor_margin(reading.risk_curve_floor_se, self.tolerance_level)
        reach = held_out_reach(reading.risk_curve_upper, reading.risk_curve_floor, reading.risk_curve_floor_in_sample,
                               self.tolerance, self._risk_curve_floor_margin)
        gates = identifiability.tolerance_verdicts(tolerance=self.tolerance, rank=reading.rank, calibration=cal,
                                                   held_out_reach=reach, **self._tolerance_gates)
        _warn(_issued(gates), stacklevel=6)
        self.verdicts_ += gates
        return identifiability.within_class(reading.rank, identifiability.covering(reading.interval, gates), dim)

    def _model_checks(self, ws, res, samples, found, cal):
        """The model checks where the samples are at hand: the first-order softmax model
        (:meth:`rstar.inversions.QueryKeyInversion.first_order_misfit`) and the operator's class
        (:func:`rstar.model_check.model_check`); a rejection warns and widens the intervals to (0, d)."""
        gates = []
        if ws.inversion == "softmax_first_order":
            # None without the moment sums (predict_sums=False or over the memory budget): then only the check that
            # needs no operator (the tokens' kurtosis, where T - 1 <= d) runs
            operator = self._inv.first_order_operator(self._stats, ws.components(int(res.rank)))
            if operator is not None and self.rank is None and ws.inversion == self._inv.name:
                self._operator_cache["operator"] = operator   # the very operator predict uses: fitted once
            gates.append(identifiability.first_order_misfit_verdict(
                self._inv.first_order_misfit(self._stats, operator, samples), cal))
        if not identifiability.said_by_the_inversion(found):
            # (already out of the class or not identified: said once, by the inversion)
            self.model_check_ = model_check(self._config["operator"], self._inv, ws, self._stats, samples,
                                            alpha=cal.model_check_alpha, directions=max(1, int(res.rank)))
            gates.append(identifiability.operator_misfit_verdict(
                self.model_check_, self._config["operator"], ws.dim, causal=bool(self._config["causal"]),
                rotary=self._config["rotary"] is not None, alpha=cal.model_check_alpha))
        gates = [v for v in gates if v is not None]
        _warn(_issued(gates), stacklevel=6)
        self.verdicts_ += gates
        self.rank_interval_ = identifiability.covering(self.rank_interval_, gates)
        self.noise_floor_interval_ = identifiability.covering(self.noise_floor_interval_, gates)


def _warn(items, stacklevel):
    """Issue each ``(category, message)``; a verdict as its warning instance, which carries its ``reason`` and
    ``bounds`` (so a program can read ``caught.message.reason``)."""
    for item in items:
        if isinstance(item, identifiability.Verdict):
            warnings.warn(item.warning(), stacklevel=stacklevel)
        else:
            warnings.warn(item[1], item[0], stacklevel=stacklevel)


def _issued(verdicts):
    """The verdicts that issue a warning (a verdict may only widen the interval)."""
    return [v for v in verdicts if v.category is not None]


def _usage_notes(est, choice, ws):
    """The warnings about how the estimator's parameters were used: the inversion's fallback, a noise variance
    or value map the statistic does not use, a device the inversion did not run on."""
    notes = [(InversionFallbackWarning, message) for message in choice.messages()]
    if est.noise_variance is not None and ws.units in ("log-attention", "logit"):
        notes.append((UserWarning, f"noise_variance is in units of Y**2 and does not apply to the {ws.inversion} "
                      f"inversion, whose spectrum is in {ws.units} units: it is ignored (the split-half "
                      "noise level is used). Use method='first_order' to test at a given noise level."))
    if est._value_map_internal is not None and ws.inversion in _FIRST_ORDER:
        notes.append((UserWarning, f"the known value_map is not used by the {ws.inversion} inversion's statistic "
                      "(only by predict): the rank is estimated as with V unknown. The least-squares inversions "
                      "use it (see inversion_reason_ and the fallback warning, if any)."))
    if not (isinstance(est.device, str) and est.device == "cpu"):
        on_device = (est._inv.capabilities.reads_sample_passes
                     and ws.inversion in (est._inv.name, getattr(est._inv, "factored_name", None)))
        if not on_device and resolve_backend(est.device).device.type != "cpu":
            notes.append((UserWarning, f"device={est.device!r} is used only by the least-squares softmax fit; "
                          f"the {ws.inversion} inversion ran on numpy on the CPU."))
    return notes


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
        Upper bound on the estimated rank: a bound the model class gives
        (an attention head's kernel has rank at most its ``d_head``). The
        factored least squares then fits no rank above it, so it need not
        fit twice that rank to tell r* = max_rank from more (four MiniLM
        heads at ``max_rank=32``: 27-39 s each instead of 35-59 s).
    tolerance : float in [0, 1) or None, default=None
        None estimates the noise-floor r*. A float ε asks for r*(ε) (theory
        §2, paper eq. 4): the smallest rank r whose rank-r model's risk is
        within ``ε Var(Y)`` of the full-rank model's, read off the data-only
        curve ``risk_curve_`` (residuals of the inversion's rank-r models: in
        sample for the closed-form operators, cross-fitted for the factored
        least squares, whose bound also covers ``predict``'s own model,
        ``risk_curve_distance_``; :mod:`rstar.risk`). Needs the samples at
        the end of the fit: ``fit`` and ``fit_batches`` (``partial_fit`` and
        ``fit_from`` raise). Cannot be combined with a forced ``rank``. The
        factored least squares fits for it: where its halves settle at fits
        that disagree by more than the curve resolves ε with, or that
        predict each other's samples worse than their own by more than ε,
        it refits at a larger rank from fresh starts (the fit's ``agreement`` finding), so a
        tolerance can lengthen the fit (MiniLM layer 1 head 8: 6 s → 28 s).
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
        uses a fixed seed (the calibration's ``default_seed``), so that a fit
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
        and ``d^2 x d^2`` matrices (:mod:`rstar.budgets`). A fit's working
        arrays come on top: on the factored least squares (n = 2000, T = 32,
        d = 256, V known, a tolerance; samples 141 MiB) the fit's own traced
        peak was 1.7 times the samples, its kept copy included (the class
        check's), at a planted rank of 4 and of 24 alike (the class check
        sums over chunks of samples whatever the rank), and a fit on torch
        holds float32 copies of X twice (X and its whitened ``X P``) and of Y
        beside them, about 0.7–1 times the samples more here (resident: +293
        MiB on numpy, +390 MiB on torch's CPU threads at rank 4; +293 and
        +429 MiB at rank 24; ``python benchmarks/fit_memory.py --rank R``).
        On dask arrays the workers' chunk steps hold half of it and the
        samples kept get the other half (the choice's warning says how many).
    compute_budget : float or "auto", default="auto"
        Multiply-adds one least-squares fit or information matrix may cost
        (:mod:`rstar.budgets`). Beyond either budget
        :func:`rstar.inversions.choose_inversion` falls back to the
        first-order inversion with an ``InversionFallbackWarning``, and a
        factored fit that reaches it stops, warned. ``"auto"`` scales with
        the problem: the inversion is chosen within the calibration's
        ``compute_budget`` (2**39, minutes of one core), and the factored
        least squares of real sizes runs until its split-half count settles
        or its iteration caps (the calibration's ``factored_max_iter`` and
        ``factored_max_iter_fitted_v`` at each rank it visits), whatever
        multiply-adds that takes: a fixed number stopped V-unknown fits on
        MiniLM's tokens (d = 384, T = 32, n = 2000) before they settled,
        and they read a planted rank 8 as 6.
    predict_sums : bool, default=True
        Accumulate the moment sums behind ``predict``'s closed-form operator
        (query–key inversions, ``d^4`` entries). False saves their memory and
        time; ``rank_`` is unchanged and ``predict`` raises.
    device : str or torch.device, default="cpu"
        Where the heavy numerics run (the least-squares softmax fit and its
        information, which cost ``O(n T^2 (d + d_v))`` per pass): ``"cpu"``
        is numpy; ``"auto"`` (CUDA when present), ``"cuda"``, ``"cuda:N"``
        or any ``torch.device`` (``torch.device("cpu")`` included) is torch,
        which needs the ``torch`` extra: the full-rank fit in float64, which
        agrees with the CPU path to round-off (the optimiser's path can then
        differ in its last iterations); the factored fit of real sizes (its
        loss evaluations) in float32 with float64 sums, 2-4 times faster
        than numpy on the CPU's threads, whose fits stop within the
        optimiser's tolerance of numpy's (the same ranks on the planted and
        real-head benchmarks; spectra within about 1%). The statistic, its
        null and the risk curve stay on numpy in float64; a GPU asked for
        where the inversion that runs does not use it is reported with a
        ``UserWarning``.
    calibration : Calibration or None, default=None
        The tuned values of the inversions, rules and gates
        (:class:`rstar.calibration.Calibration`; the list, with the benchmark
        that set each, is on the calibration page). None:
        :data:`rstar.calibration.DEFAULT_CALIBRATION`. Change one with
        ``DEFAULT_CALIBRATION.replace(name=value)``."""


def _init_common(est, rank, max_rank, noise_variance, random_state, n_null_draws, memory_budget, compute_budget,
                 predict_sums, device="cpu", tolerance=None, tolerance_level=0.05, calibration=None):
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
    est.calibration = calibration


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
    risk_curve_fit_se_ : ndarray of shape (R + 1,) or None
        Only with a ``tolerance``, where the curve is cross-fitted (the
        factored least squares): its standard error with the fits' own
        variability, from the difference between the two halves' excess
        (each scored by the other half's model; one degree of freedom), at
        least ``risk_curve_se_``
        (:func:`rstar.risk.excess_risk_fit_standard_error`). A better scale
        than ``risk_curve_se_`` to set a predicted excess against, still
        short of a refit's spread (``benchmarks/curve_fit_error.py``); not
        read by ``rank_``. None elsewhere.
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
    risk_curve_floor_ : float
        Only with a ``tolerance``: the unconstrained model's residual sum
        of squares over the total that ``risk_curve_`` subtracts (each
        point is ``RSS(r) / TSS - risk_curve_floor_``): out of sample where
        the curve is cross-fitted (each half's full model on the other
        half), in sample elsewhere.
    risk_curve_floor_in_sample_ : float or None
        Only with a ``tolerance``, where the curve is cross-fitted: the same
        full models on the halves they were fitted on. The best
        unconstrained model's risk is at most ``risk_curve_floor_`` in
        expectation, and at least this where the fit minimises the squared
        error on Y (the factored least squares; the log-attention fits
        minimise another loss), so the curve, measured against the held-out
        side, may understate the excess by up to their difference (on
        SmolLM2's noise-free heads, 0.0003–0.0105 of Var(Y) held out against
        at most 4e-5 in sample; ``benchmarks/curve_floor.py``). None elsewhere.
    risk_curve_floor_se_ : float or None
        Only with a ``tolerance``, where the curve is measured per sample:
        the standard error of ``risk_curve_floor_`` over the samples. The
        rank whose models hold the tolerance on their own held-out risk
        (the upper end of ``rank_interval_`` where the fit did not identify
        its statistic) counts it at ``tolerance_level``, beside the curve's
        own margin. None elsewhere.
    risk_curve_floor_fit_se_ : float or None
        Only with a ``tolerance``, where the curve is cross-fitted and
        measured per sample: that error with the full models' own
        variability (each half's floor is scored by the other half's model;
        their difference is one replicate of fit and measurement,
        :func:`rstar.risk.excess_risk_fit_standard_error`), at least
        ``risk_curve_floor_se_``. Where the halves' models generalise
        unequally it is the larger: what ``predict``'s model leaves held out
        is then known to no better than this. Reported, not read. None
        elsewhere.
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
    verdicts_ : list of Verdict
        Every decision of :mod:`rstar.rules.identifiability` on this fit, in the order made: each unpacks as
        ``(category, message)`` (the warning issued; ``category`` None for one that only widened the interval)
        and carries ``reason`` (a key of :data:`rstar.rules.identifiability.REASONS`) and ``bounds`` (the range
        ``rank_interval_`` covers because of it, or None). Empty where r* is identified.
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
                 alpha=0.01, random_state=None, n_null_draws=DEFAULT_CALIBRATION.default_null_draws, memory_budget=DEFAULT_CALIBRATION.memory_budget,
                 compute_budget="auto", predict_sums=True, device="cpu",
                 calibration=None):
        self.operator = operator
        self.value_map = value_map
        self.alpha = alpha
        _init_common(self, rank, max_rank, noise_variance, random_state, n_null_draws, memory_budget, compute_budget,
                     predict_sums, device, tolerance, tolerance_level, calibration)

    def _validate_rule_params(self):
        check_positive(self.alpha, "alpha", allow_none=False, upper=1.0)

    def _make_rule(self, unit):
        return MarchenkoPasturRule(alpha=self.alpha, calibration=self._config["calibration"])


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
        return EnergyRule(alpha=self.alpha, calibration=self._config["calibration"])


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
                 tol=None, rtol=1e-2, random_state=None, n_null_draws=DEFAULT_CALIBRATION.default_null_draws,
                 memory_budget=DEFAULT_CALIBRATION.memory_budget, compute_budget="auto", predict_sums=True, device="cpu",
                 calibration=None):
        self.operator = operator
        self.value_map = value_map
        self.tol = tol
        self.rtol = rtol
        _init_common(self, rank, max_rank, noise_variance, random_state, n_null_draws, memory_budget, compute_budget,
                     predict_sums, device, tolerance, tolerance_level, calibration)

    def _validate_rule_params(self):
        check_positive(self.tol, "tol", strict=False)
        check_positive(self.rtol, "rtol", allow_none=False, upper=1.0 + 1e-12)

    def _make_rule(self, unit):
        return NumericalRule(tol=None if self.tol is None else self.tol / unit, rtol=self.rtol,
                             calibration=self._config["calibration"])


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
                 method="auto", clip=1e-3, random_state=None, n_null_draws=DEFAULT_CALIBRATION.default_null_draws,
                 memory_budget=DEFAULT_CALIBRATION.memory_budget, compute_budget="auto", predict_sums=True, device="cpu",
                 calibration=None):
        self.value_map = value_map
        self.alpha = alpha
        self.method = method
        self.clip = clip
        _init_common(self, rank, max_rank, noise_variance, random_state, n_null_draws, memory_budget, compute_budget,
                     predict_sums, device, tolerance, tolerance_level, calibration)

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
    rotary : RotaryPositions or None, default=None
        A rotary (RoPE) head's positions: the angles of its planes at the
        windows' T positions (:class:`rstar.RotaryPositions`;
        ``RotaryPositions.from_frequencies(theta, T)`` for plain RoPE,
        ``rstar.heads`` reads them off a model). The fit then stays in the
        rotary class (theory §2): a head of width ``2P`` at those
        frequencies is fitted on each half — on the attention read back from
        the outputs and then on the outputs (``softmax_rotary_log_attention``)
        where ``value_map`` is given and ``T <= 0.9 min(d, d_v)``, else on the
        outputs (``softmax_rotary_least_squares``) — and ``rank_`` is the
        rank of its query and key projections with the rotation kept (the
        rank of its logit family over the window's pairs, at most ``2P``;
        odd widths exist); the risk curve truncates to the top directions of
        that family. ``predict`` then needs windows of the same T.
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
                 alpha=DEFAULT_CALIBRATION.rstar_alpha, random_state=None, n_null_draws=DEFAULT_CALIBRATION.default_null_draws,
                 memory_budget=DEFAULT_CALIBRATION.memory_budget, compute_budget="auto", predict_sums=True, device="cpu",
                 causal=False, rotary=None, calibration=None):
        super().__init__(operator, value_map=value_map, rank=rank, max_rank=max_rank, tolerance=tolerance,
                         tolerance_level=tolerance_level, noise_variance=noise_variance,
                         alpha=alpha, random_state=random_state, n_null_draws=n_null_draws,
                         memory_budget=memory_budget, compute_budget=compute_budget, predict_sums=predict_sums,
                         device=device, calibration=calibration)
        self.causal = causal
        self.rotary = rotary

    _parameter_constraints = {**MPRankEstimator._parameter_constraints, "causal": ["boolean"],
                              "rotary": [RotaryPositions, None]}

    def _causal(self):
        return bool(self.causal)

    def _rotary(self):
        return self.rotary

    def _method(self):
        # softmax: least squares on the model itself (first order beyond its budget)
        return "least_squares" if self._get_operator() == "softmax" else "auto"
