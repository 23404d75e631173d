"""The error of a fitted value map and what it leaks into a least-squares kernel (pure functions on arrays).

The cross-fitted query–key inversion (:class:`rstar.inversions.QueryKeyCrossFitInversion`)
fits ``(K, V)`` of ``Y_i = X_i K G_i V + E_i`` (``G_i = X_i^T X_i``) on one
half of the samples and solves the least squares for K with that V on the
other half. An error ``dV = V^ - V*`` of the fitted V leaves the signal term
``-X_i K* G_i dV`` in the second half, which its least squares partly absorbs
into K: to first order the estimate of K moves by

    ``-H^{-1} vec( sum_i G_i K* G_i dV V^T G_i )``

(``H`` the second half's normal matrix in K). For a kernel of rank r* that
move is in general of full rank, so with a strong kernel and heavy-tailed
tokens it can exceed every draw of the noise in the directions beyond r*: an
over-count that the exact known-V null cannot see.

This module linearises it. The error of the fitted V is Gaussian to first
order with covariance ``sigma2 P^{-1}``, where ``P`` is the Gauss–Newton
information of the first half in V *profiled over K* (the Schur complement
``H_VV - H_VK H_KK^{-1} H_KV``): the delta method for a least-squares fit
(e.g. Seber & Wild, *Nonlinear Regression*, 1989, §2.1). Because only
``dV V^T`` enters the move above, V is first reduced to its row space,
``V = V~ Q^T`` with ``Q`` orthonormal (``V~`` of shape ``(d, min(d, d_v))``),
and ``dV = D Q^T``; the information in ``D`` has at most ``d^2`` dimensions
for any ``d_v``. Its direction ``D ~ V~`` only rescales K (``(K, V)`` and
``(K / c, c V)`` fit alike) and is left out of the draws.
"""

import copy

import numpy as np
from scipy import linalg

from ...calibration import DEFAULT_CALIBRATION
from .bilinear import query_key_normal_matrix
from .linalg import sym


def reduced_value_map(V):
    """``V~ = V Q`` (``d x m``, ``m = min(d, d_v)``) with ``Q`` an orthonormal basis of the row space of V, so that
    ``V = V~ Q^T`` and ``V V^T = V~ V~^T``."""
    U, s, _ = np.linalg.svd(np.asarray(V, dtype=float), full_matrices=False)
    return U * s


def _cross_information(G, K, Vr):
    """``C[(a,b),(c,e)] = sum_i (G_i K G_i)[a,c] (G_i V~)[b,e]``: the Gauss–Newton cross term between
    row-major ``vec K`` and ``vec D`` (``dV = D Q^T``) of the model ``X_i K G_i V``; shape ``(d^2, d m)``."""
    n, d, _ = G.shape
    m = Vr.shape[1]
    GKG = np.matmul(np.matmul(G, K), G).reshape(n, d * d)
    GV = np.matmul(G, Vr).reshape(n, d * m)
    return (GKG.T @ GV).reshape(d, d, d, m).transpose(0, 2, 1, 3).reshape(d * d, d * m)


def value_map_information(G, K, Vr):
    """Gauss–Newton information of ``Y_i ~ X_i K G_i V`` in the reduced value map D (``dV = D Q^T``), profiled
    over K: ``P = S (x) I_m - C^T H_KK^{-1} C`` with ``S = sum_i G_i K^T G_i K G_i``, ``H_KK`` the normal
    matrix in K and ``C`` the cross term.

    Parameters
    ----------
    G : ndarray of shape (n, d, d)
        The grams ``X_i^T X_i`` of the samples the value map was fitted on.
    K : ndarray of shape (d, d)
        The fitted kernel.
    Vr : ndarray of shape (d, m)
        :func:`reduced_value_map` of the fitted V.

    Returns
    -------
    P : ndarray of shape (d m, d m)
        Symmetric positive semi-definite; ``vec V~`` is (close to) a null direction.
    """
    d, m = Vr.shape
    H_KK = sym(query_key_normal_matrix(G, np.matmul(G, Vr)))
    C = _cross_information(G, K, Vr)
    S = sym(np.einsum("nab,nbc->ac", np.matmul(np.matmul(G, K.T), G), np.matmul(K, G), optimize=True))
    ridge = 1e-12 * max(np.trace(H_KK) / H_KK.shape[0], np.finfo(float).tiny)
    L = linalg.cholesky(H_KK + ridge * np.eye(d * d), lower=True, check_finite=False)
    W = linalg.solve_triangular(L, C, lower=True, check_finite=False)
    return sym(np.kron(S, np.eye(m)) - W.T @ W)


def value_map_error_draws(G, K, Vr, sigma2, n_draws, seed):
    """Draws of the linearised error ``D`` of a fitted value map (``dV = D Q^T``), ``N(0, sigma2 P^{-1})`` with P
    from :func:`value_map_information`, the scale direction ``D ~ V~`` removed.

    Parameters
    ----------
    G : ndarray of shape (n, d, d)
        The grams ``X_i^T X_i`` of the samples the value map was fitted on.
    K : ndarray of shape (d, d)
    Vr : ndarray of shape (d, m)
    sigma2 : float
        The fit's residual noise variance.
    n_draws : int
    seed : int

    Returns
    -------
    draws : ndarray of shape (n_draws, d, m)
    """
    d, m = Vr.shape
    P = value_map_information(G, K, Vr)
    v = Vr.ravel() / max(np.linalg.norm(Vr), np.finfo(float).tiny)
    scale = max(np.trace(P) / P.shape[0], np.finfo(float).tiny)
    # the scale direction carries no information (K / c, c V fit alike): give it the mean level, then drop it;
    # a tiny ridge keeps directions no sample sees finite
    L = linalg.cholesky(P + scale * np.outer(v, v) + 1e-10 * scale * np.eye(d * m), lower=True, check_finite=False)
    z = np.random.default_rng(seed).standard_normal((d * m, n_draws))
    D = linalg.solve_triangular(L, z, lower=True, trans="T", check_finite=False) * np.sqrt(sigma2)
    D -= np.outer(v, v @ D)
    return np.ascontiguousarray(D.T).reshape(n_draws, d, m)


