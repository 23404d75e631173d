"""Least-squares softmax inversion (rstar.inversions._numerics.softmax_ls and SoftmaxLeastSquaresInversion)."""

import warnings

import numpy as np
import pytest

from rstar import RStarEstimator, SoftmaxInversionEstimator
from rstar.inversions._numerics import softmax_ls as sls
from rstar import streaming
from rstar.budgets import CostBudget, information_cost, softmax_fit_cost
from rstar.calibration import DEFAULT_CALIBRATION
from rstar.datasets import make_attention_task, softmax_attention
from rstar.exceptions import IllConditionedInversionWarning, InversionFallbackWarning, UnidentifiableRankWarning
from rstar.inversions import (
    QueryKeyInversion,
    SimulatedNull,
    SoftmaxLeastSquaresInversion,
    make_inversion,
    merge_stats,
    nearest_kronecker_product,
)
from rstar.inversions.softmax_least_squares import softmax_fit_blocker, softmax_fit_sizes_fit

from _reasons import assert_warned


def _task(n=300, T=10, d=5, d_v=4, rank=2, noise=0.05, seed=0, **kw):
    return make_attention_task(n, seq_len=T, n_features=d, value_dim=d_v, rank=rank, noise=noise,
                               random_state=seed, return_teacher=True, **kw)


@pytest.mark.parametrize("known_v", [False, True])
@pytest.mark.parametrize("with_basis", [False, True])
def test_loss_gradient_matches_central_differences(known_v, with_basis):
    X, Y, t = _task(n=40)
    rng = np.random.default_rng(1)
    basis = np.linalg.qr(rng.standard_normal((5, 3)))[0].T if with_basis else None
    loss = sls.SoftmaxLeastSquaresLoss(X, Y, t.value_map if known_v else None, basis)
    m = rng.standard_normal(15 if with_basis else 25) * 0.5
    f, g = loss(m)
    for _ in range(3):
        u = rng.standard_normal(m.size)
        h = 1e-5
        numeric = (loss(m + h * u)[0] - loss(m - h * u)[0]) / (2 * h)
        assert g @ u == pytest.approx(numeric, rel=1e-5, abs=1e-7)
    # the value is the residual of the model at the (known or least-squares) value map
    K = loss.kernel(m)
    V, rss = loss.value_map(K)
    assert f == pytest.approx(rss, rel=1e-12)
    if known_v:
        np.testing.assert_array_equal(V, t.value_map)
    else:
        Z = (sls.attention_weights(X, K) @ X).reshape(-1, 5)
        V_ls = np.linalg.lstsq(Z, Y.reshape(-1, 4), rcond=None)[0]
        np.testing.assert_allclose(V, V_ls, rtol=1e-8, atol=1e-10)


