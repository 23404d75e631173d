"""Every public entry point rejects bad input with a message naming the argument."""

import numpy as np
import pytest

from rstar import (
    EnergyRankEstimator,
    MPRankEstimator,
    NumericalRankEstimator,
    RStarEstimator,
    SoftmaxInversionEstimator,
)

from _reasons import assert_warned

ALL = [NumericalRankEstimator, MPRankEstimator, EnergyRankEstimator, SoftmaxInversionEstimator, RStarEstimator]

rng = np.random.default_rng(0)
X = rng.standard_normal((30, 6, 4))
Y = rng.standard_normal((30, 6, 3))


@pytest.mark.parametrize("Est", ALL)
@pytest.mark.parametrize(
    "Xb, Yb, exc, match",
    [
        (X[0, 0], Y, ValueError, "X must have shape"),
        (X[..., None], Y, ValueError, "X must have shape"),
        (X, Y[..., None], ValueError, "Y must have shape"),
        (X, Y[:-1], ValueError, "different numbers of samples"),
        (X, Y[:, :-1], ValueError, "different numbers of tokens"),
        (np.where(X > 2, np.nan, X), Y, ValueError, "X contains NaN"),
        (X, np.where(Y > 2, np.inf, Y), ValueError, "Y contains NaN or infinity"),
        (X.astype(complex), Y, ValueError, "Complex data not supported"),
        (X, Y.astype(complex), ValueError, "Complex data not supported"),
        (X.astype(str), Y, TypeError, "X must be a numeric array"),
        (np.array([[["a"] * 4] * 6] * 30, dtype=object), Y, TypeError, "X must be a numeric array"),
        (X[:0], Y[:0], ValueError, "0 sample"),
        (X[:, :, :0], Y, ValueError, "0 feature"),
        (X[:1], Y[:1], ValueError, "1 sample"),
        (X, None, ValueError, "requires y"),
        (X, Y[:, :, 0], ValueError, "Y must have shape"),
    ],
)
def test_bad_arrays(Est, Xb, Yb, exc, match):
    with pytest.raises(exc, match=match):
        Est().fit(Xb, Yb)


@pytest.mark.parametrize("Est", ALL)
@pytest.mark.parametrize(
    "params, match",
    [
        # scikit-learn's parameter validation names the parameter and its valid range
        ({"rank": -1}, r"'rank' parameter of .* must be an int in the range \[0, inf\) or None"),
        ({"rank": 1.5}, r"'rank' parameter of .* must be an int in the range \[0, inf\) or None"),
        ({"rank": True}, "rank must be None or a non-negative integer"),
        ({"rank": 99}, "rank must be <="),
        ({"max_rank": -2}, "max_rank"),
        ({"noise_variance": -1.0}, "noise_variance"),
        ({"noise_variance": np.nan}, "noise_variance"),
        ({"value_map": np.ones((3, 3))}, r"value_map must have shape \(d, d_v\) = \(4, 3\)"),
        ({"value_map": np.full((4, 3), np.nan)}, "value_map contains NaN"),
    ],
)
def test_bad_parameters(Est, params, match):
    with pytest.raises(ValueError, match=match):
        Est(**params).fit(X, Y)


@pytest.mark.parametrize("Est", [NumericalRankEstimator, MPRankEstimator, EnergyRankEstimator, RStarEstimator])
def test_unknown_operator(Est):
    with pytest.raises(ValueError, match=r"'operator' parameter of .* must be a str among"):
        Est(operator="attention").fit(X, Y)


@pytest.mark.parametrize(
    "est, match",
    [
        (MPRankEstimator(alpha=0.0), "alpha"),
        (MPRankEstimator(alpha=1.0), "alpha"),
        (NumericalRankEstimator(tol=-1.0), "tol"),
        (NumericalRankEstimator(rtol=0.0), "rtol"),
        (SoftmaxInversionEstimator(method="second_order"), "method"),
        (SoftmaxInversionEstimator(clip=0.0), "clip"),
    ],
)
def test_bad_rule_parameters(est, match):
    with pytest.raises(ValueError, match=match):
        est.fit(X, Y)


