"""Kernel estimates shared by the least-squares inversions: their whitened statistic with simulated null
draws, the nearest Kronecker product of a normal matrix, and the closed-form operators used by ``predict``."""

import numpy as np
from scipy import linalg

from ._numerics import softmax_ls as _softmax_ls
from ._numerics.softmax_factored import causal_attention_weights
from ._numerics.linalg import kronecker_rearranged, psd_power, solve_psd, sym
from ._base import eigh_descending
from ._statistic import SimulatedNull, WhitenedStatistic

__all__ = ["kernel_statistic_with_null_draws", "kernel_in_basis", "nearest_kronecker_product"]


def kernel_statistic_with_null_draws(K, L, A, B, sigma2, dof, warnings, *, inversion, seed, n_draws,
                                     noise_source="least-squares residual"):
    """The whitened statistic of a least-squares kernel estimate K (d x d) whose noise is
    ``vec N ~ N(0, sigma2 (L L^T)^{-1})`` (row-major vec; L the Cholesky factor of its normal matrix or
    information): ``K~ K~^T / d`` with ``K~ = A^{1/2} K B^{1/2}`` (``A (x) B`` that matrix's nearest Kronecker
    product) and a :class:`SimulatedNull` of ``n_draws`` draws ``A^{1/2} N B^{1/2}`` (seeded with ``seed``)."""
    d = K.shape[0]
    A_half, B_half = psd_power(A, 0.5), psd_power(B, 0.5)
    A_inv_half, B_inv_half = psd_power(A, -0.5), psd_power(B, -0.5)
    Kt = A_half @ K @ B_half
    lam, vecs = eigh_descending(Kt @ Kt.T / d)
    lam = np.clip(lam, 0.0, None)
    rng = np.random.default_rng(seed)
    Z = linalg.solve_triangular(L, rng.standard_normal((d * d, n_draws)), lower=True, trans="T",
                                check_finite=False) * np.sqrt(sigma2)   # sigma L^{-T} z
    draws = np.einsum("ab,bcj,cd->jad", A_half, Z.reshape(d, d, n_draws), B_half, optimize=True)
    null = SimulatedNull(Kt, lam, float(d), draws, float(sigma2), float(dof), noise_source,
                         factors=(L, A_half, B_half, A_inv_half, B_inv_half))
    return WhitenedStatistic(lam, vecs, A_inv_half, float(d), null, inversion, (), warnings)


def kernel_in_basis(H, rhs, U):
    """Least-squares kernel ``K = U B`` (range in the columns of ``U``, d x r) from the normal
    equations ``H vec K = rhs`` of a row-major ``vec K`` (``H``: d^2 x d^2)."""
    d, r = U.shape
    if r == 0:
        return np.zeros((d, d))
    J = np.kron(U, np.eye(d))  # vec_row(U B) = J vec_row(B)
    b = solve_psd(J.T @ H @ J, J.T @ rhs)
    return U @ b.reshape(r, d)


class LinearQKOperator:
    def __init__(self, K, V):
        self.K, self.V = K, V

    def predict(self, X):
        return np.einsum("nta,ab,nsb,nsc,cv->ntv", X, self.K, X, X, self.V, optimize=True)


class SoftmaxOperator:
    def __init__(self, K, V, causal=False):
        self.K, self.V, self.causal = K, V, causal

    def predict(self, X):
        if getattr(self, "causal", False):
            return causal_attention_weights(X, self.K) @ (X @ self.V)
        return _softmax_ls.attention_weights(X, self.K) @ (X @ self.V)


def nearest_kronecker_product(H, d, n_iter=100):
    """Symmetric PSD ``A, B`` (d x d) with ``kron(A, B)`` closest to ``H`` in Frobenius norm.

    Van Loan & Pitsianis (1993): the rearrangement
    ``R[(i,k),(j,l)] = H[(i,j),(k,l)]`` turns the problem into a rank-one
    approximation, solved here by power iteration.

    Parameters
    ----------
    H : ndarray of shape (d*d, d*d)
    d : int

    Returns
    -------
    A, B : ndarray of shape (d, d)
    """
    return _kronecker_factors(kronecker_rearranged(H, d), d, n_iter)


def _kronecker_factors(R, d, n_iter=100):
    """:func:`nearest_kronecker_product` from the rearranged matrix ``R``."""
    v = np.eye(d).ravel() / np.sqrt(d)
    for _ in range(n_iter):
        u = R @ v
        nu = np.linalg.norm(u)
        if nu == 0:
            break
        u /= nu
        v_new = R.T @ u
        s = np.linalg.norm(v_new)
        v_new /= s
        if np.linalg.norm(v_new - v) < 1e-12:
            v = v_new
            break
        v = v_new
    s = float(u @ R @ v)
    A, B = sym(u.reshape(d, d)), sym(v.reshape(d, d))
    if np.trace(A) < 0:
        A, B = -A, -B
    if np.trace(B) < 0:
        A, B, s = A, -B, -s
    scale = np.sqrt(abs(s))
    return psd_power(A, 1.0) * scale, psd_power(B, 1.0) * scale


class LinearProxyOperator:
    """``Y = A X V`` (the linear proxy's closed-form operator)."""

    def __init__(self, A, V):
        self.A, self.V = A, V

    def predict(self, X):
        return np.einsum("st,ntd,dv->nsv", self.A, X, self.V, optimize=True)
