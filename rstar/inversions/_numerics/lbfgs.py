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
    pairs instead of ``4 m`` vector operations with their temporaries.

    With many variables the products are memory-bound: each is one pass over ``m x n`` stored numbers (98 560
    variables, m = 60: 47 MB a pass). An iteration here makes two passes over the pairs, the fewest the compact
    form allows: ``[S; Y] g`` when the gradient is observed (:meth:`observe`; kept for the next direction), and
    ``[S; Y]^T c`` for the direction; computing every product afresh took seven. A new pair's products with the
    others come from those already held (as Byrd, Nocedal & Schnabel's section 4 keeps them): ``S^T y = S^T g_new -
    S^T g`` and ``Y^T y = Y^T g_new - Y^T g`` from the two observed gradients, and for a step along the last
    direction, ``s = t H g``, ``Y^T s = t Y^T H g`` from that direction's own coefficients through ``(S^T Y)^T``,
    ``Y^T Y`` and ``Y^T g``. Without the new gradient or the step's direction (``g_new`` or ``along`` None)
    :meth:`add` computes the products directly instead.
    """

    def __init__(self, n, memory):
        self.pairs = np.zeros((2 * memory, n))      # [S; Y]: one buffer, so that one pass reads both
        self.S, self.Y = self.pairs[:memory], self.pairs[memory:]
        self.SY, self.YY = np.zeros((memory, memory)), np.zeros((memory, memory))
        self.order = []   # slots, oldest first
        self._g, self._Sg, self._Yg = None, None, None   # the observed gradient and its products (every slot)
        self._Y_Hg = None   # Y H g of the last direction (every held slot)

    def __bool__(self):
        return bool(self.order)

    def clear(self):
        self.order = []

    def observe(self, g):
        """The current gradient: its products with every stored pair, for the next :meth:`inverse_hessian_times`."""
        products = self.pairs @ g
        memory = self.S.shape[0]
        self._g, self._Sg, self._Yg = g, products[:memory], products[memory:]

    def _products(self, g):
        if g is not self._g:
            self.observe(g)
        return self._Sg, self._Yg

    def add(self, s, y, g_new=None, along=None):
        """Keep the pair ``(s, y)``; ``g_new`` the gradient after the step (then observed as well) and
        ``along`` the ``t`` with ``s = t H g`` for the last :meth:`inverse_hessian_times` ``H g``, where known."""
        memory = self.S.shape[0]
        held = np.asarray(self.order, dtype=int)
        if g_new is not None and self._g is not None:
            Sg, Yg = self._Sg, self._Yg
            self.observe(g_new)
            s_y, y_y = self._Sg - Sg, self._Yg - Yg       # S^T y, Y^T y over every slot
        elif held.size:
            s_y, y_y = self.S @ y, self.Y @ y
        else:
            s_y = y_y = None
        if along is not None and self._Y_Hg is not None:
            y_s = along * self._Y_Hg
        else:
            y_s = self.Y @ s if held.size else None
        slot = self.order.pop(0) if len(self.order) == memory else next(
            k for k in range(memory) if k not in self.order)
        self.S[slot], self.Y[slot] = s, y
        self.order.append(slot)
        # the new slot's row and column of S^T Y (s_i^T y_j) and Y^T Y; free slots hold stale entries, never read
        if held.size:
            self.SY[slot, :], self.SY[:, slot] = y_s, s_y
            self.YY[slot, :] = self.YY[:, slot] = y_y
        self.SY[slot, slot], self.YY[slot, slot] = float(s @ y), float(y @ y)
        if g_new is not None and self._g is g_new:
            self._Sg[slot], self._Yg[slot] = float(s @ g_new), float(y @ g_new)
        self._Y_Hg = None

    def inverse_hessian_times(self, g):
        idx = np.asarray(self.order)
        Sg, Yg = self._products(g)
        SY, YY = self.SY[np.ix_(idx, idx)], self.YY[np.ix_(idx, idx)]
        newest = idx[-1]
        gamma = self.SY[newest, newest] / self.YY[newest, newest]
        a, b = Sg[idx], Yg[idx]
        R = np.triu(SY)
        p = linalg.solve_triangular(R, a)
        w = linalg.solve_triangular(R, np.diag(SY) * p + gamma * (YY @ p) - gamma * b, trans="T")
        memory = self.S.shape[0]
        coef = np.zeros(2 * memory)
        coef[idx], coef[memory + idx] = w, -gamma * p
        out = self.pairs.T @ coef
        out += gamma * g
        # Y^T (H g) over the held slots: (Y^T S) w - gamma (Y^T Y) p + gamma Y^T g, from the small matrices
        self._Y_Hg = np.zeros(memory)
        self._Y_Hg[idx] = SY.T @ w - gamma * (YY @ p) + gamma * b
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
    pairs.observe(g)
    nit = 0
    tiny = np.finfo(float).tiny
    while nit < max_iter:
        step, along = None, None
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
                along = -alpha if quasi_newton else None     # p = -H g
                break
        if step is None:
            return x, f, nit, "line_search"
        x_new = x + step
        f_new, g_new = evaluate(x_new)
        y = g_new - g
        sy = float(step @ y)
        if sy > np.finfo(float).eps * float(y @ y):
            pairs.add(step, y, g_new, along)
        else:
            pairs.observe(g_new)
        reduction = f - f_new
        x, f, g = x_new, f_new, g_new
        nit += 1
        if callback is not None and callback(x, nit):
            return x, f, nit, "stopped"
        if reduction <= ftol * max(abs(f + reduction), abs(f), 1.0):
            return x, f, nit, "converged"
    return x, f, nit, "max_iter"
