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

* **No head that also attends by position explains what it misses** (the factored and the rotary least squares,
  fitted on two halves: :func:`cross_fitted_class_check`). A head fitted in the wrong class because of *which*
  tokens it reads (a causal head fitted as bidirectional or the reverse, a head that attends by position fitted
  without positions) still mixes the same values ``z_s = x_s V``, and its average attention on each pair of
  positions (t, s) is off. So each half's model is measured on the other half, a correction by one weight per pair
  of positions (:func:`position_pair_corrections`) is fitted on one part of those held-out residuals and tested on
  the other. Under the class the held-out residual is the noise plus the half model's own estimation error; no
  correction can remove more than that error, which the two halves' disagreement on the same samples bounds (in
  expectation), so the per-sample gain minus the disagreement has mean at most zero. What the pairs after t add
  says the mask is wrong; the pairs up to t, that order matters. A rotary head whose rotations change *which
  contents* match without changing a pair's average weight is not seen by it, so a second correction is tested the
  same way: each of the head's strongest query-key directions (as many as the fit counted) gets its own logit
  weight at each offset t - s, linearised about the fitted attention (:func:`modulation_correction`). A random
  rotary head of width 2 fitted position-free (held out at 6-15 times the noise, read 3 with no warning before) is
  rejected by it; what it says is that the head attends by relative position.

