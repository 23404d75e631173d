"""Token inversion of the linear proxy ``Y = A X V`` (theory §4, class B0)."""

import numpy as np
from scipy import linalg

from ._numerics import bilinear as _bilinear
from ._numerics.linalg import sym
from ..calibration import DEFAULT_CALIBRATION
from ._base import (
    Inversion,
    eigh_descending,
    keep_half_samples,
    kept_half,
    start_keeping_samples,
)
from ._kernel import LinearProxyOperator
from ._statistic import CoherentEvidence, WhitenedStatistic, WishartNull

__all__ = ["TokenInversion", "proxy_coherent_spectrum", "moment_sums_fit"]

def moment_sums_fit(budget, T, d, d_v):
    """Whether the linear proxy's moment sums (``(T d)^2`` and ``T d T d_v`` entries, and the odd half's copy)
    fit the memory budget (each array at most half of it)."""
    return budget.allows_array((T * d) ** 2) and budget.allows_array(T * d * T * d_v)


class TokenInversion(Inversion):
    """Token inversion for the linear proxy ``Y = A* X V* + E`` (theory §4).

    ``C = sum_i Y_i Y_i^T / (n d_v)`` (T x T): signal of rank r* = rank(A*),
    noise ``sigma2 I_T`` with ``m = n d_v`` columns. The noise variance comes
    from the residual of the unconstrained linear regression of ``vec Y`` on
    ``vec X`` when ``n > T d`` (it is exact under the linear proxy), else
    from the bulk. ``fit_operator`` fits ``A = U B`` and ``V`` by alternating
    least squares on the moment sums. A coherent split-half statistic
    (:func:`proxy_coherent_spectrum`) comes with it, from the moment sums
    or, beyond their budget, from the samples kept for it.

    Examples
    --------
    >>> from rstar.datasets import make_linear_proxy
    >>> from rstar.inversions import TokenInversion
    >>> X, Y = make_linear_proxy(500, random_state=0)
    >>> inv = TokenInversion()
    >>> stats = inv.new_stats(16, 12, 12)
    >>> inv.update(stats, X, Y)
    >>> ws = inv.whiten(stats)
    >>> ws.eigenvalues.shape, int((ws.eigenvalues > 0.1).sum())
    ((16,), 3)
    """

    space = "tokens"
    name = "token"

    def statistic_dim(self, T, d):
        return T

    def new_stats(self, T, d, d_v):
        # the odd half's copy of the moment sums has the same size: it fits when they do
        moments = split = moment_sums_fit(self.budget, T, d, d_v)
        stats = {
            "dims": (T, d, d_v),
            "n": 0,
            "YY": np.zeros((T, T)),
            "yy": 0.0,
            "HZ": np.zeros((T, d, T, d)) if moments else None,
            "FZ": np.zeros((T, d, T, d_v)) if moments else None,
            # the same sums over the samples with odd global index, for the coherent statistic
            "HZ_odd": np.zeros((T, d, T, d)) if split else None,
            "FZ_odd": np.zeros((T, d, T, d_v)) if split else None,
            "n_odd": 0,
            "yy_odd": 0.0,
            # beyond the moment sums' budget, the samples of each half (lists of (X, Y); merge concatenates)
            "samples_odd": None,
            "samples_even": None,
        }
        if not moments:
            start_keeping_samples(stats, self.budget)
        return stats

    def update(self, stats, X, Y):
        n = X.shape[0]
        odd = (stats["n"] + np.arange(n)) % 2 == 1
        stats["n"] += n
        stats["YY"] += np.einsum("nta,nsa->ts", Y, Y, optimize=True)
        stats["yy"] += float(np.sum(Y**2))
        stats["n_odd"] += int(odd.sum())
        stats["yy_odd"] += float(np.sum(Y[odd] ** 2))
        keep_half_samples(stats, X, Y, odd)   # over budget: no coherent statistic
        if stats["HZ"] is None:
            return
        if stats.get("HZ_odd") is None:
            HZ, FZ = _bilinear.moment_sums(X, Y, np.ones(n))
            stats["HZ"] += HZ
            stats["FZ"] += FZ
            return
        # each sample's moments once: the odd and even halves, whose sum is the whole
        for is_odd in (True, False):
            mask = odd == is_odd
            if not mask.any():
                continue
            HZ, FZ = _bilinear.moment_sums(X[mask], Y[mask], np.ones(int(mask.sum())))
            stats["HZ"] += HZ
            stats["FZ"] += FZ
            if is_odd:
                stats["HZ_odd"] += HZ
                stats["FZ_odd"] += FZ

    def whiten(self, stats, run=None):
        self._check_run(run)
        n = stats["n"]
        T, _, d_v = stats["dims"]
        m = n * d_v
        lam, vecs = eigh_descending(stats["YY"] / m)
        noise, dof = None, 0.0
        Td = T * stats["dims"][1]
        min_dof = self.calibration.min_noise_dof
        if stats["HZ"] is not None and T * d_v * (n - Td) >= min_dof:
            fitted, rank_H = _regression_fit(stats["HZ"].reshape(Td, Td), stats["FZ"].reshape(Td, -1))
            dof = T * d_v * n - rank_H * T * d_v
            if dof >= min_dof:
                noise = max(stats["yy"] - fitted, 0.0) / dof
        coherent, coh_noise, coh_dof = None, None, None
        if stats.get("HZ_odd") is not None or stats.get("samples_odd") is not None:
            coherent = proxy_coherent_spectrum(stats, calibration=self.calibration)
            if coherent is not None and noise is None:
                # n <= T d: no regression residual; the even half's restricted residual serves the
                # coherent test alone (the second-moment test keeps its bulk estimate)
                coh_noise, coh_dof = coherent[2], coherent[3]
                if coh_noise is None:
                    coherent = None
        null = WishartNull(noise, float(max(dof, 0)), "regression residual" if noise is not None else "bulk")
        evidence = () if coherent is None else (CoherentEvidence(coherent[0], coherent[1], coh_noise, coh_dof),)
        return WhitenedStatistic(lam, vecs, np.eye(T), float(m), null, self.name, evidence)

    def fit_operator(self, stats, basis):
        if stats["HZ"] is None:
            return None
        L, R = _bilinear.fit_bilinear(stats["HZ"], stats["FZ"], basis.T, R_known=self.value_map)
        return LinearProxyOperator(L, R)


