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
