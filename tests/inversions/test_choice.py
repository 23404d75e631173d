"""The choice of inversion, made once and in the open: every branch of the decision table and every fallback.

Each branch is fitted through the public estimators and read off ``inversion_``; each fallback is forced with a
small ``memory_budget`` / ``compute_budget`` or too few samples and must warn with the inversion it ran instead.
"""

import pickle
import warnings

import numpy as np
import pytest

from rstar import (
    EnergyRankEstimator,
    InversionFallbackWarning,
    MPRankEstimator,
    NumericalRankEstimator,
    RStarEstimator,
    SoftmaxInversionEstimator,
    UnidentifiableRankWarning,
)
from rstar.baselines import BaselineRule
from rstar.budgets import CostBudget, cross_fit_als_cost, softmax_fit_cost
from rstar.calibration import DEFAULT_CALIBRATION
from rstar.datasets import make_attention_task, make_linear_proxy
from rstar.inversions import (
    INVERSIONS,
    UnsupportedNullModelError,
    choose_inversion,
    decision_table,
    decision_table_markdown,
)
from rstar.rules import MarchenkoPasturRule

from _reasons import assert_warned


def _fit(est, X, Y, partial=False):
    """Fit (or partial_fit), returning the warnings raised (``warnings.WarningMessage``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (est.partial_fit if partial else est.fit)(X, Y)
    return caught


def _fallbacks(caught):
    """The messages of the budget fallbacks (InversionFallbackWarning: no reason field; the message names the
    budget or the inversion not used)."""
    return [str(w.message) for w in caught if issubclass(w.category, InversionFallbackWarning)]


def _qk(n, T, d, d_v, rank=2, seed=0, **kw):
    return make_attention_task(n, kind="linear_qk", seq_len=T, n_features=d, value_dim=d_v, rank=rank, noise=0.05,
                               random_state=seed, return_teacher=True, **kw)


# -- every branch of the decision table, through the estimators ----------------------------------------------


def test_linear_proxy_branch():
    X, Y = make_linear_proxy(400, rank=3, random_state=0)
    est = MPRankEstimator()
    caught = _fit(est, X, Y)
    assert (est.inversion_, est.null_model_, est.noise_source_) == ("token", "wishart", "regression residual")
    assert not _fallbacks(caught) and est.rank_ == 3


def test_linear_qk_known_value_map_branch_and_its_sample_fallback():
    X, Y, t = _qk(300, 3, 8, 8)
    est = RStarEstimator("linear_qk", value_map=t.value_map)
    assert not _fallbacks(_fit(est, X, Y))
    assert (est.inversion_, est.null_model_, est.noise_source_) == ("query_key_least_squares", "simulated",
                                                                    "least-squares residual")
    assert est.rank_ == 2
    # 6 samples of 3 tokens cannot identify the 64 entries of K (it needs 9): first order, and the warning says so
    est = RStarEstimator("linear_qk", value_map=t.value_map)
    messages = _fallbacks(_fit(est, X[:6], Y[:6]))
    assert est.inversion_ == "query_key_first_order" and len(messages) == 1
    assert "query_key_least_squares inversion not used" in messages[0] and "too few" in messages[0]
    assert est.inversion_reason_.startswith("query_key_least_squares inversion not used")


@pytest.mark.parametrize("T, d_v", [(6, 8), (16, 4)])   # T <= d, and T > d with d_v < d
def test_linear_qk_unknown_value_map_cross_fit_branches(T, d_v):
    X, Y, _ = _qk(400, T, 8, d_v)
    est = RStarEstimator("linear_qk")
    assert not _fallbacks(_fit(est, X, Y))
    assert (est.inversion_, est.null_model_) == ("query_key_cross_fit", "cross_fit_union")
    assert est.inversion_ == choose_inversion("linear_qk", shape=(T, 8, d_v), n_samples=400).name


def test_linear_qk_first_order_branch_is_no_fallback():
    X, Y, _ = _qk(300, 16, 8, 8)
    est = RStarEstimator("linear_qk")
    assert not _fallbacks(_fit(est, X, Y))
    assert (est.inversion_, est.null_model_, est.noise_source_) == ("query_key_first_order", "wishart",
                                                                    "residual outside col(X_i)")
    assert est.rank_ == 2


def test_softmax_branches():
    X, Y, t = make_attention_task(600, seq_len=6, n_features=12, rank=2, random_state=0, return_teacher=True)
    exact = SoftmaxInversionEstimator(value_map=t.value_map)
    assert not _fallbacks(_fit(exact, X, Y))
    assert (exact.inversion_, exact.null_model_, exact.noise_source_) == ("softmax_exact", "wishart",
                                                                          "split-half draw")
    first = SoftmaxInversionEstimator()
    _fit(first, X, Y)
    assert (first.inversion_, first.null_model_) == ("softmax_first_order", "structured_bulk")
    X, Y, t = make_attention_task(600, seq_len=12, n_features=6, rank=2, noise=0.05, random_state=0,
                                  return_teacher=True)
    ls = RStarEstimator()
    assert not _fallbacks(_fit(ls, X, Y))
    assert (ls.inversion_, ls.null_model_) == ("softmax_least_squares", "simulated") and ls.rank_ == 2
    # a known V with T > 0.9 min(d, d_v): the paper's first order, by design (no fallback), and V unused says so
    known = SoftmaxInversionEstimator(value_map=t.value_map)
    caught = _fit(known, X, Y)
    assert known.inversion_ == "softmax_first_order" and not _fallbacks(caught)
    assert any("value_map is not used" in str(w.message) for w in caught)   # a UserWarning about a parameter


# -- every fallback, forced by a budget ---------------------------------------------------------------------


def test_token_moment_sums_over_budget_warn():
    X, Y = make_linear_proxy(400, seq_len=8, n_features=40, value_dim=8, rank=3, random_state=0)
    ref = MPRankEstimator().fit(X, Y)
    # (T d)^2 = 320^2 entries = 800 KiB per array, over half a 1.5 MiB budget, which still keeps the 1.2 MiB of
    # samples for the coherent statistic
    est = MPRankEstimator(memory_budget=3 * 2**19)
    messages = _fallbacks(_fit(est, X, Y))
    assert len(messages) == 1 and "noise level comes from the bulk" in messages[0]
    assert est.inversion_ == "token" and est.noise_source_ == "bulk" and ref.noise_source_ == "regression residual"
    assert est.rank_ == ref.rank_ == 3
    with pytest.raises(ValueError, match="predict is not available"):
        est.predict(X[:2])
    # a 1 MiB budget cannot keep the samples either: no coherent statistic, also said
    est = MPRankEstimator(memory_budget=2**20)
    messages = _fallbacks(_fit(est, X, Y))
    assert len(messages) == 2 and "coherent split-half statistic" in messages[1]


def test_least_squares_query_key_over_memory_budget():
    X, Y, t = _qk(300, 6, 8, 8)
    # its 8^4-entry normal matrix is 32 KiB: a 32 KiB budget (16 KiB per matrix) rules it out
    est = MPRankEstimator("linear_qk", value_map=t.value_map, memory_budget=2**15)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "query_key_first_order" and "memory budget" in messages[0]
    with pytest.raises(ValueError, match="memory budget"):
        choose_inversion("linear_qk", value_map_known=True, shape=(6, 8, 8), method="exact",
                         budget=CostBudget(memory_bytes=2**15))


def test_cross_fit_fallbacks_name_their_budget():
    X, Y, _ = _qk(400, 6, 8, 8)
    ref = RStarEstimator("linear_qk").fit(X, Y)
    # samples: 8 * 400 * 6 * 16 = 300 KiB > 256 KiB (the 8^4 normal matrices, 32 KiB, still fit)
    est = RStarEstimator("linear_qk", memory_budget=2**18)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "query_key_first_order" and "keeping the 400 samples" in messages[0]
    # compute: below the alternating least squares' and the profiled fit's cost
    budget = cross_fit_als_cost(400, 8) - 1
    est = RStarEstimator("linear_qk", compute_budget=min(budget, 1000))
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "query_key_first_order" and "compute budget" in messages[0]
    assert ref.inversion_ == "query_key_cross_fit"
    # memory for its d^2 x d^2 normal matrices: 8^4 entries = 32 KiB, over half a 32 KiB budget
    est = RStarEstimator("linear_qk", memory_budget=2**15)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "query_key_first_order" and "normal matrices" in messages[0]


def test_exact_softmax_over_memory_budget():
    X, Y, t = make_attention_task(300, seq_len=6, n_features=12, rank=2, random_state=0, return_teacher=True)
    est = SoftmaxInversionEstimator(value_map=t.value_map, memory_budget=2**20)   # 12^4 * 8 = 162 KiB > 128 KiB
    est.set_params(memory_budget=2**18)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "softmax_first_order" and "softmax_exact inversion not used" in messages[0]
    with pytest.raises(ValueError, match="memory budget"):
        SoftmaxInversionEstimator(value_map=t.value_map, method="exact", memory_budget=2**18).fit(X, Y)


def test_softmax_least_squares_over_budgets():
    X, Y = make_attention_task(300, seq_len=12, n_features=6, rank=2, noise=0.05, random_state=0)
    # kept samples: 8 * 300 * 12 * 12 = 338 KiB; 256 KiB keep the first 227: the least squares is fitted on them,
    # exactly as fit on them alone, and says so
    est = RStarEstimator(memory_budget=2**18)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "softmax_least_squares" and "fitted on the first 227" in messages[0]
    alone = RStarEstimator(memory_budget=2**18).fit(X[:227], Y[:227])
    assert est.rank_ == alone.rank_ and est.n_samples_seen_ == 300
    np.testing.assert_allclose(est.spectrum_, alone.spectrum_, rtol=1e-8, atol=1e-10 * alone.spectrum_[0])
    np.testing.assert_allclose(est.predict(X[:5]), alone.predict(X[:5]), rtol=1e-8)
    # so in a stream: partial_fit keeps the first 227 and no more
    stream = RStarEstimator(memory_budget=2**18)
    for i in range(0, 300, 70):
        _fit(stream, X[i:i + 70], Y[i:i + 70], partial=True)
    np.testing.assert_allclose(stream.spectrum_, alone.spectrum_, rtol=1e-8, atol=1e-10 * alone.spectrum_[0])
    # a budget below the d^2 x d^2 information (8 d^4 = 10 KiB > 8 KiB): the factored least squares, on the
    # first 14 samples that fit it
    est = RStarEstimator(memory_budget=2**14)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "softmax_factored_least_squares" and "fitted on the first 14" in messages[0]
    assert est.rank_ == 2
    # too few samples fit the budget for it: first order, and why
    est = RStarEstimator(memory_budget=2**11)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "softmax_first_order" and "degrees of freedom" in messages[0]
    # over the compute budget likewise: the first 299 samples are within it
    est = RStarEstimator(compute_budget=softmax_fit_cost(300, 12, 6, 6) - 1)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "softmax_least_squares" and "compute budget" in messages[0]
    assert "fitted on the first 299" in messages[0]
    est = RStarEstimator(compute_budget=softmax_fit_cost(1, 12, 6, 6))
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "softmax_first_order" and "exceeds the compute budget" in messages[0]


def test_no_value_signal_falls_back_with_a_warning():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((300, 12, 6))
    est = RStarEstimator()
    caught = _fit(est, X, rng.standard_normal((300, 12, 6)))
    assert est.inversion_ == "softmax_first_order"
    hit = assert_warned(caught, "no_value_signal", category=UnidentifiableRankWarning)
    assert est.statistic_.fallback.kind == "no_value_signal" and est.inversion_reason_ == str(hit.message)


# -- the choice function itself ---------------------------------------------------------------------------


def test_choose_inversion_is_pure_and_checks_its_arguments():
    a = choose_inversion("linear_qk", shape=(6, 12, 12), n_samples=8)
    b = choose_inversion("linear_qk", shape=(6, 12, 12), n_samples=8)
    assert a == b and a.is_fallback and a.preferred == "query_key_cross_fit"
    with pytest.raises(ValueError, match="operator"):
        choose_inversion("bilinear", shape=(4, 4, 4))
    with pytest.raises(ValueError, match="method"):
        choose_inversion("softmax", shape=(4, 4, 4), method="magic")
    with pytest.raises(ValueError, match="least_squares"):
        choose_inversion("linear_qk", shape=(4, 4, 4), method="least_squares")
    with pytest.raises(ValueError, match="value_map"):
        choose_inversion("linear_qk", shape=(4, 4, 4), method="exact")


def test_decision_table_is_the_choice_function():
    for method in ("auto", "least_squares", "first_order"):
        for row in decision_table(method):
            assert row["inversion"] in INVERSIONS
            T, d, d_v = (int(part.split("=")[1]) for part in row["example"].split(", "))
            known = row["value_map"] == "known"
            assert row["inversion"] == choose_inversion(row["operator"], value_map_known=known, shape=(T, d, d_v),
                                                        n_samples=10_000, method=method).name
    table = decision_table_markdown()
    assert table.count("\n") == 2 + len(decision_table("auto")) + len(decision_table("least_squares")) - 1


# -- randomness and draws as parameters ----------------------------------------------------------------------


def test_random_state_seeds_the_null_draws():
    X, Y, t = _qk(300, 6, 8, 8, rank=1)
    default = RStarEstimator("linear_qk", value_map=t.value_map).fit(X, Y)
    same = RStarEstimator("linear_qk", value_map=t.value_map, random_state=DEFAULT_CALIBRATION.default_seed).fit(X, Y)
    other = RStarEstimator("linear_qk", value_map=t.value_map, random_state=1).fit(X, Y)
    np.testing.assert_array_equal(default.p_values_, same.p_values_)
    assert not np.array_equal(default.statistic_.null.draws, other.statistic_.null.draws)
    assert default.rank_ == other.rank_ == 1
    # a RandomState is drawn from once per fit, so a fit with it is reproducible from the same state
    a = RStarEstimator("linear_qk", value_map=t.value_map, random_state=np.random.RandomState(3)).fit(X, Y)
    b = RStarEstimator("linear_qk", value_map=t.value_map, random_state=np.random.RandomState(3)).fit(X, Y)
    np.testing.assert_array_equal(a.statistic_.null.draws, b.statistic_.null.draws)


def test_n_null_draws_sets_the_smallest_p_value():
    X, Y, t = _qk(300, 6, 8, 8, rank=1)
    est = RStarEstimator("linear_qk", value_map=t.value_map, n_null_draws=399).fit(X, Y)
    assert est.statistic_.null.n_draws == 399
    assert est.p_values_[0] == pytest.approx(1 / 400)


@pytest.mark.parametrize("params", [dict(n_null_draws=0), dict(memory_budget=0), dict(compute_budget=0.5),
                                    dict(random_state="seed"), dict(predict_sums="yes")])
def test_budget_and_randomness_parameters_are_validated(params):
    X, Y = make_linear_proxy(100, random_state=0)
    with pytest.raises(ValueError, match=list(params)[0]):
        MPRankEstimator(**params).fit(X, Y)


# -- a fitted statistic shared between estimators -------------------------------------------------------------


def test_fit_from_equals_fit_and_copies_on_write():
    X, Y, _ = _qk(400, 6, 8, 8)
    ref = RStarEstimator("linear_qk").fit(X, Y)
    mp = MPRankEstimator("linear_qk", alpha=0.003).fit_from(ref)
    direct = MPRankEstimator("linear_qk", alpha=0.003).fit(X, Y)
    assert mp.rank_ == direct.rank_ and mp.inversion_ == direct.inversion_ == "query_key_cross_fit"
    np.testing.assert_array_equal(mp.p_values_, direct.p_values_)
    energy = EnergyRankEstimator("linear_qk").fit_from(ref)
    assert energy.rank_interval_ == EnergyRankEstimator("linear_qk").fit(X, Y).rank_interval_
    n_before = ref.n_samples_seen_
    mp.partial_fit(X[:50], Y[:50])
    assert mp.n_samples_seen_ == n_before + 50
    assert RStarEstimator("linear_qk").fit_from(ref).n_samples_seen_ == n_before   # ref's sums untouched
    with pytest.raises(ValueError, match="different inversion"):
        RStarEstimator("softmax").fit_from(ref)
    with pytest.raises(ValueError, match="different inversion"):
        RStarEstimator("linear_qk", random_state=1).fit_from(ref)
    assert pickle.loads(pickle.dumps(mp)).rank_ == mp.rank_


# -- rules check the null model they are given ----------------------------------------------------------------


def test_rules_refuse_null_models_they_do_not_know():
    X, Y, t = _qk(300, 6, 8, 8)
    ws = RStarEstimator("linear_qk", value_map=t.value_map).fit(X, Y).statistic_
    with pytest.raises(UnsupportedNullModelError, match="SimulatedNull"):
        BaselineRule("minka")(ws)
    assert MarchenkoPasturRule()(ws).rank == 2


# -- defects, each with its regression test ------------------------------------------------------------------


@pytest.mark.parametrize("make", [SoftmaxInversionEstimator, RStarEstimator, lambda: NumericalRankEstimator("softmax"),
                                  lambda: EnergyRankEstimator("softmax"), lambda: MPRankEstimator("linear_qk")])
def test_all_zero_outputs_give_rank_zero(make):
    X = np.random.default_rng(0).standard_normal((50, 16, 8))
    est = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.simplefilter("ignore", UserWarning)
        est.fit(X, np.zeros((50, 16, 8)))
    assert est.rank_ == 0 and est.rank_interval_ == (0, 0)


def test_numerical_tolerance_in_log_attention_units_and_noise_variance_said_unused():
    X, Y, t = make_attention_task(600, seq_len=6, n_features=12, rank=2, random_state=0, return_teacher=True)
    Yb = Y * 1000.0   # the exact inversion's spectrum does not scale with Y
    a = NumericalRankEstimator("softmax", value_map=t.value_map, tol=0.5).fit(X, Y)
    b = NumericalRankEstimator("softmax", value_map=t.value_map * 1000.0, tol=0.5).fit(X, Yb)
    assert a.inversion_ == b.inversion_ == "softmax_exact"
    assert a.threshold_ == pytest.approx(b.threshold_) == pytest.approx(0.5)
    assert a.rank_ == b.rank_
    with pytest.warns(UserWarning, match="noise_variance .* does not apply"):
        SoftmaxInversionEstimator(value_map=t.value_map, noise_variance=0.01).fit(X, Y)


def test_numerical_rank_interval_contains_rank():
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((300, 16, 12)), rng.standard_normal((300, 16, 12))
    est = NumericalRankEstimator()
    caught = _fit(est, X, Y)   # pure noise: the relative tolerance counts most of the bulk
    lo, hi = est.rank_interval_
    assert est.rank_ > 0 and lo <= est.rank_ <= hi
    # the tolerance counts noise: the interval is widened to contain rank_
    assert_warned(caught, "numerical_outside", bounds=(est.rank_, est.rank_), category=UnidentifiableRankWarning)


def test_real_size_value_map_gives_no_memory_error():
    rng = np.random.default_rng(0)
    n, T, d, d_v = 60, 8, 96, 16   # the exact inversion would need 2 x 8 d^4 = 1.3 GiB
    X, V = rng.standard_normal((n, T, d)), rng.standard_normal((d, d_v)) / np.sqrt(d)
    Y = rng.standard_normal((n, T, d_v))
    est = SoftmaxInversionEstimator(value_map=V)
    messages = _fallbacks(_fit(est, X, Y))
    assert est.inversion_ == "softmax_first_order" and "memory budget" in messages[0]


def test_the_documented_decision_table_is_current():
    """docs/decision_table.md holds the table generated from choose_inversion (docs/generate_decision_table.py)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "generate_decision_table.py"
    spec = importlib.util.spec_from_file_location("generate_decision_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = Path(module.PAGE).read_text()
    assert module.BEGIN in text and module.render(text) == text


# -- found in review ---------------------------------------------------------------------------------------


def test_too_few_null_draws_raise_instead_of_reading_zero():
    X, Y, t = _qk(300, 6, 8, 8)
    with pytest.raises(ValueError, match="n_null_draws=300 gives p-values of at least"):
        RStarEstimator("linear_qk", value_map=t.value_map, n_null_draws=300).fit(X, Y)   # 1/301 > 0.003
    with pytest.raises(ValueError, match="n_null_draws=500"):
        RStarEstimator("linear_qk", n_null_draws=500).fit(X, Y)   # cross-fit union: 2/501 > 0.003
    est = MPRankEstimator("linear_qk", value_map=t.value_map, n_null_draws=300).fit(X, Y)   # alpha = 0.01
    assert est.rank_ == 2 and est.rank_interval_[0] <= est.rank_ <= est.rank_interval_[1]


def test_fit_from_compares_what_the_statistic_was_built_with():
    X, Y, t = _qk(300, 6, 8, 8)
    ref = RStarEstimator("linear_qk", value_map=t.value_map).fit(X, Y)
    ref.set_params(n_null_draws=50)   # after the fit: its statistic still has 1000 draws
    with pytest.raises(ValueError, match="different inversion"):
        RStarEstimator("linear_qk", value_map=t.value_map, n_null_draws=50).fit_from(ref)
    assert RStarEstimator("linear_qk", value_map=t.value_map).fit_from(ref).rank_ == 2


def test_parameters_of_the_inversion_cannot_change_between_batches():
    X, Y = make_attention_task(200, seq_len=12, n_features=6, rank=2, noise=0.05, random_state=0)
    est = RStarEstimator().partial_fit(X[:100], Y[:100])
    est.set_params(operator="linear_qk")
    with pytest.raises(ValueError, match="changed since the first partial_fit batch"):
        est.partial_fit(X[100:], Y[100:])
    est.set_params(operator="softmax", alpha=0.01)   # a rule parameter may change
    assert est.partial_fit(X[100:], Y[100:]).n_samples_seen_ == 200


def test_all_zero_outputs_with_a_known_value_map():
    X, _, t = make_attention_task(100, seq_len=8, n_features=6, rank=2, random_state=0, return_teacher=True)
    est = RStarEstimator(value_map=t.value_map)
    caught = _fit(est, X, np.zeros((100, 8, 6)))
    assert est.rank_ == 0 and est.inversion_ == "softmax_first_order"
    assert_warned(caught, "no_output", category=UnidentifiableRankWarning)


def test_fallback_reason_is_recorded_and_pickles_stay_small():
    X, Y, t = _qk(300, 6, 8, 8)
    est = MPRankEstimator("linear_qk", value_map=t.value_map, memory_budget=2**15).fit(X, Y)
    assert est.inversion_reason_.startswith("query_key_least_squares inversion not used")
    full = RStarEstimator("linear_qk", value_map=t.value_map).fit(X, Y)
    assert full.statistic_.null.draws.shape[0] == 1000
    restored = pickle.loads(pickle.dumps(full))
    assert "_whitened" not in vars(restored) and restored.rank_ == full.rank_
    np.testing.assert_array_equal(restored.statistic_.eigenvalues, full.statistic_.eigenvalues)


def test_softmax_least_squares_checks_its_information_memory():
    from rstar.inversions.softmax_least_squares import softmax_fit_blocker

    # 100 samples of 4 tokens keep in 150 KiB, but the 24^4-entry information needs 2.5 MiB > half of 4 MiB
    reason = softmax_fit_blocker(100, 4, 24, 24, budget=CostBudget(memory_bytes=4 * 2**20))
    assert reason is not None and "information of K" in reason and "memory" in reason
    assert softmax_fit_blocker(100, 4, 24, 24) is None


def test_merge_refuses_statistics_accumulated_differently():
    from rstar.inversions import TokenInversion, merge_stats

    X, Y = make_linear_proxy(100, random_state=0)
    a, b = TokenInversion(), TokenInversion(budget=CostBudget(memory_bytes=2**18))
    sa, sb = a.new_stats(16, 12, 12), b.new_stats(16, 12, 12)
    a.update(sa, X, Y)
    b.update(sb, X, Y)
    with pytest.raises(ValueError, match="accumulated differently"):
        merge_stats(sa, sb)