def proxy_coherent_spectrum(stats, *, calibration=DEFAULT_CALIBRATION):
    r"""Coherent statistic of the linear proxy from split-half fits (None if a half is too small).

    Under ``Y_i = A X_i V + E_i`` every sample carries the same A, so a
    regression that pools the samples adds their signal *coherently*, while
    ``Σ Y_i Y_i^T`` adds it incoherently. V is estimated from the samples
    with odd global index, by alternating least squares of the bilinear model
    with a full-rank A (:func:`rstar.inversions._numerics.bilinear.fit_bilinear` on their moment
    sums; it needs far fewer than the ``T d`` samples of the unconstrained
    regression of ``vec Y`` on ``vec X``), and normalised to ``U``. Given
    ``U``, the model on the other samples is *linear* in A:
    ``Y_i ≈ Â (X_i U)``, the restricted regression with normal matrix
    ``Ω = Σ_even (X_i U)(X_i U)^T`` (T × T; a contraction of the moment sums
    with ``U U^T``) and right-hand side ``R = Σ_even Y_i (X_i U)^T``.
    Because ``U`` is independent of the even samples' noise, the rows of
    ``Â = R Ω^{-1}`` are independent ``N(·, sigma2 Ω^{-1})``, so
    ``W = Â Ω^{1/2}`` has white noise and the eigenvalues of ``W W^T / T``
    are a white T × T Wishart at level ``sigma2`` plus a signal
    ``A Q`` (``Q`` a T × T matrix) of rank at most r\*. The residual of the
    same restricted regression gives an independent, exactly chi-square
    estimate of ``sigma2`` with ``n_even T d_v - T^2`` degrees of freedom,
    used when the unconstrained regression has none (``n <= T d``).

    Where the moment sums exceed half the memory budget the inversion keeps
    the samples of each half instead (while they number at most
    the memory budget): the same fit, each
    iteration a pass over the odd samples
    (:func:`rstar.inversions._numerics.bilinear.fit_bilinear_samples`), and ``Ω``, ``R`` from one
    pass over the even ones. The bilinear fit stops after the calibration's
    ``coherent_max_iter`` iterations or once one adds less than
    ``coherent_fit_tol`` of the explained sum of squares: U only sets the
    power.

    Parameters
    ----------
    stats : dict
        :class:`TokenInversion` statistics with the odd-sample moment sums.
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``coherent_max_iter``, ``coherent_fit_tol`` and ``min_noise_dof`` (:mod:`rstar.calibration`).

    Returns
    -------
    (eigenvalues, n_columns, noise_variance, noise_dof) or None
        ``noise_variance`` is None when the restricted residual has fewer
        than the calibration's ``min_noise_dof`` degrees of freedom.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_linear_proxy
    >>> from rstar.inversions import TokenInversion, proxy_coherent_spectrum
    >>> X, Y = make_linear_proxy(1000, seq_len=8, n_features=6, value_dim=6, rank=2, random_state=0)
    >>> inv = TokenInversion()
    >>> stats = inv.new_stats(8, 6, 6)
    >>> inv.update(stats, X, Y)
    >>> lam, m, sigma2, dof = proxy_coherent_spectrum(stats)
    >>> int(np.sum(lam / sigma2 > 10)), m          # white 8 x 8 Wishart (edge 4) plus 2 spikes
    (2, 8.0)
    >>> # the restricted residual also holds the misfit of the estimated U: a little above the noise
    >>> round(sigma2 / inv.whiten(stats).noise_variance, 2)
    1.03
    """
    T, d, d_v = stats["dims"]
    n_odd, n_even = stats["n_odd"], stats["n"] - stats["n_odd"]
    # the odd half must identify the bilinear model (T^2 + d d_v parameters) and the even half A given U
    if n_odd * T * d_v < 2 * (T * T + d * d_v) or n_odd * T < 2 * d or n_even * d_v < 2 * T:
        return None
    samples = stats.get("HZ_odd") is None
    if samples:
        if not stats.get("samples_odd") or not stats.get("samples_even"):
            return None
        X_odd, Y_odd = kept_half(stats, "samples_odd")
        _, U = _bilinear.fit_bilinear_samples(X_odd, Y_odd, max_iter=calibration.coherent_max_iter,
                                              fit_tol=calibration.coherent_fit_tol)
        del X_odd, Y_odd
    else:
        _, U = _bilinear.fit_bilinear(stats["HZ_odd"], stats["FZ_odd"], np.eye(T),
                                      max_iter=calibration.coherent_max_iter, fit_tol=calibration.coherent_fit_tol)
    scale = np.linalg.norm(U)
    if not (np.isfinite(scale) and scale > 0):
        return None
    U = U / scale
    if samples:
        omega, R = np.zeros((T, T)), np.zeros((T, T))
        for X_e, Y_e in stats["samples_even"]:
            XU = np.matmul(X_e, U)
            omega += _bilinear._token_gram(XU, XU)
            R += _bilinear._token_gram(Y_e, XU)
    else:
        UU = U @ U.T
        # the even half's contractions as whole minus odd (no even-half copy of the sums)
        omega = (np.einsum("ab,satb->st", UU, stats["HZ"], optimize=True)
                 - np.einsum("ab,satb->st", UU, stats["HZ_odd"], optimize=True))
        R = (np.einsum("satv,av->ts", stats["FZ"], U, optimize=True)
             - np.einsum("satv,av->ts", stats["FZ_odd"], U, optimize=True))
    vals, vecs = np.linalg.eigh(sym(omega))
    if not vals.min() > 1e-12 * vals.max():
        return None
    W = R @ (vecs / np.sqrt(vals)) @ vecs.T   # Â Ω^{1/2} = R Ω^{-1/2}
    lam = np.clip(np.linalg.eigvalsh(sym(W @ W.T / T))[::-1], 0.0, None)
    dof = n_even * T * d_v - T * T
    noise = None
    if dof >= calibration.min_noise_dof:
        noise = max(stats["yy"] - stats["yy_odd"] - float(np.sum(W**2)), 0.0) / dof
    return lam, float(T), noise, float(dof)


def _regression_fit(H, F):
    """Explained sum of squares ``tr(F^T H^+ F)`` of a least-squares fit and the rank of ``H``."""
    H = sym(H)
    try:
        factor = linalg.cho_factor(H, check_finite=False)
        diag = np.abs(np.diag(factor[0]))
        if diag.min() > 1e-6 * diag.max():
            return float(np.sum(F * linalg.cho_solve(factor, F, check_finite=False))), H.shape[0]
    except linalg.LinAlgError:
        pass
    w, Q = np.linalg.eigh(H)
    keep = w > 1e-10 * max(w.max(), np.finfo(float).tiny)
    proj = Q[:, keep].T @ F
    return float(np.sum(proj**2 / w[keep, None])), int(keep.sum())


