"""The factored least-squares softmax inversion: its gradients, its split-half test, its choice and its estimates."""

import pickle
import warnings

import numpy as np
import pytest

from rstar import NumericalRankEstimator, RStarEstimator, UnidentifiableRankWarning
from rstar.inversions._numerics import softmax_factored as sf
from rstar.inversions._numerics.linalg import psd_power
from rstar.budgets import CostBudget
from rstar.calibration import DEFAULT_CALIBRATION
from rstar.datasets import make_attention_task
from rstar.inversions import SplitHalfNull, WhitenedStatistic, choose_inversion
from rstar.inversions._kernel import SoftmaxOperator
from rstar.inversions.softmax_factored import FACTORED_NAME, factored_fit_blocker, factored_statistic, truncated_kernel
from rstar.risk import centred_sums, held_out_reach, total_sum_of_squares
from rstar.rules import MarchenkoPasturRule, split_half_result

from _reasons import assert_warned, reasons

# d = 96: the full least squares' information (8 d^4 bytes = 0.63 GiB) exceeds half the default memory budget
SHAPE = dict(seq_len=8, n_features=96, value_dim=8, noise=0.05)


def _task(rank, seed=0, n=600, **kw):
    return make_attention_task(n, rank=rank, random_state=seed, return_teacher=True, **{**SHAPE, **kw})


@pytest.mark.parametrize("causal", [False, True])
def test_factor_gradients_match_finite_differences(causal):
    rng = np.random.default_rng(0)
    n, T, d, d_v, q = 4, 5, 6, 3, 2
    X, Z, Y = rng.standard_normal((n, T, d)), rng.standard_normal((n, T, d_v)), rng.standard_normal((n, T, d_v))
    A, B = rng.standard_normal((d, q)), rng.standard_normal((d, q))
    mask = np.tril(np.ones((T, T), bool)) if causal else None
    f, gA, gB = sf.factored_loss(X, Z, Y, A, B, mask)
    assert f == pytest.approx(sf.factored_rss(X, Z, Y, A, B, mask))
    eps = 1e-6
    for grad, which in ((gA, 0), (gB, 1)):
        num = np.zeros_like(grad)
        for idx in np.ndindex(*grad.shape):
            E = np.zeros_like(A)
            E[idx] = eps
            args_p = (A + E, B) if which == 0 else (A, B + E)
            args_m = (A - E, B) if which == 0 else (A, B - E)
            num[idx] = (sf.factored_rss(X, Z, Y, *args_p, mask) - sf.factored_rss(X, Z, Y, *args_m, mask)) / (2 * eps)
        np.testing.assert_allclose(grad, num, rtol=1e-5, atol=1e-7)
    # with V fitted: the joint gradient in V (value path X V), against finite differences
    V = rng.standard_normal((d, d_v))
    fj, gAj, _, gV = sf.joint_loss(X, Y, A, B, V, mask)
    assert fj == pytest.approx(sf.factored_rss(X, X @ V, Y, A, B, mask))
    np.testing.assert_allclose(gAj, sf.factored_loss(X, X @ V, Y, A, B, mask)[1], rtol=1e-10)
    num = np.zeros_like(V)
    for idx in np.ndindex(*V.shape):
        E = np.zeros_like(V)
        E[idx] = eps
        num[idx] = (sf.factored_rss(X, X @ (V + E), Y, A, B, mask)
                    - sf.factored_rss(X, X @ (V - E), Y, A, B, mask)) / (2 * eps)
    np.testing.assert_allclose(gV, num, rtol=1e-5, atol=1e-7)
    # the d x d gradient of K at K = A B^T, against the factor gradients (grad_A = G B, grad_B = G^T A)
    G = sf.kernel_gradient(X, Z, Y, A, B, mask)
    np.testing.assert_allclose(G @ B, gA, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(G.T @ A, gB, rtol=1e-8, atol=1e-10)


def test_choice_at_a_d_whose_information_exceeds_the_budget():
    c = choose_inversion("softmax", shape=(8, 96, 8), n_samples=600, method="least_squares")
    assert c.name == FACTORED_NAME and not c.is_fallback and "d^2 x d^2 information" in c.reason
    # below its degrees of freedom, or over the compute budget: first order, and why
    few = choose_inversion("softmax", shape=(8, 96, 8), n_samples=20, method="least_squares")
    assert few.name == "softmax_first_order" and few.preferred == FACTORED_NAME and "degrees of freedom" in \
        few.fallback_reason
    tiny = CostBudget(multiply_adds=1e6)
    over = choose_inversion("softmax", shape=(8, 96, 8), n_samples=600, method="least_squares", budget=tiny)
    assert over.name == "softmax_first_order" and "compute budget" in over.fallback_reason
    # read in passes: the factored fit needs the samples in memory
    assert "in passes" in factored_fit_blocker(600, 8, 96, 8, samples_in_memory=False)
    # a d whose information fits: the full-rank least squares as before
    assert choose_inversion("softmax", shape=(32, 16, 16), n_samples=2000, method="least_squares").name == \
        "softmax_least_squares"


@pytest.mark.parametrize("known", [True, False])
def test_planted_rank_read_exactly_with_a_settled_count(known):
    X, Y, teacher = _task(3)
    est = RStarEstimator(value_map=teacher.value_map if known else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnidentifiableRankWarning)
        est.fit(X, Y)
    assert est.inversion_ == FACTORED_NAME and est.null_model_ == "split_half"
    assert est.rank_ == 3 and est.rank_interval_ == (3, 3)
    null = est.statistic_.null
    # the planted directions stand orders of magnitude above the half-difference; the fourth does not
    assert est.spectrum_[2] > 100 * null.null_eigenvalues[0] > 0
    assert est.spectrum_[3] < est.threshold_
    assert est.score(X, Y) > 0.98


def test_pure_noise_reads_zero():
    for seed in (0, 1):
        X, Y, _ = _task(0, seed=seed)
        est = RStarEstimator().fit(X, Y)
        assert est.inversion_ == FACTORED_NAME
        assert est.rank_ == 0 and est.rank_interval_ == (0, 0)


def test_rank_beyond_the_first_factors_doubles_them():
    X, Y, teacher = _task(10, n=800)
    est = RStarEstimator(value_map=teacher.value_map).fit(X, Y)
    # the first rank comes from the first-order split-half count: 10 directions, so q = 16 at once
    assert est.statistic_.null.fitted_rank == 16 and est.rank_ == 10
    # from q = 4 the fit fills it and doubles (4 -> 8 -> 16), each time from the fit at hand
    sx, sy = np.sqrt(np.mean(X**2)), np.sqrt(np.mean(Y**2))
    Xs, Ys, V = X / sx, Y / sy, teacher.value_map * (sx / sy)
    ws = factored_statistic(((Xs[1::2], Ys[1::2]), (Xs[::2], Ys[::2])), V, start_rank=4)
    assert ws.null.fitted_rank == 16
    assert split_half_result(ws).rank == 10


def test_a_class_bound_on_r_star_is_the_largest_rank_fitted_and_is_read_there():
    X, Y, teacher = _task(10, n=800)
    # max_rank = r*: the fit stops at q = 10 (not 16) and its full count is read, not warned as a cap
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnidentifiableRankWarning)
        est = RStarEstimator(value_map=teacher.value_map, max_rank=10).fit(X, Y)
    assert est.inversion_ == FACTORED_NAME and est.statistic_.null.fitted_rank == 10
    assert est.rank_ == 10 and est.rank_interval_ == (10, 10)
    # a bound above r*: the first rank (16, from the first-order count of 10) is cut to it; the same rank
    est = RStarEstimator(value_map=teacher.value_map, max_rank=12).fit(X, Y)
    assert est.statistic_.null.fitted_rank == 12 and est.rank_ == 10


