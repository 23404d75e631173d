"""Least-squares fit of softmax attention and its Fisher information (pure functions on arrays).

Model (theory §2, class B2), for samples ``X_i`` (T x d) and ``Y_i`` (T x d_v)::

    Y_i = S_i X_i V + E_i,   S_i = softmax(X_i K X_i^T / sqrt(d))   (row-wise)

Under Gaussian noise the least-squares ``(K, V)`` is the maximum-likelihood
estimate. K is fitted at full rank (``d x d``) by L-BFGS, with V either known
or profiled out (variable projection, Golub & Pereyra 1973: for each K the
best V is one ``d x d`` linear solve). The Gauss–Newton information of K,
``F = J^T J`` with V profiled out (:func:`softmax_kernel_information_matrix`),
gives the first-order noise law ``N(0, sigma2 F^{-1})`` of the fitted K, from
which :class:`rstar.inversions.SoftmaxLeastSquaresInversion` draws its null.
"""

import numpy as np
from scipy import optimize

from ..._backend import NUMPY
from ...calibration import DEFAULT_CALIBRATION
from .linalg import solve_psd
from ...streaming import ArraySamples, Samples


def _as_samples(X, Y):
    """A :class:`rstar.streaming.Samples` source: ``X`` itself, or the arrays ``(X, Y)`` in memory."""
    return X if isinstance(X, Samples) else ArraySamples(X, Y)


def _attention(ops, X, K):
    S = (X @ (K / np.sqrt(X.shape[2]))) @ ops.transposed(X)
    return ops.softmax_rows(S)


def attention_weights(X, K):
    """Row-wise ``softmax(X_i K X_i^T / sqrt(d))`` for every sample.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    K : ndarray of shape (d, d)

    Returns
    -------
    S : ndarray of shape (n, T, T)
    """
    return _attention(NUMPY, X, K)


# -- per-chunk terms (written once for numpy and torch: rstar._backend) ---------------------------------------


def _value_terms(ops, X, Y, K):
    """A chunk's attention weights S, ``Z = S X`` and their shares of the value map's normal equations."""
    d, d_v = X.shape[2], Y.shape[2]
    S = _attention(ops, X, K)
    Z = S @ X
    Zf = Z.reshape(-1, d)
    return S, Z, Zf.T @ Zf, Zf.T @ Y.reshape(-1, d_v)


def value_map_sums(X, Y, K, ops=NUMPY):
    """A chunk's ``(sum Z_i^T Z_i, sum Z_i^T Y_i)`` with ``Z_i = S_i X_i`` (numpy in and out)."""
    _, _, gram, cross = _value_terms(ops, ops.asarray(X), ops.asarray(Y), ops.asarray(K))
    return ops.to_numpy(gram), ops.to_numpy(cross)


def _residual(ops, X, Y, K, V, kept=None):
    """A chunk's attention weights and residual ``Y - S X V`` (through ``Z = S X`` where kept or d <= d_v)."""
    S, Z = kept if kept is not None else (_attention(ops, X, K), None)
    if Z is None and X.shape[2] <= V.shape[1]:
        Z = S @ X
    return S, Y - (Z @ V if Z is not None else S @ (X @ V))


def _loss_terms(ops, X, Y, K, V, kept=None):
    """A chunk's residual sum of squares and its gradient in K (before the ``1 / sqrt(d)``)."""
    d = X.shape[2]
    S, R = _residual(ops, X, Y, K, V, kept)
    f = ops.scalar((R**2).sum())
    # dL/dS = -2 R (X V)^T, its T x T product through d or d_v, whichever is smaller
    if d < V.shape[1]:
        dS = (R @ (-2.0 * V.T)) @ ops.transposed(X)
    else:
        dS = R @ ops.transposed(-2.0 * (X @ V))
    # dA = S o (dS - rowsum(S o dS))
    dS = (dS - ops.einsum("nts,nts->nt", dS, S, optimize=False)[..., None]) * S
    return f, X.reshape(-1, d).T @ (dS @ X).reshape(-1, d)


def loss_sums(X, Y, K, V, ops=NUMPY):
    """A chunk's ``(rss, gradient sum)`` at ``(K, V)`` (numpy in and out)."""
    f, grad = _loss_terms(ops, ops.asarray(X), ops.asarray(Y), ops.asarray(K), ops.asarray(V))
    return f, ops.to_numpy(grad)