def test_loss_is_the_same_with_and_without_the_weight_cache(monkeypatch):
    X, Y, _ = _task(n=30)
    m = np.random.default_rng(0).standard_normal(25)
    f1, g1 = sls.SoftmaxLeastSquaresLoss(X, Y)(m)
    monkeypatch.setattr(streaming.Samples, "chunk_entries", 7 * 100)   # several chunks
    loss = sls.SoftmaxLeastSquaresLoss(X, Y, max_cached_weights=0)
    assert len(list(loss.samples.chunks(X.shape[1] ** 2))) > 1 and not loss._cache
    f2, g2 = loss(m)
    assert f1 == pytest.approx(f2, rel=1e-12)
    np.testing.assert_allclose(g1, g2, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("d_v", [1, 2, 5])   # d_v > d / 2: the cross term goes through D; d_v > d: V V^T is factored
@pytest.mark.parametrize("value_map_fitted", [False, True])
def test_information_matrix_is_gauss_newton_with_v_profiled(value_map_fitted, d_v):
    X, _, t = _task(n=10, T=5, d=3, d_v=d_v)
    K = t.kernel + 0.2
    V = t.value_map

    def model(theta):
        return softmax_attention(X, theta[:9].reshape(3, 3), theta[9:].reshape(3, d_v)).ravel()

    theta = np.concatenate([K.ravel(), V.ravel()])
    J = np.stack([(model(theta + 1e-6 * e) - model(theta - 1e-6 * e)) / 2e-6 for e in np.eye(theta.size)], axis=1)
    F = J.T @ J
    expected = F[:9, :9]
    if value_map_fitted:   # Schur complement: the information left for K once V is fitted too
        expected = expected - F[:9, 9:] @ np.linalg.solve(F[9:, 9:], F[9:, :9])
    got = sls.softmax_kernel_information_matrix(X, K, V, value_map_fitted)
    np.testing.assert_allclose(got, expected, atol=1e-7 * np.abs(expected).max())


def test_statistic_carries_null_draws():
    X, Y, _ = _task(n=300, T=10, d=5, d_v=4, rank=2, noise=0.05)
    inv = SoftmaxLeastSquaresInversion()
    stats = inv.new_stats(10, 5, 4)
    inv.update(stats, X, Y)
    ws = inv.whiten(stats)
    assert ws.inversion == "softmax_least_squares" and isinstance(ws.null, SimulatedNull)
    assert ws.null.draws.shape == (DEFAULT_CALIBRATION.default_null_draws, 5, 5)
    assert ws.null.statistic_matrix.shape == (5, 5)
    np.testing.assert_allclose(np.linalg.svd(ws.null.statistic_matrix, compute_uv=False) ** 2 / 5, ws.eigenvalues)
    # the draws' whitened noise is close to white at the residual variance (Gaussian tokens)
    assert np.mean(ws.null.draws**2) == pytest.approx(ws.noise_variance, rel=0.3)


@pytest.mark.parametrize("known_v", [False, True])
def test_fit_recovers_a_noise_free_teacher(known_v):
    X, Y, t = _task(n=200, T=12, d=6, d_v=5, rank=3, noise=0.0, logit_scale=3.0)
    K, V, rss, converged = sls.fit_softmax_least_squares(X, Y, t.value_map if known_v else None)
    assert converged
    assert np.linalg.norm(K - t.kernel) < 1e-3 * np.linalg.norm(t.kernel)
    np.testing.assert_allclose(V, t.value_map, atol=1e-4 * np.abs(t.value_map).max())
    assert rss < 1e-8 * np.sum(Y**2)


def test_rank_constrained_fit_stays_in_the_basis():
    X, Y, t = _task(n=200, T=12, d=6, d_v=5, rank=2, noise=0.02)
    U = np.linalg.svd(t.kernel)[0][:, :2]
    K, V, rss, _ = sls.fit_softmax_least_squares(X, Y, basis=U.T)
    np.testing.assert_allclose(U @ U.T @ K, K, atol=1e-12)
    K_full, _, rss_full, _ = sls.fit_softmax_least_squares(X, Y)
    # the truth lies in the basis, so the constrained fit loses only the noise fitted by the other directions
    assert rss_full <= rss <= rss_full * 1.02



def _anisotropic_task(seed=0, n=300, T=12, d=6, d_v=4):
    """Tokens with a common mean and standard deviations from 0.1 to 3 along random axes; a rank-2 kernel with
    logits of standard deviation 2; 5% noise; both scaled to unit RMS (as the inversion fits them)."""
    rng = np.random.default_rng(seed)
    axes = np.linalg.qr(rng.standard_normal((d, d)))[0]
    X = (rng.standard_normal((n, T, d)) * np.geomspace(0.1, 3.0, d)) @ axes.T + 0.5 * rng.standard_normal(d)
    K = rng.standard_normal((d, 2)) @ rng.standard_normal((2, d))
    K *= 2.0 / np.std(np.einsum("nta,ab,nsb->nts", X[:50], K, X[:50]) / np.sqrt(d))
    V = rng.standard_normal((d, d_v))
    Y = softmax_attention(X, K, V)
    Y = Y + 0.05 * Y.std() * rng.standard_normal(Y.shape)
    sx, sy = np.sqrt(np.mean(X**2)), np.sqrt(np.mean(Y**2))
    return X / sx, Y / sy, V * sx / sy


@pytest.mark.parametrize("known_v", [False, True])
def test_token_metric_shortens_the_fit_on_anisotropic_tokens(known_v, monkeypatch):
    from rstar.inversions._numerics.softmax_factored import token_metric_roots

    X, Y, V = _anisotropic_task()
    Hq, Pq, Hk, Pk = token_metric_roots(X)
    calls = []
    plain_call = sls.SoftmaxLeastSquaresLoss.__call__
    monkeypatch.setattr(sls.SoftmaxLeastSquaresLoss, "__call__", lambda self, m: calls.append(1) or plain_call(self, m))
    fits = []
    for precondition in (None, (Hq, Pq, Hk, Pk)):
        calls.clear()
        K, _, rss, converged = sls.fit_softmax_least_squares(X, Y, V if known_v else None, precondition=precondition)
        fits.append((len(calls), rss, K))
        assert converged
    (n_plain, rss_plain, K_plain), (n_metric, rss_metric, K_metric) = fits
    # measured: 213 evaluations without the metric, 24 with it (V fitted; about the same with V known)
    assert n_metric * 4 < n_plain
    # the same minimum, which the plain fit stops a little short of on its slow, ill-conditioned path: in the
    # tokens' metric (what the logits see) within 0.2% (measured 0.12%); the raw kernels differ by 26% along
    # the low-variance token axes, where the loss is nearly flat
    assert rss_metric <= rss_plain * (1 + 1e-9)
    assert rss_plain - rss_metric < 1e-3 * rss_metric
    seen = lambda K: Hq @ K @ Hk   # noqa: E731
    assert np.linalg.norm(seen(K_metric - K_plain)) < 2e-3 * np.linalg.norm(seen(K_metric))
    # and a plain fit started there stays there
    K_again = sls.fit_softmax_least_squares(X, Y, V if known_v else None, K0=K_metric)[0]
    assert np.linalg.norm(seen(K_again - K_metric)) < 1e-4 * np.linalg.norm(seen(K_metric))

    # the inversion's own fit runs in that metric (in the data's units; here already unit RMS)
    inv = SoftmaxLeastSquaresInversion(V if known_v else None)
    K_inv = inv._fit(streaming.ArraySamples(X, Y))[0]
    assert np.linalg.norm(seen(K_inv - K_metric)) < 1e-4 * np.linalg.norm(seen(K_metric))


def test_preconditioned_parameters_round_trip():
    from rstar.inversions._numerics.linalg import psd_power

    rng = np.random.default_rng(1)
    X, Y = rng.standard_normal((20, 5, 4)), rng.standard_normal((20, 5, 3))
    A, B = (np.cov(rng.standard_normal((4, 30))) + 0.1 * np.eye(4) for _ in range(2))
    P, R = psd_power(A, -0.5), psd_power(B, -0.5)
    loss = sls.SoftmaxLeastSquaresLoss(X, Y, precondition=(psd_power(A, 0.5), P, psd_power(B, 0.5), R))
    K = rng.standard_normal((4, 4))
    np.testing.assert_allclose(loss.kernel(loss.parameters(K)), K, atol=1e-10)
    # the gradient in the parameters is the chain rule of the gradient in K
    m = loss.parameters(K)
    f, g = loss(m)
    f_K, g_K = sls.SoftmaxLeastSquaresLoss(X, Y)(K.ravel())
    assert f == pytest.approx(f_K)
    np.testing.assert_allclose(g, (P.T @ g_K.reshape(4, 4) @ R.T).ravel(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tokens", ["gaussian", "student_t", "correlated"])
@pytest.mark.parametrize("T, d", [(6, 6), (7, 6), (12, 6), (5, 6)])
def test_rstar_softmax_v_unknown_recovers_rank(tokens, T, d):
    X, Y, _ = _task(n=500, T=T, d=d, d_v=6, rank=3, noise=0.05, logit_scale=2.0, token_distribution=tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IllConditionedInversionWarning)
        est = RStarEstimator(operator="softmax").fit(X, Y)
    assert est.inversion_ == "softmax_least_squares" and est.null_model_ == "simulated"
    assert est.rank_ == 3
    # the simulated null's smallest p-value is 1 / (draws + 1)
    assert est.p_values_[:3].max() <= 1.0 / (DEFAULT_CALIBRATION.default_null_draws + 1)
    assert est.p_values_[3] > 0.01


def test_known_v_beyond_the_exact_inversion_recovers_rank():
    # T > 0.9 min(d, d_v): the exact inversion is ill-conditioned, the least squares is not
    X, Y, t = _task(n=400, T=16, d=8, d_v=8, rank=3, noise=0.1, logit_scale=3.0)
    est = RStarEstimator(operator="softmax", value_map=t.value_map).fit(X, Y)
    assert est.inversion_ == "softmax_least_squares"
    # V is known to the fit: its residual has n T d_v - d^2 degrees of freedom (not - d d_v more)
    assert est.statistic_.null.noise_dof == SoftmaxLeastSquaresInversion.residual_dof(400, 16, 8, 8, True)
    assert est.rank_ == 3


def test_null_false_alarms_and_p_values():
    """r* = 0 (uniform attention): the Wald test keeps its level (40 tasks, alpha = 0.01)."""
    ranks, p0 = [], []
    for seed in range(40):
        X, Y, _ = _task(n=200, T=10, d=6, d_v=6, rank=0, noise=0.1, seed=seed,
                        token_distribution=("gaussian", "student_t", "correlated")[seed % 3])
        est = RStarEstimator(operator="softmax").fit(X, Y)
        ranks.append(est.rank_)
        p0.append(est.p_values_[0])
    assert sum(r > 0 for r in ranks) <= 2
    # the p-values of the first test spread over (0, 1) rather than piling up near 0 or 1
    p0 = np.asarray(p0)
    assert 0.05 <= np.mean(p0 < 0.5) <= 0.8 and np.mean(p0 < 0.05) <= 0.2


@pytest.mark.parametrize("n,T,d,d_v,binding", [(300, 16, 6, 6, "fit"), (40, 4, 16, 16, "information")])
def test_compute_budget_binds_at_the_larger_cost(n, T, d, d_v, binding):
    # one compute budget bounds both the fit (512 n T^2 (d + d_v) per start) and the information of K; the fit
    # runs exactly while the larger of the two is within it
    from rstar.inversions.softmax_least_squares import softmax_fit_starts

    fit = softmax_fit_cost(n, T, d, d_v) * softmax_fit_starts(T, d, value_map_known=False)
    info = information_cost(n, T, d, d_v)
    assert (fit > info) == (binding == "fit")
    cost = max(fit, info)
    assert softmax_fit_blocker(n, T, d, d_v, budget=CostBudget(multiply_adds=cost)) is None
    assert softmax_fit_sizes_fit(n, T, d, d_v, budget=CostBudget(multiply_adds=cost))
    why = softmax_fit_blocker(n, T, d, d_v, budget=CostBudget(multiply_adds=cost - 1))
    assert why is not None and ("information of K" in why) == (binding == "information")


def test_over_budget_is_the_first_order_inversion():
    X, Y, _ = _task(n=300, T=16, d=6, d_v=6, rank=2, noise=0.05)
    cost = softmax_fit_cost(300, 16, 6, 6)   # 512 n T^2 (d + d_v): above the information's cost here
    assert cost == 512 * 16 * 16 * 12 * 300
    inv = SoftmaxLeastSquaresInversion(budget=CostBudget(multiply_adds=cost))
    stats = inv.new_stats(16, 6, 6)
    inv.update(stats, X, Y)
    assert inv.fit_possible(stats)
    # one multiply-add less: the first 299 samples are within the compute budget, and the least squares runs on them
    inv = SoftmaxLeastSquaresInversion(budget=CostBudget(multiply_adds=cost - 1))
    stats = inv.new_stats(16, 6, 6)
    inv.update(stats, X, Y)
    assert inv.n_samples_kept(stats) == 299 and inv.fit_possible(stats)
    with pytest.warns(InversionFallbackWarning, match="compute budget .* fitted on the first 299"):
        est = RStarEstimator(operator="softmax", compute_budget=cost - 1).fit(X, Y)
    alone = RStarEstimator(operator="softmax").fit(X[:299], Y[:299])
    assert est.inversion_ == "softmax_least_squares" and est.rank_ == alone.rank_ == 2
    np.testing.assert_allclose(est.spectrum_, alone.spectrum_, rtol=1e-8, atol=1e-10 * alone.spectrum_[0])
    # within the budget only one sample, too few for the least squares: the first-order inversion
    small = softmax_fit_cost(1, 16, 6, 6)
    inv = SoftmaxLeastSquaresInversion(budget=CostBudget(multiply_adds=small))
    stats = inv.new_stats(16, 6, 6)
    inv.update(stats, X, Y)
    assert not inv.fit_possible(stats) and inv.default_run(stats) == "softmax_first_order"
    ref = QueryKeyInversion(centred=True, residual_noise=False)
    ref_stats = ref.new_stats(16, 6, 6)
    ref.update(ref_stats, X, Y)
    np.testing.assert_allclose(inv.whiten(stats).eigenvalues, ref.whiten(ref_stats).eigenvalues)
    with pytest.warns(InversionFallbackWarning, match="softmax_least_squares inversion not used: keeping the 300 "
                      "samples exceeds the memory budget|softmax_least_squares inversion not used"):
        est = RStarEstimator(operator="softmax", compute_budget=small).fit(X, Y)
    assert est.rank_ == 2 and est.inversion_ == "softmax_first_order"


def test_too_few_residual_dof_is_the_first_order_inversion():
    inv = SoftmaxLeastSquaresInversion()
    stats = inv.new_stats(4, 6, 1)
    stats["n"] = 20    # 80 equations for 36 + 6 unknowns: 38 < min_noise_dof (50)
    assert not inv.fit_possible(stats)


def test_partial_fit_and_merge_equal_fit():
    X, Y, _ = _task(n=300, T=10, d=5, d_v=4, rank=2, noise=0.05)
    full = RStarEstimator(operator="softmax").fit(X, Y)
    part = RStarEstimator(operator="softmax")
    for s in (slice(0, 120), slice(120, 300)):
        part.partial_fit(X[s], Y[s])
    assert part.rank_ == full.rank_ == 2
    # the fit runs on samples scaled to unit RMS, so the first batch's scaling does not move it
    np.testing.assert_allclose(part.spectrum_, full.spectrum_, rtol=1e-6)
    inv = SoftmaxLeastSquaresInversion()
    x_scale, y_scale = np.sqrt(np.mean(X**2)), np.sqrt(np.mean(Y**2))   # the estimator's internal units
    shards = []
    for s in (slice(0, 151), slice(151, 300)):
        st = inv.new_stats(10, 5, 4)
        inv.update(st, X[s] / x_scale, Y[s] / y_scale)
        shards.append(st)
    ws = inv.whiten(merge_stats(*shards))
    # shards split by their own parity: the samples come in another order (round-off only)
    np.testing.assert_allclose(ws.eigenvalues * y_scale**2, full.spectrum_, rtol=1e-6)


def test_predict_uses_the_rank_constrained_fit():
    X, Y, t = _task(n=400, T=10, d=6, d_v=4, rank=2, noise=0.05)
    est = RStarEstimator(operator="softmax").fit(X, Y)
    assert est.rank_ == 2
    K = est.operator_.K
    assert np.linalg.matrix_rank(K, tol=1e-8 * np.linalg.norm(K)) == 2
    clean = softmax_attention(X, t.kernel, t.value_map)
    # in-sample R^2 close to the noise ceiling
    ceiling = 1 - np.sum((Y - clean) ** 2) / np.sum((Y - Y.mean(axis=(0, 1))) ** 2)
    assert est.score(X, Y) > ceiling - 0.01
    zero = RStarEstimator(operator="softmax", rank=0).fit(X, Y)
    np.testing.assert_array_equal(zero.operator_.K, 0.0)


def test_non_convergence_is_warned_and_falls_back_to_first_order():
    X, Y, _ = _task(n=300, T=10, d=5, d_v=4, rank=2, noise=0.05, logit_scale=4.0)
    two = DEFAULT_CALIBRATION.replace(softmax_max_iter=2)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est = RStarEstimator(operator="softmax", calibration=two).fit(X, Y)
    hit = assert_warned(caught, "not_converged", category=UnidentifiableRankWarning)
    assert est.statistic_.fallback.kind == "not_converged" and est.statistic_.fallback.values["max_iter"] == 2
    assert est.inversion_ == "softmax_first_order" and est.inversion_reason_ == str(hit.message)
    with pytest.warns(InversionFallbackWarning, match="exceeds the compute budget"):
        ref = RStarEstimator(operator="softmax", compute_budget=1).fit(X, Y)   # the first-order inversion
    assert ref.inversion_ == "softmax_first_order"
    assert est.rank_ == ref.rank_
    np.testing.assert_allclose(est.spectrum_, ref.spectrum_, rtol=1e-12)


def test_method_option():
    assert isinstance(make_inversion("softmax", shape=(8, 6, 6), method="least_squares"),
                      SoftmaxLeastSquaresInversion)
    assert isinstance(make_inversion("softmax", shape=(8, 6, 6), method="first_order"), QueryKeyInversion)
    assert not isinstance(make_inversion("softmax", shape=(8, 6, 6), method="first_order"),
                          SoftmaxLeastSquaresInversion)
    with pytest.raises(ValueError, match="least_squares"):
        make_inversion("linear_qk", shape=(8, 6, 6), method="least_squares")
    X, Y, _ = _task(n=300, T=10, d=5, d_v=4, rank=2, noise=0.05)
    est = SoftmaxInversionEstimator(method="least_squares").fit(X, Y)
    assert est.inversion_ == "softmax_least_squares" and est.rank_ == 2


def test_no_value_signal_is_the_first_order_inversion():
    # pure noise: without a value signal the kernel's least squares runs off to hard attention
    rng = np.random.default_rng(0)
    X = rng.standard_normal((400, 16, 6))
    Y = 0.05 * rng.standard_normal((400, 16, 6))
    inv = SoftmaxLeastSquaresInversion()
    stats = inv.new_stats(16, 6, 6)
    inv.update(stats, X, Y)
    assert inv.fit_possible(stats) and inv.value_signal_p_value(stats, Y) > 0.01
    ref = QueryKeyInversion(centred=True, residual_noise=False)
    ref_stats = ref.new_stats(16, 6, 6)
    ref.update(ref_stats, X, Y)
    np.testing.assert_allclose(inv.whiten(stats).eigenvalues, ref.whiten(ref_stats).eigenvalues)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est = RStarEstimator(operator="softmax").fit(X, Y)
    assert_warned(caught, "no_value_signal", category=UnidentifiableRankWarning)
    assert est.rank_ == 0 and est.inversion_ == "softmax_first_order"
    # with a value signal the test rejects
    X, Y, _ = _task(n=400, T=16, d=6, d_v=6, rank=0, noise=0.3)
    stats = inv.new_stats(16, 6, 6)
    inv.update(stats, X, Y)
    assert inv.value_signal_p_value(stats, Y) < 1e-6


def test_linear_qk_data_fall_back_to_first_order_with_a_warning():
    # the softmax model does not hold: its residual is far above the power outside col(P X_i), and the
    # first-order inversion (which holds for linear QK too) reads r*
    X, Y = make_attention_task(400, kind="linear_qk", seq_len=24, n_features=8, rank=3, noise=0.05, random_state=0)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est = RStarEstimator().fit(X, Y)
    # the fit ran (within the budgets) and failed the model check
    hit = assert_warned(caught, "softmax_misfit", bounds=(0, 8), category=UnidentifiableRankWarning)
    assert est.rank_ == 3 and est.inversion_ == "softmax_first_order"
    assert est.inversion_reason_ == str(hit.message)
    assert est.spectrum_.shape == (8,) and est.n_columns_ > 8   # the first-order statistic, not the Wald one


def test_softmax_data_pass_the_misfit_check():
    inv = SoftmaxLeastSquaresInversion()
    for tokens in ("gaussian", "student_t"):
        X, Y, _ = _task(n=400, T=24, d=6, d_v=6, rank=3, noise=0.05, token_distribution=tokens, logit_scale=4.0)
        stats = inv.new_stats(24, 6, 6)
        inv.update(stats, X, Y)
        ws = inv.whiten(stats)
        assert ws.inversion == "softmax_least_squares" and isinstance(ws.null, SimulatedNull)


def test_restarts_only_where_no_residual_checks_the_fit_and_the_budget_counts_them():
    from rstar.budgets import CostBudget, softmax_fit_cost
    from rstar.inversions.softmax_least_squares import softmax_fit_blocker, softmax_fit_starts

    assert softmax_fit_starts(8, 16, value_map_known=False) == 1 + DEFAULT_CALIBRATION.softmax_restarts
    assert softmax_fit_starts(8, 16, False, calibration=DEFAULT_CALIBRATION.replace(softmax_restarts=0)) == 1
    assert softmax_fit_starts(8, 16, value_map_known=True) == 1
    assert softmax_fit_starts(32, 16, value_map_known=False) == 1
    # a compute budget that allows one start but not three blocks the V-unknown fit at T - 1 <= d only
    budget = CostBudget(multiply_adds=2 * softmax_fit_cost(500, 8, 16, 8))
    assert softmax_fit_blocker(500, 8, 16, 8, value_map_known=True, budget=budget) is None
    assert "compute budget" in softmax_fit_blocker(500, 8, 16, 8, value_map_known=False, budget=budget)
