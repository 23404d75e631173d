"""Limited-memory BFGS for smooth unconstrained problems with many parameters (pure functions on arrays).

The factored softmax fit (:mod:`rstar.inversions._numerics.softmax_factored`) minimises over tens of thousands of parameters (two
halves' ``d x q`` factors: 49 280 at d = 385, q = 32) with a loss that costs tens of milliseconds. scipy's
L-BFGS-B spent a quarter of such a fit in its bound-constrained Fortran step (20 ms per call on a MiniLM head:
its generalised Cauchy point and subspace minimisation pass over every variable several times, with no bounds to
enforce); the unconstrained L-BFGS step (Nocedal & Wright, *Numerical Optimization*, 2nd ed., Algorithm 7.4, here
in its compact matrix form: :class:`_CurvatureMemory`) costs about ``4 m n`` multiply-adds per iteration. The step is scipy's strong-Wolfe line search
(:func:`scipy.optimize.line_search`, Algorithms 3.5-3.6 of the same book), and the stopping rule is L-BFGS-B's
relative reduction ``(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|, 1) <= ftol``.
"""

import warnings

import numpy as np
from scipy import linalg, optimize

__all__ = ["minimize_lbfgs"]


class _CurvatureMemory:
    """The last ``memory`` curvature pairs ``(s, y)`` and ``H g`` of their L-BFGS inverse Hessian, in the compact form
    of Byrd, Nocedal & Schnabel (*Math. Programming* 63, 1994, eq. 3.1; Nocedal & Wright, 2nd ed., eq. 7.24):
    ``H g = gamma g + S R^{-T} ((D + gamma Y^T Y) R^{-1} S^T g - gamma Y^T g) - gamma Y R^{-1} S^T g`` with
    ``R`` the upper triangle of ``S^T Y``, ``D`` its diagonal and ``gamma = s^T y / y^T y`` of the newest pair —
    what the two-loop recursion computes (Algorithm 7.4), through matrix-vector products over ring buffers of the
    pairs instead of ``4 m`` vector operations with their temporaries: on the factored fit's 98 560 variables,
    m = 20, 6-7 ms an iteration instead of 16 with BLAS's threads, and the same with one thread (as beside torch on
    the CPU). Each new pair costs three matrix-vector products to extend ``S^T Y`` and ``Y^T Y``.
    """

    def __init__(self, n, memory):
        self.S, self.Y = np.zeros((memory, n)), np.zeros((memory, n))
        self.SY, self.YY = np.zeros((memory, memory)), np.zeros((memory, memory))
        self.order = []   # slots, oldest first

    def __bool__(self):
        return bool(self.order)

    def clear(self):
        self.order = []

    def add(self, s, y):
        memory = self.S.shape[0]
        slot = self.order.pop(0) if len(self.order) == memory else next(
            k for k in range(memory) if k not in self.order)
        self.S[slot], self.Y[slot] = s, y
        self.order.append(slot)
        # the new slot's row and column of S^T Y (s_i^T y_j) and Y^T Y; free slots hold stale rows, never read
        y_s, s_y = self.Y @ s, self.S @ y
        self.SY[slot, :], self.SY[:, slot] = y_s, s_y
        self.YY[slot, :] = self.YY[:, slot] = self.Y @ y

    def inverse_hessian_times(self, g):
        idx = np.asarray(self.order)
        SY = self.SY[np.ix_(idx, idx)]
        newest = idx[-1]
        gamma = self.SY[newest, newest] / self.YY[newest, newest]
        a, b = (self.S @ g)[idx], (self.Y @ g)[idx]
        R = np.triu(SY)
        p = linalg.solve_triangular(R, a)
        w = linalg.solve_triangular(R, np.diag(SY) * p + gamma * (self.YY[np.ix_(idx, idx)] @ p) - gamma * b,
                                    trans="T")
        coef_s, coef_y = np.zeros(self.S.shape[0]), np.zeros(self.S.shape[0])
        coef_s[idx], coef_y[idx] = w, -gamma * p
        out = self.S.T @ coef_s
        out += self.Y.T @ coef_y
        out += gamma * g
        return out