Each test is one-sided at the calibration's ``model_check_alpha`` (:mod:`rstar.calibration`). The first two are
about the class's *least-squares* fit (a moment estimator's operator can leave far more than the noise on data in
the class while its rank is right), so they run where the operator is one: the softmax least squares (the full
rank one at small d; the factored and the rotary one on their halves).
"""

import numpy as np
from scipy import stats as _stats

from .calibration import DEFAULT_CALIBRATION
from .inversions._numerics.linalg import solve_psd
from .inversions.query_key import pseudo_inverse_fit

__all__ = ["cross_fitted_class_check", "direction_scale_sums", "model_check", "no_attention_features",
           "operator_class_check",
           "modulation_correction", "offset_modulation_sums", "outside_span_residuals", "paired_excess",
           "position_pair_corrections"]


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


def position_pair_corrections(Z, R, allowed=None):
    """The least-squares correction ``R_t ~ sum_s c_ts z_s``, one scalar per pair of positions (t, s): what the values
    of a head that attends by position alone would add (the module's third test).

    Parameters
    ----------
    Z : ndarray of shape (n, T, d_v)
        A model's values ``X V``.
    R : ndarray of shape (n, T, d_v)
        Its residuals.
    allowed : ndarray of shape (T, T) of bool, optional
        The pairs a coefficient may use (None: all).

    Returns
    -------
    C : ndarray of shape (T, T)
        ``C[t, s] = c_ts`` (zero where not allowed).
    """
    T = Z.shape[1]
    G = np.einsum("nsv,nuv->su", Z, Z)          # the same Gram for every t
    cross = np.einsum("nsv,ntv->ts", Z, R)
    C = np.zeros((T, T))
    for t in range(T):
        cols = np.arange(T) if allowed is None else np.flatnonzero(allowed[t])
        if cols.size:
            C[t, cols] = solve_psd(G[np.ix_(cols, cols)], cross[t, cols])
    return C


def _corrected_power(Z, R, C):
    corrected = R - np.einsum("ts,nsv->ntv", C, Z)
    return np.einsum("ntv,ntv->n", corrected, corrected)


def _offset_index(T, causal):
    """``index[t, s]``: the offset ``t - s`` as a column (``0 .. T-1`` causal, ``0 .. 2T-2`` else), and the count."""
    t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    return (t - s, T) if causal else (t - s + T - 1, 2 * T - 1)


def offset_modulation_sums(coordinates, attention, Z, R, causal, chunk=64):
    """Per query-key direction, the normal equations of its offset modulation: the linearised change of a head's
    outputs when the logit's term along direction i is scaled at each offset ``t - s`` by ``c_{t-s, i}``,
    ``R_t ~ sum_s a_ts c_{t-s,i} p_ti k_si (z_s - y_t)`` (what rotary positions, or other positions, do to a
    position-free head; and wrong positions to a rotary one). Each direction's equations are its own (the
    directions' cross terms would cost k^2 times more); :func:`modulation_correction` combines them.

    Parameters
    ----------
    coordinates : tuple of two ndarray of shape (n, T, k)
        The query and key coordinates ``p``, ``k`` along the head's k strongest directions (logit scale folded in).
    attention : ndarray of shape (n, T, T)
    Z, R : ndarray of shape (n, T, d_v)
        The values and the residuals.
    causal : bool

    Returns
    -------
    G : ndarray of shape (k, m, m)
    C : ndarray of shape (k, m)
        With m offsets (T causal, 2T - 1 else).
    """
    P, Kc = coordinates
    n, T, k = P.shape
    index, m = _offset_index(T, causal)
    Yhat = attention @ Z
    G = np.zeros((k, m, m))
    C = np.zeros((k, m))
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        Zp, Yp, Rp = Z[part], Yhat[part], R[part]
        zz = Zp @ Zp.transpose(0, 2, 1)                     # <z_s, z_u>
        zy = Zp @ Yp.transpose(0, 2, 1)                     # <z_s, y_t>, indexed [n, s, t]
        yy = np.einsum("ntv,ntv->nt", Yp, Yp)
        zr = Zp @ Rp.transpose(0, 2, 1)                     # <z_s, R_t>, [n, s, t]
        yr = np.einsum("ntv,ntv->nt", Yp, Rp)
        for t in range(T):
            # causal: the attention of position t is zero after t, and so are its keys' terms
            S = t + 1 if causal else T
            phi = attention[part, t, :S, None] * P[part, t, None, :] * Kc[part, :S]     # (c, s, k)
            E = (zz[:, :S, :S] - zy[:, :S, t, None] - zy[:, None, :S, t]
                 + yy[:, t, None, None])                                                # <e_ts, e_tu>
            cross = zr[:, :S, t] - yr[:, t, None]                                       # <e_ts, R_t>
            rows = index[t, :S]
            block = np.ix_(rows, rows)
            # one direction at a time: a three-operand einsum over all k at once ran 3.5 times slower (c = 64, T = 128)
            for i, weights in enumerate(np.ascontiguousarray(phi.transpose(2, 0, 1))):
                G[i][block] += np.einsum("ns,nsu,nu->su", weights, E, weights)
            C[:, rows] += np.einsum("nsi,ns->is", phi, cross)
    return G, C


def _direction_corrections(coordinates, attention, Z, weights, causal):
    """Each direction's correction ``sum_s a_ts c_{t-s,i} p_ti k_si (z_s - y_t)``, shape (k, n, T, d_v)."""
    P, Kc = coordinates
    n, T, k = P.shape
    index, _ = _offset_index(T, causal)
    Yhat = attention @ Z
    out = np.empty((k, n, T, Z.shape[2]))
    for i in range(k):
        delta = attention * (P[:, :, i, None] * Kc[:, None, :, i]) * weights[i][index]
        out[i] = delta @ Z - delta.sum(axis=2, keepdims=True) * Yhat
    return out


def direction_scale_sums(coordinates, attention, Z, R, weights, causal,
                         chunk_entries=DEFAULT_CALIBRATION.chunk_entries):
    """The normal equations of one scale per direction fitted jointly on the directions' corrections
    (:func:`_direction_corrections`): their Gram ``(k, k)`` and their products with the residuals ``(k,)``, summed
    over chunks of samples whose k corrections hold at most ``chunk_entries`` entries (the calibration's), never the
    k corrections of every sample at once (k times the values: 4 GiB at n = 1000, T = 128, d_v = 64, k = 64)."""
    P = coordinates[0]
    n, T, k = P.shape
    gram, cross = np.zeros((k, k)), np.zeros(k)
    step = max(1, int(chunk_entries) // max(k * T * Z.shape[2], 1))
    for start in range(0, n, step):
        part = slice(start, start + step)
        flat = _direction_corrections(tuple(c[part] for c in coordinates), attention[part], Z[part], weights,
                                      causal).reshape(k, -1)
        gram += flat @ flat.T
        cross += flat @ R[part].ravel()
    return gram, cross


def modulation_correction(coordinates, attention, Z, R, causal):
    """The offset-modulation weights ``(m, k)`` fitted on these samples: each direction's least squares
    (:func:`offset_modulation_sums`), then one scale per direction fitted jointly on their corrections
    (:func:`direction_scale_sums`)."""
    G, C = offset_modulation_sums(coordinates, attention, Z, R, causal)
    weights = np.stack([solve_psd(G[i], C[i]) for i in range(G.shape[0])])              # (k, m)
    scale = solve_psd(*direction_scale_sums(coordinates, attention, Z, R, weights, causal))
    return (weights * scale[:, None]).T


def _modulation_power(coordinates, attention, Z, R, coefficients, causal):
    """Each sample's ``||R_t - correction_t||^2`` summed over t, for offset-modulation ``coefficients`` (m, k)."""
    P, Kc = coordinates
    n, T, k = P.shape
    index, _ = _offset_index(T, causal)
    Yhat = attention @ Z
    weights = coefficients[index]                                        # (T, T, k): c_{t-s, i}
    delta = attention * np.einsum("nti,tsi,nsi->nts", P, weights, Kc)    # a_ts sum_i c p k
    correction = delta @ Z - delta.sum(axis=2, keepdims=True) * Yhat
    left = R - correction
    return np.einsum("ntv,ntv->n", left, left)


def _accumulate(sums, diff):
    """Add per-sample differences to ``[total, total of squares, count]`` (:func:`paired_excess`'s sums)."""
    sums[0] += float(diff.sum())
    sums[1] += float((diff**2).sum())
    sums[2] += diff.size


def cross_fitted_class_check(halves, models, outputs, alpha=DEFAULT_CALIBRATION.model_check_alpha, *,
                             head=None, causal=False):
    """Test a head fitted on two halves against heads that attend also by position (the module's third test).

    Each half's model is measured on the other half's samples (held-out residuals ``R_i``); those samples are split
    in two parts (alternately), the position-pair correction (:func:`position_pair_corrections` of the model's
    values) is fitted on one part and measured on the other, and the per-sample gain
    ``||R_i||^2 - ||R_i - sum_s c_ts z_is||^2 - ||f_h(X_i) - f_o(X_i)||^2`` (the last term, the two halves'
    disagreement, bounds in expectation what a correction can remove from a model that is in its class) is tested
    for a positive mean. Two parts of it are tested too: the correction by the pairs ``s <= t`` alone
    (``"earlier"``: order among the tokens a causal head reads, as positions make), and what the pairs ``s > t``
    add to it (``"later"``, per sample ``||R - C_{s<=t} Z||^2 - ||R - C Z||^2``: the mask).

    Parameters
    ----------
    halves : tuple of two (X, Y)
        The samples each half's model was fitted on (internal units).
    models : tuple of two (A, B, V)
        Each half's fitted query and key factors and value map.
    outputs : callable
        ``outputs(X, Z, A, B)``: a model's outputs ``P_i(A, B) Z_i`` (the fit's mask and positions bound in).
    alpha : float
        Level of the one-sided tests.
    head : callable, optional
        ``head(X, A, B)`` -> ``((p, k), attention)``: the model's query and key coordinates along its strongest
        directions and its attention. Given, the offset-modulation correction
        (:func:`modulation_correction`: each direction's logit term scaled by its own weight at each offset) is
        tested the same way (``"modulation"``): positions that change which contents match, which the pair
        correction does not see.
    causal : bool
        The fit's mask (the offsets the modulation has).

    Returns
    -------
    dict
        ``misfit_gain`` (the mean gain beyond the disagreement, as a fraction of the mean held-out residual),
        ``misfit_p``; ``misfit_groups``: ``{"earlier": (gain, p), "later": (gain, p)}`` likewise (and
        ``"modulation"`` where ``head`` is given); ``rejected``: ``"order"`` where the whole pair correction's test
        rejects, ``"modulation"`` where the modulation's does.

    Examples
    --------
    A bidirectional head fitted as a causal one:

    >>> import numpy as np
    >>> from rstar import RStarEstimator
    >>> from rstar.inversions._numerics.softmax_factored import factored_outputs
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((1000, 12, 8))
    >>> A, B, V = rng.standard_normal((8, 2)), rng.standard_normal((8, 2)), rng.standard_normal((8, 4))
    >>> Y = factored_outputs(X, X @ V, A, B)
    >>> Y += 0.05 * Y.std() * rng.standard_normal(Y.shape)
    >>> est = RStarEstimator(causal=True, value_map=V)
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     est = est.fit(X, Y)
    >>> est.model_check_["rejected"]
    ['order']
    """
    names = ("all", "earlier", "later") + (("modulation",) if head is not None else ())
    sums = {name: [0.0, 0.0, 0] for name in names}
    own_total, own_count = 0.0, 0
    for h in (0, 1):
        A, B, V = models[h]
        Ao, Bo, Vo = models[1 - h]
        X, Y = halves[1 - h]
        if X.shape[0] < 4:
            continue
        T = X.shape[1]
        Z = X @ V
        fitted = outputs(X, Z, A, B)
        R = Y - fitted
        D = fitted - outputs(X, X @ Vo, Ao, Bo)
        dis = np.einsum("ntv,ntv->n", D, D)
        own = np.einsum("ntv,ntv->n", R, R)
        own_total, own_count = own_total + float(own.sum()), own_count + own.size
        earlier = np.tril(np.ones((T, T), dtype=bool))
        part = np.arange(X.shape[0]) % 2
        if head is not None:
            coordinates, attention = head(X, A, B)
        for k in (0, 1):
            fit, test = part != k, part == k
            if head is not None:
                sub = tuple(c[fit] for c in coordinates)
                coefficients = modulation_correction(sub, attention[fit], Z[fit], R[fit], causal)
                power = _modulation_power(tuple(c[test] for c in coordinates), attention[test], Z[test], R[test],
                                          coefficients, causal)
                _accumulate(sums["modulation"], own[test] - power - dis[test])
            power_all = _corrected_power(Z[test], R[test], position_pair_corrections(Z[fit], R[fit]))
            power_earlier = _corrected_power(Z[test], R[test], position_pair_corrections(Z[fit], R[fit], earlier))
            _accumulate(sums["all"], own[test] - power_all - dis[test])
            _accumulate(sums["earlier"], own[test] - power_earlier - dis[test])
            _accumulate(sums["later"], power_earlier - power_all)
    out = {"misfit_gain": None, "misfit_p": None, "misfit_groups": {}, "rejected": []}
    if own_count == 0:
        return out
    own_mean = own_total / own_count
    for name, (total, total_sq, n) in sums.items():
        mean, _, p_value = paired_excess(total, total_sq, n)
        gain = float(mean / own_mean) if own_mean > 0 else 0.0
        if name == "all":
            out["misfit_gain"], out["misfit_p"] = gain, p_value
            if p_value < alpha and mean > 0:
                out["rejected"].append("order")
        else:
            out["misfit_groups"][name] = (gain, p_value)
            if name == "modulation" and p_value < alpha and mean > 0:
                out["rejected"].append("modulation")
    return out


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


def model_check(operator_name, inversion, ws, stats, samples, alpha=None, directions=None):
    """The operator-class check a fit runs on its own samples, where it applies; its outcome, or None.

    Runs for linear query-key attention with T > d (any inversion: its test needs no operator) and for softmax
    attention where a least squares ran (the full-rank fit: its no-attention baseline; the factored and the rotary
    one: :func:`cross_fitted_class_check` on their halves; not the first order, which has model checks of its own:
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
    directions : int or None
        The query-key directions the factored and rotary check's offset modulation uses (the fit's count: the
        directions it says matter; None: all the halves fitted).

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
    if ws.inversion == getattr(inversion, "factored_name", None):
        # the factored or rotary least squares: its two halves' models, each measured on the other half
        parts = inversion.class_check_models(stats, ws, directions=directions)
        return cross_fitted_class_check(parts["halves"], parts["models"], parts["outputs"],
                                        DEFAULT_CALIBRATION.model_check_alpha if alpha is None else alpha,
                                        head=parts["head"], causal=parts["causal"])
    if ws.inversion != "softmax_least_squares":
        return None   # the check needs the class's least-squares fit; the first order has its own model checks
    operator = inversion.full_rank_operator(stats)   # the fit whiten made: no second fit
    if operator is None:
        return None
    return operator_class_check(samples, operator, exact_in_span=False, **kw)