def test_a_reading_beyond_max_rank_is_read_at_the_bound_and_warned():
    # max_rank below the data's rank: the curve of the halves' mean kernel (of rank up to 2 max_rank) reaches 1%
    # only beyond the bound; r*(1%) <= max_rank by the class, so the reading is the bound, warned, (0, max_rank)
    X, Y, teacher = _task(10, n=800)
    est = RStarEstimator(value_map=teacher.value_map, max_rank=6, tolerance=0.001,
                         calibration=DEFAULT_CALIBRATION.replace(factored_max_iter=20))
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est.fit(X, Y)
    assert np.argmax(est.risk_curve_upper_ <= 0.001) > 6          # the curve itself reads beyond the bound
    assert_warned(caught, "tolerance_beyond_class_bound", bounds=(0, 6), category=UnidentifiableRankWarning)
    assert est.rank_ == 6 and est.rank_interval_ == (0, 6)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        assert est.rank_at_tolerance(0.001, return_interval=True) == (6, (0, 6))
    assert_warned(caught, "tolerance_beyond_class_bound", bounds=(0, 6))
    # a tolerance the bound's models reach: no such verdict, the reading within the bound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank, (lo, hi) = est.rank_at_tolerance(0.2, return_interval=True)
    assert "tolerance_beyond_class_bound" not in reasons(caught) and rank <= hi <= 6


def test_factors_capped_by_the_budget_are_warned_with_an_interval_to_d():
    X, Y, teacher = _task(10, n=800)
    # enough for the first rank's start and two segments, not for a doubling
    budget = 1.3 * (sf.factored_start_cost(800, 8, 96, 8) + 2 * 50 * sf.factored_eval_cost(800, 8, 96, 8, 8)
                    + sf.token_metric_cost(800, 8, 96))
    est = RStarEstimator(value_map=teacher.value_map, compute_budget=budget)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est.fit(X, Y)
    assert_warned(caught, "split_half_at_cap", bounds=(None, 96), category=UnidentifiableRankWarning)
    assert est.inversion_ == FACTORED_NAME and est.statistic_.null.fitted_rank == 8
    assert est.rank_interval_[1] == 96 and est.rank_interval_[0] <= 10
    # r*(tolerance) measured against a fit that did not settle: warned, and its interval reaches d
    est.set_params(tolerance=0.05)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est.fit(X, Y)
    assert_warned(caught, "curve_against_unidentified_fit", bounds=(None, 96), category=UnidentifiableRankWarning)
    assert est.rank_interval_[1] == 96


def test_a_curve_against_an_unsettled_fit_reaches_the_class_bound_not_d():
    """max_rank is the class's bound on r* (a head's d_head): r*(tolerance) read off a curve measured against a
    fit that did not settle is warned with an interval up to that bound, as the noise-floor count's is — unless
    the rank read holds the tolerance on its own held-out risk (the curve plus the floor it subtracts), which
    bounds r*(tolerance) whatever the full model was."""
    X, Y, teacher = _task(10, n=800)
    cal = DEFAULT_CALIBRATION.replace(factored_max_iter=20)
    # the noise (0.05 of Y's scale) leaves the full models about 0.047 of Var(Y) held out: at 1% no rank's own
    # held-out risk is within the tolerance, so the reading is warned and reaches the bound
    est = RStarEstimator(value_map=teacher.value_map, max_rank=12, tolerance=0.01, calibration=cal)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est.fit(X, Y)
    assert_warned(caught, "factored_unsettled", category=UnidentifiableRankWarning)
    assert_warned(caught, "curve_against_unidentified_fit", bounds=(None, 12), category=UnidentifiableRankWarning)
    assert est.rank_interval_[1] == 12 and est.rank_interval_[0] <= est.rank_ <= 12
    assert 0.03 < est.risk_curve_floor_ < 0.07
    # at 10% the planted rank's own held-out risk is within it: read there, not warned for the curve (the
    # noise-floor count still is), and its interval ends at the held-out reach, not at the bound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank, (lo, hi) = est.rank_at_tolerance(0.1, return_interval=True)
    assert rank == 10 and lo <= 10 <= hi < 12
    assert "curve_against_unidentified_fit" not in reasons(caught)
    assert held_out_reach(est.risk_curve_upper_, est.risk_curve_floor_, est.risk_curve_floor_in_sample_, 0.1) == 10
    est.set_params(tolerance=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, Y)
    assert "factored_unsettled" in reasons(caught) and "curve_against_unidentified_fit" not in reasons(caught)
    assert est.rank_ == 10 and est.rank_interval_[1] < 12
    # a reading at 1% again through the gates: warned up to the bound
    with pytest.warns(UnidentifiableRankWarning) as caught:
        assert est.rank_at_tolerance(0.01, return_interval=True)[1][1] == 12
    assert_warned(caught, "curve_against_unidentified_fit", bounds=(None, 12))


