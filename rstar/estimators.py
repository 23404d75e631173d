"""Data-only r* estimators: an inversion composed with a rank rule.

The classes here are thin: they validate, rescale, call an inversion from
:mod:`rstar.inversions` and a rule from :mod:`rstar.rules`, and store the
fitted attributes. Adding a rule or an inversion needs no change here beyond
naming it in ``_make_rule`` / :func:`make_inversion`.
"""

import warnings

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from ._validation import (
    check_operator,
    check_positive,
    check_rank_param,
    check_tokens,
    check_value_map,
    check_X_Y,
)
from .inversions import (
    ILL_CONDITIONED_ASPECT,
    MAX_MOMENT_ENTRIES,
    QueryKeyCrossFitInversion,
    QueryKeyInversion,
    QueryKeyLeastSquaresInversion,
    SoftmaxExactInversion,
    SoftmaxLeastSquaresInversion,
    TokenInversion,
)
from .metrics import token_r2_score
from .rules import EnergyRule, MarchenkoPasturRule, NumericalRule

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
#: benchmarks/alpha_calibration.py from the p-values at 0.01; docs/recovery.md, change 24)
RSTAR_ALPHA = 0.003


def make_inversion(operator, value_map=None, *, shape=None, method="auto", residual_noise=None, clip=1e-3):
    """The inversion for an operator (theory §4).

    Parameters
    ----------
    operator : {"linear_proxy", "linear_qk", "softmax"}
    value_map : ndarray of shape (d, d_v) or None
        Known V, in the units the inversion will see.
    shape : tuple (T, d, d_v) or None
        Needed to decide ``method="auto"``.
    method : {"auto", "first_order", "exact", "least_squares"}, default="auto"
        Softmax: ``"exact"`` needs V and ``d >= T``, ``d_v >= T``;
        ``"auto"`` uses it when ``X_i V`` is well conditioned
        (``T <= 0.9 min(d, d_v)``), else the first-order inversion (the
        paper's estimators); ``"least_squares"`` fits the model itself
        (:class:`~rstar.inversions.SoftmaxLeastSquaresInversion`, V known or
        not; first order beyond its budgets), :class:`RStarEstimator`'s choice.
        Linear QK: ``"exact"`` (needs V) is the least-squares inversion
        :class:`~rstar.inversions.QueryKeyLeastSquaresInversion`;
        ``"auto"`` uses it when V is known and its ``d^2 x d^2`` normal
        matrix fits the memory budget (``d^4 <= MAX_MOMENT_ENTRIES``, i.e.
        ``d <= 76``); with V unknown and ``T <= d`` or ``d_v < d`` (same
        budget) it uses the cross-fitted least squares
        :class:`~rstar.inversions.QueryKeyCrossFitInversion`; else
        ``M_i = X_i^+ Y_i`` (``"first_order"``).
    residual_noise : bool or None
        Query–key inversions: take the noise variance from the residual
        outside ``col(X_i)``. Default: True for linear_qk; False for softmax,
        whose bulk is fitted instead (both its level and its width, see
        :func:`rstar.marchenko_pastur.fit_mp_bulk`).
    clip : float, default=1e-3
        Exact softmax inversion: attention weights are clipped at ``clip / T``.

    Returns
    -------
    Inversion

    Examples
    --------
    >>> from rstar.estimators import make_inversion
    >>> type(make_inversion("linear_qk")).__name__
    'QueryKeyInversion'
    """
    if method not in ("auto", "first_order", "exact", "least_squares"):
        raise ValueError(f"method must be 'auto', 'first_order', 'exact' or 'least_squares', got {method!r}.")
    if method == "least_squares" and operator != "softmax":
        raise ValueError(f"method must be 'auto', 'first_order' or 'exact' for operator={operator!r} "
                         "('least_squares' is the softmax inversion).")
    if operator == "linear_proxy":
        return TokenInversion(value_map=value_map)
    if operator == "linear_qk":
        if method == "exact" and value_map is None:
            raise ValueError("method='exact' for operator='linear_qk' needs a known value_map (the least-squares "
                             "inversion solves Y_i = X_i K X_i^T X_i V for K).")
        d = None if value_map is None else np.asarray(value_map).shape[0]
        if method == "exact" or (method == "auto" and d is not None and d**4 <= MAX_MOMENT_ENTRIES
                                 and (residual_noise is None or residual_noise)):
            return QueryKeyLeastSquaresInversion(value_map)
        # V unknown: least squares with V cross-fitted where the first-order inversion is biased (T <= d) or
        # weak on r* - d_v of the directions should r* exceed d_v (d_v < d; see QueryKeyCrossFitInversion)
        if (method == "auto" and value_map is None and shape is not None
                and (shape[0] <= shape[1] or shape[2] < shape[1]) and shape[1] ** 4 <= MAX_MOMENT_ENTRIES
                and (residual_noise is None or residual_noise)):
            return QueryKeyCrossFitInversion()
        return QueryKeyInversion(centred=False, residual_noise=True if residual_noise is None else residual_noise,
                                 value_map=value_map)
    if operator == "softmax":
        exact_ok = well_conditioned = False
        if value_map is not None and shape is not None:
            T, d, d_v = shape
            exact_ok = d >= T and d_v >= T
            # S_i = Y_i (X_i V)^+ amplifies noise as T nears min(d, d_v) (MP hard edge)
            well_conditioned = T <= ILL_CONDITIONED_ASPECT * min(d, d_v)
        if method == "exact" and not exact_ok:
            raise ValueError(
                "method='exact' needs a known value_map and d >= T and d_v >= T (X_i V must have full row "
                f"rank T); got value_map={'None' if value_map is None else 'given'} and (T, d, d_v)={shape}.")
        if method == "exact" or (method == "auto" and exact_ok and well_conditioned):
            return SoftmaxExactInversion(value_map, clip=clip)
        if method == "least_squares":
            return SoftmaxLeastSquaresInversion(value_map)
        return QueryKeyInversion(centred=True, residual_noise=False if residual_noise is None else residual_noise,
                                 value_map=value_map)
    raise ValueError(f"unknown operator {operator!r}")


