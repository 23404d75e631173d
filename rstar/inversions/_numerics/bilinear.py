"""Closed-form fit of a rank-constrained bilinear "sandwich" model from moment sums.

Model, for per-sample targets ``T_i`` (a x e) and regressors ``Z_i`` (b x c)::

    T_i ~ L Z_i R,   L = U B  (U: a x r orthonormal, known),  R: c x e

fitted by alternating least squares (each step an exact linear solve) using
only the sums

    HZ[b, c, b', c'] = sum_i w_i Z_i[b, c] Z_i[b', c']
    FZ[b, c, a, e]   = sum_i w_i Z_i[b, c] T_i[a, e]

so that the fit streams with ``partial_fit``. The linear proxy is
``Y_i ~ A X_i V`` (Z_i = X_i); the query–key inversion is
``M_i ~ K G_i V`` (Z_i = X_i^T X_i).
"""

import numpy as np
from scipy import optimize

from ...calibration import DEFAULT_CALIBRATION
from .linalg import kronecker_rearranged, solve_psd, sym


def moment_sums(Z, Tgt, w):
    """Weighted moment sums of one batch.

    Parameters
    ----------
    Z : ndarray of shape (n, b, c)
    Tgt : ndarray of shape (n, a, e)
    w : ndarray of shape (n,)

    Returns
    -------
    HZ : ndarray of shape (b, c, b, c)
    FZ : ndarray of shape (b, c, a, e)
    """
    n, b, c = Z.shape
    _, a, e = Tgt.shape
    Zf = Z.reshape(n, b * c)
    Zw = Zf * w[:, None]
    HZ = (Zw.T @ Zf).reshape(b, c, b, c)
    FZ = (Zw.T @ Tgt.reshape(n, a * e)).reshape(b, c, a, e)
    return HZ, FZ


class _Contractions:
    """The moment sums rearranged once so every ALS step is a matrix-vector product."""

    def __init__(self, HZ, FZ):
        b, c = HZ.shape[:2]
        a, e = FZ.shape[2:]
        self.shape = (a, b, c, e)
        self.H = HZ.transpose(0, 2, 1, 3).reshape(b * b, c * c)  # [(b,B),(c,C)]
        self.F_b = FZ.transpose(2, 0, 1, 3).reshape(a * b, c * e)  # [(a,b),(c,e)]
        self.F_r = FZ.transpose(0, 2, 1, 3).reshape(b * a, c * e)  # [(b,a),(c,e)]

    def b_step(self, U, R):
        a, b, c, e = self.shape
        lhs = (self.H @ (R @ R.T).ravel()).reshape(b, b)
        rhs = (self.F_b @ R.ravel()).reshape(a, b)
        return solve_psd(sym(lhs), (U.T @ rhs).T).T

    def r_step(self, U, B):
        """Least-squares R given B, and the sum of squares it explains, ``tr(R^T rhs)``."""
        a, b, c, e = self.shape
        lhs = ((B.T @ B).ravel() @ self.H).reshape(c, c)
        rhs = ((B.T @ U.T).ravel() @ self.F_r).reshape(c, e)
        R = solve_psd(sym(lhs), rhs)
        return R, float(np.sum(R * rhs))


