"""Limited-memory BFGS for smooth unconstrained problems with many parameters (pure functions on arrays).

The factored softmax fit (:mod:`rstar.inversions._numerics.softmax_factored`) minimises over tens of thousands of parameters (two
halves' ``d x q`` factors: 49 280 at d = 385, q = 32) with a loss that costs tens of milliseconds. scipy's
L-BFGS-B spent a quarter of such a fit in its bound-constrained Fortran step (20 ms per call on a MiniLM head:
its generalised Cauchy point and subspace minimisation pass over every variable several times, with no bounds to
enforce); the unconstrained two-loop recursion (Nocedal & Wright, *Numerical Optimization*, 2nd ed., Algorithm
7.4) costs ``4 m n`` multiply-adds per iteration. The step is scipy's strong-Wolfe line search
(:func:`scipy.optimize.line_search`, Algorithms 3.5-3.6 of the same book), and the stopping rule is L-BFGS-B's
relative reduction ``(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|, 1) <= ftol``.
"""

import numpy as np
from scipy import optimize

__all__ = ["minimize_lbfgs"]


def _two_loop(g, pairs):
    """``H g`` for the L-BFGS inverse-Hessian approximation of the curvature pairs ``(s, y, 1 / y^T s)``."""
    r = g.copy()
    coef = []
    for s, y, rho in reversed(pairs):
        a = rho * float(s @ r)
        r -= a * y
        coef.append(a)
    s, y, _ = pairs[-1]
    r *= float(s @ y) / float(y @ y)
    for (s, y, rho), a in zip(pairs, reversed(coef)):
        r += (a - rho * float(y @ r)) * s
    return r


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
    pairs = []
    nit = 0
    tiny = np.finfo(float).tiny
    while nit < max_iter:
        step = None
        for quasi_newton in ((True, False) if pairs else (False,)):
            if quasi_newton:
                p = -_two_loop(g, pairs)
            else:   # the first iteration, or a reset: steepest descent of unit length (as L-BFGS-B starts)
                pairs = []
                p = -g / max(float(np.linalg.norm(g)), tiny)
            if not float(g @ p) < 0:
                continue
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
            pairs.append((step, y, 1.0 / sy))
            if len(pairs) > memory:
                pairs.pop(0)
        reduction = f - f_new
        x, f, g = x_new, f_new, g_new
        nit += 1
        if callback is not None and callback(x, nit):
            return x, f, nit, "stopped"
        if reduction <= ftol * max(abs(f + reduction), abs(f), 1.0):
            return x, f, nit, "converged"
    return x, f, nit, "max_iter"