def minimize_lbfgs(fun, x0, max_iter, ftol, memory=20, callback=None, c1=1e-4, c2=0.9, line_search_iter=20):
    """Minimise ``fun`` from ``x0`` by L-BFGS with a strong-Wolfe line search.

    Parameters
    ----------
    fun : callable
        ``fun(x) -> (f, g)``: the value and gradient (an array shaped as x) at x, a 1-D float array.
    x0 : ndarray of shape (n,)
    max_iter : int
        Iterations at most.
    ftol : float
        Stop once an iteration lowers f by at most ``ftol * max(|f_k|, |f_{k+1}|, 1)``.
    memory : int, default=20
        Curvature pairs kept.
    callback : callable or None
        ``callback(x, n_iter)`` after every iteration; True stops the run.
    c1, c2 : float
        The line search's sufficient-decrease and curvature constants.
    line_search_iter : int, default=20
        Iterations of one line search at most.

    Returns
    -------
    x : ndarray of shape (n,)
    f : float
    n_iter : int
    status : {"converged", "max_iter", "stopped", "line_search"}
        Stopped on ``ftol``, on ``max_iter``, by ``callback``, or because no step along the quasi-Newton nor the
        steepest-descent direction met the Wolfe conditions (at a minimum to rounding, typically).

    Examples
    --------
    >>> import numpy as np
    >>> h = np.array([1.0, 10.0, 100.0])
    >>> x, f, nit, status = minimize_lbfgs(lambda x: (0.5 * np.sum(h * x * x), h * x), np.ones(3), 100, 1e-15)
    >>> bool(np.allclose(x, 0.0, atol=1e-6)), status
    (True, 'converged')
    """
    last = {}

    def evaluate(x):
        # the line search asks for f and then g at one point: evaluate once
        if "x" not in last or not np.array_equal(last["x"], x):
            f, g = fun(x)
            last.update(x=np.array(x, dtype=float), f=float(f), g=np.asarray(g, dtype=float).ravel())
        return last["f"], last["g"]

    x = np.array(x0, dtype=float)
    f, g = evaluate(x)
    pairs = _CurvatureMemory(x.size, memory)
    nit = 0
    tiny = np.finfo(float).tiny
    while nit < max_iter:
        step = None
        for quasi_newton in ((True, False) if pairs else (False,)):
            if quasi_newton:
                p = -pairs.inverse_hessian_times(g)
            else:   # the first iteration, or a reset: steepest descent of unit length (as L-BFGS-B starts)
                pairs.clear()
                p = -g / max(float(np.linalg.norm(g)), tiny)
            if not float(g @ p) < 0:
                continue
            with warnings.catch_warnings():
                # a failed search is handled here (steepest descent, then the "line_search" status); scipy's own
                # warning would only reach the user as noise
                warnings.filterwarnings("ignore", message="The line search algorithm did not converge")
                alpha = optimize.line_search(lambda z: evaluate(z)[0], lambda z: evaluate(z)[1], x, p, g, f,
                                             c1=c1, c2=c2, maxiter=line_search_iter)[0]
            if alpha is not None:
                step = alpha * p
                break
        if step is None:
            return x, f, nit, "line_search"
        x_new = x + step
        f_new, g_new = evaluate(x_new)
        y = g_new - g
        sy = float(step @ y)
        if sy > np.finfo(float).eps * float(y @ y):
            pairs.add(step, y)
        reduction = f - f_new
        x, f, g = x_new, f_new, g_new
        nit += 1
        if callback is not None and callback(x, nit):
            return x, f, nit, "stopped"
        if reduction <= ftol * max(abs(f + reduction), abs(f), 1.0):
            return x, f, nit, "converged"
    return x, f, nit, "max_iter"
