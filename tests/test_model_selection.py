"""The one-standard-error rule reads the plateau of a data-only rank sweep."""

import numpy as np
import pytest
from sklearn.model_selection import GridSearchCV, KFold

from rstar import RStarEstimator
from rstar.datasets import make_attention_task
from rstar.metrics import token_r2_scorer
from rstar.model_selection import one_standard_error_rank


def _cv(means, stds, ranks, n_splits=3):
    out = {"mean_test_score": np.asarray(means, float), "std_test_score": np.asarray(stds, float),
           "param_rank": np.ma.masked_array(ranks, dtype=object)}
    for k in range(n_splits):
        out[f"split{k}_test_score"] = np.zeros(len(means))
    return out


def test_smallest_rank_within_one_standard_error_of_the_best():
    # the maximum sits at the top of a flat plateau; the rule goes back to where the plateau starts
    cv = _cv([0.1, 0.6, 0.90, 0.901, 0.902, 0.903], [0.01] * 6, [0, 1, 2, 3, 4, 5])
    assert int(np.argmax(cv["mean_test_score"])) == 5
    assert one_standard_error_rank(cv) == 2
    # a rise larger than the standard error is not a plateau
    cv = _cv([0.1, 0.6, 0.80, 0.95], [0.01] * 4, [0, 1, 2, 3])
    assert one_standard_error_rank(cv) == 3


def test_grid_order_does_not_matter_and_nan_scores_are_skipped():
    cv = _cv([0.902, np.nan, 0.90, 0.6], [0.01] * 4, [4, 0, 2, 1])
    assert one_standard_error_rank(cv) == 2


def test_errors():
    with pytest.raises(ValueError, match="split<k>_test_score"):
        one_standard_error_rank({"mean_test_score": [1.0], "std_test_score": [0.0], "param_rank": [1]})
    with pytest.raises(ValueError, match="finite"):
        one_standard_error_rank(_cv([np.nan], [np.nan], [1]))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_documented_sweep_finds_r_star():
    """The README's rank sweep (the softmax operator, the one-SE rule) on softmax data picks r*, where the linear
    proxy's sweep on the same data runs to the top of its grid."""
    X, Y = make_attention_task(600, kind="softmax", seq_len=16, n_features=6, rank=2, random_state=0)
    cv = KFold(3, shuffle=True, random_state=0)
    search = GridSearchCV(RStarEstimator(), {"rank": range(0, 5)}, scoring=token_r2_scorer, cv=cv,
                          refit=one_standard_error_rank).fit(X, Y)
    assert search.best_params_["rank"] == 2 and search.best_estimator_.rank == 2
    proxy = GridSearchCV(RStarEstimator(operator="linear_proxy"), {"rank": range(0, 9)}, scoring=token_r2_scorer,
                         cv=cv).fit(X, Y)
    assert proxy.best_params_["rank"] > 2
