"""First-order query–key inversion ``M_i = X_i^+ Y_i`` (theory §4; class B1, and B2 to first order)."""

import numpy as np

from ._numerics import bilinear as _bilinear
from ._numerics.linalg import batched_pseudo_inverse, psd_power, solve_psd, sym
from ..exceptions import IllConditionedInversionWarning
from ._base import Inversion, whiten_pair
from ._kernel import LinearQKOperator, SoftmaxOperator
from ._statistic import CoherentEvidence, Finding, StructuredBulkNull, WhitenedStatistic, WishartNull

__all__ = ["QueryKeyInversion", "coherent_spectrum", "predict_sums_fit", "centred_token_kurtosis"]

def predict_sums_fit(budget, d, d_v):
    """Whether the query–key moment sums behind ``predict`` (``d^4`` and ``d^3 d_v`` entries) fit the memory
    budget (each at most half of it)."""
    return budget.allows_array(d**4) and budget.allows_array(d**3 * d_v)


def coherent_spectrum(M_sum, N_coherent):
    """Eigenvalues of the whitened first moment of the query–key inversion.

    For linear QK with ``T >= d`` every sample gives ``M_i = X_i^+ Y_i =
    K G_i V + X_i^+ E_i`` exactly, so the weighted sum
    ``M = sum_i w_i M_i = K (sum_i w_i G_i) V + E'`` has its signal in
    range(K) with rank ``min(r*, rank V)``, and its noise columns are
    independent ``N(0, sigma2 N_c)`` with ``N_c = sum_i w_i^2 (X_i^T X_i)^+``
    (Gaussian noise: exactly). ``W = N_c^{-1/2} M`` (d × d_v) then has white
    noise, and the eigenvalues of ``W W^T / d_v`` (or of ``W^T W / d`` when
    ``d > d_v``, the same non-zero spectrum rescaled) follow a white Wishart
    with ``p = min(d, d_v)`` rows and ``m = max(d, d_v)`` columns at level
    ``sigma2``, plus spikes. Because the signal adds coherently over samples
    while the noise adds incoherently, a direction of K whose spike in the
    second-moment statistic is ``theta`` has about ``n theta`` here: spikes
    far below that statistic's BBP threshold stand out, as long as V does not
    crush them (the signal is ``K G V``, not ``K``) and ``d_v >= r*``.

    Parameters
    ----------
    M_sum : ndarray of shape (d, d_v)
    N_coherent : ndarray of shape (d, d)

    Returns
    -------
    eigenvalues : ndarray of shape (min(d, d_v),)
        Descending.
    n_columns : float
        ``max(d, d_v)``.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.inversions import QueryKeyInversion
    >>> X, Y = make_attention_task(500, kind="linear_qk", seq_len=24, n_features=8, rank=2, random_state=0)
    >>> inv = QueryKeyInversion()
    >>> stats = inv.new_stats(24, 8, 8)
    >>> inv.update(stats, X, Y)
    >>> ws = inv.whiten(stats)
    >>> from rstar.inversions import CoherentEvidence
    >>> coherent = ws.evidence_of(CoherentEvidence)
    >>> lam = coherent.eigenvalues / ws.noise_variance   # white Wishart 8 x 8 (edge 4) plus 2 spikes
    >>> int(np.sum(lam > 10)), coherent.n_columns
    (2, 8.0)
    """
    M_sum = np.asarray(M_sum, dtype=np.float64)
    N_coherent = np.asarray(N_coherent, dtype=np.float64)
    if M_sum.ndim != 2 or M_sum.size == 0:
        raise ValueError(f"M_sum must be a non-empty 2-D array (d, d_v), got shape {M_sum.shape}.")
    d, d_v = M_sum.shape
    if N_coherent.shape != (d, d):
        raise ValueError(f"N_coherent must have shape ({d}, {d}) to match M_sum, got {N_coherent.shape}.")
    if not (np.all(np.isfinite(M_sum)) and np.all(np.isfinite(N_coherent))):
        raise ValueError("M_sum and N_coherent must be finite.")
    W = psd_power(N_coherent, -0.5) @ M_sum
    S = W @ W.T / d_v if d <= d_v else W.T @ W / d
    lam = np.clip(np.linalg.eigvalsh(sym(S))[::-1], 0.0, None)
    return lam, float(max(d, d_v))


