"""Exact softmax inversion with a known value map (theory §4, class B2)."""

import numpy as np

from ._numerics.linalg import psd_power, solve_psd, sym
from ..exceptions import IllConditionedInversionWarning
from ..marchenko_pastur import MEDIAN_EFFICIENCY, mp_median
from ..calibration import DEFAULT_CALIBRATION
from ._base import Inversion, eigh_descending
from ._kernel import SoftmaxOperator, kernel_in_basis, nearest_kronecker_product
from ._statistic import Finding, SplitHalfEvidence, StructuredBulkNull, WhitenedStatistic, WishartNull

__all__ = ["SoftmaxExactInversion", "exact_softmax_shape_ok", "exact_softmax_memory_fits"]


def exact_softmax_shape_ok(T, d, d_v):
    """Whether ``X_i V`` can have full row rank T (``d >= T`` and ``d_v >= T``)."""
    return d >= T and d_v >= T


def exact_softmax_well_conditioned(T, d, d_v, *, calibration=DEFAULT_CALIBRATION):
    """Whether ``S_i = Y_i (X_i V)^+`` is well conditioned: ``T <= 0.9 min(d, d_v)`` (MP hard edge; 0.9 the
    calibration's ``ill_conditioned_aspect``)."""
    return T <= calibration.ill_conditioned_aspect * min(d, d_v)


def exact_softmax_memory_fits(budget, d):
    """Whether its two ``d^2 x d^2`` normal matrices (all samples, odd half) fit the memory budget."""
    return budget.allows_kernel_matrix(d)


