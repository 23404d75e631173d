"""Choosing the rank of a data-only rank sweep (``GridSearchCV`` over ``rank``) where the score plateaus.

Above r* a held-out score stays flat up to sampling noise, so the grid's maximum lands anywhere on the plateau
(often its top). The *one-standard-error rule* (Breiman et al. 1984, *Classification and Regression Trees*,
§3.4.3; Hastie, Tibshirani & Friedman, *The Elements of Statistical Learning*, 2nd ed., §7.10) reads the
plateau instead: the smallest rank whose mean cross-validated score is within one standard error of the best
mean score. Pass :func:`one_standard_error_rank` as ``GridSearchCV``'s ``refit``.
"""

import numpy as np

__all__ = ["one_standard_error_rank"]


def one_standard_error_rank(cv_results, param="rank"):
    """Index of the smallest ``param`` whose mean test score is within one standard error of the best.

    The standard error is that of the best candidate's mean over the cross-validation splits,
    ``std_test_score / sqrt(n_splits)``. Use it as ``GridSearchCV(..., refit=one_standard_error_rank)``:
    ``best_index_`` is then this index, ``best_params_`` its rank, and the search refits at it.

    Parameters
    ----------
    cv_results : dict
        ``GridSearchCV.cv_results_`` (``mean_test_score``, ``std_test_score``, ``split<k>_test_score`` and
        ``param_<param>``), with one scorer.
    param : str, default="rank"
        The swept complexity parameter (smaller is simpler).

    Returns
    -------
    int
        Index into ``cv_results``.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.model_selection import one_standard_error_rank
    >>> cv = {"mean_test_score": np.array([0.2, 0.9, 0.905, 0.91]), "std_test_score": np.array([.02] * 4),
    ...       "split0_test_score": np.zeros(4), "split1_test_score": np.zeros(4),
    ...       "param_rank": np.array([1, 2, 3, 4])}
    >>> one_standard_error_rank(cv)   # rank 2: 0.9 is within 0.02 / sqrt(2) of 0.91
    1
    """
    means = np.asarray(cv_results["mean_test_score"], dtype=float)
    stds = np.asarray(cv_results["std_test_score"], dtype=float)
    n_splits = sum(1 for key in cv_results if key.startswith("split") and key.endswith("_test_score"))
    if n_splits < 1:
        raise ValueError("cv_results has no split<k>_test_score entries: one_standard_error_rank needs the "
                         "per-split scores of a single-metric search.")
    values = np.asarray(cv_results[f"param_{param}"], dtype=object)
    finite = np.isfinite(means)
    if not finite.any():
        raise ValueError("no candidate of the search has a finite mean test score.")
    best = int(np.nanargmax(np.where(finite, means, -np.inf)))
    threshold = means[best] - stds[best] / np.sqrt(n_splits)
    eligible = [i for i in range(means.size) if finite[i] and means[i] >= threshold and values[i] is not None]
    return min(eligible, key=lambda i: (float(values[i]), i))