class _BaseRankEstimator(RegressorMixin, BaseEstimator):
    """Shared fit / partial_fit / predict / score for the data-only estimators."""

    _operator_default = "linear_proxy"

    # -- hooks -----------------------------------------------------------
    def _get_operator(self):
        return self.operator

    def _make_rule(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _validate_rule_params(self):
        pass

    def _inversion_options(self):
        return {}

    # -- validation --------------------------------------------------------
    def _validate_params_(self):
        check_operator(self._get_operator())
        check_rank_param(self.rank, "rank")
        check_rank_param(self.max_rank, "max_rank")
        check_positive(self.noise_variance, "noise_variance")
        self._validate_rule_params()

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
        """
        for attr in ("_stats", "_inv"):
            if hasattr(self, attr):
                delattr(self, attr)
        return self._fit_batch(X, Y)

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
        """
        return self._fit_batch(X, Y)

    def _fit_batch(self, X, Y):
        self._validate_params_()
        if Y is not None and not hasattr(Y, "ndim"):
            Y = np.asarray(Y)
        if X is not None and not hasattr(X, "ndim"):
            X = np.asarray(X)
        y_ndim = None if Y is None else np.asarray(Y).ndim
        if y_ndim == 1 and np.asarray(X).ndim == 2:
            Y = np.asarray(Y)[:, None]
        X, Y = check_X_Y(X, Y)
        n, T, d = X.shape
        d_v = Y.shape[2]
        first = not hasattr(self, "_stats")
        if first:
            self.n_features_in_ = d
            self._dims = (T, d, d_v)
            self._y_ndim = 3 if y_ndim == 3 else y_ndim
            self._x_scale = _rms(X)
            self._y_scale = _rms(Y)
            V = check_value_map(self.value_map, d, d_v)
            V_internal = None if V is None else V * (self._x_scale / self._y_scale)
            self._inv = make_inversion(self._get_operator(), V_internal, shape=(T, d, d_v),
                                       **self._inversion_options())
            self._stats = self._inv.new_stats(T, d, d_v)
        else:
            T0, d0, dv0 = self._dims
            if d != d0:
                raise ValueError(f"X has {d} features, but {type(self).__name__} is expecting {d0} features "
                                 "as input (from the first partial_fit batch).")
            if d_v != dv0:
                raise ValueError(f"Y has {d_v} output features, but earlier batches had d_v={dv0}.")
            if T != T0:
                raise ValueError(f"X has T={T} tokens, but earlier batches had T={T0}; partial_fit batches "
                                 "must share the sequence length.")
        self._inv.update(self._stats, X / self._x_scale, Y / self._y_scale)
        n_total = self._stats["n"]
        need = self._inv.min_samples(T, d, d_v)
        if n_total < need:
            raise ValueError(f"Found {n_total} sample(s) so far, but {type(self).__name__} needs at least {need} "
                             f"samples for this inversion at T={T}, d={d} (got {n_total} sample(s)).")
        self._finalize()
        return self

    def _finalize(self):
        T, d, d_v = self._dims
        ws = self._inv.whiten(self._stats)
        exact = isinstance(self._inv, SoftmaxExactInversion)
        unit = 1.0 if exact else self._y_scale**2
        user_noise = None
        if self.noise_variance is not None and not exact:
            user_noise = self.noise_variance / unit
        p = ws.dim
        if self.max_rank is not None and self.max_rank > p:
            raise ValueError(f"max_rank must be <= {p} (the dimension of the statistic), got {self.max_rank}.")
        if self.rank is not None and self.rank > p:
            raise ValueError(f"rank must be <= {p} (the dimension of the statistic: "
                             f"{'T' if self._inv.space == 'tokens' else 'd'}), got {self.rank}.")
        res = self._make_rule()(ws, user_noise, self.max_rank)
        for category, message in list(ws.warnings) + list(res.warnings):
            warnings.warn(message, category, stacklevel=4)
        rank = res.rank if self.rank is None else self.rank
        self.rank_ = int(rank)
        self.effective_rank_ = float(res.effective_rank)
        self.spectrum_ = ws.eigenvalues * unit
        self.threshold_ = float(res.threshold * unit)
        self.noise_variance_ = float(res.noise_variance * unit)
        self.spike_strengths_ = np.asarray(res.spike_strengths, dtype=float)
        self.p_values_ = np.asarray(res.p_values, dtype=float)
        self.rank_interval_ = (int(res.rank_interval[0]), int(res.rank_interval[1]))
        self.n_columns_ = float(ws.n_columns)
        self.components_ = ws.components(self.rank_)
        self.n_samples_seen_ = int(self._stats["n"])
        # the closed-form operator costs several times the rank estimate: built on first use
        self._operator_cache = {}

    @property
    def operator_(self):
        """The closed-form operator used by ``predict`` (built on first access, then cached)."""
        check_is_fitted(self, "rank_")
        cache = self._operator_cache
        if "operator" not in cache:
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
        ``"softmax"`` (Y = softmax(X K X^T / sqrt(d)) X V; first-order
        inversion, which is also exact for linear-QK data when T > d).
    value_map : array-like of shape (d, d_v) or None, default=None
        The value matrix V if known. None (unknown) is supported throughout.
    rank : int or None, default=None
        None estimates r*; an int forces ``rank_`` (the rank of the fitted
        operator), e.g. for a data-only rank sweep with ``GridSearchCV``.
    max_rank : int or None, default=None
        Upper bound on the estimated rank.
    noise_variance : float or None, default=None
        Known variance sigma**2 of the noise entries of Y. None: estimated
        (residual of the model when identifiable, else the MP bulk median)."""

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
        Noise variance used (given, residual-based or bulk-based).
    spike_strengths_ : ndarray of shape (n_spikes,)
        BBP-debiased population spikes (units of the noise variance).
    p_values_ : ndarray of shape (n_tests,)
        Approximate Tracy–Widom p-values of the sequential spike tests, in
        order (entry k: is eigenvalue k+1 signal, given k spikes?), each the
        smaller of the test from the top and the multiplicity-adjusted
        top-down one (:func:`rstar.rules.top_down_p_values`); the first one
        at or above ``alpha`` stopped the count. Tests go on up to the
        first one not significant at the lenient level ``min(10 alpha, 0.5)``.
        Under pure noise ``p_values_[0]`` is close to uniform on (0, 1)
        (conservative with a fitted bulk; for linear QK with V unknown and
        T <= d or d_v < d it is twice the smaller of two such p-values, one
        per half of the samples, capped at 1; see docs/estimators.md).
    rank_interval_ : tuple of two ints
        ``(lower, upper)``: the counts of the same sequential test at the
        strict level ``alpha / 10`` and the lenient level ``min(10 alpha, 0.5)``
        (where the test is against ``B`` simulated noise draws, the strict
        level is at least ``1 / B``, the smallest it can reject at, or
        ``2 / B`` for the cross-fitted union; for the energy rule, their energy ranks; for the numerical rule, the
        noise-aware counts). A sensitivity range, not a coverage guarantee:
        ``lower < upper`` says that some eigenvalues sit near the detection
        edge, where r* is only partly identifiable. Under pure noise,
        ``lower > 0`` in about ``alpha / 10`` of data sets and ``upper > 0`` in
        about ``10 alpha``. Not affected by a forced ``rank``.
    n_columns_ : float
        Effective number of MP columns behind ``spectrum_``.
    components_ : ndarray of shape (rank_, T) or (rank_, d)
        Orthonormal basis of the recovered subspace (range of A, or of K).
    operator_ : object
        The closed-form operator used by ``predict``; fitted from the moment
        sums on first access (``predict``, ``score`` or reading it), since it
        costs several times the rank estimate itself.
    n_features_in_ : int
        d.
    n_samples_seen_ : int
"""


class MPRankEstimator(_BaseRankEstimator):
    __doc__ = ("""Rank = eigenvalues of the whitened statistic above the Marchenko–Pastur edge.

    The edge carries a Tracy–Widom margin at false-alarm level ``alpha``
    (sequential tests, theory §5), so pure noise gives ``rank_ = 0`` with
    probability about ``1 - alpha``. ``effective_rank_`` is the entropy
    effective rank R_eff of the BBP-debiased spikes (the paper's MP-corrected
    R_eff).

    Parameters
    ----------""" + _SHARED_PARAMS_DOC % {"default": "linear_proxy"} + """
    alpha : float in (0, 1), default=0.01
        False-alarm level of each spike test.
""" + _FITTED_DOC + """
    Examples
    --------
    >>> from rstar import MPRankEstimator
    >>> from rstar.datasets import make_linear_proxy
    >>> X, Y = make_linear_proxy(500, rank=3, random_state=0)
    >>> MPRankEstimator().fit(X, Y).rank_
    3
    """)

    def __init__(self, operator="linear_proxy", *, value_map=None, rank=None, max_rank=None, noise_variance=None,
                 alpha=0.01):
        self.operator = operator
        self.value_map = value_map
        self.rank = rank
        self.max_rank = max_rank
        self.noise_variance = noise_variance
        self.alpha = alpha

    def _validate_rule_params(self):
        check_positive(self.alpha, "alpha", allow_none=False, upper=1.0)

    def _make_rule(self):
        return MarchenkoPasturRule(alpha=self.alpha)


class EnergyRankEstimator(MPRankEstimator):
    __doc__ = ("""Rank = energy effective rank R̃_eff of the noise-corrected spectrum, rounded.

    Spikes are detected as by :class:`MPRankEstimator`, de-biased through the
    inverse BBP map, and ``effective_rank_ = exp(H(theta / sum theta))``;
    ``rank_ = floor(effective_rank_ + 1/2)``. Weak spikes count for less: the
    paper's choice for softmax kernels; it under-counts spikes of very
    unequal strength.

    Parameters
    ----------""" + _SHARED_PARAMS_DOC % {"default": "linear_proxy"} + """
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

    def _make_rule(self):
        return EnergyRule(alpha=self.alpha)


class NumericalRankEstimator(_BaseRankEstimator):
    __doc__ = ("""Rank = eigenvalues of the whitened statistic above a tolerance.

    The paper's data-only numerical rank: not noise-aware (pure noise gives
    full rank unless ``tol`` sits above the noise), and broken by the
    softmax inversion's non-linear bulk.

    Parameters
    ----------""" + _SHARED_PARAMS_DOC % {"default": "linear_proxy"} + """
    tol : float or None, default=None
        Absolute tolerance in the units of ``spectrum_`` (Y**2).
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

    def __init__(self, operator="linear_proxy", *, value_map=None, rank=None, max_rank=None, noise_variance=None,
                 tol=None, rtol=1e-2):
        self.operator = operator
        self.value_map = value_map
        self.rank = rank
        self.max_rank = max_rank
        self.noise_variance = noise_variance
        self.tol = tol
        self.rtol = rtol

    def _validate_rule_params(self):
        check_positive(self.tol, "tol", strict=False)
        check_positive(self.rtol, "rtol", allow_none=False, upper=1.0 + 1e-12)

    def _make_rule(self):
        tol = None if self.tol is None else self.tol / self._y_scale**2
        return NumericalRule(tol=tol, rtol=self.rtol)


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
    value_map : array-like of shape (d, d_v) or None, default=None
    rank : int or None, default=None
    max_rank : int or None, default=None
    noise_variance : float or None, default=None
        Known noise variance of Y (first-order inversion only).
    alpha : float in (0, 1), default=0.01
    method : {"auto", "first_order", "exact", "least_squares"}, default="auto"
        ``"auto"`` is the paper's choice above; ``"least_squares"`` is
        :class:`RStarEstimator`'s inversion (least squares on the model
        itself, :class:`rstar.inversions.SoftmaxLeastSquaresInversion`).
    clip : float, default=1e-3
        Exact inversion: recovered attention weights are clipped at ``clip / T``.