@pytest.fixture(scope="module")
def unsettled_floor_fit():
    """A rank-10 head fitted with an iteration cap its halves do not settle within, a tolerance read off its curve:
    the estimator, the full models' held-out residual per sample and the total sum of squares they are relative to."""
    X, Y, teacher = _task(10, n=800)
    cal = DEFAULT_CALIBRATION.replace(factored_max_iter=20)
    est = RStarEstimator(value_map=teacher.value_map, max_rank=12, tolerance=0.1, calibration=cal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(X, Y)
    ws, halves = est._whitened[1], est._inv._halves(est._stats)
    full = est._inv.rank_residual_samples(est._stats, ws, [None], halves)[0]
    tss = total_sum_of_squares(tuple(a + b for a, b in zip(*(centred_sums(*h) for h in halves))))
    return est, full, tss


def test_the_held_out_reach_counts_the_floor_s_own_sampling_error(unsettled_floor_fit):
    """The rank whose models hold the tolerance on their own held-out risk adds the floor the curve subtracts, and
    that floor is a held-out estimate with an error of its own: the reach counts it at the curve's level
    (``risk_curve_floor_se_``, the floor's standard error over the samples), so an interval that ends at the reach
    does not end short of it by the floor's noise."""
    from scipy.stats import norm

    est, full, tss = unsettled_floor_fit
    assert np.isclose(est.risk_curve_floor_, full.sum() / tss)
    se = np.sqrt(full.size) * full.std(ddof=1) / tss
    assert np.isclose(est.risk_curve_floor_se_, se) and se > 0
    margin = norm.ppf(1 - est.tolerance_level) * se
    upper, floor, inside = est.risk_curve_upper_, est.risk_curve_floor_, est.risk_curve_floor_in_sample_
    # a tolerance the planted rank's models' own held-out risk reaches without the floor's margin, and not with it
    r = len(upper) - 1
    assert r == 10 and margin > 0
    tol = float(upper[r] + floor + margin / 2)
    assert held_out_reach(upper, floor, inside, tol) == r
    assert held_out_reach(upper, floor, inside, tol, margin) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank, (lo, hi) = est.rank_at_tolerance(tol, return_interval=True)
    # read at 10 off the curve, but those models are not known to hold it on their own: warned, up to the bound
    assert rank == r and hi == 12
    assert "curve_against_unidentified_fit" in reasons(caught)


def test_the_floor_s_standard_error_with_the_full_models_own_variability(unsettled_floor_fit):
    """``risk_curve_floor_fit_se_``: each block's floor is scored by the full model fitted on the other block, so
    the two blocks' mean residuals differ by the models' variability as well as the samples'; the floor's error
    with it is ``n |m_1 - m_2| / 2`` relative to TSS, at least its sampling error (``risk_curve_floor_se_``)."""
    est, full, tss = unsettled_floor_fit
    ws = est._whitened[1]
    n1, n2 = est._inv.cross_fit_blocks(est._stats, ws)
    assert n1 + n2 == full.size and n1 > 0 and n2 > 0
    between = full.size * abs(full[:n1].mean() - full[n1:].mean()) / (2 * tss)
    # the unsettled halves' models generalise unequally here: the models' own variability is the larger part
    assert between > 2 * est.risk_curve_floor_se_
    assert np.isclose(est.risk_curve_floor_fit_se_, between)
    # a curve measured in sample (no cross-fitting) has no such estimate
    assert NumericalRankEstimator(tolerance=0.05).fit(*_task(3, n=200)[:2]).risk_curve_floor_fit_se_ is None


def test_tolerance_curve_and_predict_survive_pickle():
    X, Y, teacher = _task(3, seed=2)
    est = RStarEstimator(value_map=teacher.value_map, tolerance=0.05).fit(X, Y)
    curve = est.risk_curve_
    assert curve[0] > curve[1] > curve[2] > curve[3] >= -1e-6
    assert est.rank_ <= 3 and est.noise_floor_rank_ == 3
    again = pickle.loads(pickle.dumps(est))
    np.testing.assert_allclose(again.predict(X[:5]), est.predict(X[:5]), rtol=1e-10)


def _statistic(signal, null_top, fitted_rank, rank_cap, p=20):
    lam = np.concatenate([signal, np.full(p - len(signal), 0.5 * null_top)])
    null = SplitHalfNull(null_eigenvalues=np.full(p, null_top) * np.linspace(1, 0.1, p), fitted_rank=fitted_rank,
                         rank_cap=rank_cap)
    return WhitenedStatistic(lam, np.eye(p), np.eye(p), 1000.0, null, FACTORED_NAME, (), [], "logit")


def test_split_half_rule_counts_above_the_margin():
    ws = _statistic([100.0, 9.0, 1.2], 1.0, fitted_rank=8, rank_cap=20)
    res = split_half_result(ws)
    # margin 1.5 on singular values: 2.25 on eigenvalues; 1.2 lies below the noise edge 1.25**2
    assert res.rank == 2 and res.rank_interval == (2, 2) and not res.warnings
    # one between the noise edge and the margin: warned, and with no gap at the noise edge the weaker directions
    # are not resolved either, so the interval reaches the fitted rank q = 8
    res = split_half_result(_statistic([100.0, 9.0, 2.0], 1.0, fitted_rank=8, rank_cap=20))
    assert res.rank == 2 and res.rank_interval == (2, 8)
    assert reasons(res.warnings) == {"split_half_band"} and res.warnings[0][0] is UnidentifiableRankWarning
    assert res.warnings[0].bounds == (None, 8)   # up to the fitted rank q = 8
    # ... but never below the band's own count, nor above max_rank
    res = split_half_result(_statistic([100.0, 9.0, 2.0, 2.0, 2.0], 1.0, fitted_rank=4, rank_cap=20))
    assert res.rank_interval == (2, 5)
    assert_warned(res.warnings, "split_half_band", bounds=(None, 5))   # the band's 5, not q = 4
    assert split_half_result(_statistic([100.0, 9.0, 2.0], 1.0, fitted_rank=8, rank_cap=20),
                             max_rank=5).rank_interval == (2, 5)
    assert MarchenkoPasturRule()(ws).rank == 2
    assert split_half_result(ws, max_rank=1).rank == 1
    # every fitted direction above the null at the largest rank the budget allowed: warned, up to d
    full = _statistic([9.0] * 8, 1.0, fitted_rank=8, rank_cap=8)
    res = split_half_result(full)
    assert res.rank == 8 and res.rank_interval == (8, 20)
    assert_warned(res.warnings, "split_half_at_cap", bounds=(None, 20), category=UnidentifiableRankWarning)


def test_causal_attention_is_fitted_with_its_mask():
    X, _, teacher = _task(3)
    clean = SoftmaxOperator(teacher.kernel, teacher.value_map, causal=True).predict(X)
    Y = clean + 0.05 * clean.std() * np.random.default_rng(0).standard_normal(clean.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnidentifiableRankWarning)
        est = RStarEstimator(causal=True).fit(X, Y)
    assert est.inversion_ == FACTORED_NAME and "causal" in est.inversion_reason_
    assert est.rank_ == 3 and est.rank_interval_ == (3, 3)
    assert est.score(X, Y) > 0.99
    # causal attention at a d whose information fits: still the factored fit (the full one has no mask)
    c = choose_inversion("softmax", shape=(8, 12, 8), n_samples=600, method="least_squares", causal=True)
    assert c.name == FACTORED_NAME
    with pytest.raises(ValueError, match="factored least squares only"):
        choose_inversion("softmax", shape=(8, 96, 8), n_samples=20, method="least_squares", causal=True)
    with pytest.raises(ValueError, match="causal=True"):
        RStarEstimator(operator="linear_qk", causal=True).fit(X, Y)


@pytest.mark.parametrize("known", [True, False])
def test_causal_windows_are_fitted_cut_short_first(known):
    """With coarse stages at 2 and 4 tokens (a calibration made for the test: the defaults start at 128 tokens) the
    causal factored fit runs them first at its first rank, records them, names them, and reads the planted rank as
    the fit without them does."""
    X, _, teacher = _task(3)
    clean = SoftmaxOperator(teacher.kernel, teacher.value_map, causal=True).predict(X)
    Y = clean + 0.05 * clean.std() * np.random.default_rng(0).standard_normal(clean.shape)
    cal = DEFAULT_CALIBRATION.replace(coarse_window_ratio=2, coarse_window_min_length=2)
    kw = dict(causal=True, value_map=teacher.value_map if known else None, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnidentifiableRankWarning)
        est = RStarEstimator(calibration=cal, **kw).fit(X, Y)
        plain = RStarEstimator(**kw).fit(X, Y)
    stages = [f.values for f in est._whitened[1].findings if f.kind == "factored_fit"][0]["coarse_windows"]
    assert [stage["length"] for stage in stages] == [2, 4]
    assert all(stage["iterations"] > 0 for stage in stages)
    assert "cut to 2, 4 tokens" in est.inversion_reason_ and "cut to" not in plain.inversion_reason_
    assert [f.values for f in plain._whitened[1].findings if f.kind == "factored_fit"][0]["coarse_windows"] == []
    assert (est.rank_, est.rank_interval_) == (plain.rank_, plain.rank_interval_) == (3, (3, 3))
    np.testing.assert_allclose(est.spectrum_[:3], plain.spectrum_[:3], rtol=0.05)


def test_a_count_that_does_not_settle_is_refitted_at_a_larger_rank():
    # A rank-q fit below r* has no stable optimum (a noise-free real head fitted at q = 8 kept sharpening); here
    # "settled" is made unreachable, so the first stage runs out of segments: with directions to spare (r* = 2
    # at q = 8) it waits them out at q = 8; counted as using all of them, q doubles after the calibration's
    # factored_unsettled_segments segments (the larger fit then stops on the loss tolerance).
    from rstar.calibration import DEFAULT_CALIBRATION

    X, Y, teacher = make_attention_task(600, seq_len=8, n_features=24, value_dim=8, noise=0.05, rank=2,
                                        random_state=0, return_teacher=True)
    halves = ((X[1::2], Y[1::2]), (X[0::2], Y[0::2]))
    settled = factored_statistic(halves, teacher.value_map)
    assert settled.null.fitted_rank == 8 and not settled.warnings
    # (plain L-BFGS: the scaled fit, factored_rescale_iter, converges within the segments the doubling waits for)
    unsettled = DEFAULT_CALIBRATION.replace(factored_stable_rtol=0.0, factored_rescale_iter=0)
    waited = factored_statistic(halves, teacher.value_map, calibration=unsettled)
    assert waited.null.fitted_rank == 8 and split_half_result(waited).rank == 2
    ws = factored_statistic(halves, teacher.value_map, calibration=unsettled.replace(factored_fill_ratio=0.0))
    assert ws.null.fitted_rank == 16
    assert split_half_result(ws).rank == 2   # the larger fit still reads r*


def test_tolerance_is_read_off_the_curves_upper_confidence_bound():
    # the factored fit measures its cross-fitted curve per sample: rank_ reads curve + z se at tolerance_level
    from scipy.stats import norm

    from rstar.risk import rank_at_tolerance

    X, Y, teacher = _task(3, seed=2)
    est = RStarEstimator(value_map=teacher.value_map, tolerance=0.05).fit(X, Y)
    curve, se, upper = est.risk_curve_, est.risk_curve_se_, est.risk_curve_upper_
    assert se.shape == curve.shape and np.all(se >= 0) and se[0] > 0
    assert se[-1] < se[0]   # where the rank-r model is the full one nearly, its per-sample differences vanish
    # and no lower than the bound on predict's own model's output distance from its full one (by hand)
    dist = est.risk_curve_distance_
    halves = est._inv._halves(est._stats)
    Xa = np.concatenate([h[0] for h in halves])
    Za = Xa @ est._inv.value_map
    tss = total_sum_of_squares(centred_sums(Xa, np.concatenate([h[1] for h in halves])))
    s = est.statistic_.null.singular_vectors[1]
    full = sf._attention(Xa, *truncated_kernel(est.statistic_, len(s))) @ Za
    per = np.array([np.sum((sf._attention(Xa, *truncated_kernel(est.statistic_, r)) @ Za - full) ** 2, axis=(1, 2))
                    for r in range(len(curve))])
    np.testing.assert_allclose(dist, per.sum(axis=1) / tss, rtol=1e-8, atol=1e-12)
    dist_se = np.sqrt(per.shape[1]) * per.std(axis=1, ddof=1) / tss
    np.testing.assert_allclose(upper, np.maximum(curve + norm.ppf(0.95) * se, dist + norm.ppf(0.95) * dist_se))
    assert np.all(dist[:-1] > 0) and np.any(dist > curve)
    assert est.rank_ == rank_at_tolerance(upper, 0.05) == est.rank_at_tolerance(0.05)
    # the interval's lower end is read off the curve itself, its upper end off the bound
    assert est.rank_interval_ == (rank_at_tolerance(curve, 0.1), rank_at_tolerance(upper, 0.025))
    point = RStarEstimator(value_map=teacher.value_map, tolerance=0.05, tolerance_level=0.5).fit(X, Y)
    np.testing.assert_allclose(point.risk_curve_upper_, np.maximum(point.risk_curve_, point.risk_curve_distance_))
    assert point.rank_ == rank_at_tolerance(curve, 0.05) <= est.rank_
    # the bound: one-sided level in (0, 0.5]
    with pytest.raises(ValueError, match="tolerance_level"):
        RStarEstimator(tolerance=0.05, tolerance_level=0.9).fit(X, Y)


def test_closed_form_curves_have_no_standard_error():
    X, Y = make_attention_task(300, kind="linear_qk", seq_len=12, n_features=6, rank=2, random_state=0)
    est = RStarEstimator("linear_qk", tolerance=0.05).fit(X, Y)
    assert est.risk_curve_se_ is None and est.risk_curve_distance_ is None
    np.testing.assert_array_equal(est.risk_curve_upper_, est.risk_curve_)


def test_halves_that_do_not_resolve_the_reading_tolerance_refit_wider_from_fresh_starts():
    # MiniLM's layer 1 head 8 settled at q = 8 with a count of 2 while its halves disagreed by 0.25 of Var(Y)
    # (each half's model left 0.95 of it on the other half); fitted afresh at q = 32 they agree to 0.008. Here the
    # count is held at 1 so that only the halves' failure to resolve the tolerance can widen the fit: from q = 2 below r* = 8 it
    # doubles while the cross-fitted residual falls, and the doubling past r* (which predicts the other half no
    # better) is undone.
    X, Y, teacher = make_attention_task(600, seq_len=8, n_features=24, value_dim=8, noise=0.05, rank=8,
                                        random_state=0, return_teacher=True)
    sx, sy = np.sqrt(np.mean(X**2)), np.sqrt(np.mean(Y**2))
    Xs, Ys, V = X / sx, Y / sy, teacher.value_map * (sx / sy)
    halves = ((Xs[1::2], Ys[1::2]), (Xs[0::2], Ys[0::2]))

    def one(s, edge, margin):
        return (1, 1)

    def fit(target, calibration=DEFAULT_CALIBRATION):
        ws = factored_statistic(halves, V, start_rank=2, stopping_count=one, reading_tolerance=target,
                                calibration=calibration)
        return ws, [f for f in ws.findings if f.kind == "factored_fit"][0].values["agreement"]

    ws, agreement = fit(None)
    assert ws.null.fitted_rank == 2 and agreement == []
    ws, agreement = fit(1e-6)
    assert [a["rank"] for a in agreement] == [2, 4, 8, 16] and ws.null.fitted_rank == 8
    held_out = [a["held_out"] for a in agreement]
    assert held_out[0] > held_out[1] > 0.1 > 0.01 > held_out[2] and held_out[3] >= held_out[2]
    assert agreement[3].get("undone") and not any(a.get("undone") for a in agreement[:3])
    assert agreement[2]["disagreement"] < 1e-4 < 0.01 < agreement[0]["disagreement"]
    # the kept fits are the rank-8 ones: their disagreement and cross-fitted floor are what was recorded
    from rstar.inversions.softmax_factored import factored_half_disagreement
    assert factored_half_disagreement(ws, halves, V) == pytest.approx(agreement[2]["disagreement"], rel=1e-9)
    # a tolerance the rank-8 fits resolve stops there (halves 4e-5 apart, floor gap 2e-4)
    ws, agreement = fit(1e-3)
    assert [a["rank"] for a in agreement] == [2, 4, 8] and ws.null.fitted_rank == 8
    assert 0 < agreement[2]["held_out"] - agreement[2]["in_sample"] < 1e-3 < agreement[0]["held_out"] - agreement[0][
        "in_sample"]
    # the floor gap alone (the halves' disagreement let through) widens the fit the same way: MiniLM's layer 0
    # head 9 stopped at q = 16 with halves 0.003 apart but a gap of 0.013, and read r*(1%) = 12 where its kernel
    # truncated to 12 held out 2.3%
    ws, gap_only = fit(1e-3, DEFAULT_CALIBRATION.replace(curve_resolution_fraction=1e6))
    assert [a["rank"] for a in gap_only] == [2, 4, 8] and ws.null.fitted_rank == 8


def test_halves_that_disagree_beyond_the_tolerance_are_warned():
    # the cross-fitted curve compares half models; where they disagree by more than half the tolerance it cannot
    # resolve it: warned, interval to d (a MiniLM head whose halves were 0.026 apart read 1.46% for 1%)
    from rstar.inversions.softmax_factored import factored_half_disagreement
    from rstar.risk import centred_sums, total_sum_of_squares

    X, Y, teacher = _task(3, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnidentifiableRankWarning)
        est = RStarEstimator(value_map=teacher.value_map, tolerance=0.01).fit(X, Y)
    assert est.rank_ == 3 and 0 < est.risk_curve_resolution_ < 0.005
    # by hand: a quarter of the halves' squared output difference over every sample, relative to TSS
    halves = est._inv._halves(est._stats)
    (A1, B1), (A2, B2) = est.statistic_.null.half_kernels
    V = est._inv.value_map
    diff = sum(np.sum((sf._attention(Xh, A1, B1) @ (Xh @ V) - sf._attention(Xh, A2, B2) @ (Xh @ V)) ** 2)
               for Xh, _ in halves)
    tss = sum(total_sum_of_squares(centred_sums(Xh, Yh)) for Xh, Yh in halves)
    assert est.risk_curve_resolution_ == pytest.approx(diff / (4 * tss), rel=1e-10)
    same = WhitenedStatistic(est.statistic_.eigenvalues, None, None, 1.0,
                             SplitHalfNull(half_kernels=((A1, B1), (A1, B1))), FACTORED_NAME)
    assert factored_half_disagreement(same, halves, V) == 0.0
    # few noisy samples: the halves' fits differ by far more than 1% of Var(Y)
    X, Y, teacher = make_attention_task(200, rank=3, random_state=0, return_teacher=True, **{**SHAPE, "noise": 0.5})
    with pytest.warns(UnidentifiableRankWarning) as caught:
        noisy = RStarEstimator(value_map=teacher.value_map, tolerance=0.01).fit(X, Y)
    assert_warned(caught, "curve_resolution", bounds=(0, SHAPE["n_features"]), category=UnidentifiableRankWarning)
    # halves that disagree have not found the model: neither end of the reading holds (a SmolLM2 head whose fit
    # had not converged read r*(1%) = 58 with the interval (53, 64) where its truncation rank was 32)
    assert noisy.risk_curve_resolution_ > 0.05 and noisy.rank_interval_ == (0, SHAPE["n_features"])
    # the curve stops at the half-sum's rank 2q, beyond which nothing changes (not at d = 96)
    q = noisy.statistic_.null.fitted_rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnidentifiableRankWarning)
        fine = RStarEstimator(value_map=teacher.value_map, tolerance=1e-9).fit(X, Y)
    assert 2 * q < SHAPE["n_features"] and len(fine.risk_curve_) == 2 * q + 1
    assert fine.rank_ <= 2 * q and fine.risk_curve_distance_[-1] < 1e-20
    # closed-form inversions measure no half models
    Xq, Yq = make_attention_task(300, kind="linear_qk", seq_len=12, n_features=6, rank=2, random_state=0)
    assert RStarEstimator("linear_qk", tolerance=0.05).fit(Xq, Yq).risk_curve_resolution_ is None


