"""Cross-fitted least-squares query-key inversion (V unknown, T <= d or d_v < d) and the fit behind it."""

import dataclasses
import warnings

import numpy as np
import pytest

from rstar import RStarEstimator
from rstar.inversions._numerics import bilinear as _bilinear
from rstar.budgets import CostBudget
from rstar.calibration import DEFAULT_CALIBRATION
from rstar.datasets import make_attention_task
from rstar.exceptions import InversionFallbackWarning, UnidentifiableRankWarning
from sklearn.exceptions import ConvergenceWarning
from rstar.inversions import (
    CrossFitNull,
    QueryKeyCrossFitInversion,
    QueryKeyInversion,
    QueryKeyLeastSquaresInversion,
    SimulatedNull,
    WishartNull,
    make_inversion,
    merge_stats,
)
from rstar.inversions.query_key_cross_fit import cross_fit_method, cross_fit_sizes_fit
from rstar.rules import MarchenkoPasturRule
from rstar.rules.simulated import _union_p_values

from _reasons import assert_warned


def _task(n, T, d, r, noise=0.1, d_v=None, seed=0, **kw):
    return make_attention_task(n, kind="linear_qk", seq_len=T, n_features=d, value_dim=d_v, rank=r, noise=noise,
                               random_state=seed, return_teacher=True, **kw)


def _first_order_fit(X, Y):
    """RStar on linear QK with the cross-fit over the compute budget: its first-order fallback (public API)."""
    est = RStarEstimator("linear_qk", compute_budget=1)
    with pytest.warns(InversionFallbackWarning, match="query_key_cross_fit inversion not used"):
        est.fit(X, Y)
    assert est.inversion_ == "query_key_first_order"
    return est


def _direction(ws, i):
    """The statistic ``ws`` tested against its cross-fit direction ``i`` alone (a simulated null)."""
    return dataclasses.replace(ws, null=ws.null.directions[i])


def test_make_inversion_picks_cross_fit_for_unknown_v_and_few_tokens():
    assert type(make_inversion("linear_qk", None, shape=(6, 8, 4))) is QueryKeyCrossFitInversion
    assert type(make_inversion("linear_qk", None, shape=(8, 8, 4))) is QueryKeyCrossFitInversion
    # T > d: the first-order inversion is consistent; the cross-fit only where d_v < d (it may be < r*)
    assert type(make_inversion("linear_qk", None, shape=(9, 8, 4))) is QueryKeyCrossFitInversion
    assert type(make_inversion("linear_qk", None, shape=(9, 8, 8))) is QueryKeyInversion
    assert type(make_inversion("linear_qk", None, shape=(9, 8, 16))) is QueryKeyInversion
    assert type(make_inversion("linear_qk", None, shape=(6, 8, 4), method="first_order")) is QueryKeyInversion
    assert type(make_inversion("linear_qk", None, shape=(6, 80, 4))) is QueryKeyInversion   # d^4 over budget
    assert type(make_inversion("linear_qk", np.ones((8, 4)), shape=(6, 8, 4))) is QueryKeyLeastSquaresInversion


def test_query_key_normal_matrix_is_the_sum_of_kronecker_products():
    rng = np.random.default_rng(0)
    G = rng.standard_normal((5, 4, 4))
    G = G @ np.swapaxes(G, 1, 2)
    B = rng.standard_normal((5, 4, 3))
    H = sum(np.kron(G[i], B[i] @ B[i].T) for i in range(5))
    np.testing.assert_allclose(_bilinear.query_key_normal_matrix(G, B), H, rtol=1e-12, atol=1e-12)


def test_fit_query_key_samples_recovers_noise_free_kernel_and_value_map():
    X, Y, t = _task(300, 6, 8, 3, noise=0.0, d_v=5)
    K, V, rss = _bilinear.fit_query_key_restarts(X, Y, [np.eye(8)] + [np.random.default_rng(s).standard_normal((8, 8))
                                                                    for s in range(4)])
    assert rss < 1e-7 * np.sum(Y**2)
    # the fit is exact up to the scale (K, V) ~ (aK, V/a)
    target = t.kernel
    a = np.sum(K * target) / np.sum(K * K)
    np.testing.assert_allclose(a * K, target, atol=1e-3 * np.abs(target).max())
    fitted = np.einsum("nta,ab,nsb,nsc,cv->ntv", X, K, X, X, V)
    np.testing.assert_allclose(fitted, Y, atol=1e-3 * np.abs(Y).max())


