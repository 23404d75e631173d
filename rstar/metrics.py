"""Token-wise metrics and scorers for 3-D targets.

scikit-learn's string scorers (``scoring="r2"``) refuse 3-D targets; these
flatten ``(n, T, d_v)`` to ``(n * T, d_v)`` first, so
``token_r2_score(Y, Y_hat)`` equals ``r2_score(Y.reshape(-1, d_v),
Y_hat.reshape(-1, d_v))``.
"""

import numbers

import numpy as np
from sklearn.metrics import make_scorer, mean_squared_error, r2_score

__all__ = [
    "token_r2_score",
    "token_mse",
    "sample_risk",
    "token_r2_scorer",
    "neg_token_mse_scorer",
    "neg_sample_risk_scorer",
    "make_rank_scorer",
    "get_scorer",
]


def _check_pair(Y_true, Y_pred):
    """Both as float64 arrays of one shape."""
    Y_true = np.asarray(Y_true, dtype=np.float64)
    Y_pred = np.asarray(Y_pred, dtype=np.float64)
    if Y_true.shape != Y_pred.shape:
        raise ValueError(f"Y_true and Y_pred must have the same shape, got {Y_true.shape} and {Y_pred.shape}.")
    return Y_true, Y_pred


def _flatten_pair(Y_true, Y_pred):
    Y_true, Y_pred = _check_pair(Y_true, Y_pred)
    if Y_true.ndim == 3:
        return Y_true.reshape(-1, Y_true.shape[-1]), Y_pred.reshape(-1, Y_pred.shape[-1])
    if Y_true.ndim in (1, 2):
        return Y_true, Y_pred
    raise ValueError(f"Y must have 1, 2 or 3 dimensions, got shape {Y_true.shape}.")


def token_r2_score(Y_true, Y_pred, *, multioutput="uniform_average"):
    """R² over all tokens and outputs.

    Parameters
    ----------
    Y_true, Y_pred : array-like of shape (n_samples, T, d_v), (n_samples, d_v) or (n_samples,)
    multioutput : str or array-like, default="uniform_average"
        Passed to :func:`sklearn.metrics.r2_score` (outputs are the d_v columns).

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.metrics import token_r2_score
    >>> Y = np.arange(24.0).reshape(2, 3, 4)
    >>> token_r2_score(Y, Y)
    1.0
    """
    yt, yp = _flatten_pair(Y_true, Y_pred)
    return float(r2_score(yt, yp, multioutput=multioutput))


def token_mse(Y_true, Y_pred):
    """Mean squared error per entry, over all tokens and outputs.

    Parameters
    ----------
    Y_true, Y_pred : array-like of shape (n_samples, T, d_v)

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.metrics import token_mse
    >>> token_mse(np.zeros((2, 3, 4)), np.ones((2, 3, 4)))
    1.0
    """
    yt, yp = _flatten_pair(Y_true, Y_pred)
    return float(mean_squared_error(yt, yp))


def sample_risk(Y_true, Y_pred):
    """Mean per-sample squared Frobenius error ``E ||Y - Y_hat||_F^2``.

    This is the paper's risk: its Bayes value is the noise floor
    ``sigma**2 * T * d_v``.

    Parameters
    ----------
    Y_true, Y_pred : array-like of shape (n_samples, T, d_v)

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.metrics import sample_risk
    >>> sample_risk(np.zeros((2, 3, 4)), np.ones((2, 3, 4)))
    12.0
    """
    Y_true, Y_pred = _check_pair(Y_true, Y_pred)
    diff = (Y_true - Y_pred).reshape(Y_true.shape[0], -1)
    return float(np.mean(np.sum(diff**2, axis=1)))


token_r2_scorer = make_scorer(token_r2_score)
neg_token_mse_scorer = make_scorer(token_mse, greater_is_better=False)
neg_sample_risk_scorer = make_scorer(sample_risk, greater_is_better=False)


def make_rank_scorer(true_rank, *, kind="neg_abs_error"):
    """A scorer ``(estimator, X, Y) -> float`` comparing a fitted ``rank_`` with r*.

    The estimator passed in is already fitted (as in ``cross_validate``);
    ``X`` and ``Y`` are not used.

    Parameters
    ----------
    true_rank : int
        The known r*.
    kind : {"neg_abs_error", "exact"}, default="neg_abs_error"
        ``-|rank_ - r*|`` or ``1.0 if rank_ == r* else 0.0``.

    Returns
    -------
    callable

    Examples
    --------
    >>> from sklearn.model_selection import cross_validate
    >>> from rstar import MPRankEstimator
    >>> from rstar.datasets import make_linear_proxy
    >>> from rstar.metrics import make_rank_scorer
    >>> X, Y = make_linear_proxy(300, random_state=0)
    >>> cv = cross_validate(MPRankEstimator(), X, Y, cv=3,
    ...                     scoring={"exact": make_rank_scorer(3, kind="exact")})
    >>> cv["test_exact"].tolist()
    [1.0, 1.0, 1.0]
    """
    if isinstance(true_rank, bool) or not isinstance(true_rank, numbers.Integral) or true_rank < 0:
        raise ValueError(f"true_rank must be a non-negative integer, got {true_rank!r}.")
    if kind not in ("neg_abs_error", "exact"):
        raise ValueError(f"kind must be 'neg_abs_error' or 'exact', got {kind!r}.")

    def rank_scorer(estimator, X=None, Y=None):
        r = int(estimator.rank_)
        if kind == "exact":
            return float(r == true_rank)
        return -float(abs(r - true_rank))

    return rank_scorer


_SCORERS = {
    "token_r2": token_r2_scorer,
    "neg_token_mse": neg_token_mse_scorer,
    "neg_sample_risk": neg_sample_risk_scorer,
}


def get_scorer(name):
    """Scorer by name: ``"token_r2"``, ``"neg_token_mse"`` or ``"neg_sample_risk"``.

    Parameters
    ----------
    name : str

    Returns
    -------
    callable

    Examples
    --------
    >>> from rstar.metrics import get_scorer
    >>> callable(get_scorer("token_r2"))
    True
    """
    try:
        return _SCORERS[name]
    except KeyError:
        raise ValueError(f"unknown scorer {name!r}; choose from {sorted(_SCORERS)}.") from None