def test_each_block_runs_in_its_own_metric():
    # an ill-conditioned quadratic per block: whitening each block by its own Hessian leaves L-BFGS a sphere
    rng = np.random.default_rng(0)
    d = 6
    hessians, centres = [], []
    for scale in (1.0, 1e4):
        Q = np.linalg.qr(rng.standard_normal((d, d)))[0]
        hessians.append((Q * (scale * np.logspace(0, 3, d))) @ Q.T)
        centres.append(rng.standard_normal((d, 2)))

    def fun(blocks):
        out = [H @ (b - c) for H, b, c in zip(hessians, blocks, centres)]
        return sum(float(np.sum((b - c) * g)) for b, c, g in zip(blocks, centres, out)), [2 * g for g in out]

    start = [np.zeros((d, 2)), np.zeros((d, 2))]
    f0 = fun(start)[0]
    own = [(psd_power(H, -0.5), psd_power(H, 0.5)) for H in hessians]
    # stop once an iteration gains less than 1e-12 of the loss
    blocks, f, nit, _ = sf._minimize(fun, start, None, 50, 1e-12, 1, block_precondition=own)
    assert nit <= 4 and f < 1e-12 * f0
    for b, c in zip(blocks, centres):
        np.testing.assert_allclose(b, c, atol=1e-5)
    # a block left without its own metric takes the common one (here none): many more iterations
    _, _, nit_plain, _ = sf._minimize(fun, start, None, 500, 1e-12, 1, block_precondition=[own[0], None])
    assert nit_plain > 5 * nit