def _weighted_gram(R, scale):
    """``sum_i sum_k scale[i, k]^2 r_ik r_ik^T`` for rows ``r_ik = R[i, k]`` (R of shape (n, k, d), scale of shape
    (n, k) or (n, 1)): one matrix product over the stacked scaled rows."""
    B = (R * scale[:, :, None]).reshape(-1, R.shape[2])
    return B.T @ B


def pseudo_inverse_fit(Xc, Yc, tokens_eff):
    """Per sample, from one SVD of ``X_i`` (``batched_pseudo_inverse``): ``M_i = X_i^+ Y_i``, the SVD factors, and
    the residual power of ``Y_i`` outside ``col(X_i)`` with its degrees of freedom ``(tokens_eff - rank) d_v``.

    Returns
    -------
    M : ndarray of shape (n, d, d_v)
    svd : tuple ``(U, inv_s, Wt, smallest, rank)``
    y_sq, res, dof : ndarray of shape (n,)
    """
    svd = batched_pseudo_inverse(Xc)
    U, inv_s, Wt, _, rank = svd
    M = np.einsum("nka,nk,ntk,ntv->nav", Wt, inv_s, U, Yc, optimize=True)
    fitted = np.einsum("nta,nav->ntv", Xc, M, optimize=True)
    y_sq = np.sum(Yc**2, axis=(1, 2))
    res = np.maximum(y_sq - np.sum(fitted**2, axis=(1, 2)), 0.0)
    dof = np.maximum(tokens_eff - rank, 0) * Yc.shape[2]
    return M, svd, y_sq, res, dof


def first_order_misfit_sums(X, Y, operator):
    """A chunk's ``(sum_i r_i / o_i, number of samples with o_i > 0)``: ``r_i`` the residual power per entry of
    ``Y_i - operator.predict(X_i)``, ``o_i`` that per degree of freedom of ``P Y_i`` outside ``col(P X_i)``
    (``P`` the token centring), as the first-order sums measure it (:func:`pseudo_inverse_fit`)."""
    T, d_v = X.shape[1], Y.shape[2]
    R = Y - operator.predict(X)
    r = np.einsum("ntv,ntv->n", R, R) / (T * d_v)
    _, _, _, res, dof = pseudo_inverse_fit(X - X.mean(axis=1, keepdims=True), Y - Y.mean(axis=1, keepdims=True),
                                           T - 1)
    ok = (dof > 0) & (res > np.finfo(float).tiny)
    return float(np.sum(r[ok] / (res[ok] / dof[ok]))), int(ok.sum())


def _centred_token_gram(X, Y):
    """A chunk's ``(sum_i (P X_i)^T P X_i, number of tokens)``."""
    Xc = X - X.mean(axis=1, keepdims=True)
    return np.einsum("ntd,nte->de", Xc, Xc, optimize=True), Xc.shape[0] * Xc.shape[1]


def _centred_token_fourth_moments(X, Y, whitener):
    """A chunk's ``(sum_i m_i, sum_i m_i**2, n)``, ``m_i`` the mean over sample i's centred tokens of their squared
    whitened norm, squared."""
    Z = (X - X.mean(axis=1, keepdims=True)) @ whitener
    m = np.mean(np.sum(Z**2, axis=2) ** 2, axis=1)
    return float(np.sum(m)), float(np.sum(m**2)), m.size