def test_params_are_validated_in_fit_not_init():
    est = MPRankEstimator(operator="nonsense", rank=-3, alpha=7)
    assert est.get_params()["operator"] == "nonsense"  # stored unchanged


@pytest.mark.parametrize("Est", ALL)
def test_predict_input_checks(Est):
    est = Est().fit(X, Y)
    with pytest.raises(ValueError, match="X has 3 features, but .* is expecting 4 features"):
        est.predict(X[:, :, :3])
    with pytest.raises(ValueError, match="NaN"):
        est.predict(np.full_like(X, np.nan))
    with pytest.raises(ValueError, match="same shape|shape"):
        est.score(X, Y[:, :, :2])


def test_predict_before_fit():
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        RStarEstimator().predict(X)


def test_linear_proxy_needs_same_T_at_predict():
    est = RStarEstimator(operator="linear_proxy").fit(X, Y)
    with pytest.raises(ValueError, match="T=5 tokens"):
        est.predict(X[:, :5])


def test_too_few_samples_for_the_inversion():
    rng = np.random.default_rng(1)
    Xs, Ys = rng.standard_normal((3, 4, 16)), rng.standard_normal((3, 4, 16))
    # query-key: 3 samples of rank 3 (centred) cannot fill d=16 dimensions
    with pytest.raises(ValueError, match="needs at least 7 samples"):
        RStarEstimator().fit(Xs, Ys)
    # exact softmax with a known V: 3 * 4 * 3 equations < 256 unknowns
    with pytest.raises(ValueError, match="needs at least 23 samples"):
        SoftmaxInversionEstimator(value_map=np.eye(16)).fit(Xs, Ys)
    # partial_fit: the samples so far, and how many more batches must bring
    with pytest.raises(ValueError, match=r"Found 3 sample\(s\) so far, .* add batches of at least 4 more"):
        RStarEstimator().partial_fit(Xs, Ys)


# -- data that cannot identify r*, or lie outside the operator's class -------------------------------------------


def test_two_dimensional_x_with_three_dimensional_y_says_which_shapes():
    with pytest.raises(ValueError, match=r"X is 2-D, shape \(30, 4\) \(read as T = 1.*expected X of shape "
                                         r"\(n_samples, T, d\) and Y of shape \(n_samples, T, d_v\)"):
        RStarEstimator().fit(X[:, 0], Y)


@pytest.mark.parametrize("Est, operator", [(RStarEstimator, "softmax"), (RStarEstimator, "linear_qk"),
                                           (MPRankEstimator, "linear_qk"), (NumericalRankEstimator, "softmax"),
                                           (EnergyRankEstimator, "softmax")])
def test_one_token_per_sample_is_not_a_confident_rank(Est, operator):
    # 2-D X and Y are read as T = 1: softmax over one token is 1 whatever K (and linear QK sees only x^T K x)
    from rstar import UnidentifiableRankWarning
    from rstar.datasets import make_attention_task

    X1, Y1 = make_attention_task(400, kind="softmax", seq_len=16, n_features=6, rank=2, random_state=0)
    with pytest.warns(UnidentifiableRankWarning) as record:
        est = Est(operator=operator).fit(X1[:, 0], Y1[:, 0])
    assert_warned(record, "single_token", bounds=(0, 6), category=UnidentifiableRankWarning)
    assert est.rank_interval_ == (0, 6)


def test_one_token_linear_proxy_is_still_answered():
    # the linear proxy's T x T token mixing is 1 x 1 at T = 1: r* in {0, 1} is identified, no warning
    import warnings as _w

    with _w.catch_warnings():
        _w.simplefilter("error")
        est = RStarEstimator(operator="linear_proxy").fit(X[:, 0], Y[:, 0] + X[:, 0, :3])
    assert est.rank_ == 1


@pytest.fixture(scope="module")
def softmax_pair():
    from rstar.datasets import make_attention_task

    return make_attention_task(1000, kind="softmax", seq_len=32, n_features=8, rank=2, random_state=0)