def residual_sum(X, Y, K, V, ops=NUMPY):
    """A chunk's residual sum of squares at ``(K, V)``."""
    _, R = _residual(ops, ops.asarray(X), ops.asarray(Y), ops.asarray(K), ops.asarray(V))
    return ops.scalar((R**2).sum())


class SoftmaxLeastSquaresLoss:
    """Residual sum of squares of ``Y_i ~ softmax(X_i K X_i^T / sqrt(d)) X_i V`` as a function of K.

    With ``value_map=None`` V is profiled out: for each K the least-squares V
    solves ``(sum_i Z_i^T Z_i) V = sum_i Z_i^T Y_i`` with ``Z_i = S_i X_i``, and
    the gradient at that V is the partial gradient in K (the residuals are
    orthogonal to every change of V). The gradient back-propagates
    ``dL/dS_i = -2 R_i (X_i V)^T`` through the row-wise softmax:
    ``dL/dK = sum_i X_i^T [S_i o (dL/dS_i - rowsum(S_i o dL/dS_i))] X_i / sqrt(d)``.
    One evaluation costs ``O(n T^2 (d + d_v))``: one pass over the samples
    with V known, two with V profiled (the second reuses the first's
    attention weights where the samples are in memory and they number at
    most ``max_cached_weights`` entries).

    Parameters
    ----------
    X : ndarray of shape (n, T, d), or rstar.streaming.Samples
        The tokens, or a source of ``(X, Y)`` chunks read at every evaluation
        (then ``Y`` is None): batches or dask arrays never held in memory.
    Y : ndarray of shape (n, T, d_v) or None
    value_map : ndarray of shape (d, d_v) or None
        Known V; None profiles it out.
    basis : ndarray of shape (k, d) or None
        Orthonormal rows Q: the loss is then a function of the ``k x d``
        matrix M with ``K = Q^T M`` (a fit of rank at most k).
    ops : back-end operations, default=numpy
        :func:`rstar._backend.resolve_backend` of a device.
    precondition : tuple (A_half, A_inv_half, B_half, B_inv_half) of ndarray of shape (d, d), or None
        Square roots and pseudo-inverse square roots of symmetric PSD metrics
        A (query side) and B (key side), e.g. the tokens' metric
        (:func:`rstar.inversions._numerics.softmax_factored.token_metric_roots`): the loss is a
        function of M with ``K = A^{-1/2} M B^{-1/2}`` (``K = Q^T M B^{-1/2}``
        with a basis, A unused), the metric L-BFGS runs in. None: ``K = M``.
    max_cached_weights : int, default=2**23
        The calibration's ``max_cached_weights`` (:mod:`rstar.calibration`).
    """

    def __init__(self, X, Y=None, value_map=None, basis=None, ops=NUMPY, precondition=None,
                 max_cached_weights=DEFAULT_CALIBRATION.max_cached_weights):
        self.samples = _as_samples(X, Y)
        self.T, self.d, self.d_v = self.samples.dims
        self.known_value_map = value_map
        self.basis = basis
        self.ops = ops
        # K = left M right, and M = left_pinv K right_pinv for a K that the parameters reach
        A_half, A_inv_half, B_half, B_inv_half = (None,) * 4 if precondition is None else precondition
        self._left, self._left_pinv = (basis.T, basis) if basis is not None else (A_inv_half, A_half)
        self._right, self._right_pinv = B_inv_half, B_half
        in_memory = self.samples.in_memory
        self._cache = in_memory and self.samples.n_samples * self.T**2 <= max_cached_weights
        self.n_evaluations = 0

    def kernel(self, m):
        """The ``d x d`` kernel of a parameter vector (``Q^T M`` with a basis, ``P M R`` preconditioned)."""
        d = self.d
        K = np.reshape(m, (-1, d))
        if self._left is not None:
            K = self._left @ K
        return K if self._right is None else K @ self._right

    def parameters(self, K):
        """A parameter vector whose kernel is K's projection on what the parameters reach (``Q Q^T K`` with a
        basis; ``A^{1/2} K B^{1/2}`` preconditioned, the metrics' null spaces dropped)."""
        M = np.asarray(K, dtype=float)
        if self._left_pinv is not None:
            M = self._left_pinv @ M
        if self._right_pinv is not None:
            M = M @ self._right_pinv
        return M.ravel()

    def _parameter_gradient(self, grad):
        """The gradient in the parameters of a gradient G in K (``left^T G right^T``)."""
        if self._left is not None:
            grad = self._left.T @ grad
        return grad if self._right is None else grad @ self._right.T

    def _cached_value_map(self, K):
        """V for kernel K and, per chunk, the device arrays ``(X, Y, (S, Z))`` (samples in memory)."""
        ops, kept = self.ops, []
        gram, cross = None, None
        Kd = ops.asarray(K)
        for X, Y in self.samples.chunks(self.T**2):
            Xd, Yd = ops.asarray(X), ops.asarray(Y)
            S, Z, g, c = _value_terms(ops, Xd, Yd, Kd)
            gram = g if gram is None else gram + g
            cross = c if cross is None else cross + c
            kept.append((Xd, Yd, (S, Z)))
        V = self.known_value_map
        if V is None:
            V = solve_psd(ops.to_numpy(gram), ops.to_numpy(cross))
        return V, kept

    def _value_map(self, K):
        """V for kernel K: the known one, or the least squares (one pass)."""
        if self.known_value_map is not None:
            return self.known_value_map
        gram, cross = self.samples.map_sum(value_map_sums, self.T**2, K, self.ops)
        return solve_psd(gram, cross)

    def value_map(self, K):
        """The value map for kernel K (the known one, or the least-squares one) and the residual
        sum of squares: ``(V, rss)``."""
        K = np.asarray(K, dtype=float)
        if self._cache and self.known_value_map is None:
            V, kept = self._cached_value_map(K)
            ops = self.ops
            Kd, Vd = ops.asarray(K), ops.asarray(V)
            rss = 0.0
            for X, Y, c in kept:
                rss += ops.scalar((_residual(ops, X, Y, Kd, Vd, c)[1] ** 2).sum())
            return V, rss
        V = self._value_map(K)
        return V, float(self.samples.map_sum(residual_sum, self.T**2, K, V, self.ops))

    def __call__(self, m):
        """``(f, grad f)`` at the parameter vector m (row-major ``vec K``, or ``vec M`` with a basis)."""
        self.n_evaluations += 1
        K = self.kernel(m)
        d, ops = self.d, self.ops
        if self._cache and self.known_value_map is None:
            V, kept = self._cached_value_map(K)
            Kd, Vd = ops.asarray(K), ops.asarray(V)
            f, grad = 0.0, None
            for X, Y, c in kept:
                fc, gc = _loss_terms(ops, X, Y, Kd, Vd, c)
                f += fc
                grad = gc if grad is None else grad + gc
            grad = ops.to_numpy(grad)
        else:
            V = self._value_map(K)
            f, grad = self.samples.map_sum(loss_sums, self.T**2, K, V, ops)
        grad = self._parameter_gradient(grad / np.sqrt(d))
        return float(f), grad.ravel()


