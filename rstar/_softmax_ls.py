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
from scipy import optimize, special

from ._linalg import solve_psd

#: L-BFGS stops once an iteration lowers the residual sum of squares by less than this many times its
#: value per observation (about the noise variance): an optimiser's error far below the noise's, whose
#: share of the loss is about d^2 times the noise variance. On the held-out recovery grid 0.01 and 0.1
#: gave the same 232 ranks as a relative tolerance of 1e-10, in 55% and 47% of the time.
SOFTMAX_LOSS_TOL = 0.01

#: Largest number of L-BFGS iterations of :func:`fit_softmax_least_squares`.
SOFTMAX_MAX_ITER = 1000

#: Float entries of one chunk's attention weights (``chunk T^2``) or information terms (``chunk T d max(d, d_v)``).
CHUNK_ENTRIES = 2**20

#: The attention weights of all samples are kept between the two passes of a loss evaluation up to this many entries.
MAX_CACHED_WEIGHTS = 2**23


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
    logits = np.einsum("nta,ab,nsb->nts", X, K, X, optimize=True) / np.sqrt(X.shape[2])
    return special.softmax(logits, axis=-1)


def _chunks(n, per_sample):
    step = max(1, CHUNK_ENTRIES // max(per_sample, 1))
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


class SoftmaxLeastSquaresLoss:
    """Residual sum of squares of ``Y_i ~ softmax(X_i K X_i^T / sqrt(d)) X_i V`` as a function of K.

    With ``value_map=None`` V is profiled out: for each K the least-squares V
    solves ``(sum_i Z_i^T Z_i) V = sum_i Z_i^T Y_i`` with ``Z_i = S_i X_i``, and
    the gradient at that V is the partial gradient in K (the residuals are
    orthogonal to every change of V). The gradient back-propagates
    ``dL/dS_i = -2 R_i (X_i V)^T`` through the row-wise softmax:
    ``dL/dK = sum_i X_i^T [S_i o (dL/dS_i - rowsum(S_i o dL/dS_i))] X_i / sqrt(d)``.
    One evaluation costs ``O(n T^2 (d + d_v))``.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)
    value_map : ndarray of shape (d, d_v) or None
        Known V; None profiles it out.
    basis : ndarray of shape (k, d) or None
        Orthonormal rows Q: the loss is then a function of the ``k x d``
        matrix M with ``K = Q^T M`` (a fit of rank at most k).
    """

    def __init__(self, X, Y, value_map=None, basis=None):
        self.X, self.Y = X, Y
        self.d = X.shape[2]
        self.known_value_map = value_map
        self.basis = basis
        self._parts = _chunks(X.shape[0], X.shape[1] ** 2)
        self._cache = X.shape[0] * X.shape[1] ** 2 <= MAX_CACHED_WEIGHTS
        self.n_evaluations = 0

    def kernel(self, m):
        """The ``d x d`` kernel of a parameter vector (``Q^T M`` with a basis)."""
        d = self.d
        if self.basis is None:
            return np.reshape(m, (d, d))
        return self.basis.T @ np.reshape(m, (self.basis.shape[0], d))

    def _value_map(self, K, keep):
        if self.known_value_map is not None:
            return self.known_value_map, [None] * len(self._parts)
        d = self.d
        gram, cross, kept = np.zeros((d, d)), np.zeros((d, self.Y.shape[2])), []
        for part in self._parts:
            S = attention_weights(self.X[part], K)
            Z = S @ self.X[part]
            gram += np.einsum("nta,ntb->ab", Z, Z, optimize=True)
            cross += np.einsum("nta,ntv->av", Z, self.Y[part], optimize=True)
            kept.append(S if keep else None)
        return solve_psd(gram, cross), kept

    def value_map(self, K):
        """The value map for kernel K (the known one, or the least-squares one) and the residual
        sum of squares: ``(V, rss)``."""
        K = np.asarray(K, dtype=float)
        V, kept = self._value_map(K, keep=self._cache)
        rss = 0.0
        for part, S in zip(self._parts, kept):
            if S is None:
                S = attention_weights(self.X[part], K)
            rss += float(np.sum((self.Y[part] - S @ (self.X[part] @ V)) ** 2))
        return V, rss

    def __call__(self, m):
        """``(f, grad f)`` at the parameter vector m (row-major ``vec K``, or ``vec M`` with a basis)."""
        self.n_evaluations += 1
        K = self.kernel(m)
        V, kept = self._value_map(K, keep=self._cache)
        f, grad = 0.0, np.zeros((self.d, self.d))
        for part, S in zip(self._parts, kept):
            Xb = self.X[part]
            if S is None:
                S = attention_weights(Xb, K)
            W = Xb @ V
            R = self.Y[part] - S @ W
            f += float(np.sum(R**2))
            dS = -2.0 * (R @ np.swapaxes(W, 1, 2))
            dA = S * (dS - np.sum(dS * S, axis=-1, keepdims=True))
            grad += np.einsum("nta,nts,nsb->ab", Xb, dA, Xb, optimize=True)
        grad /= np.sqrt(self.d)
        if self.basis is not None:
            grad = self.basis @ grad
        return f, grad.ravel()


def fit_softmax_least_squares(X, Y, value_map=None, K0=None, basis=None, max_iter=None):
    """Least-squares ``(K, V)`` of ``Y_i ~ softmax(X_i K X_i^T / sqrt(d)) X_i V`` by L-BFGS.

    Starts from ``K0`` (default ``0``: uniform attention, where the gradient
    is the first-order inversion's signal) and stops once an iteration
    lowers the loss by less than ``SOFTMAX_LOSS_TOL`` times the loss per
    observation (``n T d_v`` of them), or after ``max_iter`` iterations.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)
    value_map : ndarray of shape (d, d_v) or None
        Known V; None fits it too (profiled).
    K0 : ndarray of shape (d, d) or None
    basis : ndarray of shape (k, d) or None
        Orthonormal rows Q: fit ``K = Q^T M`` (rank at most k), from the
        projection ``Q^T Q K0``.
    max_iter : int or None, default=None
        None means ``SOFTMAX_MAX_ITER``.

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
    >>> from rstar._softmax_ls import fit_softmax_least_squares
    >>> X, Y, t = make_attention_task(300, seq_len=8, n_features=4, rank=1, noise=0.01,
    ...                               random_state=0, return_teacher=True)
    >>> K, V, rss, converged = fit_softmax_least_squares(X, Y)
    >>> converged, bool(np.linalg.norm(K - t.kernel) < 0.05 * np.linalg.norm(t.kernel))
    (True, True)
    """
    d = X.shape[2]
    max_iter = SOFTMAX_MAX_ITER if max_iter is None else int(max_iter)
    loss = SoftmaxLeastSquaresLoss(X, Y, value_map, basis)
    K0 = np.zeros((d, d)) if K0 is None else np.asarray(K0, dtype=float)
    m0 = K0 if basis is None else basis @ K0
    res = optimize.minimize(loss, m0.ravel(), jac=True, method="L-BFGS-B",
                            options={"maxiter": max_iter, "gtol": 0.0, "ftol": SOFTMAX_LOSS_TOL / Y.size,
                                     "maxcor": 20})
    K = loss.kernel(res.x)
    V, rss = loss.value_map(K)
    return K, V, rss, bool(res.nit < max_iter)


def softmax_kernel_information_matrix(X, K, V, value_map_fitted=True):
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
    Cost ``O(n T (d^4 + d^3 d_v) + d^5 d_v)``.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    K : ndarray of shape (d, d)
    V : ndarray of shape (d, d_v)
    value_map_fitted : bool, default=True

    Returns
    -------
    F : ndarray of shape (d * d, d * d)
    """
    d, d_v = X.shape[2], V.shape[1]
    rearranged = np.zeros((d * d, d * d))    # [(a, c), (b, e)] = sum x_a x_c (C C^T)_be
    cross = np.zeros((d * d, d * d_v))       # [(a, c), (b, v)] = sum x_a m_c C_bv
    m_gram = np.zeros((d, d))
    for part in _chunks(X.shape[0], X.shape[1] * d * max(d, d_v)):
        Xb = X[part]
        S = attention_weights(Xb, K)
        W = Xb @ V
        SX = S @ Xb
        C = np.einsum("nts,nsa,nsv->ntav", S, Xb, W, optimize=True) - np.einsum("nta,ntv->ntav", SX, S @ W)
        x = Xb.reshape(-1, d)
        CC = np.einsum("nav,nbv->nab", C.reshape(-1, d, d_v), C.reshape(-1, d, d_v), optimize=True)
        rearranged += np.einsum("na,nc->nac", x, x).reshape(-1, d * d).T @ CC.reshape(-1, d * d)
        if value_map_fitted:
            m = SX.reshape(-1, d)
            cross += np.einsum("na,nc->nac", x, m).reshape(-1, d * d).T @ C.reshape(-1, d * d_v)
            m_gram += m.T @ m
    F = rearranged.reshape(d, d, d, d).transpose(0, 2, 1, 3).reshape(d * d, d * d) / d
    if value_map_fitted:
        # cross[(a, c), (b, v)] -> F_KV[(a, b), (c, v)], then F_KV (m_gram^{-1} (x) I) F_VK
        F_KV = cross.reshape(d, d, d, d_v).transpose(0, 2, 1, 3).reshape(d * d, d, d_v) / np.sqrt(d)
        w, U = np.linalg.eigh(m_gram)
        keep = w > max(w.max(), np.finfo(float).tiny) * 1e-12
        G = np.einsum("kcv,cj->kjv", F_KV, U[:, keep] / np.sqrt(w[keep]), optimize=True).reshape(d * d, -1)
        F = F - G @ G.T
    return (F + F.T) / 2