def test_value_map_metric_reaches_the_same_fit():
    # V fitted in its own normal-matrix metric (the default) or in the token metric: the same least squares
    X, Y = make_attention_task(400, seq_len=32, n_features=12, value_dim=4, rank=2, random_state=0)
    halves = ((X[::2], Y[::2]), (X[1::2], Y[1::2]))
    metric = sf.token_metric_roots(X)
    pre = (metric[1], metric[0])
    starts = []
    for Xh, Yh in halves:
        V0 = sf.value_map_given_kernel(Xh, Yh)
        starts.append(sf.gradient_start(Xh, Yh, sf.kernel_gradient(Xh, Xh @ V0, Yh), 4, None, None, pre))
    fits = [sf.fit_factored_pair(halves, 4, starts, max_iter=600, precondition=pre, value_precondition=vp)
            for vp in (True, False)]
    rss = [sum(f.rss for f in pair) for pair in fits]
    assert rss[0] == pytest.approx(rss[1], rel=1e-3)
    for a, b in zip(*fits):
        np.testing.assert_allclose(a.kernel, b.kernel, atol=0.05 * np.abs(b.kernel).max())


def _random_half(seed, n=30, T=6, d=10, d_v=4, q=3):
    """``(X, Y, A, B, V)``: one half's samples and factors, all standard normal."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, T, d)), rng.standard_normal((n, T, d_v)), rng.standard_normal((d, q)),
            rng.standard_normal((d, q)), rng.standard_normal((d, d_v)))


@pytest.mark.parametrize("causal", [False, True])
def test_torch_half_loss_agrees_with_numpy(causal):
    torch = pytest.importorskip("torch")
    from rstar._torch_backend.factored import FactoredHalfLoss

    X, Y, A, B, V = _random_half(1)
    T, d = X.shape[1:]
    mask = sf.causal_mask(T) if causal else None
    ref = sf.NumpyHalfLoss(X, Y, mask)
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        # chunks of 7 samples: the sums over chunks are those of one pass
        loss = FactoredHalfLoss(X, Y, mask, torch.device("cpu"), dtype, chunk_entries=7 * T * d)
        assert len(loss.parts) > 1
        for value_grad in (False, True):
            want, got = ref(A, B, V, value_grad), loss(A, B, V, value_grad)
            assert got[0] == pytest.approx(want[0], rel=rtol)
            for w, g in zip(want[1:3], got[1:3]):
                np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())
            if value_grad:
                np.testing.assert_allclose(got[3], want[3], rtol=rtol, atol=rtol * np.abs(want[3]).max())
            else:
                assert got[3] is None and want[3] is None
    # a new V is a new value path (the cached one is not reused)
    assert loss(A, B, 2 * V)[0] == pytest.approx(ref(A, B, 2 * V)[0], rel=1e-4)


@pytest.mark.parametrize("rotary", [False, True])
def test_torch_half_loss_in_a_basis_is_the_loss_of_the_basis_factors(rotary):
    # basis=P: the factors P A, P B, the gradients in A and B (P^T times the plain ones); the V path unchanged
    torch = pytest.importorskip("torch")
    from rstar._torch_backend.factored import FactoredHalfLoss
    from rstar.inversions._numerics.rotary import RotaryPositions

    X, Y, A, B, V = _random_half(2, q=4)
    T, d = X.shape[1:]
    P = np.random.default_rng(3).standard_normal((d, d))     # not symmetric: the gradient is P^T's, not P's
    pos = RotaryPositions(np.outer(np.arange(T), [1.0, 0.3])) if rotary else None
    loss = FactoredHalfLoss(X, Y, sf.causal_mask(T), torch.device("cpu"), torch.float64, chunk_entries=7 * T * d,
                            rotary=pos)
    for value_grad in (False, True):
        want, got = loss(P @ A, P @ B, V, value_grad), loss(A, B, V, value_grad, basis=P)
        assert got[0] == pytest.approx(want[0], rel=1e-10)
        for w, g in zip(want[1:3], got[1:3]):
            np.testing.assert_allclose(g, P.T @ w, rtol=1e-9, atol=1e-9 * np.abs(P.T @ w).max())
        if value_grad:
            np.testing.assert_allclose(got[3], want[3], rtol=1e-9)
    # a new basis is formed afresh, and None is the tokens themselves again
    assert loss(A, B, V, basis=2 * P)[0] == pytest.approx(loss(2 * P @ A, 2 * P @ B, V)[0], rel=1e-10)
    assert loss(A, B, V)[0] == pytest.approx(loss(A, B, V, basis=np.eye(d))[0], rel=1e-10)


@pytest.mark.parametrize("known", [True, False])
def test_a_fit_on_losses_in_the_preconditioned_basis_is_the_fit_without(known, monkeypatch):
    # torch's losses take the factors in L-BFGS's whitened coordinates (V known): the same iterations as the
    # losses that are given P A~ and return P grad, in float64 to round-off
    torch = pytest.importorskip("torch")
    from rstar._torch_backend.factored import FactoredHalfLoss

    rng = np.random.default_rng(5)
    X = rng.standard_normal((160, 6, 10)) * np.linspace(0.3, 3.0, 10)   # anisotropic tokens: P far from I
    Y = rng.standard_normal((160, 6, 4))
    halves = ((X[:80], Y[:80]), (X[80:], Y[80:]))
    V = rng.standard_normal((X.shape[2], Y.shape[2])) if known else None
    roots = sf.token_metric_roots_of_halves(halves)
    pre = (roots[1], roots[0])      # as the inversion's: L-BFGS on M^{1/2} A
    starts = [(rng.standard_normal((10, 3)) * 0.3, rng.standard_normal((10, 3)) * 0.3) for _ in halves]
    calls = []

    class Recording(FactoredHalfLoss):
        def __call__(self, *args, **kwargs):
            calls.append("basis" in kwargs)
            return super().__call__(*args, **kwargs)

    def fit(takes_basis):
        monkeypatch.setattr(Recording, "takes_basis", takes_basis)
        losses = [Recording(Xh, Yh, None, torch.device("cpu"), torch.float64, 10**6) for Xh, Yh in halves]
        calls.clear()
        fits = sf.fit_factored_pair(halves, 3, starts, value_map=V, max_iter=60, precondition=pre, losses=losses)
        return fits, set(calls)

    folded, used = fit(True)
    plain, unused = fit(False)
    assert used == {known} and unused == {False}     # the basis is used exactly where V is known
    for a, b in zip(folded, plain):
        assert a.n_iter == b.n_iter
        np.testing.assert_allclose(a.kernel, b.kernel, rtol=1e-6, atol=1e-8 * np.abs(b.kernel).max())
        assert a.rss == pytest.approx(b.rss, rel=1e-8)
    # the blocks in preconditioned coordinates need one common precondition to be in
    with pytest.raises(ValueError, match="one common precondition"):
        sf._minimize(lambda bl: (0.0, bl), [np.ones((10, 3))], None, 5, 1e-9, 1,
                     preconditioned_fun=lambda bl: (0.0, bl))


def test_split_half_values_are_the_singular_values_of_the_half_sum_and_difference():
    from rstar.inversions.softmax_factored import _split_half, _split_half_values

    rng = np.random.default_rng(2)
    d, q = 12, 3
    metric = sf.token_metric_roots(rng.standard_normal((50, 6, d)) @ np.diag(np.linspace(0.5, 2, d)))
    A1, B1, A2, B2 = (rng.standard_normal((d, q)) for _ in range(4))
    s, sd = _split_half_values([(A1, B1), (A2, B2)], metric)
    _, s_full, _, sd_full = _split_half(A1 @ B1.T, A2 @ B2.T, metric)
    assert s.shape == sd.shape == (d,)
    np.testing.assert_allclose(s, s_full, rtol=1e-10, atol=1e-10 * s_full[0])
    np.testing.assert_allclose(sd, sd_full, rtol=1e-10, atol=1e-10 * sd_full[0])


@pytest.mark.parametrize("r", [1, 3, 5])
def test_truncation_through_thin_qr_is_the_truncated_svd_in_the_token_metric(r):
    from rstar.inversions.softmax_factored import _truncation

    rng = np.random.default_rng(3)
    d, q = 12, 3
    metric = sf.token_metric_roots(rng.standard_normal((50, 6, d)) @ np.diag(np.linspace(0.5, 2, d)))
    Mq, Mq_inv, Mk, Mk_inv = metric
    A, B = rng.standard_normal((d, q)), rng.standard_normal((d, q))
    U, s, Wt = np.linalg.svd(Mq @ A @ B.T @ Mk)
    expected = Mq_inv @ (U[:, :r] * s[:r]) @ Wt[:r] @ Mk_inv
    A_r, B_r = _truncation(metric, A, B, r)
    assert A_r.shape == B_r.shape == (d, r)   # beyond q, zero directions
    np.testing.assert_allclose(A_r @ B_r.T, expected, rtol=0, atol=1e-10 * np.abs(expected).max())


def test_truncations_on_projected_tokens_match_their_factors():
    """With V known the risk curve's residuals and output distances are computed on the tokens' coordinates along
    each kernel's singular directions (once for every rank): they equal those of the truncated factors."""
    from rstar.inversions.softmax_factored import (_truncated_model, _truncation, factored_output_distances,
                                                   factored_rank_residuals)

    X, Y, teacher = _task(3, n=300)
    est = RStarEstimator(value_map=teacher.value_map, causal=True).fit(X, Y)
    ws, halves, Vi = est._whitened[1], est._inv._halves(est._stats), est._inv.value_map
    mask, q = sf.causal_mask(X.shape[1]), ws.null.half_kernels[0][0].shape[1]
    ranks = [0, 1, 3, q, q + 2, None]
    got = factored_rank_residuals(ws, halves, Vi, ranks, mask, per_sample=True)
    for r, g in zip(ranks, got):
        want = []
        for (A_h, B_h), (Xo, Yo) in zip(ws.null.half_kernels, halves[::-1]):
            Ar, Br = (A_h, B_h) if r is None else _truncation(ws.null.metric, A_h, B_h, r)
            want.append(sf.factored_sample_rss(Xo, Xo @ Vi, Yo, Ar, Br, mask))
        np.testing.assert_allclose(g, np.concatenate(want), rtol=1e-9, atol=1e-12)
    ranks, top = ranks[:-1], len(ws.null.singular_vectors[1])
    got = factored_output_distances(ws, halves[0], Vi, ranks, mask)
    X0 = halves[0][0]
    full = sf.factored_outputs(X0, X0 @ Vi, *_truncated_model(ws, halves[0], Vi, top, mask)[:2], mask)
    for r, g in zip(ranks, got):
        Ar, Br, _ = _truncated_model(ws, halves[0], Vi, min(r, top), mask)
        np.testing.assert_allclose(g, sf.factored_sample_rss(X0, X0 @ Vi, full, Ar, Br, mask), rtol=1e-9,
                                   atol=1e-12)