def fit_bilinear(HZ, FZ, U, R_known=None, max_iter=500, tol=1e-9, fit_tol=None):
    """Fit ``L = U B`` and ``R`` of the sandwich model by alternating least squares.

    Parameters
    ----------
    HZ, FZ : ndarray
        Moment sums from :func:`moment_sums` (accumulated over all batches).
    U : ndarray of shape (a, r)
        Orthonormal basis of the range of L (from the rank rule).
    R_known : ndarray of shape (c, e) or None
        A known right factor (e.g. a known value map): then only ``B`` is
        solved, in one step.
    max_iter : int, default=500
    tol : float, default=1e-9
        Stop when the relative change of ``B`` and ``R`` falls below it.
    fit_tol : float or None, default=None
        Also stop when an iteration raises the explained sum of squares by
        less than this fraction of it. For callers that need a good fit
        rather than converged factors: where the model is weakly identified
        (e.g. no signal) the factors drift along nearly flat directions for
        hundreds of iterations while the fit no longer moves.

    Returns
    -------
    L : ndarray of shape (a, b)
    R : ndarray of shape (c, e)
    """
    b, c = HZ.shape[:2]
    a, e = FZ.shape[2:]
    r = U.shape[1]
    if r == 0:
        return np.zeros((a, b)), (np.zeros((c, e)) if R_known is None else R_known)
    ops = _Contractions(HZ, FZ)
    if R_known is not None:
        return U @ ops.b_step(U, R_known), R_known
    # initial guess: L = U U^T restricted to the first r rows/cols of Z's range
    B = U.T[:, :b] if a == b else np.eye(r, b)
    B, R = _alternate(lambda R: ops.b_step(U, R), lambda B: ops.r_step(U, B), B, max_iter, tol, fit_tol)
    return U @ B, R


def _alternate(b_step, r_step, B, max_iter, tol, fit_tol):
    """The alternating least squares loop shared by the two fits: ``r_step(B) -> (R, explained)``."""
    R, explained = r_step(B)
    tiny = np.finfo(float).tiny
    for _ in range(max_iter):
        B_prev, R_prev, explained_prev = B, R, explained
        B = b_step(R)
        norm = np.linalg.norm(B)
        if norm == 0:
            break
        B = B / norm  # fix the scale ambiguity (B, R) ~ (sB, R/s)
        R, explained = r_step(B)
        change = np.linalg.norm(B - B_prev) / max(np.linalg.norm(B), tiny) + np.linalg.norm(
            R - R_prev) / max(np.linalg.norm(R), tiny)
        if change < tol:
            break
        if fit_tol is not None and explained - explained_prev <= fit_tol * max(abs(explained), tiny):
            break
    return B, R


def _token_gram(A, B):
    """``sum_i A_i B_i^T`` over a stack of (n, T, e) arrays: a T x T matrix."""
    n, T, e = A.shape
    return A.transpose(1, 0, 2).reshape(T, n * e) @ B.transpose(1, 0, 2).reshape(T, n * e).T


def fit_bilinear_samples(Z, Tgt, max_iter=500, tol=1e-9, fit_tol=None):
    """Fit ``T_i ~ L Z_i R`` with a full ``L`` (a x a, a = rows of Z) from the samples themselves.

    The same alternating least squares as :func:`fit_bilinear` with
    ``U = I``, for when the moment sums (``(b c)^2`` entries) are too large to
    keep but the samples are not: each step is a pass over the samples
    (``O(n a c (a + e))`` per iteration) instead of a product with the sums.

    Parameters
    ----------
    Z : ndarray of shape (n, a, c)
    Tgt : ndarray of shape (n, a, e)
    max_iter, tol, fit_tol
        As in :func:`fit_bilinear`.

    Returns
    -------
    L : ndarray of shape (a, a)
    R : ndarray of shape (c, e)
    """
    n, a, c = Z.shape
    e = Tgt.shape[2]
    Zf = Z.reshape(n * a, c)

    def r_step(B):
        LZ = np.matmul(B, Z).reshape(n * a, c)
        lhs, rhs = LZ.T @ LZ, LZ.T @ Tgt.reshape(n * a, e)
        R = solve_psd(sym(lhs), rhs)
        return R, float(np.sum(R * rhs))

    def b_step(R):
        ZR = (Zf @ R).reshape(n, a, e)
        return solve_psd(sym(_token_gram(ZR, ZR)), _token_gram(Tgt, ZR).T).T

    return _alternate(b_step, r_step, np.eye(a), max_iter, tol, fit_tol)


