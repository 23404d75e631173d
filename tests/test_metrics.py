import numpy as np
import pytest
from sklearn.metrics import mean_squared_error, r2_score

from rstar.metrics import make_rank_scorer, sample_risk, token_mse, token_r2_score


def test_token_r2_equals_sklearn_on_flattened(rng):
    Y = rng.standard_normal((20, 5, 3))
    P = Y + 0.3 * rng.standard_normal(Y.shape)
    assert token_r2_score(Y, P) == pytest.approx(r2_score(Y.reshape(-1, 3), P.reshape(-1, 3)))
    assert token_mse(Y, P) == pytest.approx(mean_squared_error(Y.reshape(-1, 3), P.reshape(-1, 3)))
    assert sample_risk(Y, P) == pytest.approx(np.mean(np.sum((Y - P) ** 2, axis=(1, 2))))
    assert token_r2_score(Y[:, 0], P[:, 0]) == pytest.approx(r2_score(Y[:, 0], P[:, 0]))


def test_metric_errors(rng):
    Y = rng.standard_normal((4, 2, 2))
    with pytest.raises(ValueError, match="same shape"):
        token_r2_score(Y, Y[:, :1])
    with pytest.raises(ValueError, match="same shape"):
        sample_risk(Y, Y[:2])
    with pytest.raises(ValueError, match="dimensions"):
        token_mse(Y[..., None], Y[..., None])


def test_rank_scorer():
    class Fitted:
        rank_ = 4

    assert make_rank_scorer(3)(Fitted()) == -1.0
    assert make_rank_scorer(4, kind="exact")(Fitted()) == 1.0
    with pytest.raises(ValueError, match="true_rank"):
        make_rank_scorer(-1)
    with pytest.raises(ValueError, match="kind"):
        make_rank_scorer(1, kind="close")
