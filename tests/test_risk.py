"""r*(ε): the tolerance parameter and the data-only risk curve (theory §2, rstar.risk)."""

import pickle
import warnings

import numpy as np
import pytest
from sklearn.base import clone

from rstar import MPRankEstimator, RStarEstimator, UnidentifiableRankWarning
from rstar.datasets import make_attention_task, make_linear_proxy
from rstar.risk import (excess_risk_fit_standard_error, excess_risk_standard_error, rank_at_tolerance,
                        relative_excess_risk)

from _reasons import assert_warned


@pytest.fixture(scope="module")
def graded_softmax():
    # four directions of very unequal strength: the weak ones matter little to the risk
    return make_attention_task(1500, kind="softmax", seq_len=16, n_features=8, rank=4,
                               singular_values=[3.0, 2.0, 0.6, 0.3], noise=0.02, random_state=3)


def test_curve_decreases_to_zero_and_reads_each_tolerance(graded_softmax):
    X, Y = graded_softmax
    est = RStarEstimator(tolerance=0.01).fit(X, Y)
    curve = est.risk_curve_
    assert curve[0] > 0.3 and curve[-1] <= 0.005
    assert np.all(np.diff(curve) <= 1e-9)          # truncations nest: more rank never fits worse here
    assert est.rank_ == rank_at_tolerance(curve, 0.01)
    assert est.rank_ <= est.noise_floor_rank_
    # one fit answers every coarser tolerance; a coarse tolerance asks for fewer directions
    coarse = est.rank_at_tolerance(0.2)
    assert coarse < est.noise_floor_rank_
    assert coarse == RStarEstimator(tolerance=0.2).fit(X, Y).rank_
    lo, hi = est.rank_interval_
    assert lo <= est.rank_ <= hi


def test_tolerance_none_is_the_noise_floor(graded_softmax):
    X, Y = graded_softmax
    plain = RStarEstimator().fit(X, Y)
    assert plain.rank_ == plain.noise_floor_rank_ == 4
    assert not hasattr(plain, "risk_curve_")
    with pytest.raises(ValueError, match="no risk curve"):
        plain.rank_at_tolerance(0.01)


def test_refit_without_tolerance_drops_the_curve(graded_softmax):
    X, Y = graded_softmax
    est = RStarEstimator(tolerance=0.05).fit(X, Y)
    assert hasattr(est, "risk_curve_")
    est.set_params(tolerance=None).fit(X, Y)
    assert not hasattr(est, "risk_curve_")


@pytest.mark.parametrize("operator", ["linear_proxy", "linear_qk"])
def test_closed_form_operators(operator):
    if operator == "linear_proxy":
        X, Y = make_linear_proxy(600, rank=3, random_state=0)
    else:
        X, Y = make_attention_task(1500, kind="linear_qk", seq_len=32, n_features=12, rank=3, random_state=0)
    est = MPRankEstimator(operator, tolerance=0.01).fit(X, Y)
    assert est.noise_floor_rank_ == 3
    assert est.rank_ == 3
    assert est.risk_curve_[0] > 0.2 and est.risk_curve_[3] <= 0.01


def test_curve_is_scale_free(graded_softmax):
    X, Y = graded_softmax
    a = RStarEstimator(tolerance=0.01).fit(X, Y).risk_curve_
    b = RStarEstimator(tolerance=0.01).fit(X * 3.0, Y * 1e3).risk_curve_
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_tiny_tolerance_warns_beyond_the_noise():
    X, Y = make_linear_proxy(400, rank=2, noise=0.3, random_state=1)
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est = MPRankEstimator(tolerance=0.0).fit(X, Y)
    assert_warned(caught, "tolerance_below_noise", category=UnidentifiableRankWarning)
    assert "tolerance_below_noise" in [v.reason for v in est.verdicts_]
    assert est.rank_ > est.noise_floor_rank_
    # the curve beyond the noise floor does not place r*(eps): the interval runs from the noise floor's lower end
    # to every rank
    assert est.rank_interval_ == (est.noise_floor_interval_[0], est.statistic_.dim)