def test_profile_loss_gradient_and_value_map():
    X, Y, _ = _task(40, 4, 5, 2, noise=0.3, d_v=3, token_distribution="student_t")
    loss = _bilinear.QueryKeyProfileLoss(X, Y)
    rng = np.random.default_rng(0)
    k, step = rng.standard_normal(25), rng.standard_normal(25)
    f, g = loss(k)
    # central difference along a random direction
    h = 1e-5
    numeric = (loss(k + h * step)[0] - loss(k - h * step)[0]) / (2 * h)
    assert numeric == pytest.approx(g @ step, rel=1e-6)
    # the loss is the residual of the best V, and is blind to the scale of K
    V, rss = loss.value_map(k.reshape(5, 5))
    P = np.einsum("nta,ab,nsb,nsc->ntc", X, k.reshape(5, 5), X, X)
    V_ls = np.linalg.lstsq(P.reshape(-1, 5), Y.reshape(-1, 3), rcond=None)[0]
    np.testing.assert_allclose(V, V_ls, rtol=1e-8, atol=1e-10)
    assert rss == pytest.approx(f, rel=1e-12)
    assert loss(3.0 * k)[0] == pytest.approx(f, rel=1e-10)
    assert abs(g @ k) < 1e-8 * np.linalg.norm(g) * np.linalg.norm(k)


def test_fit_query_key_profiled_recovers_noise_free_fit_and_matches_als():
    X, Y, t = _task(300, 6, 8, 3, noise=0.0, d_v=5)
    starts = [np.eye(8)] + [np.random.default_rng(s).standard_normal((8, 8)) for s in range(4)]
    K, V, rss = _bilinear.fit_query_key_profiled(X, Y, starts)
    assert rss < 1e-8 * np.sum(Y**2)
    a = np.sum(K * t.kernel) / np.sum(K * K)
    np.testing.assert_allclose(a * K, t.kernel, atol=1e-3 * np.abs(t.kernel).max())
    # with noise: the same least-squares optimum as the alternating fit run to convergence
    X, Y, _ = _task(300, 6, 8, 3, noise=0.3, d_v=5)
    _, V_p, rss_p = _bilinear.fit_query_key_profiled(X, Y, starts)
    _, V_a, rss_a = _bilinear.fit_query_key_restarts(X, Y, starts, max_iter=2000, fit_tol=1e-13)
    assert rss_p == pytest.approx(rss_a, rel=1e-7)
    # (K, V) and (-K, -V) fit alike; K has unit norm in both
    V_p = V_p * np.sign(np.sum(V_p * V_a))
    np.testing.assert_allclose(V_p, V_a, rtol=1e-3, atol=1e-3 * np.abs(V_a).max())


def test_fit_query_key_samples_never_increases_the_residual():
    X, Y, _ = _task(200, 6, 8, 3, noise=0.3, d_v=6, token_distribution="student_t")
    start = np.random.default_rng(1).standard_normal((8, 8))
    rss = [_bilinear.fit_query_key_samples(X, Y, start, max_iter=k, fit_tol=0.0)[2] for k in (0, 1, 5, 20)]
    assert all(b <= a * (1 + 1e-10) for a, b in zip(rss, rss[1:]))


@pytest.mark.parametrize("T,d,d_v,r,n", [(8, 16, 16, 12, 600), (6, 12, 24, 7, 700), (8, 8, 8, 8, 800)])
def test_cross_fit_recovers_rank_where_first_order_falls_short(T, d, d_v, r, n):
    # T < d: M_i = X_i^+ Y_i sees only projections of K; T = d: no residual noise level, and a
    # bulk that is all signal. Fitting V on one half and K on the other recovers r*.
    X, Y, _ = _task(n, T, d, r, noise=1.0, d_v=d_v, singular_values=np.geomspace(1.0, 0.3, r))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _first_order_fit(X, Y)
        est = RStarEstimator("linear_qk").fit(X, Y)
    assert est.inversion_ == "query_key_cross_fit"
    assert first.rank_ < r
    assert est.rank_ == r
    assert est.noise_variance_ == pytest.approx(1.0, rel=0.05)
    assert est.rank_interval_[0] <= r <= est.rank_interval_[1]


