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

from ._linalg import solve_psd

#: L-BFGS stops once an iteration lowers the residual sum of squares by less than this many times its
#: value per observation (about the noise variance): an optimiser's error far below the noise's, whose
#: share of the loss is about d^2 times the noise variance. On the held-out recovery grid 0.01 and 0.1
#: gave the same 232 ranks as a relative tolerance of 1e-10, in 55% and 47% of the time.
SOFTMAX_LOSS_TOL = 0.01

#: Largest number of L-BFGS iterations of :func:`fit_softmax_least_squares`. Student-t tokens at d = 64
#: with few samples need more than 1000: on the held-out recovery grid the two fits that stopped there
#: (r* = 4 and 50) converged within 4000 and read r* exactly (196 and 348 s).
SOFTMAX_MAX_ITER = 4000

#: Float entries of one chunk's attention weights (``chunk T^2``) or information terms (``chunk T d^2``).
CHUNK_ENTRIES = 2**20

#: The attention weights of all samples are kept between the two passes of a loss evaluation up to this many entries.
MAX_CACHED_WEIGHTS = 2**23


def _transposed(A):
    """``A_i^T`` for every sample, contiguous: numpy's stacked matmul is several times slower on a
    transposed view."""
    return np.ascontiguousarray(np.swapaxes(A, 1, 2))


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
    S = (X @ (K / np.sqrt(X.shape[2]))) @ _transposed(X)
    # row-wise softmax in place (one (n, T, T) array instead of scipy.special.softmax's temporaries)
    S -= S.max(axis=-1, keepdims=True)
    np.exp(S, out=S)
    S /= S.sum(axis=-1, keepdims=True)
    return S


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
        """V for kernel K and, per chunk, its ``(S, Z = S X)`` if ``keep`` (else None)."""
        if self.known_value_map is not None:
            return self.known_value_map, [None] * len(self._parts)
        d = self.d
        gram, cross, kept = np.zeros((d, d)), np.zeros((d, self.Y.shape[2])), []
        for part in self._parts:
            S = attention_weights(self.X[part], K)
            Z = S @ self.X[part]
            gram += Z.reshape(-1, d).T @ Z.reshape(-1, d)
            cross += Z.reshape(-1, d).T @ self.Y[part].reshape(-1, self.Y.shape[2])
            kept.append((S, Z) if keep else None)
        return solve_psd(gram, cross), kept

    def _residual(self, part, K, V, kept):
        """The chunk's attention weights and residual ``Y - S X V`` (through ``Z = S X`` where kept or d <= d_v)."""
        Xb = self.X[part]
        S, Z = kept if kept is not None else (attention_weights(Xb, K), None)
        if Z is None and self.d <= V.shape[1]:
            Z = S @ Xb
        return S, self.Y[part] - (Z @ V if Z is not None else S @ (Xb @ V))

    def value_map(self, K):
        """The value map for kernel K (the known one, or the least-squares one) and the residual
        sum of squares: ``(V, rss)``."""
        K = np.asarray(K, dtype=float)
        V, kept = self._value_map(K, keep=self._cache)
        rss = sum(float(np.sum(self._residual(part, K, V, c)[1] ** 2)) for part, c in zip(self._parts, kept))
        return V, rss

    def __call__(self, m):
        """``(f, grad f)`` at the parameter vector m (row-major ``vec K``, or ``vec M`` with a basis)."""
        self.n_evaluations += 1
        K = self.kernel(m)
        V, kept = self._value_map(K, keep=self._cache)
        d = self.d
        f, grad = 0.0, np.zeros((d, d))
        for part, c in zip(self._parts, kept):
            Xb = self.X[part]
            S, R = self._residual(part, K, V, c)
            f += float(np.sum(R**2))
            # dL/dS = -2 R (X V)^T, its T x T product through d or d_v, whichever is smaller
            if d < V.shape[1]:
                dS = (R @ (-2.0 * V.T)) @ _transposed(Xb)
            else:
                dS = R @ _transposed(-2.0 * (Xb @ V))
            # dA = S o (dS - rowsum(S o dS)), in place
            dS -= np.einsum("nts,nts->nt", dS, S)[..., None]
            dS *= S
            grad += Xb.reshape(-1, d).T @ (dS @ Xb).reshape(-1, d)
        grad /= np.sqrt(d)
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


def information_matrix_cost(n, T, d, d_v, value_map_fitted=True):
    """Multiply-adds to form :func:`softmax_kernel_information_matrix` and factor it (``d^6``).

    ``n T d^4 / 4`` for the Kronecker part, ``n T d^3 min(d_v, d / 2)`` for the
    cross term with V (if fitted) and ``d^5 min(d, d_v)`` for its Schur complement.
    """
    cost = n * T * d**4 / 4 + d**6
    if value_map_fitted:
        cost += n * T * d**3 * min(d_v, d / 2) + d**5 * min(d, d_v)
    return cost


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
    Cost ``O(n T (d^4 / 4 + d^3 min(d_v, d / 2)) + d^5 min(d, d_v))``.

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
    d = X.shape[2]
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
    rearranged = np.zeros((n_upper, n_upper))  # [(a<=c), (b<=e)] = sum x_a x_c (C C^T)_be
    cross = np.zeros((d * d, n_upper if through_d else d * d_v))  # [(a, c), (b<=e)] = sum x_a m_c D_be
    m_gram = np.zeros((d, d))                                     # or [(a, c), (b, v)] = sum x_a m_c C_bv
    for part in _chunks(X.shape[0], X.shape[1] * d * d):
        Xb = X[part]
        S = attention_weights(Xb, K)
        SX = S @ Xb
        if through_d:
            D = np.einsum("nts,nsa,nsb->ntab", S, Xb, Xb, optimize=True) - np.einsum("nta,ntb->ntab", SX, SX)
            D = D.reshape(-1, d, d)
            C = D @ V
        else:
            W = Xb @ V
            C = np.einsum("nts,nsa,nsv->ntav", S, Xb, W, optimize=True) - np.einsum("nta,ntv->ntav", SX, S @ W)
            C = C.reshape(-1, d, d_v)
        x = Xb.reshape(-1, d)
        CC = np.einsum("nav,nbv->nab", C, C, optimize=True)
        rearranged += (x[:, upper[0]] * x[:, upper[1]]).T @ CC[:, upper[0], upper[1]]
        if value_map_fitted:
            m = SX.reshape(-1, d)
            xm = np.einsum("na,nc->nac", x, m).reshape(-1, d * d)
            cross += xm.T @ (D[:, upper[0], upper[1]] if through_d else C.reshape(-1, d * d_v))
            m_gram += m.T @ m
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
