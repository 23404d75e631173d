"""Least-squares inversion of linear query–key attention with a known value map (theory §4, class B1)."""

import numpy as np
from scipy import linalg

from ._numerics.linalg import kronecker_rearranged
from ..exceptions import IllConditionedInversionWarning
from ..calibration import DEFAULT_CALIBRATION
from ._kernel import LinearQKOperator, _kronecker_factors, kernel_in_basis, kernel_statistic_with_null_draws
from .query_key import QueryKeyInversion

__all__ = ["QueryKeyLeastSquaresInversion", "least_squares_samples"]


def least_squares_samples(T, d, d_v):
    """Fewest samples for which the pooled normal matrix of the kernel can have full rank ``d^2``."""
    t = min(T, d)
    return max(2, -(-d * d // (t * min(t, d_v))) + 1)


def least_squares_sizes_fit(n, T, d, d_v, *, calibration=DEFAULT_CALIBRATION):
    """Whether ``n`` samples identify the least-squares kernel: a full-rank normal matrix and the calibration's
    ``min_noise_dof`` residual degrees of freedom (``n T d_v - d^2``)."""
    return n >= least_squares_samples(T, d, d_v) and n * T * d_v - d * d >= calibration.min_noise_dof


class QueryKeyLeastSquaresInversion(QueryKeyInversion):
    """Least-squares inversion of linear QK with a known V (theory §4, B1).

    With V known, ``Y_i = X_i K (G_i V) + E_i`` (``G_i = X_i^T X_i``, the
    scale ``1/c`` absorbed in K) is *linear* in K: ``vec K`` is the
    least-squares solution of the pooled system, with normal matrix
    ``H = sum_i G_i (x) G_i V V^T G_i`` (``d^2 x d^2``) and right-hand side
    ``sum_i vec(X_i^T Y_i V^T G_i)``. Unlike ``M_i = X_i^+ Y_i``, which keeps
    only the projection ``X_i^+ X_i K`` when ``T < d``, it is unbiased for any
    ``T`` (each sample pins the bilinear form of K on the row space of
    ``X_i``; the samples together pin all of K), and its noise is exactly
    Gaussian, ``N(0, sigma2 H^{-1})``, with ``sigma2`` from the residual
    (``n T d_v - d^2`` degrees of freedom).

    The statistic is ``K~ K~^T / d`` with ``K~ = A^{1/2} K B^{1/2}`` and
    ``A (x) B`` the nearest Kronecker product to ``H`` (Van Loan & Pitsianis
    1993), so that its noise is close to white at level ``sigma2`` (MP ratio
    1). Because ``H`` is not exactly a Kronecker product, the rule does not
    lean on the MP law: its :class:`~rstar.inversions.SimulatedNull` carries
    ``n_null_draws`` exact draws of the whitened noise (seeded), and
    :func:`rstar.rules.simulated_null_p_values` tests each eigenvalue
    against them.

    The sums of :class:`QueryKeyInversion` are kept too: with fewer samples
    than the pooled system needs (``n min(T, d) min(T, d, d_v) < d^2``) the
    statistic falls back to that first-order inversion
    (:func:`rstar.inversions.choose_inversion` says so, with a warning).

    Parameters
    ----------
    value_map : ndarray of shape (d, d_v)
        The known V (in the estimator's internal units).
    budget, seed, n_null_draws, calibration
        See :class:`rstar.inversions.Inversion`.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.inversions import QueryKeyLeastSquaresInversion
    >>> X, Y, t = make_attention_task(300, kind="linear_qk", seq_len=6, n_features=12, rank=3,
    ...                               noise=0.1, random_state=0, return_teacher=True)
    >>> inv = QueryKeyLeastSquaresInversion(t.value_map)
    >>> stats = inv.new_stats(6, 12, 12)
    >>> inv.update(stats, X, Y)
    >>> ws = inv.whiten(stats)
    >>> round(ws.noise_variance / 0.1**2, 2), ws.null.kind, ws.null.draws.shape
    (1.0, 'simulated', (1000, 12, 12))
    """

    name = "query_key_least_squares"

    def __init__(self, value_map, *, budget=None, seed=None, n_null_draws=None, calibration=None):
        super().__init__(centred=False, residual_noise=True, value_map=value_map, budget=budget, seed=seed,
                         n_null_draws=n_null_draws, calibration=calibration)

    @property
    def produces(self):
        return (self.name, self.first_order_name)

    least_squares_samples = staticmethod(least_squares_samples)

    def default_run(self, stats):
        """The least squares where the samples identify it (:func:`least_squares_sizes_fit`), else first order."""
        return (self.name if least_squares_sizes_fit(stats["n"], *stats["dims"], calibration=self.calibration)
                else self.first_order_name)

    def new_stats(self, T, d, d_v):
        stats = super().new_stats(T, d, d_v)
        # the first-order sums serve only the fallback; predict uses the least-squares sums
        stats["HZ"] = stats["FZ"] = None
        n_pairs = d * (d + 1) // 2
        stats.update(R_ls=np.zeros((n_pairs, n_pairs)), rhs_ls=np.zeros(d * d), yy=0.0)
        return stats

    def update(self, stats, X, Y, chunk=256):
        super().update(stats, X, Y)
        self._update_least_squares(stats, X, Y, chunk)

    def _update_least_squares(self, stats, X, Y, chunk=256):
        """The least-squares sums alone (``update`` without the first-order ones behind the fallback)."""
        n, _, d = X.shape
        V = self.value_map
        upper = np.triu_indices(d)
        for start in range(0, n, chunk):
            Xb, Yb = X[start:start + chunk], Y[start:start + chunk]
            G = np.einsum("nta,ntb->nab", Xb, Xb, optimize=True)
            GV = G @ V
            P = GV @ np.swapaxes(GV, 1, 2)
            # H[(a,b),(a',b')] = sum_i G_i[a,a'] P_i[b,b']: its rearrangement R[(a,a'),(b,b')]
            # is one matrix product over samples; G_i and P_i are symmetric, so only their upper
            # triangles enter (R[(a,a'),(b,b')] over a <= a', b <= b': 4x fewer products)
            stats["R_ls"] += G[:, upper[0], upper[1]].T @ P[:, upper[0], upper[1]]
            stats["rhs_ls"] += np.einsum("nta,ntv,nbv->ab", Xb, Yb, GV, optimize=True).ravel()
            stats["yy"] += float(np.sum(Yb**2))

    @staticmethod
    def _rearranged_normal_matrix(stats):
        """``R[(a,a'),(b,b')] = sum_i G_i[a,a'] P_i[b,b']`` in full, from its upper-triangle sums."""
        d = stats["dims"][1]
        # position of the pair (a, a') in the upper triangle, for every (a, a')
        pos = np.zeros((d, d), dtype=np.intp)
        pos[np.triu_indices(d)] = np.arange(d * (d + 1) // 2)
        pos = np.maximum(pos, pos.T).ravel()
        return stats["R_ls"][np.ix_(pos, pos)]

    @classmethod
    def normal_matrix(cls, stats):
        """The pooled normal matrix ``H`` (``d^2 x d^2``, row-major ``vec K``) from the sums (exactly symmetric)."""
        return kronecker_rearranged(cls._rearranged_normal_matrix(stats), stats["dims"][1])

    def whiten(self, stats, run=None):
        run = self._check_run(self.default_run(stats) if run is None else run)
        if run != self.name:
            return self._first_order_statistic(stats)
        T, d, d_v = stats["dims"]
        n = stats["n"]
        dof = n * T * d_v - d * d
        R = self._rearranged_normal_matrix(stats)
        H = kronecker_rearranged(R, d)
        scale = float(np.trace(H)) / H.shape[0]
        warnings = []
        try:
            L = linalg.cholesky(H, lower=True, check_finite=False)
            cond_ok = np.min(np.abs(np.diag(L))) > 1e-6 * np.max(np.abs(np.diag(L)))
        except linalg.LinAlgError:
            cond_ok = False
        if not cond_ok:
            # a direction of K no sample sees (e.g. degenerate tokens): a tiny ridge keeps it at zero
            warnings.append((IllConditionedInversionWarning,
                             "the least-squares query-key normal matrix is singular or ill-conditioned (some "
                             "directions of K are not seen by any sample). Fallback in use: a ridge of 1e-8 "
                             "times its mean diagonal, which sets unseen directions of K to zero."))
            H = H + 1e-8 * max(scale, np.finfo(float).tiny) * np.eye(H.shape[0])
            R = kronecker_rearranged(H, d)
            L = linalg.cholesky(H, lower=True, check_finite=False)
        k = linalg.cho_solve((L, True), stats["rhs_ls"], check_finite=False)
        sigma2 = max(stats["yy"] - float(stats["rhs_ls"] @ k), 0.0) / dof
        A, B = _kronecker_factors(R, d)   # nearest Kronecker product to H (R is its rearrangement)
        # exact draws of the whitened noise: vec N ~ N(0, sigma2 H^{-1})
        return kernel_statistic_with_null_draws(k.reshape(d, d), L, A, B, sigma2, dof, warnings, inversion=self.name,
                                                seed=self.seed, n_draws=self.n_null_draws)

    def fit_operator(self, stats, basis):
        return LinearQKOperator(kernel_in_basis(self.normal_matrix(stats), stats["rhs_ls"], basis.T),
                                 self.value_map)