@pytest.mark.parametrize("d_v,r", [(2, 5), (3, 6)])
def test_cross_fit_recovers_rank_beyond_the_value_dimension(d_v, r):
    # T > d with d_v < r*: M_i = K G_i V holds exactly, but r* - d_v directions of range(K) see only the
    # isotropic part of E[G_i V V^T G_i], so the first-order count falls short
    T, d, n = 12, 8, 600
    X, Y, _ = _task(n, T, d, r, noise=1.0, d_v=d_v, singular_values=np.geomspace(1.0, 0.3, r))
    first = _first_order_fit(X, Y)
    est = RStarEstimator("linear_qk").fit(X, Y)
    assert est.inversion_ == "query_key_cross_fit"
    assert first.rank_ < r
    assert est.rank_ == r
    assert est.noise_variance_ == pytest.approx(1.0, rel=0.05)


def test_cross_fit_at_more_tokens_than_features_stays_within_the_als_budget():
    # T > d: the first-order inversion is consistent, so the (costlier) profiled fit is not spent.
    # compute_budget=1e9 allows the profiled fit (1024 n T d (d + d_v) = 5.9e8) but not the alternating
    # least squares (512 (n d^4 + d^6) = 1.4e9)
    X, Y, _ = _task(600, 12, 8, 5, noise=1.0, d_v=2, singular_values=np.geomspace(1.0, 0.3, 5))
    budget = CostBudget(multiply_adds=1e9)
    assert cross_fit_method(600, 12, 8, 2, budget) == "profiled"
    assert not cross_fit_sizes_fit(600, 12, 8, 2, budget)
    assert cross_fit_sizes_fit(600, 8, 8, 2, budget)
    with pytest.warns(InversionFallbackWarning, match="only the alternating least squares is spent"):
        est = RStarEstimator("linear_qk", compute_budget=1e9).fit(X, Y)
    assert est.inversion_ == "query_key_first_order"   # first order
    assert est.null_model_ == "wishart" and isinstance(est.statistic_.null, WishartNull)
    assert est.noise_variance_ == pytest.approx(1.0, rel=0.05)


def test_a_fit_beaten_on_its_own_half_is_left_out_of_the_union(monkeypatch):
    X, Y, _ = _task(600, 6, 12, 3, noise=0.05)
    good = QueryKeyCrossFitInversion.fit_half
    calls = []

    def fit_half(Xh, Yh, **kw):
        calls.append(1)
        if len(calls) % 2 == 0:   # whiten fits the odd half first, then the even one
            return good(Xh, Yh, **kw)
        # the odd half's fit stopped at a random kernel (with its best V): a poor fit of that half
        K0 = np.random.default_rng(0).standard_normal((12, 12))
        K, V, rss = _bilinear._query_key_als(Xh, Yh, _bilinear._query_key_grams(Xh, Yh), K0, 0, 0.0)
        return K, V, rss / QueryKeyCrossFitInversion._fit_dof(*Xh.shape, Yh.shape[2])

    ci = QueryKeyCrossFitInversion()
    stats = ci.new_stats(6, 12, 12)
    ci.update(stats, X, Y)
    monkeypatch.setattr(QueryKeyCrossFitInversion, "fit_half", staticmethod(fit_half))
    ws = ci.whiten(stats)
    # ws.null.directions[0] tests the odd half's V on the even half; directions[1] the even half's V on the odd half
    assert ws.null.directions[0].poor_fit and not ws.null.directions[1].poor_fit
    assert ConvergenceWarning in [c for c, _ in ws.warnings]
    res = MarchenkoPasturRule()(ws)
    alone = MarchenkoPasturRule()(_direction(ws, 1))
    assert res.rank == alone.rank == 3
    # the other direction alone, still at half the level
    np.testing.assert_allclose(res.p_values[:3], np.minimum(2 * alone.p_values[:3], 1))
    with pytest.warns(ConvergenceWarning, match="poor local optimum"):
        est = RStarEstimator("linear_qk").fit(X, Y)
    assert est.rank_ == 3