@pytest.mark.parametrize("swap, operator", [(True, "softmax"), (True, "linear_qk"), (False, "linear_qk")])
def test_data_outside_the_operators_class_are_warned(softmax_pair, swap, operator):
    """X and Y swapped, or softmax data fitted as linear query-key attention: a model check says the data do not
    fit the operator, with what would, and the interval covers every rank."""
    from rstar import OperatorMisfitWarning

    Xs, Ys = softmax_pair
    if swap:
        Xs, Ys = Ys, Xs
    with pytest.warns(OperatorMisfitWarning) as record:
        est = RStarEstimator(operator=operator).fit(Xs, Ys)
    misfit = assert_warned(record, "operator_misfit", bounds=(0, 8), category=OperatorMisfitWarning)
    assert "not swapped" in str(misfit.message)   # the message names what would help
    assert est.rank_interval_ == (0, 8) and est.model_check_["rejected"]


@pytest.mark.parametrize("kind", ["softmax", "linear_qk"])
def test_data_inside_the_class_pass_the_model_check(kind):
    import warnings as _w

    from rstar.datasets import make_attention_task

    Xs, Ys, teacher = make_attention_task(1000, kind=kind, seq_len=32, n_features=8, rank=2, random_state=1,
                                          return_teacher=True)
    with _w.catch_warnings():
        _w.simplefilter("error")
        est = RStarEstimator(operator=kind).fit(Xs, Ys)
    assert est.rank_ == teacher.rank and est.rank_interval_ == (2, 2)
    check = est.model_check_
    assert check["rejected"] == []
    if kind == "linear_qk":   # the exact-in-span test, which needs no operator
        assert check["baseline_p"] is None and check["span_p"] > 0.01 and abs(check["span_correlation"]) < 0.1
    else:                     # the least squares against the no-attention regression
        assert check["span_p"] is None and check["baseline_p"] > 0.01 and check["baseline_gain"] < 0


def test_model_check_is_not_run_where_it_has_no_test():
    from rstar.datasets import make_attention_task

    Xs, Ys = make_attention_task(300, kind="linear_qk", seq_len=8, n_features=8, rank=1, random_state=0)
    assert RStarEstimator(operator="linear_qk").fit(Xs, Ys).model_check_ is None      # T <= d: no span left
    assert RStarEstimator(operator="linear_proxy").fit(Xs, Ys).model_check_ is None   # a model of any tokens


def _order_head_task(mask, rotary_planes=True, seed=3, n=1000):
    """A causal or bidirectional head on tokens with a constant coordinate (a bias, as real hidden states carry):
    with ``rotary_planes`` a plane at 1 rad a position on the constant (attention by offset alone) beside a content
    plane, as Llama-family position heads are made; else the content plane alone, without positions."""
    from rstar import RotaryPositions
    from rstar.inversions._numerics.softmax_factored import factored_outputs

    T, d, P, d_v = 12, 16, 4, 8
    positions = RotaryPositions.from_frequencies(10000.0 ** -(np.arange(P) / P), T)
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, T, d))
    X[:, :, 0] = 1.0
    A, B = np.zeros((d, 2 * P)), np.zeros((d, 2 * P))
    A[0, 0] = B[0, 0] = 3.0
    A[1:, 1], B[1:, 1] = rng.standard_normal(d - 1) * 0.7, rng.standard_normal(d - 1) * 0.7
    V = rng.standard_normal((d, d_v)) / 4
    keep = np.tril(np.ones((T, T), dtype=bool)) if mask else None
    if rotary_planes:
        Y = factored_outputs(X, X @ V, A, B, keep, rotary=positions)
    else:
        Y = factored_outputs(X, X @ V, A[:, 1:2], B[:, 1:2], keep)
    return X, Y + 0.05 * Y.std() * rng.standard_normal(Y.shape), V, positions


