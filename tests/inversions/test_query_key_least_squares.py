"""Least-squares query-key inversion with a known V and its simulated-null rule."""

import warnings

import numpy as np
import pytest

from rstar import EnergyRankEstimator, MPRankEstimator, RStarEstimator
from rstar.calibration import DEFAULT_CALIBRATION
from rstar.datasets import make_attention_task
from rstar.exceptions import IllConditionedInversionWarning, InversionFallbackWarning
from rstar.inversions import (
    QueryKeyInversion,
    QueryKeyLeastSquaresInversion,
    SimulatedNull,
    make_inversion,
)
from rstar.rules import MarchenkoPasturRule, interval_levels, simulated_null_p_values


def _task(n, T, d, r, noise=0.1, d_v=None, seed=0, **kw):
    X, Y, t = make_attention_task(n, kind="linear_qk", seq_len=T, n_features=d, value_dim=d_v, rank=r, noise=noise,
                                  random_state=seed, return_teacher=True, **kw)
    return X, Y, t.value_map


def test_make_inversion_picks_least_squares_with_known_v():
    V = np.ones((8, 4))
    assert type(make_inversion("linear_qk", V, shape=(6, 8, 4))) is QueryKeyLeastSquaresInversion
    assert type(make_inversion("linear_qk", V, shape=(6, 8, 4), method="first_order")) is QueryKeyInversion
    assert type(make_inversion("linear_qk", None, shape=(6, 8, 4), method="first_order")) is QueryKeyInversion
    # past the memory budget of the d^2 x d^2 normal matrix: the first-order inversion
    assert type(make_inversion("linear_qk", np.ones((80, 4)), shape=(6, 80, 4))) is QueryKeyInversion
    with pytest.raises(ValueError, match="needs a known value_map"):
        make_inversion("linear_qk", None, method="exact")
    with pytest.raises(ValueError, match="method must be"):
        make_inversion("linear_qk", V, shape=(6, 8, 4), method="least_squares")