def fit_softmax_least_squares(X, Y=None, value_map=None, K0=None, basis=None, max_iter=None, ops=NUMPY,
                              precondition=None, *, calibration=DEFAULT_CALIBRATION):
    """Least-squares ``(K, V)`` of ``Y_i ~ softmax(X_i K X_i^T / sqrt(d)) X_i V`` by L-BFGS.

    Starts from ``K0`` (default ``0``: uniform attention, where the gradient
    is the first-order inversion's signal) and stops once an iteration
    lowers the loss by less than the calibration's ``least_squares_loss_tol``
    times the loss per observation (``n T d_v`` of them), or after
    ``max_iter`` iterations.

    Parameters
    ----------
    X : ndarray of shape (n, T, d), or rstar.streaming.Samples
        The tokens, or a source of chunks read at every evaluation (``Y`` None).
    Y : ndarray of shape (n, T, d_v) or None
    value_map : ndarray of shape (d, d_v) or None
        Known V; None fits it too (profiled).
    K0 : ndarray of shape (d, d) or None
    basis : ndarray of shape (k, d) or None
        Orthonormal rows Q: fit ``K = Q^T M`` (rank at most k), from the
        projection ``Q^T Q K0``.
    max_iter : int or None, default=None
        None means the calibration's ``softmax_max_iter``.
    ops : back-end operations, default=numpy
    precondition : tuple of 4 ndarray of shape (d, d), or None
        Metric roots ``(A^{1/2}, A^{-1/2}, B^{1/2}, B^{-1/2})``: L-BFGS runs on
        M with ``K = A^{-1/2} M B^{-1/2}`` (:class:`SoftmaxLeastSquaresLoss`),
        e.g. the tokens' :func:`rstar.inversions._numerics.softmax_factored.token_metric_roots`;
        the minimum is the same, the path to it shorter where the tokens are
        anisotropic.
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``least_squares_loss_tol``, ``softmax_max_iter`` and ``max_cached_weights``
        (:mod:`rstar.calibration`).

    Returns
    -------
    K : ndarray of shape (d, d)
    V : ndarray of shape (d, d_v)
    rss : float
    converged : bool
        False when ``max_iter`` stopped it.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.inversions._numerics.softmax_ls import fit_softmax_least_squares
    >>> X, Y, t = make_attention_task(300, seq_len=8, n_features=4, rank=1, noise=0.01,
    ...                               random_state=0, return_teacher=True)
    >>> K, V, rss, converged = fit_softmax_least_squares(X, Y)
    >>> converged, bool(np.linalg.norm(K - t.kernel) < 0.05 * np.linalg.norm(t.kernel))
    (True, True)
    """
    loss = SoftmaxLeastSquaresLoss(X, Y, value_map, basis, ops, precondition,
                                   max_cached_weights=calibration.max_cached_weights)
    d = loss.d
    max_iter = calibration.softmax_max_iter if max_iter is None else int(max_iter)
    n_obs = loss.samples.n_samples * loss.T * loss.d_v
    K0 = np.zeros((d, d)) if K0 is None else np.asarray(K0, dtype=float)
    ftol = calibration.least_squares_loss_tol / n_obs
    res = optimize.minimize(loss, loss.parameters(K0), jac=True, method="L-BFGS-B",
                            options={"maxiter": max_iter, "gtol": 0.0, "ftol": ftol, "maxcor": 20})
    K = loss.kernel(res.x)
    V, rss = loss.value_map(K)
    return K, V, rss, bool(res.nit < max_iter)


