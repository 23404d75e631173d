"""scikit-learn integration on 3-D data: Pipeline, GridSearchCV, cross-validation, clone, pickle."""

import pickle

import joblib
import numpy as np
import pytest
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score, cross_validate
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer

from rstar import MPRankEstimator, RStarEstimator, SoftmaxInversionEstimator
from rstar.metrics import get_scorer, make_rank_scorer, neg_sample_risk_scorer, token_r2_scorer


def test_grid_search_over_rank_is_a_data_only_sweep(table1_task):
    X, Y, _ = table1_task
    search = GridSearchCV(RStarEstimator(operator="linear_proxy"), {"rank": range(1, 12)}, scoring=token_r2_scorer,
                          cv=KFold(3, shuffle=True, random_state=0))
    search.fit(X, Y)
    means = search.cv_results_["mean_test_score"]
    assert means[1] - means[0] > 0.05 and means[2] - means[1] > 0.05  # rises up to r* = 3
    assert np.ptp(means[2:]) < 2e-3  # and flattens after
    assert search.best_params_["rank"] >= 3
    assert search.best_estimator_.rank_ == search.best_params_["rank"]


def test_grid_search_default_score_method(small_qk_task):
    X, Y, _ = small_qk_task
    search = GridSearchCV(MPRankEstimator(operator="linear_qk"), {"rank": [1, 2, 3]}, cv=3).fit(X, Y)
    means = search.cv_results_["mean_test_score"]
    assert means[1] > means[0] + 0.05
    assert abs(means[2] - means[1]) < 0.01


def test_cross_val_score_and_rank_scorer(linear_qk_task):
    X, Y, teacher = linear_qk_task
    # alpha=1e-3: each fold's rule has a false-alarm rate of about alpha (0.3% by default),
    # and this test is about the scorer plumbing, not the rule's error rate.
    scores = cross_val_score(RStarEstimator(operator="linear_qk", alpha=1e-3), X[:900], Y[:900], cv=3,
                             scoring=make_rank_scorer(teacher.rank, kind="exact"))
    np.testing.assert_array_equal(scores, 1.0)
    cv = cross_validate(RStarEstimator(operator="linear_qk", alpha=1e-3), X[:900], Y[:900], cv=3,
                        scoring={"r2": token_r2_scorer, "risk": neg_sample_risk_scorer,
                                 "rank": make_rank_scorer(teacher.rank)})
    assert np.all(cv["test_r2"] > 0.99)
    assert np.all(cv["test_rank"] == 0)
    # the risk sits at the noise floor sigma^2 T d_v
    assert -cv["test_risk"].mean() == pytest.approx(teacher.noise_floor, rel=0.1)


def test_pipeline_with_3d_transformer(softmax_task):
    X, Y, _ = softmax_task
    pipe = Pipeline([("scale", FunctionTransformer(lambda Z: 3.0 * Z, validate=False)),
                     ("rstar", RStarEstimator())])
    pipe.fit(X[:1000], Y[:1000])
    assert pipe.named_steps["rstar"].rank_ == 3
    assert pipe.predict(X[:5]).shape == (5, 32, 16)
    assert np.isfinite(pipe.score(X[1000:1200], Y[1000:1200]))


@pytest.mark.parametrize("est", [RStarEstimator(), RStarEstimator(operator="linear_proxy"),
                                 MPRankEstimator(operator="linear_qk"), SoftmaxInversionEstimator()],
                         ids=["softmax", "proxy", "qk", "softmax-inv"])
def test_clone_pickle_joblib_round_trips(est, small_qk_task, tmp_path):
    X, Y, _ = small_qk_task
    fitted = clone(est).fit(X, Y)
    assert not hasattr(clone(fitted), "rank_")
    assert clone(fitted).get_params() == est.get_params()
    again = pickle.loads(pickle.dumps(fitted))
    path = tmp_path / "est.joblib"
    joblib.dump(fitted, path)
    loaded = joblib.load(path)
    for other in (again, loaded):
        assert other.rank_ == fitted.rank_
        np.testing.assert_array_equal(other.predict(X[:10]), fitted.predict(X[:10]))
        np.testing.assert_array_equal(other.spectrum_, fitted.spectrum_)
    # a pickled, partially fitted estimator keeps streaming
    half = clone(est).partial_fit(X[:200], Y[:200])
    resumed = pickle.loads(pickle.dumps(half)).partial_fit(X[200:], Y[200:])
    assert resumed.rank_ == fitted.rank_
    np.testing.assert_allclose(resumed.spectrum_, fitted.spectrum_, rtol=1e-8,
                               atol=1e-12 * fitted.spectrum_[0])


def test_named_scorers():
    assert get_scorer("token_r2") is token_r2_scorer
    with pytest.raises(ValueError, match="unknown scorer"):
        get_scorer("r2")