def test_another_tolerance_is_read_through_the_fit_s_gates():
    """rank_at_tolerance reads another tolerance as fit reads its own: the same rank and interval as a fit at that
    tolerance, and the same warnings where the tolerance is finer than the noise (not a bare number)."""
    X, Y = make_linear_proxy(400, rank=2, noise=0.3, random_state=1)
    coarse = MPRankEstimator(tolerance=0.3).fit(X, Y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fine = MPRankEstimator(tolerance=0.0).fit(X, Y)
    with pytest.warns(UnidentifiableRankWarning) as again:
        rank, interval = fine.rank_at_tolerance(0.0, return_interval=True)
    assert_warned(again, "tolerance_below_noise", category=UnidentifiableRankWarning)
    assert [str(w.message) for w in again] == [str(w.message) for w in caught
                                              if issubclass(w.category, UnidentifiableRankWarning)]
    assert (rank, interval) == (fine.rank_, fine.rank_interval_)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fine.rank_at_tolerance(0.3, return_interval=True) == (coarse.rank_, coarse.rank_interval_)
        assert coarse.rank_at_tolerance(0.3) == coarse.rank_


def test_fit_batches_gives_the_same_curve(graded_softmax):
    X, Y = graded_softmax
    whole = RStarEstimator(tolerance=0.02).fit(X, Y)
    parts = RStarEstimator(tolerance=0.02).fit_batches([(X[i:i + 500], Y[i:i + 500]) for i in range(0, 1500, 500)])
    np.testing.assert_allclose(parts.risk_curve_, whole.risk_curve_, atol=1e-8)
    assert parts.rank_ == whole.rank_


def test_errors():
    X, Y = make_linear_proxy(200, rank=2, random_state=0)
    with pytest.raises(ValueError, match="give one of them"):
        MPRankEstimator(rank=2, tolerance=0.1).fit(X, Y)
    with pytest.raises(ValueError, match="partial_fit does not keep"):
        MPRankEstimator(tolerance=0.1).partial_fit(X, Y)
    ref = MPRankEstimator().fit(X, Y)
    with pytest.raises(ValueError, match="fit_from does not read"):
        MPRankEstimator(tolerance=0.1).fit_from(ref)
    for bad in (-0.1, 1.0, "a"):
        with pytest.raises(ValueError):
            MPRankEstimator(tolerance=bad).fit(X, Y)
    with pytest.raises(ValueError, match="closed-form operators"):
        MPRankEstimator("linear_qk", tolerance=0.1, predict_sums=False).fit(
            *make_attention_task(300, kind="linear_qk", seq_len=16, n_features=6, rank=2, random_state=0))


def test_clone_and_pickle_keep_the_curve(graded_softmax):
    X, Y = graded_softmax
    est = RStarEstimator(tolerance=0.05).fit(X, Y)
    assert clone(est).get_params()["tolerance"] == 0.05
    back = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(back.risk_curve_, est.risk_curve_)
    assert back.rank_at_tolerance(0.2) == est.rank_at_tolerance(0.2)


def test_relative_excess_risk_units():
    np.testing.assert_allclose(relative_excess_risk([5.0, 2.0, 1.0], 1.0, 4.0), [1.0, 0.25, 0.0])
    np.testing.assert_array_equal(relative_excess_risk([1.0, 1.0], 1.0, 0.0), [0.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rank_at_tolerance([0.5, 0.04], 0.05) == 1


def test_every_inversion_has_a_curve():
    from rstar import SoftmaxInversionEstimator

    X, Y, t = make_attention_task(800, kind="linear_qk", seq_len=12, n_features=16, rank=3, random_state=0,
                                  return_teacher=True)
    for est in (RStarEstimator(operator="linear_qk", tolerance=0.05),
                RStarEstimator(operator="linear_qk", value_map=t.value_map, tolerance=0.05)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, Y)
        assert est.rank_ == est.noise_floor_rank_ == 3 and est.risk_curve_[2] > 0.1
    X, Y, t = make_attention_task(800, kind="softmax", seq_len=8, n_features=12, value_dim=12, rank=3,
                                  random_state=0, return_teacher=True)
    est = SoftmaxInversionEstimator(value_map=t.value_map, tolerance=0.05).fit(X, Y)
    assert est.inversion_ == "softmax_exact" and est.rank_ == 3 and est.risk_curve_[2] > 0.1


def test_fit_standard_error_is_the_blocks_difference_and_at_least_the_sampling_one():
    rng = np.random.default_rng(0)
    full = rng.random(40)
    same = full[None, :] + rng.random((3, 40))
    # two blocks of one law: their difference is that law's sampling error again, so the larger of the two
    sampling = excess_risk_standard_error(same, full, 7.0)
    between = 40 * np.abs((same - full)[:, :25].mean(1) - (same - full)[:, 25:].mean(1)) / (2 * 7.0)
    assert np.allclose(excess_risk_fit_standard_error(same, full, 7.0, (25, 15)), np.maximum(sampling, between))
    # a second block scored by a worse model: the blocks' gap, not the spread within them, sets the error
    shifted = same.copy()
    shifted[:, 25:] += 5.0
    se = excess_risk_fit_standard_error(shifted, full, 7.0, (25, 15))
    assert np.all(se > 3 * excess_risk_standard_error(same, full, 7.0))
    assert np.allclose(se, 40 * np.abs((shifted - full)[:, :25].mean(1) - (shifted - full)[:, 25:].mean(1)) / 14)
    # blocks that do not split the samples are a wiring mistake; no variance to scale, no error
    with pytest.raises(ValueError, match="do not split the 40 samples"):
        excess_risk_fit_standard_error(shifted, full, 7.0, (20, 15))
    assert np.all(excess_risk_fit_standard_error(shifted, full, 0.0, (25, 15)) == 0)