""" + _FITTED_DOC + """
    Examples
    --------
    >>> from rstar import SoftmaxInversionEstimator
    >>> from rstar.datasets import make_attention_task
    >>> X, Y = make_attention_task(1000, seq_len=32, n_features=16, rank=3, random_state=0)
    >>> SoftmaxInversionEstimator().fit(X, Y).rank_
    3
    """)

    def __init__(self, *, value_map=None, rank=None, max_rank=None, noise_variance=None, alpha=0.01,
                 method="auto", clip=1e-3):
        self.value_map = value_map
        self.rank = rank
        self.max_rank = max_rank
        self.noise_variance = noise_variance
        self.alpha = alpha
        self.method = method
        self.clip = clip

    def _get_operator(self):
        return "softmax"

    def _validate_rule_params(self):
        super()._validate_rule_params()
        if self.method not in ("auto", "first_order", "exact", "least_squares"):
            raise ValueError(f"method must be 'auto', 'first_order', 'exact' or 'least_squares', "
                             f"got {self.method!r}.")
        check_positive(self.clip, "clip", allow_none=False, upper=1.0)

    def _inversion_options(self):
        return {"method": self.method, "clip": self.clip}


class RStarEstimator(MPRankEstimator):
    __doc__ = ("""The package's recommended r* estimator for each operator.

    - ``"linear_proxy"``: token inversion, noise variance from the residual
      of the unconstrained linear regression (exact under the model), spikes
      above the MP edge with a Tracy–Widom margin.
    - ``"linear_qk"``: query–key inversion with sigma_min^2 sample weights
      and whitening, noise variance from the residual outside col(X_i), MP
      edge with Tracy–Widom margin; with a known V, least squares of K on Y
      itself; with V unknown and ``T <= d`` or ``d_v < d``, the same least
      squares on each half of the samples with V fitted on the other half,
      its null draws carrying that V's error, the two halves combined by a
      Bonferroni union (:class:`rstar.inversions.QueryKeyCrossFitInversion`).
    - ``"softmax"`` (default): least squares of K (full rank) on the model
      ``Y_i = softmax(X_i K X_i^T / sqrt(d)) X_i V`` itself, V known or
      profiled out, tested sequentially against draws of the fitted K's
      first-order noise (:class:`rstar.inversions.SoftmaxLeastSquaresInversion`);
      beyond its cost budgets, or without a value signal, the first-order
      centred inversion with an MP edge and Tracy–Widom margin.

    ``p_values_`` and ``rank_interval_`` say how sure the count is (see
    ``docs/estimators.md``: calibrated on null tasks).

    Parameters
    ----------""" + _SHARED_PARAMS_DOC % {"default": "softmax"} + """
    alpha : float in (0, 1), default=0.003
        False-alarm level of each sequential test. The default is the level
        with the highest exact recovery of r* on a held-out recovery grid
        (``benchmarks/alpha_calibration.py`` on seed 1 of
        ``benchmarks/recovery.py``, 1000 tasks: 97.9% at 0.003 against 97.0%
        at 0.01, over-counts 12 -> 3, under-counts 18 -> 18; see
        ``docs/recovery.md``). The other estimators keep the conventional 0.01.
""" + _FITTED_DOC + """
    Examples
    --------
    >>> from rstar import RStarEstimator
    >>> from rstar.datasets import make_attention_task
    >>> X, Y = make_attention_task(1000, seq_len=32, n_features=16, rank=3, random_state=0)
    >>> RStarEstimator().fit(X, Y).rank_
    3
    """)

    def __init__(self, operator="softmax", *, value_map=None, rank=None, max_rank=None, noise_variance=None,
                 alpha=RSTAR_ALPHA):
        super().__init__(operator, value_map=value_map, rank=rank, max_rank=max_rank,
                         noise_variance=noise_variance, alpha=alpha)

    def _inversion_options(self):
        # softmax: least squares on the model itself (first order beyond its budget)
        return {"method": "least_squares"} if self._get_operator() == "softmax" else {}