@pytest.mark.parametrize("known", [True, False])
def test_output_distances_and_operator_read_the_halves_as_the_joined_samples(known):
    """The output distances and ``predict``'s operator read the kept halves part by part (no joined copy of the
    samples): the same per-sample distances, in the halves' order, and the same refitted V as on the joined
    samples."""
    from rstar.inversions.softmax_factored import factored_operator, factored_output_distances

    X, Y, teacher = _task(3, n=300)
    est = RStarEstimator(value_map=teacher.value_map if known else None, causal=True).fit(X, Y)
    ws, halves = est._whitened[1], est._inv._halves(est._stats)
    Vi, mask = est._inv.value_map, sf.causal_mask(X.shape[1])
    joined = tuple(np.concatenate(a) for a in zip(*halves))
    ranks = [0, 1, 3, 5]
    for g, w in zip(factored_output_distances(ws, halves, Vi, ranks, mask),
                    factored_output_distances(ws, joined, Vi, ranks, mask)):
        assert g.shape == (300,)
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-12)
    for a, b in zip(factored_operator(ws, halves, Vi, 3, mask), factored_operator(ws, joined, Vi, 3, mask)):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-12 * np.abs(b).max())


@pytest.mark.parametrize("known", [True, False])
def test_factored_fit_on_torch_reads_what_numpy_reads(known):
    torch = pytest.importorskip("torch")
    X, Y, t = _task(3)
    kw = dict(value_map=t.value_map, tolerance=0.05) if known else dict(tolerance=0.05)
    ref = RStarEstimator(**kw).fit(X, Y)
    est = RStarEstimator(device=torch.device("cpu"), **kw).fit(X, Y)
    assert ref.inversion_ == est.inversion_ == FACTORED_NAME
    assert est.noise_floor_rank_ == ref.noise_floor_rank_ == 3
    assert est.noise_floor_interval_ == ref.noise_floor_interval_
    # float32 evaluations: the fit stops within the optimiser's tolerance of numpy's, not at its round-off
    np.testing.assert_allclose(est.spectrum_[:3], ref.spectrum_[:3], rtol=0.02)
    assert est.rank_ == ref.rank_ and est.rank_at_tolerance(0.01) == ref.rank_at_tolerance(0.01)