def centred_token_kurtosis(samples):
    """Mardia's multivariate kurtosis of the centred tokens ``P X_i``, over its Gaussian value, and its standard error.

    Each centred token of i.i.d. Gaussian tokens is Gaussian, with covariance ``(1 - 1/T) Sigma``: whitened by
    the pooled covariance of the centred tokens (rank p), its squared norm has mean p and second moment
    ``p (p + 2)``. The ratio is about 1 for Gaussian tokens (any covariance), below 1 for tokens of nearly fixed
    norm, and above 1 for heavy-tailed tokens; it is affine invariant. Two passes over ``samples``; the
    standard error is over samples (so tokens of one sequence may depend on each other).

    Parameters
    ----------
    samples : rstar.streaming.Samples

    Returns
    -------
    (float, float)
        ``(ratio, standard_error)``; ``(nan, nan)`` without two samples or a non-zero centred token.
    """
    T, d = samples.dims[:2]
    sums = samples.map_sum(_centred_token_gram, 2 * T * d)
    if sums is None or sums[1] == 0:
        return float("nan"), float("nan")
    gram, count = sums
    w, U = np.linalg.eigh(sym(gram / count))
    keep = w > max(w[-1], 0.0) * 1e-10
    p = int(np.sum(keep))
    if p == 0:
        return float("nan"), float("nan")
    s1, s2, n = samples.map_sum(_centred_token_fourth_moments, 2 * T * d, U[:, keep] / np.sqrt(w[keep]))
    if n < 2:
        return float("nan"), float("nan")
    mean = s1 / n
    var = max(s2 / n - mean**2, 0.0) * n / (n - 1)
    ref = p * (p + 2)
    return mean / ref, float(np.sqrt(var / n)) / ref