def softmax_kernel_information_matrix(X, K, V, value_map_fitted=True, ops=NUMPY):
    """The Gauss–Newton information of the row-major ``vec K`` (``d^2 x d^2``), V profiled out if fitted.

    The model's change along ``dK`` is, on token t of sample i,
    ``dz_it = C_it^T dK^T x_it / sqrt(d)`` with
    ``C_it = X_i^T (diag(s_it) - s_it s_it^T) X_i V`` (s_it the attention
    row), so ``F_KK = (1/d) sum_{i,t} (x_it x_it^T) (x) (C_it C_it^T)``, a sum
    of Kronecker products, accumulated through its rearrangement
    (Van Loan & Pitsianis 1993) as one matrix product. When V is fitted too, the
    information left for K is the Schur complement
    ``F_KK - F_KV F_VV^{-1} F_VK``: the model moves along ``dV`` by
    ``dz_it = dV^T m_it`` with ``m_it = X_i^T s_it``, so
    ``F_VV = (sum m m^T) (x) I`` and
    ``F_KV[(a, b), (c, v)] = sum_{i,t} x_it[a] C_it[b, v] m_it[c] / sqrt(d)``.
    The least-squares K then has covariance ``sigma2 F^{-1}`` to first order.
    Cost ``O(n T (d^4 / 4 + d^3 min(d_v, d / 2)) + d^5 min(d, d_v))``.

    Parameters
    ----------
    X : ndarray of shape (n, T, d), or rstar.streaming.Samples
        The tokens, or a source of chunks (one pass).
    K : ndarray of shape (d, d)
    V : ndarray of shape (d, d_v)
    value_map_fitted : bool, default=True
    ops : back-end operations, default=numpy

    Returns
    -------
    F : ndarray of shape (d * d, d * d)
    """
    samples = X if isinstance(X, Samples) else ArraySamples(X, None)
    T, d = samples.dims[:2]
    if V.shape[1] > d:
        # F depends on V only through V V^T (C_it = D_it V with D_it symmetric d x d), so a
        # d x d factor of V V^T gives the same information at a cost in min(d, d_v).
        U, sv, _ = np.linalg.svd(V, full_matrices=False)
        V = U * sv
    d_v = V.shape[1]
    # x x^T and C C^T are symmetric, so the rearrangement is accumulated on their
    # upper triangles (a quarter of the products) and expanded at the end.
    upper = np.triu_indices(d)
    n_upper = upper[0].size
    # With d_v > d / 2 the cross term is cheaper on the upper triangle of D_it, times V at the end.
    through_d = value_map_fitted and n_upper < d * d_v
    rearranged, cross, m_gram = samples.map_sum(information_sums, T * d * d, K, V, value_map_fitted, through_d,
                                                ops)
    pair = np.empty((d, d), dtype=np.intp)
    pair[upper] = pair[upper[::-1]] = np.arange(n_upper)
    if through_d:
        cross = (cross[:, pair.ravel()].reshape(d * d, d, d) @ V).reshape(d * d, d * d_v)
    rearranged = rearranged[np.ix_(pair.ravel(), pair.ravel())]
    F = rearranged.reshape(d, d, d, d).transpose(0, 2, 1, 3).reshape(d * d, d * d) / d
    if value_map_fitted:
        # cross[(a, c), (b, v)] -> F_KV[(a, b), (c, v)], then F_KV (m_gram^{-1} (x) I) F_VK
        F_KV = cross.reshape(d, d, d, d_v).transpose(0, 2, 1, 3).reshape(d * d, d, d_v) / np.sqrt(d)
        w, U = np.linalg.eigh(m_gram)
        keep = w > max(w.max(), np.finfo(float).tiny) * 1e-12
        G = np.einsum("kcv,cj->kjv", F_KV, U[:, keep] / np.sqrt(w[keep]), optimize=True).reshape(d * d, -1)
        F = F - G @ G.T
    return (F + F.T) / 2