def test_auto_compute_budget_lets_the_factored_fit_reach_the_rank_a_fixed_one_caps():
    from rstar.inversions.softmax_factored import _stage_cost

    X, Y, _ = _task(8)
    n, T, d = X.shape
    tight = 1.05 * _stage_cost(n, T, d, Y.shape[2], 8, False)   # the first rank's stage, no doubling
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capped = RStarEstimator(compute_budget=tight).fit(X, Y)
    assert capped.inversion_ == FACTORED_NAME
    assert "split_half_at_cap" in reasons(caught) and capped.rank_interval_ == (0, d)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = RStarEstimator().fit(X, Y)   # compute_budget="auto"
    assert est.compute_budget == "auto" and est.inversion_ == FACTORED_NAME
    assert est.rank_ == 8 and est.rank_interval_ == (8, 8)
    assert not reasons(caught)


def test_auto_budget_chooses_within_the_calibrations_and_fits_to_the_iteration_caps():
    from rstar.estimators import _budget_config

    budget = CostBudget(*_budget_config(2**20, "auto", DEFAULT_CALIBRATION))
    assert budget.multiply_adds == DEFAULT_CALIBRATION.compute_budget and budget.fit_scales
    assert budget.allows_fit_compute(1e30) and not budget.allows_compute(1e30)
    assert "compute_budget='auto'" in budget.describe()
    fixed = CostBudget(*_budget_config(2**20, 1e9, DEFAULT_CALIBRATION))
    assert not fixed.fit_scales and fixed.allows_fit_compute(1e9) and not fixed.allows_fit_compute(2e9)
    with pytest.raises(ValueError, match="compute_budget"):
        RStarEstimator(compute_budget="fast").fit(*_task(1)[:2])


def test_query_key_factors_are_the_predict_model_and_its_token_metric_truncations():
    X, Y, teacher = _task(3, seed=2)
    scale = 3.0   # the factors are in the units of the X given to fit
    est = RStarEstimator(value_map=teacher.value_map / scale, tolerance=0.05, random_state=0).fit(X * scale, Y)
    assert est.inversion_ == FACTORED_NAME
    A, B = est.query_key_factors()
    assert A.shape == B.shape == (96, est.rank_)
    # predict's model: softmax(X A B^T X^T / sqrt(d)) X V
    S = SoftmaxOperator(A @ B.T, teacher.value_map / scale).predict(X * scale)
    np.testing.assert_allclose(est.predict(X[:20] * scale), S[:20], rtol=1e-8, atol=1e-10)
    rel = np.linalg.norm(A @ B.T * scale ** 2 - teacher.kernel) / np.linalg.norm(teacher.kernel)
    assert rel < 0.05
    # the widest model truncated in the token metric is the fit's own model at that rank
    wide = est.query_key_factors(96)
    roots = sf.token_metric_roots(X * scale)
    from rstar.heads import truncated_head_factors
    for r in (1, 2):
        q, k = truncated_head_factors(*wide, r, roots)
        A_r, B_r = est.query_key_factors(r)
        np.testing.assert_allclose(q @ k.T, A_r @ B_r.T, rtol=1e-6, atol=1e-9 * np.abs(A_r @ B_r.T).max())
    for bad in (-1, 97, 2.5, True):
        with pytest.raises(ValueError, match="rank must be a whole number"):
            est.query_key_factors(bad)


def test_the_cross_fitted_curve_reports_the_floor_it_subtracts_and_its_in_sample_side():
    # the curve's excess is RSS(r) / TSS minus the full models' held-out RSS / TSS; the same models on their own
    # halves fit better, and the noise (the best model's risk) lies between the two
    X, Y, teacher = _task(3, seed=1, noise=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnidentifiableRankWarning)
        est = RStarEstimator(value_map=teacher.value_map, tolerance=0.05).fit(X, Y)
    halves = est._inv._halves(est._stats)
    V = est._inv.value_map
    kernels = est.statistic_.null.half_kernels

    def rss(Xh, Yh, A, B):
        return float(np.sum((sf._attention(Xh, A, B) @ (Xh @ V) - Yh) ** 2))

    tss = total_sum_of_squares(centred_sums(None, np.concatenate([Yh for _, Yh in halves])))
    held = sum(rss(*halves[1 - h], *kernels[h]) for h in range(2)) / tss
    own = sum(rss(*halves[h], *kernels[h]) for h in range(2)) / tss
    assert est.risk_curve_floor_ == pytest.approx(held, rel=1e-8)
    assert est.risk_curve_floor_in_sample_ == pytest.approx(own, rel=1e-8)
    noise = len(X) * teacher.noise_floor / total_sum_of_squares(centred_sums(X, Y))
    assert est.risk_curve_floor_in_sample_ < noise < est.risk_curve_floor_
    # each point of the curve is its rank's held-out RSS over TSS less that floor
    full = est.risk_curve_[-1] + est.risk_curve_floor_
    assert full == pytest.approx(held, rel=1e-6)
    # a tolerance finer than the floor's gap is warned (the curve may understate the excess by that much) and its
    # interval reaches d; a coarser one is not
    gap = est.risk_curve_floor_ - est.risk_curve_floor_in_sample_

    def floor_warnings(tol):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, interval = est.rank_at_tolerance(tol, return_interval=True)
        return [w for w in caught if "floor is known" in str(w.message)], interval

    fine, interval = floor_warnings(0.9 * gap)
    assert len(fine) == 1 and interval[1] == SHAPE["n_features"]
    assert floor_warnings(1.1 * gap)[0] == []
    # closed-form curves are measured in sample: no second side
    Xq, Yq = make_attention_task(300, kind="linear_qk", seq_len=12, n_features=6, rank=2, random_state=0)
    lin = RStarEstimator("linear_qk", tolerance=0.05).fit(Xq, Yq)
    assert lin.risk_curve_floor_in_sample_ is None and 0 < lin.risk_curve_floor_ < 1