def test_cross_fit_statistic_carries_both_directions():
    X, Y, _ = _task(600, 6, 12, 3, noise=0.05)
    stats = QueryKeyCrossFitInversion().new_stats(6, 12, 12)
    ci = QueryKeyCrossFitInversion()
    ci.update(stats, X, Y)
    ws = ci.whiten(stats)
    assert ws.inversion == "query_key_cross_fit"
    assert isinstance(ws.null, CrossFitNull) and len(ws.null.directions) == 2
    assert all(isinstance(w, SimulatedNull) and w.draws is not None for w in ws.null.directions)
    np.testing.assert_array_equal(ws.null.directions[0].eigenvalues, ws.eigenvalues)
    # each direction alone is the least-squares inversion with the other half's fitted V
    _, V_odd, _ = QueryKeyCrossFitInversion.fit_half(X[1::2], Y[1::2])
    ls = QueryKeyLeastSquaresInversion(V_odd)
    ls_stats = ls.new_stats(6, 12, 12)
    ls.update(ls_stats, X[0::2], Y[0::2])
    np.testing.assert_allclose(ws.eigenvalues, ls.whiten(ls_stats).eigenvalues, rtol=1e-8)


def test_union_takes_twice_the_smaller_p_value():
    q = _union_p_values(np.array([0.001, 0.002, 0.3]), np.array([0.001, 0.02, 0.005, 0.4]), 0.01)
    np.testing.assert_allclose(q, [0.002, 0.004, 0.01, 0.8])
    # a list that stopped counts as 1 beyond its end; the union stops where both are past the lenient level
    np.testing.assert_allclose(_union_p_values(np.array([0.001, 0.5]), np.array([0.001, 0.001, 0.2]), 0.01),
                               [0.002, 0.002, 0.4])
    X, Y, _ = _task(600, 6, 12, 3, noise=0.05)
    ci = QueryKeyCrossFitInversion()
    stats = ci.new_stats(6, 12, 12)
    ci.update(stats, X, Y)
    ws = ci.whiten(stats)
    both = MarchenkoPasturRule()(ws)
    one = MarchenkoPasturRule()(_direction(ws, 1))
    first = MarchenkoPasturRule()(_direction(ws, 0))
    assert both.rank == one.rank == first.rank == 3
    np.testing.assert_allclose(both.p_values[:3], np.minimum(2 * np.minimum(one.p_values[:3], first.p_values[:3]), 1))


def test_cross_fit_streams_and_merges_like_fit():
    X, Y, _ = _task(500, 6, 12, 4, noise=0.2, d_v=8)
    full = RStarEstimator("linear_qk").fit(X, Y)
    streamed = RStarEstimator("linear_qk")
    for start in range(0, 500, 77):
        streamed.partial_fit(X[start:start + 77], Y[start:start + 77])
    assert streamed.rank_ == full.rank_ == 4
    np.testing.assert_allclose(streamed.spectrum_, full.spectrum_, rtol=1e-6)
    # shards merged (each shard splits its own samples by parity): a valid split, same rank
    ci = QueryKeyCrossFitInversion()
    shards = []
    for part in (slice(0, 250), slice(250, 500)):
        s = ci.new_stats(6, 12, 8)
        ci.update(s, X[part], Y[part])
        shards.append(s)
    merged = merge_stats(*shards)
    assert sum(len(x[0]) for x in merged["samples_odd"]) + sum(len(x[0]) for x in merged["samples_even"]) == 500
    assert MarchenkoPasturRule()(ci.whiten(merged)).rank == 4


def test_cross_fit_uses_the_profiled_fit_beyond_the_als_budget():
    T, d, d_v, r, n = 8, 16, 16, 12, 600
    X, Y, _ = _task(n, T, d, r, noise=1.0, d_v=d_v, singular_values=np.geomspace(1.0, 0.3, r))
    assert cross_fit_method(n, T, d, d_v) == "als"
    # 1e10 multiply-adds: the profiled fit (2.5e9) but not the alternating least squares (2.9e10)
    assert cross_fit_method(n, T, d, d_v, CostBudget(multiply_adds=1e10)) == "profiled"
    est = RStarEstimator("linear_qk", compute_budget=1e10).fit(X, Y)
    assert est.inversion_ == "query_key_cross_fit"
    assert est.rank_ == r
    assert est.noise_variance_ == pytest.approx(1.0, rel=0.05)
    with pytest.raises(ValueError, match="method"):
        QueryKeyCrossFitInversion.fit_half(X[:100], Y[:100], method="newton")