def query_key_normal_matrix(G, B):
    """``H = sum_i G_i (x) B_i B_i^T`` (``d^2 x d^2``, row-major ``vec K``): the normal matrix of
    ``Y_i ~ X_i K B_i`` in K, with ``G_i = X_i^T X_i`` (n, d, d) and ``B_i`` (n, d, e)."""
    n, d, _ = G.shape
    BB = np.matmul(B, np.swapaxes(B, 1, 2)).reshape(n, d * d)
    # its rearrangement R[(a,a'),(b,b')] = sum_i G_i[a,a'] (B_i B_i^T)[b,b'] is one matrix product
    return kronecker_rearranged(G.reshape(n, d * d).T @ BB, d)


def fit_query_key_samples(X, Y, K0, max_iter=200, fit_tol=1e-7):
    """Least-squares fit of linear QK attention ``Y_i ~ X_i K (X_i^T X_i) V`` with K and V unknown.

    Alternating least squares on the samples: given K, V solves a ``d x d``
    system; given V, ``vec K`` solves the ``d^2 x d^2`` system with normal
    matrix :func:`query_key_normal_matrix` (``B_i = G_i V``). The objective is
    not convex (the factors can swap roles, e.g. K and its transpose when
    ``T < d``), so the result depends on ``K0``; see
    :func:`fit_query_key_restarts`.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)
    K0 : ndarray of shape (d, d)
        Starting kernel (its scale is irrelevant).
    max_iter : int, default=200
    fit_tol : float, default=1e-7
        Stop when an iteration raises the explained sum of squares by less
        than this fraction of it.

    Returns
    -------
    K : ndarray of shape (d, d)
        Unit Frobenius norm (the scale sits in V).
    V : ndarray of shape (d, d_v)
    rss : float
        Residual sum of squares of the fit.
    """
    return _query_key_als(X, Y, _query_key_grams(X, Y), K0, max_iter, fit_tol)


def _query_key_grams(X, Y):
    """``(G_i = X_i^T X_i, F_i = X_i^T Y_i, sum ||Y_i||^2)``: what every iteration of the fit reads."""
    Xt = np.swapaxes(X, 1, 2)
    return np.matmul(Xt, X), np.matmul(Xt, Y), float(np.sum(Y**2))


def _query_key_als(X, Y, grams, K0, max_iter, fit_tol):
    """The loop of :func:`fit_query_key_samples`, given :func:`_query_key_grams`."""
    n, T, d = X.shape
    G, F, yy = grams

    def v_step(K):
        P = np.matmul(X, K @ G).reshape(n * T, d)   # rows of X_i K G_i
        rhs = P.T @ Y.reshape(n * T, -1)
        V = solve_psd(sym(P.T @ P), rhs)
        return V, float(np.sum(V * rhs))

    K = np.asarray(K0, dtype=float)
    K = K / max(np.linalg.norm(K), np.finfo(float).tiny)
    V, explained = v_step(K)
    for _ in range(max_iter):
        B = np.matmul(G, V)
        rhs = np.tensordot(F, B, axes=([0, 2], [0, 2])).ravel()   # sum_i F_i B_i^T
        k = solve_psd(sym(query_key_normal_matrix(G, B)), rhs)
        norm = np.linalg.norm(k)
        if norm == 0:
            break
        K = k.reshape(d, d) / norm
        previous = explained
        V, explained = v_step(K)
        if explained - previous <= fit_tol * max(abs(explained), np.finfo(float).tiny):
            break
    return K, V, max(yy - explained, 0.0)


def fit_query_key_restarts(X, Y, starts, probe_iter=20, max_iter=200, fit_tol=1e-7):
    """:func:`fit_query_key_samples` from several starting kernels: each runs ``probe_iter``
    iterations, and the one with the smallest residual is run on to convergence.

    Returns
    -------
    K, V, rss
        As :func:`fit_query_key_samples`.
    """
    grams = _query_key_grams(X, Y)
    best = None
    for K0 in starts:
        fit = _query_key_als(X, Y, grams, K0, probe_iter, fit_tol)
        if best is None or fit[2] < best[2]:
            best = fit
    return _query_key_als(X, Y, grams, best[0], max_iter, fit_tol)