def test_the_cross_fitted_curve_s_fit_error_is_the_halves_difference():
    # the curve's samples come as the second half under the first half's model, then the first under the second's;
    # risk_curve_fit_se_ sets the two blocks' mean excess against each other (at least the per-sample error)
    X, Y, teacher = _task(3, seed=1, n=301, noise=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnidentifiableRankWarning)
        est = RStarEstimator(value_map=teacher.value_map, tolerance=0.05).fit(X, Y)
    halves = est._inv._halves(est._stats)
    blocks = est._inv.cross_fit_blocks(est._stats, est.statistic_)
    assert blocks == (len(halves[1][0]), len(halves[0][0])) and blocks[0] != blocks[1]
    (A1, B1), _ = est.statistic_.null.half_kernels
    V = est._inv.value_map
    full, *ranked = est._inv.rank_residual_samples(est._stats, est.statistic_, [None, 0, 1, 2, 3, 4, 5])
    X2, Y2 = halves[1]
    own = np.sum((sf._attention(X2, A1, B1) @ (X2 @ V) - Y2) ** 2, axis=(1, 2))
    assert np.allclose(full[:blocks[0]], own)
    tss = total_sum_of_squares(centred_sums(None, np.concatenate([Yh for _, Yh in halves])))
    diff = np.array(ranked) - full
    between = len(X) * np.abs(diff[:, :blocks[0]].mean(1) - diff[:, blocks[0]:].mean(1)) / (2 * tss)
    # ranks 0-2: the sampling error is the larger; ranks 3-5: the blocks' difference (0.0098 against 0.0045 at 3)
    assert np.all(between[3:] > est.risk_curve_se_[3:6])
    assert np.allclose(est.risk_curve_fit_se_[:6], np.maximum(est.risk_curve_se_[:6], between))
    assert np.all(est.risk_curve_fit_se_ >= est.risk_curve_se_)
    assert est.risk_curve_fit_se_.shape == est.risk_curve_.shape
    # closed-form curves are not cross-fitted: no fit error to report
    Xq, Yq = make_attention_task(300, kind="linear_qk", seq_len=12, n_features=6, rank=2, random_state=0)
    assert RStarEstimator("linear_qk", tolerance=0.05).fit(Xq, Yq).risk_curve_fit_se_ is None


def test_balanced_factors_keep_the_kernel_and_scale_by_its_singular_values():
    rng = np.random.default_rng(3)
    A, B = rng.standard_normal((12, 4)) * [10.0, 3.0, 1.0, 0.1], rng.standard_normal((12, 4))
    At, Bt, scale = sf.balanced_factor_scales(A, B, 0.01)
    np.testing.assert_allclose(At @ Bt.T, A @ B.T, atol=1e-10)
    s = np.linalg.svd(A @ B.T, compute_uv=False)[:4]
    np.testing.assert_allclose(At.T @ At, np.diag(s), atol=1e-9)
    np.testing.assert_allclose(Bt.T @ Bt, np.diag(s), atol=1e-9)
    np.testing.assert_allclose(scale, 1.0 / np.sqrt(s + 0.01 * s[0]))
    # a zero kernel has nothing to balance: returned as given, unit scales
    Z = np.zeros((12, 4))
    Za, Zb, unit = sf.balanced_factor_scales(Z, Z, 0.01)
    assert np.all(Za == 0) and np.all(Zb == 0) and np.all(unit == 1.0)


def _factorisation_problem(seed=0, d=30, q=3):
    """f(A, B) = ||A B^T - M||^2 for an ill-conditioned rank-q M (singular values 100, 1, 0.01)."""
    rng = np.random.default_rng(seed)
    U, _ = np.linalg.qr(rng.standard_normal((d, q)))
    W, _ = np.linalg.qr(rng.standard_normal((d, q)))
    M = (U * [100.0, 1.0, 0.01]) @ W.T

    def fun(blocks):
        A, B = blocks
        R = A @ B.T - M
        return float(np.sum(R * R)), [2 * R @ B, 2 * R.T @ A]

    start = [rng.standard_normal((d, q)) * 0.1, rng.standard_normal((d, q)) * 0.1]
    return fun, start


def test_scaled_factors_fit_an_ill_conditioned_kernel_further_in_the_same_iterations():
    # the same kernel and loss either way; balanced and scaled factors reach the weak direction (0.01 of the
    # strongest) that plain L-BFGS on the factors has not fitted in the same iterations
    fun, start = _factorisation_problem()
    checks = []
    _, f_plain, _, _ = sf._minimize(fun, start, None, 60, 0.0, 1)
    blocks, f_scaled, nit, _ = sf._minimize(fun, start, None, 60, 0.0, 1, factor_pairs=((0, 1),), rescale_every=20,
                                            damping=0.01, memory=20,
                                            on_check=lambda bl, n: checks.append(n) and False, check_every=10)
    assert f_scaled < 1e-3 * f_plain
    # the checks fall on the run's own iteration count across the restarts (every 10, restarts every 20)
    assert checks == list(range(10, nit + 1, 10))
    assert fun(blocks)[0] == pytest.approx(f_scaled)


def test_rotary_fits_keep_their_planes_unscaled(monkeypatch):
    # a rotary head's columns are planes: fit_factored_pair asks for no factor pairs there, and for both halves'
    # pairs without rotation; factored_rescale_iter = 0 asks for none
    seen = []
    original = sf._minimize

    def spy(*args, **kw):
        seen.append((kw.get("factor_pairs"), kw.get("memory")))
        return original(*args, **kw)

    monkeypatch.setattr(sf, "_minimize", spy)
    from rstar.inversions._numerics.rotary import RotaryPositions

    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((20, 6, 8)), rng.standard_normal((20, 6, 3))
    V = rng.standard_normal((8, 3))
    halves = ((X[::2], Y[::2]), (X[1::2], Y[1::2]))
    starts = [(rng.standard_normal((8, 2)) * 0.1, rng.standard_normal((8, 2)) * 0.1)] * 2
    sf.fit_factored_pair(halves, 2, starts, value_map=V, max_iter=3)
    sf.fit_factored_pair(halves, 2, starts, value_map=V, max_iter=3,
                         calibration=DEFAULT_CALIBRATION.replace(factored_rescale_iter=0))
    rot = RotaryPositions.from_frequencies(np.array([0.5]), 6)
    sf.fit_factored_pair(halves, 2, starts, value_map=V, max_iter=3, rotary=rot)
    assert seen == [(((0, 1), (2, 3)), DEFAULT_CALIBRATION.factored_scaled_memory), ((), 20), ((), 20)]