@pytest.mark.parametrize("seed", [0, 3, 6, 7])
def test_cross_fit_recovers_rank_with_heavy_tailed_tokens(seed):
    # Student-t tokens: the signal is cubic in X_i, so a few samples dominate the least squares.
    # Fitted on the samples as they are (first-order, transposed and random starts), these four
    # tasks stopped in poor optima and read 3, 4, 3 and 5; the scale-normalised start reads 2.
    X, Y = make_attention_task(400, kind="linear_qk", seq_len=6, n_features=8, value_dim=8, rank=2, noise=0.3,
                               token_distribution="student_t", random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnidentifiableRankWarning)   # the halves' misfit can stay high
        est = RStarEstimator("linear_qk").fit(X, Y)
    assert est.inversion_ == "query_key_cross_fit"
    assert est.rank_ == 2


def test_cross_fit_falls_back_to_first_order_beyond_budget():
    X, Y, _ = _task(400, 6, 12, 3, noise=0.05)
    # neither fit within the compute budget
    with pytest.warns(InversionFallbackWarning, match="exceeds the compute budget"):
        est = RStarEstimator("linear_qk", compute_budget=1).fit(X, Y)
    assert est.inversion_ == "query_key_first_order"
    assert est.null_model_ == "wishart" and isinstance(est.statistic_.null, WishartNull)
    # the 400 samples (8 n T (d + d_v) = 460800 bytes) over the memory budget, which still holds the
    # d^2 x d^2 normal matrices (8 d^4 = 165888 bytes <= half of it): the samples are dropped
    memory = 400_000
    with pytest.warns(InversionFallbackWarning, match="keeping the 400 samples exceeds the memory budget"):
        est = RStarEstimator("linear_qk", memory_budget=memory).fit(X, Y)
    assert est.inversion_ == "query_key_first_order" and est.null_model_ == "wishart"
    ci = QueryKeyCrossFitInversion(budget=CostBudget(memory_bytes=memory))
    stats = ci.new_stats(6, 12, 12)
    ci.update(stats, X, Y)
    assert not ci.samples_kept(stats) and not ci.cross_fit_possible(stats)
    assert ci.default_run(stats) == "query_key_first_order"
    # too few samples per half for the least squares: first order too (8 samples: halves of 4 < 5 needed; 12 are
    # enough, halves of 6, and the old version of this check passed only under the lingering sample budget above)
    X, Y, _ = _task(8, 6, 12, 1, noise=0.05)
    est = RStarEstimator("linear_qk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, Y)
    assert est.inversion_ == "query_key_first_order"
    assert any(w.category is InversionFallbackWarning and "too few for the least squares" in str(w.message)
               for w in caught)


def test_misfit_of_the_fitted_value_map_is_reported():
    X, Y, _ = _task(600, 6, 12, 3, noise=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RStarEstimator("linear_qk").fit(X, Y)
    strict = DEFAULT_CALIBRATION.replace(least_squares_misfit_ratio=0.5)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        RStarEstimator("linear_qk", calibration=strict).fit(X, Y)
    assert_warned(caught, "value_map_misfit", category=UnidentifiableRankWarning)


@pytest.mark.parametrize("method,T,d_v", [("als", 6, 8), ("profiled", 6, 8), ("als", 12, 4)])
def test_cross_fit_null_keeps_its_level(method, T, d_v):
    # r* = 0: each direction's V is fitted on samples independent of the ones it is tested on,
    # so each test is exact whatever the optimiser; their Bonferroni union keeps the level.
    # 2e8 multiply-adds: the profiled fit (9.4e7 at T = 6) but not the alternating least squares (3.9e8)
    compute = 2e8 if method == "profiled" else DEFAULT_CALIBRATION.compute_budget
    assert cross_fit_method(120, T, 8, d_v, CostBudget(multiply_adds=compute)) == method
    false_alarms = 0
    for seed in range(30):
        X, Y = make_attention_task(120, kind="linear_qk", seq_len=T, n_features=8, value_dim=d_v, rank=0,
                                   random_state=seed)
        est = RStarEstimator("linear_qk", compute_budget=compute).fit(X, Y)
        assert est.inversion_ == "query_key_cross_fit"
        false_alarms += est.rank_ > 0
    assert false_alarms <= 1