class QueryKeyInversion(Inversion):
    """Query–key inversion ``M_i = X_i^+ Y_i`` (theory §4; B1, and B2 to first order).

    Columns of ``M_i = K* G_i V* + X_i^+ E_i`` lie in range(K*) whatever V* is.
    ``C = sum_i w_i M_i M_i^T`` and noise Gram ``N = d_v sum_i w_i (X_i^T X_i)^+``
    with sample weights ``w_i = sigma_min(X_i)^2``: each weighted sample then
    has noise covariance at most ``sigma2 I``, which tames the heavy tail of
    ``(X_i^T X_i)^{-1}`` near ``T = d`` (MP hard edge) without moving the
    columns out of range(K*). The effective number of MP columns ``m``
    matches the second moment of the whitened null spectrum: with
    ``A_i = w_i G_i^+``, ``m = d_v (sum_i tr A_i)^2 / sum_i [(tr A_i)^2 + tr A_i^2]``.

    Parameters
    ----------
    centred : bool, default=False
        Centre X and Y over tokens first (``P X``, ``P Y``): the first-order
        softmax inversion, since ``P softmax(Z) X V ~ P Z P X V / T`` near
        uniform attention; it also holds exactly for linear-QK data.
    residual_noise : bool, default=True
        Estimate ``sigma2`` from the part of ``Y_i`` outside ``col(X_i)``
        (exact for linear QK when ``T > d``). For softmax data this residual
        also holds the higher-order terms, and its power per degree of freedom
        matches the level of the structured bulk they leave inside
        ``col(X_i)`` (checked numerically: within 5% over T = 16..64,
        d = 8..32, logit scale 1..6).
    structured_bulk : bool or None
        Flag the bulk as wider than white noise (default: ``centred``).
    value_map : ndarray or None
        Known V: used by ``fit_operator``.
    reweight : bool or None
        Divide each sample's weight by its residual power per degree of
        freedom ``rho_i`` (default: ``centred``), when every sample has at
        least the calibration's ``min_sample_dof`` residual degrees of freedom
        (``(T_eff - d) d_v >= 20`` by default). For softmax data the residual holds the
        higher-order terms, whose power varies from sample to sample by
        orders of magnitude with heavy-tailed tokens (a mixture of MP laws
        that no single bulk fits); weighting by ``1 / rho_i`` is generalised
        least squares across samples and leaves the columns in range(K*).
        The residual outside ``col(X_i)`` is independent of the noise inside
        it, so the weights do not bias the statistic.
    budget, seed, n_null_draws, calibration
        See :class:`rstar.inversions.Inversion`.
    """

    def __init__(self, centred=False, residual_noise=True, value_map=None, structured_bulk=None, reweight=None, *,
                 predict_sums=True, budget=None, seed=None, n_null_draws=None, calibration=None):
        super().__init__(value_map, budget=budget, seed=seed, n_null_draws=n_null_draws, calibration=calibration)
        self.centred = centred
        self.predict_sums = predict_sums
        self.residual_noise = residual_noise
        self.structured_bulk = centred if structured_bulk is None else structured_bulk
        self.reweight = centred if reweight is None else reweight

    @property
    def first_order_name(self):
        """The name of the first-order inversion these sums give: softmax's when centred, linear QK's otherwise."""
        return "softmax_first_order" if self.centred else "query_key_first_order"

    @property
    def name(self):
        return self.first_order_name

    def _reweighted(self, T, d, d_v):
        T_eff = self._tokens_eff(T)
        return bool(self.reweight) and (T_eff - min(T_eff, d)) * d_v >= self.calibration.min_sample_dof

    def min_samples(self, T, d, d_v):
        # the noise Gram sum_i w_i (X_i^T X_i)^+ must have full rank d
        T_eff = max(self._tokens_eff(T), 1)
        return max(2, -(-d // min(T_eff, d)) + 1)

    def new_stats(self, T, d, d_v):
        moments = self.predict_sums and predict_sums_fit(self.budget, d, d_v)
        return {
            "dims": (T, d, d_v),
            "n": 0,
            "C": np.zeros((d, d)),
            "N": np.zeros((d, d)),
            "s1": 0.0,
            "s2": 0.0,
            "s2_within": 0.0,
            "w1": 0.0,
            "w2": 0.0,
            "res": 0.0,
            "res_dof": 0.0,
            "res_w": 0.0,
            "wt": 0.0,
            "n_deficient": 0,
            "HZ": np.zeros((d, d, d, d)) if moments else None,
            "FZ": np.zeros((d, d, d, d_v)) if moments else None,
            "xbar_xbar": np.zeros((d, d)),
            "xbar_ybar": np.zeros((d, d_v)),
            # first moment, read only by the linear (uncentred) inversion
            "M_sum": None if self.centred else np.zeros((d, d_v)),
            "N_coherent": None if self.centred else np.zeros((d, d)),
        }

    def _tokens_eff(self, T):
        return T - 1 if self.centred else T

    def update(self, stats, X, Y):
        n, T, d = X.shape
        d_v = Y.shape[2]
        xbar, ybar = X.mean(axis=1), Y.mean(axis=1)
        if self.centred:
            Xc, Yc = X - xbar[:, None, :], Y - ybar[:, None, :]
        else:
            Xc, Yc = X, Y
        # M_i = X_i^+ Y_i and (X_i^T X_i)^+ = Wt_i^T diag(inv_s_i^2) Wt_i from one SVD per sample
        M, (U, inv_s, Wt, smallest, rank), y_sq, res_i, dof_i = pseudo_inverse_fit(Xc, Yc, self._tokens_eff(T))
        w = smallest
        if self._reweighted(T, d, d_v):
            power = y_sq / (T * d_v)
            rho = np.maximum(res_i / np.maximum(dof_i, 1), 1e-8 * power + np.finfo(float).tiny)
            # a sample whose outputs are exactly zero carries no information on K (and 1 / rho would overflow)
            w = np.divide(w, rho, out=np.zeros_like(w), where=y_sq > 0)
        stats["n"] += n
        # the weighted sums as single matrix products over the chunk (no per-sample d x d temporaries):
        # sum_i w_i M_i M_i^T and sum_i w_i (X_i^T X_i)^+ (the rows of Wt_i are orthonormal)
        stats["C"] += _weighted_gram(np.swapaxes(M, 1, 2), np.sqrt(w)[:, None])
        stats["N"] += _weighted_gram(Wt, np.sqrt(w)[:, None] * inv_s)
        # first moment: sum_i w_i M_i = K (sum_i w_i G_i) V + noise of covariance sigma2 sum_i w_i^2 G_i^+
        if stats.get("M_sum") is not None:
            stats["M_sum"] += np.einsum("n,nav->av", w, M)
            stats["N_coherent"] += _weighted_gram(Wt, w[:, None] * inv_s)
        tr = np.sum(inv_s**2, axis=1) * w
        stats["s1"] += float(tr.sum())
        stats["s2"] += float(np.sum(tr**2))
        stats["s2_within"] += float(np.sum(w**2 * np.sum(inv_s**4, axis=1)))
        # residual power per dof, weighted as the whitened bulk weights each sample
        stats["res_w"] += float(np.sum(tr * res_i / np.maximum(dof_i, 1)))
        stats["wt"] += float(np.sum(tr[dof_i > 0]))
        stats["w1"] += float(w.sum())
        stats["w2"] += float(np.sum(w**2))
        stats["res"] += float(res_i.sum())
        stats["res_dof"] += float(dof_i.sum())
        stats["n_deficient"] += int(np.sum(rank < min(self._tokens_eff(T), d)))
        if stats["HZ"] is not None:
            G = np.einsum("nta,ntb->nab", Xc, Xc, optimize=True)
            HZ, FZ = _bilinear.moment_sums(G, M, w)
            stats["HZ"] += HZ
            stats["FZ"] += FZ
        stats["xbar_xbar"] += xbar.T @ xbar
        stats["xbar_ybar"] += xbar.T @ ybar

    def whiten(self, stats, run=None):
        self._check_run(run)
        return self._first_order_statistic(stats)

    def _first_order_statistic(self, stats):
        """The first-order statistic of these sums (also the fallback of the least-squares inversions)."""
        name = self.first_order_name
        T, d, d_v = stats["dims"]
        warnings = []
        if stats["s1"] <= 0:
            # every sample degenerate (e.g. T = 1 with centring): no information
            lam = np.zeros(d)
            return WhitenedStatistic(lam, np.eye(d), np.eye(d), float(max(stats["n"] * d_v, 1)), WishartNull(), name,
                                     (), warnings)
        # Match the second moment of the whitened null spectrum: with per-sample noise
        # covariances A_i = w_i (X_i^T X_i)^+ (d_v columns each) and a noise Gram close to a
        # multiple of I, (1/p) E tr S^2 = sigma^4 (1 + p / m) with
        # m = d_v (sum_i tr A_i)^2 / sum_i [(tr A_i)^2 + tr A_i^2].
        # The tr A_i^2 term counts that a sample's d_v columns share one anisotropic covariance;
        # it matters near T = d, where A_i has a few dominant directions, and when T < d.
        m_eff = d_v * stats["s1"] ** 2 / (stats["s2"] + stats["s2_within"])
        T_eff = self._tokens_eff(T)
        lam, vecs, unwhiten = whiten_pair(stats["C"], d_v * stats["N"])
        aspect = min(T_eff, d) / max(T_eff, d)
        if aspect > self.calibration.ill_conditioned_aspect:
            warnings.append((IllConditionedInversionWarning,
                             f"the query-key inversion is ill-conditioned: {'T-1' if self.centred else 'T'}"
                             f"={T_eff} tokens is close to d={d} features (hard edge of the Marchenko-Pastur "
                             "law), so X_i^+ amplifies noise. Fallback in use: samples are weighted by "
                             "sigma_min(X_i)^2 and the noise Gram is whitened; the estimate rests on the "
                             "better-conditioned samples and may be unreliable. Use T >= 1.5 d or more samples."))
        # whether the shape identifies r* is rstar.rules.identifiability's to decide
        findings = [Finding("first_order_shape", {"centred": bool(self.centred), "tokens": T_eff, "features": d})]
        noise, dof = None, stats["res_dof"]
        # residual power per dof, each sample weighted as the whitened bulk weights it
        min_dof = self.calibration.min_noise_dof
        power = stats["res_w"] / stats["wt"] if dof >= min_dof and stats["wt"] > 0 else None
        if self.residual_noise and dof >= min_dof:
            if self._reweighted(T, d, d_v):
                noise = power
            else:
                noise = max(stats["res"], 0.0) / dof
        # With T < d, X_i^+ X_i is a random projector: the signal leaks a flat,
        # non-white bulk (theory §4); the rule decides from its size whether to
        # fit it like the softmax one.
        leak = (d - T_eff) / (d * T_eff) if 0 < T_eff < d else None
        coherent = None
        if (not self.centred and noise is not None and T_eff > d and stats["n_deficient"] == 0
                and stats.get("M_sum") is not None):
            coherent = coherent_spectrum(stats["M_sum"], stats["N_coherent"])
        min_columns = stats["w1"] ** 2 / stats["w2"] if stats["w2"] > 0 else None
        source = "residual outside col(X_i)" if noise is not None else ("fitted bulk" if self.structured_bulk else "bulk")
        if self.structured_bulk:
            null = StructuredBulkNull(noise, float(dof), source, min_columns, power)
        else:
            null = WishartNull(noise, float(dof), source, min_columns, leak)
        evidence = () if coherent is None else (CoherentEvidence(coherent[0], coherent[1]),)
        return WhitenedStatistic(lam, vecs, unwhiten, float(m_eff), null, name, evidence, warnings,
                                 findings=findings)

    def first_order_operator(self, stats, basis):
        """The first-order closed-form operator in the span of ``basis`` (:meth:`fit_operator` of this class, also
        for subclasses whose own operator is another fit); None without its moment sums."""
        return QueryKeyInversion.fit_operator(self, stats, basis)

    def first_order_misfit(self, stats, operator, samples):
        """The facts of the first-order softmax model check on ``samples`` (a dict: ``kind`` ``"misfit"`` with
        ``ratio``, or ``"kurtosis"`` with ``kurtosis`` and its ``se``; and ``tokens``, T - 1, and ``features``, d),
        else None; whether they reject the model is
        :func:`rstar.rules.identifiability.first_order_misfit_verdict`'s to decide.

        With ``T - 1 > d``: ``ratio`` is the mean over samples of the first-order ``operator``'s residual power
        per entry of ``Y_i`` over the power per degree of freedom of ``P Y_i`` outside ``col(P X_i)``, which
        softmax data fill with the noise plus the higher-order terms (:func:`first_order_misfit_sums`; per sample,
        so heavy-tailed tokens, whose large samples are large in both, do not tip it). About 1 without a signal
        and below it with one where the model holds; above the calibration's ``first_order_misfit`` the operator
        misses structure the expansion near uniform attention cannot hold, and the statistic's spikes are not the
        kernel's.

        With ``T - 1 <= d`` there is no such yardstick, and the statistic's null holds for Gaussian tokens only:
        the centred tokens' multivariate kurtosis over its Gaussian value (:func:`centred_token_kurtosis`), with
        its standard error; the gate rejects where it exceeds ``1 + first_order_max_kurtosis`` by more than a
        few standard errors (heavy-tailed tokens, real hidden states); ``operator`` is not used.

        None where no check applies: ``operator`` None with ``T - 1 > d``, no sample with a residual outside
        the span, or not the softmax first order.
        """
        T, d, _ = stats["dims"]
        if not self.centred:
            return None
        if T - 1 <= d:
            kurt, se = centred_token_kurtosis(samples)
            return {"kind": "kurtosis", "kurtosis": kurt, "se": se, "tokens": T - 1, "features": d}
        if operator is None:
            return None
        total, count = samples.map_sum(first_order_misfit_sums, T, operator)
        if not count > 0:
            return None
        return {"kind": "misfit", "ratio": total / count, "tokens": T - 1, "features": d}

    def fit_operator(self, stats, basis):
        if stats["HZ"] is None:
            return None
        T, d, _ = stats["dims"]
        V = self.value_map
        if not self.centred:
            L, R = _bilinear.fit_bilinear(stats["HZ"], stats["FZ"], basis.T, R_known=V)
            return LinearQKOperator(L, R)
        # First-order softmax: M_i ~ K (X^T P X) V / (T sqrt(d)), scale (K, V) ~ (aK, V/a).
        c = T * np.sqrt(d)
        if V is not None:
            L, _ = _bilinear.fit_bilinear(stats["HZ"], stats["FZ"], basis.T, R_known=V / c)
            return SoftmaxOperator(L, V)
        Sxx, Sxy = stats["xbar_xbar"], stats["xbar_ybar"]
        if basis.shape[0] == 0:
            return SoftmaxOperator(np.zeros((d, d)), solve_psd(Sxx, Sxy))
        L, R = _bilinear.fit_bilinear(stats["HZ"], stats["FZ"], basis.T)
        # token means: mean_t Y ~ mean_t X V to first order, which fixes the scale of V
        denom = float(np.sum(R * (Sxx @ R)))
        beta = float(np.sum(Sxy * R)) / denom if denom > 0 else 0.0
        if beta == 0.0 or not np.isfinite(beta):
            return SoftmaxOperator(np.zeros((d, d)), solve_psd(Sxx, Sxy))
        return SoftmaxOperator(L * c / beta, beta * R)


