"""Inversions: samples (X, Y) -> a whitened statistic whose signal part has rank r* (theory §4).

Each inversion accumulates *sums over samples* in a dict of arrays
(``new_stats`` / ``update`` / :func:`merge_stats`), so streaming
(``partial_fit``) and map-reduce come for free, and ``whiten`` turns the
sums into a :class:`WhitenedStatistic`: the eigen-decomposition of
``N^{-1/2} C N^{-1/2}`` (``N`` the noise Gram) and exactly one null model
(:mod:`rstar.inversions._statistic`). ``fit_operator`` fits the operator in
closed form at a given rank from the same sums (used by ``predict``).
Which inversion runs is decided by :func:`choose_inversion`, once per fit.

All arrays passed in are already validated and rescaled to unit RMS by the
estimator (so results do not depend on the units of X and Y).

One module per inversion:

- :mod:`~rstar.inversions.token` — :class:`TokenInversion` (linear proxy).
- :mod:`~rstar.inversions.query_key` — :class:`QueryKeyInversion`
  (``M_i = X_i^+ Y_i``: linear QK to first order, and centred, softmax).
- :mod:`~rstar.inversions.query_key_least_squares` —
  :class:`QueryKeyLeastSquaresInversion` (linear QK, V known).
- :mod:`~rstar.inversions.query_key_cross_fit` —
  :class:`QueryKeyCrossFitInversion` (linear QK, V unknown, ``T <= d`` or ``d_v < d``).
- :mod:`~rstar.inversions.softmax_exact` — :class:`SoftmaxExactInversion` (softmax, V known).
- :mod:`~rstar.inversions.softmax_least_squares` —
  :class:`SoftmaxLeastSquaresInversion` (softmax, V known or not).
- :mod:`~rstar.inversions.softmax_factored` — the factored least squares
  ``K = A B^T`` with a split-half null, which that inversion runs where the
  ``d^2 x d^2`` information exceeds the memory budget (real layers).
"""

from ..streaming import merge_stats
from ._base import Inversion
from ._kernel import nearest_kronecker_product
from ._statistic import (
    CoherentEvidence,
    CrossFitNull,
    Finding,
    NullModel,
    SimulatedNull,
    SplitHalfEvidence,
    SplitHalfNull,
    StructuredBulkNull,
    UnsupportedNullModelError,
    WhitenedStatistic,
    WishartNull,
)
from .choice import INVERSIONS, METHODS, InversionChoice, choose_inversion, decision_table, decision_table_markdown
from .query_key import QueryKeyInversion, coherent_spectrum
from .query_key_cross_fit import QueryKeyCrossFitInversion
from .query_key_least_squares import QueryKeyLeastSquaresInversion
from .softmax_exact import SoftmaxExactInversion
from .softmax_least_squares import SoftmaxLeastSquaresInversion
from .token import TokenInversion, proxy_coherent_spectrum

__all__ = [
    "Finding",
    "WhitenedStatistic",
    "NullModel",
    "WishartNull",
    "StructuredBulkNull",
    "SimulatedNull",
    "CrossFitNull",
    "CoherentEvidence",
    "SplitHalfEvidence",
    "SplitHalfNull",
    "UnsupportedNullModelError",
    "Inversion",
    "TokenInversion",
    "QueryKeyInversion",
    "QueryKeyLeastSquaresInversion",
    "QueryKeyCrossFitInversion",
    "SoftmaxExactInversion",
    "SoftmaxLeastSquaresInversion",
    "InversionChoice",
    "choose_inversion",
    "decision_table",
    "decision_table_markdown",
    "make_inversion",
    "coherent_spectrum",
    "proxy_coherent_spectrum",
    "merge_stats",
    "nearest_kronecker_product",
    "INVERSIONS",
    "METHODS",
]