class SoftmaxExactInversion(Inversion):
    """Exact softmax inversion with a known V (theory §4), for ``d, d_v >= T``.

    ``S_i = Y_i (X_i V)^+`` recovers the attention matrix; each entry gives the
    equation ``x_j^T K x_k / sqrt(d) - c_ij = log S_ijk`` with a per-row
    nuisance ``c_ij`` (the log-normaliser). Noisy ``S`` is clipped to
    ``[clip / T, 1]`` before the log, and the equations are weighted by
    ``(T S_ijk)^2`` (delta method: ``Var log S ~ Var S / S^2``); the row
    nuisances are removed by weighted centring (Frisch–Waugh). ``K`` is the
    weighted least-squares solution of the pooled system. The statistic is
    ``K~ K~^T / d`` with ``K~ = A^{1/2} K B^{1/2}``, where ``A (x) B`` is the
    nearest Kronecker product (Van Loan & Pitsianis 1993) to the normal
    matrix; its noise part is MP with ratio 1 scaled by the log-domain
    residual variance.

    Parameters
    ----------
    value_map : ndarray of shape (d, d_v)
    clip : float, default=1e-3
    budget, seed, n_null_draws, calibration
        See :class:`rstar.inversions.Inversion`.
    """

    name = "softmax_exact"

    def __init__(self, value_map, clip=1e-3, *, budget=None, seed=None, n_null_draws=None, calibration=None):
        super().__init__(value_map, budget=budget, seed=seed, n_null_draws=n_null_draws, calibration=calibration)
        self.clip = clip

    def min_samples(self, T, d, d_v):
        # n T (T - 1) log-attention equations for d^2 unknowns (plus the row nuisances)
        return max(2, -(-d * d // max(T * (T - 1), 1)) + 1)

    def new_stats(self, T, d, d_v):
        if not exact_softmax_memory_fits(self.budget, d):
            raise ValueError(f"the exact softmax inversion's two d^2 x d^2 normal matrices at d={d} need "
                             f"{2 * 8 * d**4 / 2**30:.3g} GiB, over the memory budget ({self.budget.describe()}); "
                             "raise memory_budget or use the first-order inversion (method='first_order').")
        return {"dims": (T, d, d_v), "n": 0, "H": np.zeros((d * d, d * d)), "rhs": np.zeros(d * d),
                "n_odd": 0, "H_odd": np.zeros((d * d, d * d)), "rhs_odd": np.zeros(d * d), "ll": 0.0, "n_eq": 0.0,
                "n_rows": 0.0, "n_clipped": 0.0, "n_entries": 0.0}

    def update(self, stats, X, Y, chunk=256):
        n = X.shape[0]
        # the sums of samples with odd global index are also kept apart: the split-half
        # difference of the two estimates is a draw of the estimate's noise (see whiten)
        odd = (stats["n"] + np.arange(n)) % 2 == 1
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            for is_odd in (False, True):
                mask = odd[part] == is_odd
                if not mask.any():
                    continue
                sums = self._sums(X[part][mask], Y[part][mask])
                for key, value in sums.items():
                    stats[key] += value
                if is_odd:
                    stats["H_odd"] += sums["H"]
                    stats["rhs_odd"] += sums["rhs"]
        stats["n"] += n
        stats["n_odd"] += int(odd.sum())

    def _sums(self, Xb, Yb):
        """This inversion's sums over the samples ``Xb, Yb`` (one chunk)."""
        T, d = Xb.shape[1], Xb.shape[2]
        V = self.value_map
        XV = Xb @ V
        gram = XV @ np.swapaxes(XV, 1, 2)
        S = np.swapaxes(np.linalg.solve(gram, XV @ np.swapaxes(Yb, 1, 2)), 1, 2)
        lo = self.clip / T
        n_clipped = float(np.sum((S < lo) | (S > 1)))
        S = np.clip(S, lo, 1.0)
        w = (T * S) ** 2
        logS = np.log(S)
        wsum = w.sum(axis=2, keepdims=True)
        # weighted centring over k within each row j
        xk_mean = np.einsum("njk,nkb->njb", w, Xb) / wsum
        l_mean = np.sum(w * logS, axis=2, keepdims=True) / wsum
        lt = logS - l_mean
        # Each equation's regressor is phi_jk = x_j (x) (x_k - m_j) / sqrt(d), m_j the weighted
        # mean, so sum_k w_jk phi_jk phi_jk^T = (x_j x_j^T) (x) B_j / d with
        # B_j = sum_k w_jk (x_k - m_j)(x_k - m_j)^T: O(n T d^4) instead of O(n T^2 d^4).
        B = (np.einsum("njk,nka,nkb->njab", w, Xb, Xb, optimize=True)
             - wsum[..., None] * np.einsum("nja,njb->njab", xk_mean, xk_mean))
        # sum_k w_jk lt_jk (x_k - m_j) = sum_k w_jk lt_jk x_k, since sum_k w_jk lt_jk = 0
        g = np.einsum("njk,nkc->njc", w * lt, Xb, optimize=True)
        return {
            "H": np.einsum("nja,njb,njce->acbe", Xb, Xb, B, optimize=True).reshape(d * d, d * d) / d,
            "rhs": np.einsum("nja,njc->ac", Xb, g, optimize=True).reshape(-1) / np.sqrt(d),
            "ll": float(np.sum(w * lt**2)),
            "n_eq": float(w.size),
            "n_rows": float(Xb.shape[0] * T),
            "n_clipped": n_clipped,
            "n_entries": float(S.size),
        }

    def _split_half_noise(self, stats, A_half, B_half):
        """Eigenvalues of the whitened split-half noise draw, or None if a half is too small."""
        T, d, d_v = stats["dims"]
        n_odd = stats["n_odd"]
        need = self.min_samples(T, d, d_v)  # for each half
        if min(n_odd, stats["n"] - n_odd) < need:
            return None
        k_odd = solve_psd(stats["H_odd"], stats["rhs_odd"])
        k_even = solve_psd(stats["H"] - stats["H_odd"], stats["rhs"] - stats["rhs_odd"])
        Z = A_half @ ((k_odd - k_even) / 2).reshape(d, d) @ B_half
        return np.sort(np.linalg.eigvalsh(sym(Z @ Z.T / d)))[::-1]

    def _solve(self, stats):
        return solve_psd(stats["H"], stats["rhs"])

    def whiten(self, stats, run=None):
        self._check_run(run)
        d = stats["dims"][1]
        k = self._solve(stats)
        dof = stats["n_eq"] - stats["n_rows"] - d * d
        resid = stats["ll"] - float(k @ stats["H"] @ k)
        tau2 = max(resid, 0.0) / dof if dof > 0 else None
        A, B = nearest_kronecker_product(stats["H"], d)
        A_half, B_half = psd_power(A, 0.5), psd_power(B, 0.5)
        K = k.reshape(d, d)
        Kt = A_half @ K @ B_half
        lam, vecs = eigh_descending(Kt @ Kt.T / d)
        warnings = []
        T, _, d_v = stats["dims"]
        if T > self.calibration.ill_conditioned_aspect * min(d, d_v):
            warnings.append((IllConditionedInversionWarning,
                             f"the exact softmax inversion is ill-conditioned: T={T} tokens is close to "
                             f"min(d, d_v)={min(d, d_v)} (hard edge of the Marchenko-Pastur law), so "
                             "S_i = Y_i (X_i V)^+ amplifies noise and the log-attention bulk spreads over decades. "
                             "Use method='auto' (first-order inversion here) or T <= 0.9 min(d, d_v)."))
        frac = stats["n_clipped"] / max(stats["n_entries"], 1.0)
        if frac > self.calibration.exact_clipped_fraction:
            warnings.append((IllConditionedInversionWarning,
                             f"{100 * frac:.1f}% of the recovered attention weights fell outside "
                             f"[{self.clip}/T, 1] and were clipped before the log: much of the exact softmax "
                             "inversion is noise-dominated. Fallback in use: equations are weighted by (T S)^2, "
                             "so clipped ones carry little weight; check the gap in spectrum_."))
        # Clipping and the weights leave a bulk wider than MP(ratio 1) at the log-domain
        # residual variance tau2, so tau2 is only reported. The noise level comes from the
        # split-half draw: (K_odd - K_even) / 2 has the noise law of the pooled estimate
        # (misspecification included), and its whitened spectrum is MP(ratio 1) shaped.
        null = self._split_half_noise(stats, A_half, B_half)
        if null is not None and np.median(null) > 0:
            noise = float(np.median(null) / mp_median(1.0))
            return WhitenedStatistic(lam, vecs, psd_power(A, -0.5), float(d),
                                     WishartNull(noise, MEDIAN_EFFICIENCY * d * d, "split-half draw",
                                                 mp_shaped_bulk=False),
                                     self.name, (SplitHalfEvidence(null, tau2),), warnings, "log-attention")
        # a half too small to solve: fit the bulk's level and width instead
        finding = Finding("exact_noise_level", {"n_samples": int(stats["n"]), "half_too_small": null is None,
                                                "min_samples": self.min_samples(*stats["dims"])})
        return WhitenedStatistic(lam, vecs, psd_power(A, -0.5), float(d),
                                 StructuredBulkNull(None, float(max(dof, 0)), "fitted bulk", mp_shaped_bulk=False),
                                 self.name, (SplitHalfEvidence(null, tau2),), warnings, "log-attention",
                                 findings=[finding])

    def fit_operator(self, stats, basis):
        return SoftmaxOperator(kernel_in_basis(stats["H"], stats["rhs"], basis.T), self.value_map)


