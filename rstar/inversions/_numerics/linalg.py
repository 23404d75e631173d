"""Small dense linear-algebra helpers shared by the inversions (pure functions)."""

import numpy as np
from scipy.linalg import lapack

# LAPACK's Cholesky factor and solve, called directly: scipy.linalg.cho_factor / cho_solve compute the same (they
# call these two routines) behind checks that cost more than the factorisation itself at the small d of the
# alternating least squares (about 0.1 ms a call, 16,000 calls in a cross-fitted query-key fit at d = 8)
_potrf, _potrs = lapack.get_lapack_funcs(("potrf", "potrs"), (np.zeros(1),))


def sym(A):
    return (A + A.T) / 2


def psd_power(A, power, rcond=1e-12):
    """``A**power`` for a symmetric PSD matrix; eigenvalues below
    ``rcond * max`` are treated as zero (pseudo-inverse for negative powers)."""
    w, Q = np.linalg.eigh(sym(A))
    top = w.max() if w.size else 0.0
    keep = w > rcond * top if top > 0 else np.zeros_like(w, dtype=bool)
    wp = np.zeros_like(w)
    wp[keep] = w[keep] ** power
    return (Q * wp) @ Q.T


def solve_psd(A, B, rcond=1e-12):
    """Solution of ``A Z = B`` for symmetric PSD ``A``: Cholesky when ``A`` is
    well conditioned, else the least-squares (pseudo-inverse) solution."""
    A = sym(A)
    if A.size and np.all(np.isfinite(A)):
        factor, info = _potrf(A, lower=False, clean=False)
        if info == 0:
            diag = np.abs(np.diag(factor))
            if diag.min() > np.sqrt(rcond) * diag.max():
                Z, info = _potrs(factor, B, lower=False)
                if info == 0:
                    return Z
    return psd_power(A, -1.0, rcond) @ B


def batched_pseudo_inverse(X, rcond=1e-10):
    """Per-sample pseudo-inverse factors of a stack of token matrices.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)

    Returns
    -------
    U : ndarray of shape (n, T, k)
    inv_s : ndarray of shape (n, k)
        ``1 / s`` for kept singular values, 0 otherwise (``k = min(T, d)``).
    Wt : ndarray of shape (n, k, d)
        So that ``X^+ = Wt^T diag(inv_s) U^T`` and
        ``(X^T X)^+ = Wt^T diag(inv_s**2) Wt``.
    smallest : ndarray of shape (n,)
        Smallest kept squared singular value (0 for an all-zero sample).
    rank : ndarray of shape (n,)
    """
    U, s, Wt = np.linalg.svd(X, full_matrices=False)
    top = s[:, :1]
    keep = (s > rcond * np.maximum(top, np.finfo(float).tiny)) & (top > 0)
    inv_s = np.where(keep, 1.0 / np.where(keep, s, 1.0), 0.0)
    smallest = np.where(keep, s**2, np.inf).min(axis=1)
    smallest = np.where(np.isfinite(smallest), smallest, 0.0)
    return U, inv_s, Wt, smallest, keep.sum(axis=1)


def factored_svd(A, B):
    """The thin SVD ``(U, s, W)`` of ``A B^T`` for ``A`` (d x q) and ``B`` (d' x q), through thin QR factors of the
    two sides and the SVD of the ``q x q`` core (``O((d + d') q^2)``; the ``d x d'`` product is never formed).
    ``U`` is d x q, ``s`` has q entries (descending), ``W`` is d' x q.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> A, B = rng.standard_normal((6, 2)), rng.standard_normal((5, 2))
    >>> U, s, W = factored_svd(A, B)
    >>> bool(np.allclose((U * s) @ W.T, A @ B.T)), bool(np.allclose(s, np.linalg.svd(A @ B.T)[1][:2]))
    (True, True)
    """
    Qa, Ra = np.linalg.qr(A)
    Qb, Rb = np.linalg.qr(B)
    U, s, Wt = np.linalg.svd(Ra @ Rb.T)
    return Qa @ U, s, Qb @ Wt.T


def orthonormal_rows(V):
    """Orthonormal basis (as rows) of the span of the columns of ``V`` (p x k)."""
    if V.shape[1] == 0:
        return np.zeros((0, V.shape[0]))
    Q, R = np.linalg.qr(V)
    signs = np.sign(np.diag(R))
    signs[signs == 0] = 1.0
    return (Q * signs).T


def kronecker_rearranged(M, d):
    """Van Loan–Pitsianis rearrangement ``R[(i,k),(j,l)] = M[(i,j),(k,l)]`` of a ``d^2 x d^2`` matrix (its own
    inverse): a Kronecker product ``A (x) B`` becomes the rank-one ``vec(A) vec(B)^T``."""
    return M.reshape(d, d, d, d).transpose(0, 2, 1, 3).reshape(d * d, d * d)