class ValueMapErrorLeak:
    """What the error of a fitted value map moves a least-squares kernel by, in whitened draws.

    For the second half's samples (grams ``G_i``), the value map ``V~`` it
    was tested with, draws ``D_j`` of that map's error
    (:func:`value_map_error_draws`), the Cholesky factor ``L`` of its normal
    matrix ``H`` and the whitening ``K~ = A^{1/2} K B^{1/2}``, the move of
    the whitened estimate for a kernel K is the draws

        ``A^{1/2} (-H^{-1} vec(sum_i G_i K G_i D_j V~^T G_i)) B^{1/2}``,

    linear in K. :meth:`start` returns a :class:`LeakSum` that adds whitened
    rank-one kernels one at a time (the components of a rank-k truncation,
    as :func:`rstar.rules.simulated_null_p_values` tests them).

    Parameters
    ----------
    G : ndarray of shape (n, d, d)
    Vr : ndarray of shape (d, m)
    draws : ndarray of shape (B, d, m)
    L : ndarray of shape (d^2, d^2)
        Lower Cholesky factor of the normal matrix ``H`` (row-major ``vec K``).
    A_half, B_half : ndarray of shape (d, d)
        The whitening factors ``A^{1/2}``, ``B^{1/2}``.
    A_inv_half, B_inv_half : ndarray of shape (d, d)
        Their (pseudo-)inverses, which map a whitened kernel back.
    chunk_entries : int, default=2**22
        Entries of the per-chunk work array in :meth:`right_hand_sides` (a memory bound: the calibration's
        ``value_error_chunk_entries``, :mod:`rstar.calibration`).
    """

    def __init__(self, G, Vr, draws, L, A_half, B_half, A_inv_half, B_inv_half,
                 chunk_entries=DEFAULT_CALIBRATION.value_error_chunk_entries):
        self.G, self.Vr, self.draws, self.L = G, Vr, draws, L
        self.chunk_entries = int(chunk_entries)
        self.A_half, self.B_half = A_half, B_half
        self.A_inv_half, self.B_inv_half = A_inv_half, B_inv_half
        self._VG = np.matmul(Vr.T, G)                        # (n, m, d): V~^T G_i, the same for every kernel

    @property
    def n_draws(self):
        return self.draws.shape[0]

    def right_hand_sides(self, u, w):
        """``vec(sum_i G_i K G_i D_j V~^T G_i)`` for the whitened unit kernel ``u w^T``: shape ``(d^2, B)``."""
        n, d, _ = self.G.shape
        B, _, m = self.draws.shape
        a, b = self.A_inv_half @ u, self.B_inv_half @ w     # K = a b^T
        Ga, Gb = self.G @ a, self.G @ b                      # (n, d) each
        Dflat = np.ascontiguousarray(self.draws.transpose(1, 0, 2)).reshape(d, B * m)
        c = np.zeros((d, B * d))
        step = max(1, self.chunk_entries // (B * max(d, m)))
        for s in range(0, n, step):
            t = (Gb[s:s + step] @ Dflat).reshape(-1, B, m)   # b^T G_i D_j
            r = np.matmul(t, self._VG[s:s + step])                 # b^T G_i D_j V~^T G_i: (chunk, B, d)
            c += Ga[s:s + step].T @ r.reshape(-1, B * d)
        # c[a, (j, b)] = sum_i (G_i a)[a] r_ij[b]: the j-th right-hand side, row-major over (a, b)
        return c.reshape(d, B, d).transpose(0, 2, 1).reshape(d * d, B)

    def whitened_moves(self, rhs):
        """The whitened moves ``A^{1/2} (-H^{-1} rhs_j) B^{1/2}`` of right-hand sides ``rhs`` (``d^2 x B``)."""
        d = self.A_half.shape[0]
        move = -linalg.cho_solve((self.L, True), rhs, check_finite=False)
        move = np.ascontiguousarray(move.T).reshape(-1, d, d)
        return np.matmul(np.matmul(self.A_half, move), self.B_half)

    def start(self):
        """A fresh :class:`LeakSum` (no kernel yet)."""
        return LeakSum(self)

    def scaled(self, factor):
        """The same with the value map's error (and so every move) ``factor`` times as large."""
        out = copy.copy(self)   # shares every factor; only the draws differ
        out.draws = factor * self.draws
        return out


class LeakSum:
    """The moves of a kernel built one whitened rank-one component at a time (see :class:`ValueMapErrorLeak`).

    The right-hand sides add up cheaply; the moves (a ``d^2``-size solve per
    draw) are formed only when :meth:`draws` is called.
    """

    def __init__(self, leak):
        self.leak = leak
        self.rhs = None
        self._draws = None

    def add(self, u, w, weight):
        """Add ``weight * u w^T`` (whitened) to the kernel."""
        c = weight * self.leak.right_hand_sides(u, w)
        self.rhs = c if self.rhs is None else self.rhs + c
        self._draws = None

    def draws(self):
        """The current whitened moves, shape (B, d, d)."""
        if self._draws is None:
            d = self.leak.A_half.shape[0]
            B = self.leak.n_draws
            self._draws = (np.zeros((B, d, d)) if self.rhs is None else self.leak.whitened_moves(self.rhs))
        return self._draws