@pytest.mark.parametrize("T,d,d_v,r", [(6, 12, 12, 8), (4, 8, 16, 5), (8, 16, 4, 12), (12, 12, 12, 6)])
def test_fewer_tokens_than_features_recovered_with_known_v(T, d, d_v, r):
    # T <= d: M_i = X_i^+ Y_i only sees X_i^+ X_i K (a projection) or is ill-conditioned, and with V unknown
    # the count falls short; the pooled least squares on Y_i itself is unbiased and recovers r* exactly
    X, Y, V = _task(1500, T, d, r, noise=1.0, d_v=d_v, singular_values=np.geomspace(1.0, 0.3, r))
    first = QueryKeyInversion()
    first_stats = first.new_stats(T, d, d_v)
    first.update(first_stats, X / np.sqrt(np.mean(X**2)), Y / np.sqrt(np.mean(Y**2)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unknown = MarchenkoPasturRule()(first.whiten(first_stats))
    est = RStarEstimator("linear_qk", value_map=V).fit(X, Y)
    assert est.inversion_ == "query_key_least_squares" and est.null_model_ == "simulated"
    assert est.rank_ == r
    assert est.noise_variance_ == pytest.approx(1.0, rel=0.05)
    assert est.rank_interval_[0] <= r <= est.rank_interval_[1]
    assert np.all(est.p_values_[:r] < 0.01) and est.p_values_[r] >= 0.01
    assert est.spectrum_[r - 1] > est.threshold_ >= est.spectrum_[r]
    assert unknown.rank < r   # the first-order inversion falls short


def test_components_span_kernel_range_and_predict_is_exact():
    X, Y, t = make_attention_task(800, kind="linear_qk", seq_len=6, n_features=12, rank=3, noise=0.01, random_state=0,
                                  return_teacher=True)
    est = RStarEstimator("linear_qk", value_map=t.value_map).fit(X, Y)
    assert est.rank_ == 3
    Q = np.linalg.svd(t.kernel)[0][:, :3]
    # principal angles between range(K*) and the recovered subspace
    cosines = np.linalg.svd(est.components_ @ Q, compute_uv=False)
    assert cosines.min() > 0.999
    X_new, Y_new, _ = make_attention_task(200, kind="linear_qk", seq_len=6, n_features=12, rank=3, noise=0.0,
                                          random_state=0, return_teacher=True)
    assert est.score(X_new, Y_new) > 0.99


def test_null_tasks_are_calibrated():
    # r* = 0: the simulated null is the exact law of the statistic, so the false-alarm rate is alpha
    alarms, p0 = 0, []
    for seed in range(120):
        X, Y, V = _task(150, 4, 8, 0, noise=1.0, d_v=8, seed=seed)
        est = MPRankEstimator("linear_qk", value_map=V).fit(X, Y)
        alarms += est.rank_ > 0
        p0.append(est.p_values_[0])
    assert alarms <= 4            # alpha = 1%: 1.2 expected, P(>= 5) < 1%
    p0 = np.asarray(p0)
    assert 0.03 <= np.mean(p0 < 0.1) <= 0.2
    assert 0.35 <= np.mean(p0 < 0.5) <= 0.65


def test_partial_fit_equals_fit():
    X, Y, V = _task(600, 6, 12, 4)
    full = RStarEstimator("linear_qk", value_map=V).fit(X, Y)
    part = RStarEstimator("linear_qk", value_map=V)
    for start in range(0, 600, 200):
        part.partial_fit(X[start:start + 200], Y[start:start + 200])
    assert part.rank_ == full.rank_ == 4
    # sums in another order: eigenvalues agree to rounding of the largest (eps * lambda_1 per entry, a
    # small eigenvalue 1e-8 below it can differ by 1e-7 of itself: seen with another BLAS build)
    np.testing.assert_allclose(part.spectrum_, full.spectrum_, rtol=1e-8, atol=1e-12 * full.spectrum_[0])
    np.testing.assert_allclose(part.p_values_, full.p_values_)


def test_fit_is_deterministic_and_user_noise_rescales_draws():
    X, Y, V = _task(400, 6, 12, 3, noise=0.2)
    a = RStarEstimator("linear_qk", value_map=V).fit(X, Y)
    b = RStarEstimator("linear_qk", value_map=V).fit(X, Y)
    np.testing.assert_array_equal(a.p_values_, b.p_values_)
    known = RStarEstimator("linear_qk", value_map=V, noise_variance=0.2**2).fit(X, Y)
    assert known.rank_ == a.rank_ == 3
    assert known.noise_variance_ == pytest.approx(0.04)
    # a noise level 100x too high hides every spike
    loud = RStarEstimator("linear_qk", value_map=V, noise_variance=100 * 0.2**2 * 1e4).fit(X, Y)
    assert loud.rank_ < 3


def test_energy_rule_reads_the_least_squares_spikes():
    X, Y, V = _task(1500, 6, 12, 4, singular_values=[4.0, 1.0, 0.5, 0.05])
    est = EnergyRankEstimator("linear_qk", value_map=V).fit(X, Y)
    assert 1 <= est.rank_ < 4


def test_too_few_samples_fall_back_with_a_warning():
    # d^2 = 256 unknowns, each sample pins at most T min(T, d_v) = 16 of them: 17 samples needed
    X, Y, V = _task(12, 4, 16, 2, d_v=8)
    # the fallback is decided (and warned) by the estimator's choice of inversion; the first-order statistic
    # does not use the known V, and says so
    with pytest.warns(InversionFallbackWarning, match="query_key_least_squares inversion not used: 12 samples are "
                      "too few for the least squares"), \
            pytest.warns(UserWarning, match="known value_map is not used by the query_key_first_order"):
        est = RStarEstimator("linear_qk", value_map=V).fit(X, Y)
    assert est.inversion_ == "query_key_first_order"
    assert est.rank_ >= 0 and est.spectrum_.shape == (16,)
    assert QueryKeyLeastSquaresInversion(V).least_squares_samples(4, 16, 8) == 17


def test_degenerate_tokens_warn_about_unseen_directions():
    X, Y, V = _task(400, 6, 12, 2)
    X = X.copy()
    X[:, :, -1] = 0.0    # feature 12 never appears: K's last row and column are not identified
    K = np.outer(np.eye(12)[0], np.eye(12)[1])
    Y = np.einsum("nta,ab,nsb,nsc,cv->ntv", X, K, X, X, V)
    Y += 0.01 * np.random.default_rng(0).standard_normal(Y.shape)
    with pytest.warns(IllConditionedInversionWarning, match="singular or ill-conditioned"):
        est = RStarEstimator("linear_qk", value_map=V).fit(X, Y)
    assert est.rank_ == 1


def test_inversion_draws_have_the_statistic_shape():
    X, Y, V = _task(300, 6, 12, 2)
    inv = QueryKeyLeastSquaresInversion(V)
    stats = inv.new_stats(6, 12, 12)
    inv.update(stats, X, Y)
    ws = inv.whiten(stats)
    assert isinstance(ws.null, SimulatedNull)
    assert ws.null.draws.shape == (DEFAULT_CALIBRATION.default_null_draws, 12, 12)
    np.testing.assert_allclose(np.linalg.eigvalsh(ws.null.statistic_matrix @ ws.null.statistic_matrix.T / 12)[::-1],
                               ws.eigenvalues, rtol=1e-8, atol=1e-12)
    # the whitened noise is close to white at the residual level
    level = np.mean(ws.null.draws**2)
    assert level == pytest.approx(ws.noise_variance, rel=0.2)


def test_simulated_null_p_values_are_uniform_under_the_null():
    rng = np.random.default_rng(0)
    p0 = [simulated_null_p_values(rng.standard_normal((6, 6)), rng.standard_normal((200, 6, 6)))[0][0]
          for _ in range(300)]
    p0 = np.asarray(p0)
    assert 0.05 <= np.mean(p0 < 0.1) <= 0.16
    assert 0.42 <= np.mean(p0 < 0.5) <= 0.58


def test_simulated_null_p_values_stop_at_the_lenient_level_and_respect_max_rank():
    rng = np.random.default_rng(1)
    S = np.diag([14.0, 12.0, 10.0, 0, 0, 0, 0, 0])
    M = S + rng.standard_normal((8, 8))
    Z = rng.standard_normal((400, 8, 8))
    q, cuts = simulated_null_p_values(M, Z, alpha=0.01)
    assert np.all(q[:3] < 0.01) and q[-1] >= interval_levels(0.01)[1]
    assert len(cuts) == len(q) and np.all(np.diff(cuts) <= 1e-12)   # deflated nulls shrink
    q2, _ = simulated_null_p_values(M, Z, alpha=0.01, max_rank=2)
    assert len(q2) == 2


@pytest.mark.parametrize("matrix,draws,match", [
    (np.zeros((0, 3)), np.zeros((5, 0, 3)), "matrix"),
    (np.full((3, 3), np.nan), np.zeros((5, 3, 3)), "matrix"),
    (np.zeros((3, 3)), np.zeros((5, 3, 4)), "null_draws"),
    (np.zeros((3, 3)), np.zeros((3, 3)), "null_draws"),
    (np.zeros((3, 3)), np.full((5, 3, 3), np.inf), "null_draws"),
])
def test_simulated_null_p_values_bad_input(matrix, draws, match):
    with pytest.raises(ValueError, match=match):
        simulated_null_p_values(matrix, draws)
    with pytest.raises(ValueError, match="alpha"):
        simulated_null_p_values(np.eye(3), np.zeros((5, 3, 3)), alpha=0.0)


def test_pickle_clone_and_rank_sweep_with_known_v():
    import pickle

    from sklearn.base import clone
    from sklearn.model_selection import GridSearchCV

    from rstar.metrics import token_r2_scorer

    X, Y, V = _task(400, 6, 8, 2, noise=0.05)
    est = RStarEstimator("linear_qk", value_map=V).fit(X, Y)
    again = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(again.predict(X[:5]), est.predict(X[:5]))
    np.testing.assert_array_equal(clone(est).get_params()["value_map"], V)
    search = GridSearchCV(RStarEstimator("linear_qk", value_map=V), {"rank": [1, 2, 3]}, scoring=token_r2_scorer,
                          cv=3).fit(X, Y)
    assert search.best_params_["rank"] >= 2
    assert search.cv_results_["mean_test_score"][1] > search.cv_results_["mean_test_score"][0]


def test_strict_level_is_floored_at_the_draws_resolution():
    # the default alpha (0.3%) puts alpha / 10 below the smallest Monte Carlo p-value 1/(B+1) of B = 1000 draws;
    # the strict level is then 1/B, so spikes beyond every draw still count in rank_interval_'s lower end
    alpha, draws = DEFAULT_CALIBRATION.rstar_alpha, DEFAULT_CALIBRATION.default_null_draws
    X, Y, V = _task(600, 6, 12, 4)
    est = RStarEstimator("linear_qk", value_map=V).fit(X, Y)
    assert est.n_null_draws in (None, draws) and est.alpha in (None, alpha) and alpha / 10 < 1 / (draws + 1)
    assert np.all(est.p_values_[:4] == pytest.approx(1 / (draws + 1)))
    assert est.rank_interval_[0] == est.rank_ == 4