@pytest.mark.parametrize("known", [True, False])
def test_a_head_that_attends_by_position_fitted_without_its_positions_is_warned(known):
    """A rotary position head fitted without ``rotary=``: the cross-fitted check (a weight per pair of positions
    removes what the position-free fit misses, beyond the halves' disagreement) says the data lie outside the
    class, points to the positions, and the interval covers every width; fitted with its positions, it passes and
    reads its width."""
    from rstar import OperatorMisfitWarning

    X, Y, V, positions = _order_head_task(mask=True)
    value_map = V if known else None
    with pytest.warns(OperatorMisfitWarning) as record:
        est = RStarEstimator(causal=True, value_map=value_map, random_state=0).fit(X, Y)
    misfit = assert_warned(record, "operator_misfit", bounds=(0, 16), category=OperatorMisfitWarning)
    assert "order matters" in str(misfit.message) and "rotary=RotaryPositions" in str(misfit.message)
    check = est.model_check_
    assert "order" in check["rejected"] and check["misfit_gain"] > 0.1
    assert check["misfit_groups"]["earlier"][1] < 1e-3 and check["misfit_groups"]["later"][1] > 0.01
    assert est.rank_interval_ == (0, 16)

    import warnings as _w

    with _w.catch_warnings(record=True) as caught:
        _w.simplefilter("always")
        fitted = RStarEstimator(causal=True, value_map=value_map, rotary=positions, tolerance=0.01,
                                random_state=0).fit(X, Y)
    assert fitted.model_check_["rejected"] == [] and fitted.model_check_["misfit_p"] > 0.01
    # width 2: the constant coordinate (plane 0, turned by the offset: the position pattern) and the content
    # direction (plane 1), one each on either side. The split-half count, in the metric with the keys centred, does
    # not see a direction constant within the window on both sides (1 (1, 1)); the risk curve, cut with the keys
    # uncentred, reads 2, warned that it lies beyond the noise floor, with an interval that holds it
    assert fitted.noise_floor_rank_ == 1
    assert fitted.rank_ == 2 and fitted.rank_interval_[0] <= 2 <= fitted.rank_interval_[1]
    assert any("finer than the noise resolves" in str(w.message) for w in caught)


def test_a_bidirectional_head_fitted_as_causal_is_warned_with_the_mask_to_fix():
    from rstar import OperatorMisfitWarning

    X, Y, V, _ = _order_head_task(mask=False, rotary_planes=False)
    with pytest.warns(OperatorMisfitWarning) as record:
        est = RStarEstimator(causal=True, value_map=V, random_state=0).fit(X, Y)
    misfit = assert_warned(record, "operator_misfit", bounds=(0, 16), category=OperatorMisfitWarning)
    assert "the mask is likely wrong" in str(misfit.message) and "causal=False" in str(misfit.message)
    assert est.model_check_["misfit_groups"]["later"][1] < 1e-3 and est.rank_interval_ == (0, 16)
    # the same head fitted in its class (bidirectional, the full least squares at this d) passes its checks
    assert RStarEstimator(value_map=V, random_state=0).fit(X, Y).model_check_["rejected"] == []


def test_a_rotary_head_fitted_without_its_positions_is_warned_not_read():
    """A random rotary head of width 2 (planes at 1 ... 0.001 rad a position) fitted position-free read 3 with no
    warning (its fit held out 6-15 times the noise): the rotations change which contents match, not a pair's
    average weight, so the pair correction misses it; scaling each query-key direction's logit per offset removes it
    and the estimator says the head attends by relative position. With its positions: 2 (2, 2), no warning."""
    import warnings as _w

    from rstar import OperatorMisfitWarning, RotaryPositions
    from rstar.datasets import make_attention_task

    positions = RotaryPositions.from_frequencies(10000.0 ** -(np.arange(4) / 4), 12)
    X, Y = make_attention_task(1000, seq_len=12, n_features=16, value_dim=8, rank=2, causal=True, rotary=positions,
                               random_state=0)
    with pytest.warns(OperatorMisfitWarning) as record:
        est = RStarEstimator(causal=True, random_state=0).fit(X, Y)
    misfit = assert_warned(record, "operator_misfit", bounds=(0, 16), category=OperatorMisfitWarning)
    assert "attends by relative position" in str(misfit.message) and "rotary=RotaryPositions" in str(misfit.message)
    assert "modulation" in est.model_check_["rejected"] and est.rank_interval_ == (0, 16)
    with _w.catch_warnings():
        _w.simplefilter("error")
        fitted = RStarEstimator(causal=True, rotary=positions, random_state=0).fit(X, Y)
    assert (fitted.rank_, fitted.rank_interval_) == (2, (2, 2)) and fitted.model_check_["rejected"] == []