def information_sums(X, Y, K, V, value_map_fitted, through_d, ops=NUMPY):
    """A chunk's shares of :func:`softmax_kernel_information_matrix`: the rearranged Kronecker sum
    ``[(a<=c), (b<=e)] = sum x_a x_c (C C^T)_be``, the cross term with V (``[(a, c), (b<=e)] = sum x_a m_c D_be``
    through d, or ``[(a, c), (b, v)] = sum x_a m_c C_bv``) and ``sum m m^T`` (zeros where V is known)."""
    d, d_v = X.shape[2], V.shape[1]
    upper = np.triu_indices(d)
    up0, up1 = ops.index(upper[0]), ops.index(upper[1])
    Xb, Kd, Vd = ops.asarray(X), ops.asarray(K), ops.asarray(V)
    S = _attention(ops, Xb, Kd)
    SX = S @ Xb
    if through_d:
        D = ops.einsum("nts,nsa,nsb->ntab", S, Xb, Xb) - ops.einsum("nta,ntb->ntab", SX, SX)
        D = D.reshape(-1, d, d)
        C = D @ Vd
    else:
        W = Xb @ Vd
        C = ops.einsum("nts,nsa,nsv->ntav", S, Xb, W) - ops.einsum("nta,ntv->ntav", SX, S @ W)
        C = C.reshape(-1, d, d_v)
    x = Xb.reshape(-1, d)
    CC = ops.einsum("nav,nbv->nab", C, C)
    rearranged = (x[:, up0] * x[:, up1]).T @ CC[:, up0, up1]
    if not value_map_fitted:
        return ops.to_numpy(rearranged), np.zeros((d * d, d * d_v)), np.zeros((d, d))
    m = SX.reshape(-1, d)
    xm = ops.einsum("na,nc->nac", x, m).reshape(-1, d * d)
    cross = xm.T @ (D[:, up0, up1] if through_d else C.reshape(-1, d * d_v))
    return ops.to_numpy(rearranged), ops.to_numpy(cross), ops.to_numpy(m.T @ m)
