"""Does the data follow the operator's class? Paired tests of the fitted operator against what lies outside it.

An estimator reads a rank *inside* a model class (softmax attention, linear query-key attention, ...). Data that
are not in the class (X and Y swapped, softmax data fitted as linear query-key attention) still give a spectrum
and a count, and the count means nothing. Two facts hold under the class, whatever its rank and noise level, and
are tested here on the fitted samples, per sample (samples are i.i.d.; tokens of one sample need not be):

* **No model outside the class predicts better.** With the noise independent of X, the class's best operator
  is the regression function, so the full-rank in-class fit's in-sample residual is at most the noise, while
  any other model's residual on samples it was not fitted on is at least the noise. The comparator here is the
  *no-attention regression* (:func:`no_attention_features`: each token's own features, the mean of its
  sequence, the mean of its prefix and its position, one linear map), cross-fitted on two halves of the
  samples. Its held-out residual below the class's in-sample one, by more than sampling error, rejects the
  class. The test is one-sided and conservative under the class (the in-sample residual is optimistic, the
  held-out one is not).
* **Exact classes leave only the noise outside ``col(X_i)``.** Linear query-key attention,
  ``Y_i = X_i K X_i^T X_i V + E_i``, puts every output column in the span of the sample's tokens, so with
  ``T > d`` the residual of a free per-sample regression of ``Y_i`` on ``X_i`` (:func:`outside_span_residuals`)
  is the noise alone, independent of ``X_i``, whatever K, V and the tokens' law. Its correlation over samples
  with the log of the sample's mean squared token norm is then zero; softmax attention, or X and Y swapped,
  leave signal outside the span that grows with the tokens (measured at n = 1000-2000, T = 32, d = 8-16:
  correlations 0.07-0.40 on such data, one-sided p <= 7e-4; at most 0.06 on linear query-key data with Gaussian,
  Student-t(3) and correlated tokens; ``benchmarks/model_check.py`` counts the alarms). This test needs no
  fitted operator.

Each test is one-sided at the calibration's ``model_check_alpha`` (:mod:`rstar.calibration`). The first is about
the class's *least-squares* fit (a moment estimator's operator can leave far more than the noise on data in the
class while its rank is right), so it runs where the operator is one: the softmax least squares.
"""

import numpy as np
from scipy import stats as _stats

from .calibration import DEFAULT_CALIBRATION
from .inversions._numerics.linalg import solve_psd
from .inversions.query_key import pseudo_inverse_fit

__all__ = ["model_check", "no_attention_features", "operator_class_check", "outside_span_residuals", "paired_excess"]


def no_attention_features(X):
    """Features of the no-attention regression: ``[x_t, mean_s x_s, mean_{s<=t} x_s, one-hot(t)]`` per token.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)

    Returns
    -------
    F : ndarray of shape (n, T, 3 d + T)
    """
    n, T, d = X.shape
    mean = np.broadcast_to(X.mean(axis=1, keepdims=True), X.shape)
    prefix = np.cumsum(X, axis=1) / np.arange(1, T + 1)[None, :, None]
    position = np.broadcast_to(np.eye(T)[None], (n, T, T))
    return np.concatenate([X, mean, prefix, position], axis=2)


def _halves(n):
    """Half 0 or 1 of each sample of a chunk (alternating: deterministic for a given chunking)."""
    return np.arange(n) % 2


def _baseline_normal_sums(X, Y):
    F = no_attention_features(X)
    h = _halves(X.shape[0])
    out = []
    for half in (0, 1):
        Fh, Yh = F[h == half].reshape(-1, F.shape[2]), Y[h == half].reshape(-1, Y.shape[2])
        out += [Fh.T @ Fh, Fh.T @ Yh]
    return tuple(out)


def outside_span_residuals(X, Y):
    """Per sample: the residual power per degree of freedom of the free regression of ``Y_i`` on ``X_i``
    (:func:`rstar.inversions.query_key.pseudo_inverse_fit`, ``(T - rank X_i) d_v`` degrees of freedom; nan
    where none is left), and those degrees of freedom.

    Returns
    -------
    power, dof : ndarray of shape (n,)
    """
    _, _, _, res, dof = pseudo_inverse_fit(X, Y, X.shape[1])
    return np.where(dof > 0, res / np.maximum(dof, 1), np.nan), dof


def _baseline_check_sums(X, Y, operator, W):
    """A chunk's sums of the per-sample differences: the class's residual minus the baseline's held-out one."""
    n, T, _ = X.shape
    d_v = Y.shape[2]
    R = Y - operator.predict(X)
    own = np.einsum("ntv,ntv->n", R, R) / (T * d_v)
    F = no_attention_features(X)
    h = _halves(n)
    held_out = np.empty(n)
    for half in (0, 1):
        sel = h == half
        Rb = Y[sel] - F[sel] @ W[1 - half]
        held_out[sel] = np.einsum("ntv,ntv->n", Rb, Rb) / (T * d_v)
    diff = own - held_out
    return float(diff.sum()), float((diff**2).sum()), float(own.sum()), n


def _span_check_sums(X, Y):
    """A chunk's sums for the correlation of the outside-span power with the log mean squared token norm."""
    power, dof = outside_span_residuals(X, Y)
    ok = (dof > 0) & np.isfinite(power)
    o = power[ok]
    m = np.log(np.maximum(np.mean(np.sum(X[ok] ** 2, axis=2), axis=1), np.finfo(float).tiny))
    return (float(o.sum()), float((o**2).sum()), float(m.sum()), float((m**2).sum()), float((o * m).sum()),
            int(ok.sum()))