def make_inversion(operator, value_map=None, *, shape=None, method="auto", clip=1e-3, budget=None, seed=None,
                   n_null_draws=None, predict_sums=True, causal=False, calibration=None, stopping_count=None,
                   rank_bound=None, rotary=None, reading_tolerance=None):
    """The inversion object that accumulates the sums for an operator, value map and shape.

    It is the inversion :func:`choose_inversion` prefers for the shape alone
    (``n_samples=None``); its ``whiten(stats, run)`` produces that statistic,
    or the first-order one it falls back to (``run``, decided by
    :func:`choose_inversion` with the samples' count).

    Parameters
    ----------
    operator : {"linear_proxy", "linear_qk", "softmax"}
    value_map : ndarray of shape (d, d_v) or None
        Known V, in the units the inversion will see.
    shape : tuple (T, d, d_v) or None
        None: decide as if the shape allowed only first-order inversions
        (the least squares with a known V still runs for linear QK).
    method : {"auto", "first_order", "exact", "least_squares"}, default="auto"
        See :func:`choose_inversion`.
    clip : float, default=1e-3
        Exact softmax inversion: attention weights are clipped at ``clip / T``.
    budget : CostBudget or None
    seed : int or None
        Seed of the simulations (null draws, random starts).
    n_null_draws : int or None
    predict_sums : bool, default=True
        Accumulate the first-order query–key moment sums behind ``predict``'s closed-form operator (``d^4``
        entries); False saves their memory and time (``rank_`` is unchanged; ``predict`` then raises where it
        needs them). No effect on the inversions whose operator comes from the statistic's own sums (token,
        query–key least squares, exact softmax) or from the kept samples (least-squares softmax, when it ran).
    causal : bool, default=False
        Causal attention (softmax least squares only; see :func:`choose_inversion`).
    calibration : Calibration or None, default=None
        The tuned values the choice and the inversion read (:mod:`rstar.calibration`); None:
        ``DEFAULT_CALIBRATION``.
    stopping_count : callable or None, default=None
        The factored least squares' stopping test: the split-half rule's count
        (:func:`rstar.rules.split_half.split_half_counts`, which the estimators pass; None: the same function).
    rank_bound : int or None, default=None
        A bound on r* the model class gives (the estimators pass ``max_rank``): the factored least squares fits
        no rank above it (:func:`rstar.inversions.softmax_factored.factored_statistic`). None: no bound.
    rotary : RotaryPositions or None, default=None
        A rotary head's positions: the rotary least squares (:mod:`rstar.inversions.softmax_rotary`).
    reading_tolerance : float or None, default=None
        The tolerance the risk curve will be read at (the estimators pass their ``tolerance``): a factored fit
        whose halves do not resolve it doubles its rank
        (:func:`rstar.inversions.softmax_factored.factored_statistic`). None: none.

    Returns
    -------
    Inversion

    Examples
    --------
    >>> from rstar.inversions import make_inversion
    >>> type(make_inversion("linear_qk")).__name__
    'QueryKeyInversion'
    >>> type(make_inversion("linear_qk", shape=(6, 12, 12))).__name__
    'QueryKeyCrossFitInversion'
    """
    import numpy as np

    known = value_map is not None
    if shape is None:
        d = np.asarray(value_map).shape[0] if known else 1
        T = d + 1   # T > d: no shape-driven choice
        d_v = np.asarray(value_map).shape[1] if known else d
        if operator == "softmax" and method == "auto":
            method = "first_order"
        shape = (T, d, d_v)
    name = choose_inversion(operator, value_map_known=known, shape=shape, method=method, budget=budget,
                            causal=causal, calibration=calibration, rotary=rotary).name
    opts = dict(budget=budget, seed=seed, n_null_draws=n_null_draws, calibration=calibration)
    if name == "token":
        return TokenInversion(value_map=value_map, **opts)
    if name == "query_key_first_order":
        return QueryKeyInversion(centred=False, residual_noise=True, value_map=value_map, predict_sums=predict_sums,
                                 **opts)
    if name == "query_key_least_squares":
        return QueryKeyLeastSquaresInversion(value_map, **opts)
    if name == "query_key_cross_fit":
        return QueryKeyCrossFitInversion(predict_sums=predict_sums, **opts)
    if name == "softmax_first_order":
        return QueryKeyInversion(centred=True, residual_noise=False, value_map=value_map, predict_sums=predict_sums,
                                 **opts)
    if name == "softmax_exact":
        return SoftmaxExactInversion(value_map, clip=clip, **opts)
    return SoftmaxLeastSquaresInversion(value_map, predict_sums=predict_sums, causal=causal,
                                        stopping_count=stopping_count, rank_bound=rank_bound, rotary=rotary,
                                        reading_tolerance=reading_tolerance, **opts)