class QueryKeyProfileLoss:
    """The residual of ``Y_i ~ X_i K G_i V`` with V profiled out: a function of K alone.

    Variable projection (Golub & Pereyra 1973): for each K the best V is a
    ``d x d`` least-squares solve, so the residual sum of squares
    ``f(K) = min_V sum_i ||Y_i - X_i K G_i V||^2`` is a function of K, with
    gradient ``-2 sum_i X_i^T R_i V^T G_i`` at the optimal V (the residuals
    ``R_i`` are orthogonal to every change of V). Each evaluation costs
    ``O(n T d (d + d_v))`` and never forms the ``d^2 x d^2`` normal matrix
    of the kernel, so it scales to large d; quasi-Newton steps on it do not
    stall on the flat valleys where alternating least squares creeps
    (Ruhe & Wedin 1980).

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)
    """

    def __init__(self, X, Y):
        n, T, d = X.shape
        self.d = d
        self._X = X.reshape(n * T, d)
        self._Y = Y.reshape(n * T, -1)
        self._G = np.matmul(np.swapaxes(X, 1, 2), X)

    def _fit_value_map(self, k):
        n, d = self._G.shape[0], self.d
        P = np.matmul((self._X @ k.reshape(d, d)).reshape(n, -1, d), self._G).reshape(-1, d)   # rows X_i K G_i
        V = solve_psd(P.T @ P, P.T @ self._Y)
        return P, V, self._Y - P @ V

    def value_map(self, K):
        """The least-squares V for kernel K and the residual sum of squares: ``(V, rss)``."""
        _, V, R = self._fit_value_map(np.ravel(K))
        return V, float(np.sum(R**2))

    def __call__(self, k):
        """``(f, grad f)`` at the row-major ``vec K`` k (for :func:`scipy.optimize.minimize`)."""
        n, d = self._G.shape[0], self.d
        _, V, R = self._fit_value_map(k)
        W = np.matmul((R @ V.T).reshape(n, -1, d), self._G).reshape(-1, d)   # rows R_i V^T G_i
        return float(np.sum(R**2)), -2.0 * (self._X.T @ W).ravel()


def _minimise_profile(loss, K0, max_iter, ftol):
    k0 = np.ravel(K0) / max(np.linalg.norm(K0), np.finfo(float).tiny)
    res = optimize.minimize(loss, k0, jac=True, method="L-BFGS-B",
                            options={"maxiter": max_iter, "gtol": 0.0, "ftol": ftol, "maxcor": 20})
    return res.x / max(np.linalg.norm(res.x), np.finfo(float).tiny), float(res.fun)


def fit_query_key_profiled(X, Y, starts, probe_iter=30, max_iter=500, ftol=DEFAULT_CALIBRATION.profile_ftol):
    """Least-squares fit of ``Y_i ~ X_i K (X_i^T X_i) V`` by quasi-Newton steps on the profile loss.

    L-BFGS (scipy) on :class:`QueryKeyProfileLoss` from each starting
    kernel for ``probe_iter`` iterations; the start with the smallest loss
    then runs on until an iteration lowers the loss by less than
    ``ftol`` of it, or ``max_iter`` iterations (a single start
    runs on at once). The same fit as
    :func:`fit_query_key_restarts` at ``O(n T d (d + d_v))`` per iteration
    instead of ``O(n d^4 + d^6)``.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)
    starts : sequence of ndarray of shape (d, d)
    probe_iter : int, default=30
    max_iter : int, default=500
    ftol : float, default=1e-10
        The calibration's ``profile_ftol`` (:mod:`rstar.calibration`).

    Returns
    -------
    K : ndarray of shape (d, d)
        Unit Frobenius norm.
    V : ndarray of shape (d, d_v)
    rss : float
    """
    loss = QueryKeyProfileLoss(X, Y)
    if len(starts) == 1:
        k = starts[0]
    else:
        k = min((_minimise_profile(loss, K0, probe_iter, ftol) for K0 in starts), key=lambda probe: probe[1])[0]
    k, _ = _minimise_profile(loss, k, max_iter, ftol)
    V, rss = loss.value_map(k)
    return k.reshape(loss.d, loss.d), V, rss