def paired_excess(total, total_sq, count):
    """``(mean, standard error, one-sided p-value)`` of per-sample differences from their sums (H0: mean <= 0)."""
    if count < 2:
        return np.nan, np.nan, 1.0
    mean = total / count
    var = max(total_sq / count - mean**2, 0.0) * count / (count - 1)
    se = np.sqrt(var / count)
    if se == 0:
        return mean, se, 0.0 if mean > 0 else 1.0
    return mean, se, float(_stats.norm.sf(mean / se))


def _correlation(so, soo, sm, smm, som, n):
    """``(r, one-sided p-value of r > 0)`` from sums (Fisher's z; H0: independence)."""
    if n < 4:
        return np.nan, 1.0
    co = soo / n - (so / n) ** 2
    cm = smm / n - (sm / n) ** 2
    if not (co > 0 and cm > 0):
        return 0.0, 1.0
    r = float(np.clip((som / n - so * sm / n**2) / np.sqrt(co * cm), -0.999999, 0.999999))
    return r, float(_stats.norm.sf(np.arctanh(r) * np.sqrt(n - 3)))


def operator_class_check(samples, operator=None, *, exact_in_span, alpha=DEFAULT_CALIBRATION.model_check_alpha):
    """Test whether ``samples`` follow an operator's class.

    Parameters
    ----------
    samples : rstar.streaming.Samples
        The fitted samples (internal units), read in one or two passes.
    operator : object with ``predict(X)``, or None
        The class's least-squares operator at full rank, fitted on these samples: the no-attention baseline test
        runs against it. None: not run.
    exact_in_span : bool
        The class puts every output column in ``col(X_i)`` (linear query-key attention): also test that the
        power outside that span is independent of the tokens (where ``T > d``).
    alpha : float, default=0.001
        Level of each one-sided test (the calibration's ``model_check_alpha``: set, not tuned; under the class
        the tests' statistics are conservative; ``python benchmarks/model_check.py`` counts the false alarms).

    Returns
    -------
    dict
        ``baseline_gain`` (how much less residual the no-attention regression leaves on held-out samples than
        the class on its own, as a fraction of the class's; negative where it leaves more) and ``baseline_p``
        (None where not run); ``span_correlation`` (of the outside-span power with the log mean squared token
        norm) and ``span_p`` (None where not run); ``rejected``, the tests that reject: ``"baseline"``,
        ``"span"``.

    Examples
    --------
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.model_check import operator_class_check
    >>> from rstar.streaming import ArraySamples
    >>> X, Y = make_attention_task(500, kind="softmax", seq_len=24, n_features=6, rank=2, random_state=0)
    >>> samples = ArraySamples(Y, X).set_shape(500, (24, 6, 6))    # swapped, checked as linear QK
    >>> operator_class_check(samples, exact_in_span=True)["rejected"]
    ['span']
    """
    T, d, d_v = samples.dims
    out = {"baseline_gain": None, "baseline_p": None, "span_correlation": None, "span_p": None, "rejected": []}
    if operator is not None:
        p = 3 * d + T
        per_sample = T * (p + d_v)
        G0, C0, G1, C1 = samples.map_sum(_baseline_normal_sums, per_sample)
        W = (solve_psd(G0, C0), solve_psd(G1, C1))
        total, total_sq, own, count = samples.map_sum(_baseline_check_sums, per_sample, operator, W)
        mean, _, p_value = paired_excess(total, total_sq, count)
        own_mean = own / max(count, 1)
        out["baseline_gain"] = float(mean / own_mean) if own_mean > 0 else 0.0
        out["baseline_p"] = p_value
        if p_value < alpha and mean > 0:
            out["rejected"].append("baseline")
    if exact_in_span and T > d:
        r, p_value = _correlation(*samples.map_sum(_span_check_sums, T * (d + d_v)))
        out["span_correlation"], out["span_p"] = r, p_value
        if p_value < alpha:
            out["rejected"].append("span")
    return out


def model_check(operator_name, inversion, ws, stats, samples, alpha=None):
    """The operator-class check a fit runs on its own samples, where it applies; its outcome, or None.

    Runs for linear query-key attention with T > d (any inversion: its test needs no operator) and for softmax
    attention where the least squares ran (its full-rank fit is the class's least-squares operator; not the
    factored least squares at real sizes, and not the first order, which has model checks of its own:
    :meth:`rstar.inversions.QueryKeyInversion.first_order_misfit`). What a rejection means for the rank is
    :func:`rstar.rules.identifiability.operator_misfit_verdict`'s to decide.

    Parameters
    ----------
    operator_name : {"linear_proxy", "linear_qk", "softmax"}
    inversion : Inversion
        The fit's inversion (its ``full_rank_operator`` for softmax).
    ws : WhitenedStatistic
        The statistic the fit read (which inversion ran).
    stats : dict
        The inversion's sums.
    samples : rstar.streaming.Samples
        The samples, in the inversion's units.
    alpha : float or None
        The level (None: the calibration's ``model_check_alpha``).

    Returns
    -------
    dict or None
        :func:`operator_class_check`'s outcome; None where no check applies.
    """
    if operator_name == "linear_proxy" or inversion.space == "tokens":
        return None
    kw = {} if alpha is None else {"alpha": alpha}
    if operator_name == "linear_qk":
        # the exact-in-span test needs no operator (a moment estimator's would not do for the baseline test)
        check = operator_class_check(samples, None, exact_in_span=True, **kw)
        return None if check["span_p"] is None else check   # T <= d: no span left outside col(X_i)
    if ws.inversion != "softmax_least_squares":
        return None   # the check needs the class's least-squares fit; the first order has its own model checks
    operator = inversion.full_rank_operator(stats)   # the fit whiten made: no second fit
    if operator is None:
        return None
    return operator_class_check(samples, operator, exact_in_span=False, **kw)
