"""The unconstrained L-BFGS behind the factored softmax fit: its minima, its stopping rules, its callback."""

import numpy as np
import pytest
from scipy import optimize

from rstar.inversions._numerics.lbfgs import minimize_lbfgs


def _rosen(x):
    return optimize.rosen(x), optimize.rosen_der(x)


@pytest.mark.parametrize("n", [2, 10, 50])
def test_rosenbrock_minimum_reached(n):
    x0 = np.full(n, -1.2)
    x0[1::2] = 1.0
    x, f, nit, status = minimize_lbfgs(_rosen, x0, 2000, 1e-15)
    assert status == "converged"
    np.testing.assert_allclose(x, np.ones(n), atol=1e-4)
    assert f < 1e-8
    # no slower than scipy's L-BFGS-B with the same memory on this problem (within a factor for the search)
    ref = optimize.minimize(_rosen, x0, jac=True, method="L-BFGS-B",
                            options={"maxcor": 20, "ftol": 1e-15, "gtol": 0.0, "maxiter": 2000})
    assert nit <= 2 * ref.nit + 10


def test_matches_scipy_on_an_ill_conditioned_least_squares():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((200, 60)) * np.logspace(0, 2, 60)   # Hessian condition number about 1e4
    b = rng.standard_normal(200)

    def fun(x):
        r = A @ x - b
        return float(r @ r), 2 * A.T @ r

    x, f, nit, status = minimize_lbfgs(fun, np.zeros(60), 5000, 1e-14)
    exact = np.linalg.lstsq(A, b, rcond=None)[0]
    best = float(np.sum((A @ exact - b) ** 2))
    ref = optimize.minimize(fun, np.zeros(60), jac=True, method="L-BFGS-B",
                            options={"maxcor": 20, "ftol": 1e-14, "gtol": 0.0, "maxiter": 5000})
    assert status == "converged" and nit <= 1.5 * ref.nit
    assert f == pytest.approx(best, rel=1e-10)


def test_stopping_rules():
    calls = []

    def stop_at_three(x, nit):
        calls.append(nit)
        return nit == 3

    x0 = np.array([-1.2, 1.0])
    _, _, nit, status = minimize_lbfgs(_rosen, x0, 100, 0.0, callback=stop_at_three)
    assert (nit, status, calls) == (3, "stopped", [1, 2, 3])
    _, f5, nit, status = minimize_lbfgs(_rosen, x0, 5, 0.0)
    assert (nit, status) == (5, "max_iter")
    assert f5 < optimize.rosen(x0)
    # a loose ftol stops early on a run that still gains
    _, _, nit_loose, status = minimize_lbfgs(_rosen, x0, 1000, 1e-2)
    assert status == "converged" and nit_loose < 30
    # at the minimum already: no descent direction, no step taken
    _, f, nit, status = minimize_lbfgs(_rosen, np.ones(2), 100, 1e-12)
    assert (f, nit, status) == (0.0, 0, "line_search")


def test_each_point_is_evaluated_once():
    seen = []

    def fun(x):
        seen.append(x.copy())
        return _rosen(x)

    minimize_lbfgs(fun, np.array([-1.2, 1.0]), 50, 0.0)
    keys = [p.tobytes() for p in seen]
    assert len(keys) == len(set(keys))


def _two_loop_reference(g, pairs):
    # Nocedal & Wright, Algorithm 7.4, written out pair by pair
    r, coef = g.copy(), []
    for s, y in reversed(pairs):
        a = (s @ r) / (s @ y)
        r -= a * y
        coef.append(a)
    s, y = pairs[-1]
    r *= (s @ y) / (y @ y)
    for (s, y), a in zip(pairs, reversed(coef)):
        r += (a - (y @ r) / (s @ y)) * s
    return r


def test_compact_memory_is_the_two_loop_recursion():
    # the ring buffers wrap around (12 pairs through 5 slots) and survive a reset
    from rstar.inversions._numerics.lbfgs import _CurvatureMemory

    rng = np.random.default_rng(1)
    n, memory = 300, 5
    mem, pairs = _CurvatureMemory(n, memory), []
    for k in range(16):
        if k == 12:
            mem.clear()
            pairs = []
            assert not mem
        s = rng.standard_normal(n)
        y = s * rng.uniform(0.5, 2.0, n)
        mem.add(s, y)
        pairs = (pairs + [(s, y)])[-memory:]
        g = rng.standard_normal(n)
        expected = _two_loop_reference(g, pairs)
        np.testing.assert_allclose(mem.inverse_hessian_times(g), expected, rtol=0, atol=1e-12 * np.abs(expected).max())


def test_products_carried_between_iterations_are_the_direct_ones():
    """As minimize_lbfgs drives it — the gradient observed once, each pair added with the next gradient and the
    step's multiple of the last direction — the memory's S^T Y, Y^T Y and the gradient's products are those computed
    afresh, through wrap-around, a rejected pair (the gradient observed alone) and a reset; and the direction is
    still the two-loop recursion's."""
    from rstar.inversions._numerics.lbfgs import _CurvatureMemory

    rng = np.random.default_rng(2)
    n, memory = 200, 4
    mem, pairs = _CurvatureMemory(n, memory), []
    g = rng.standard_normal(n)
    mem.observe(g)
    for k in range(14):
        if k == 10:
            mem.clear()
            pairs = []
        if pairs:
            direction = mem.inverse_hessian_times(g)
            np.testing.assert_allclose(direction, _two_loop_reference(g, pairs), rtol=1e-10,
                                       atol=1e-12 * np.abs(direction).max())
            t = -rng.uniform(0.1, 2.0)
            s, along = t * direction, t
        else:
            s, along = -g / np.linalg.norm(g), None
        y = s * rng.uniform(0.5, 2.0, n)     # a positive-definite curvature along s
        g_new = g + y
        if k == 6:        # rejected: only the gradient moves on
            mem.observe(g_new)
        else:
            mem.add(s, y, g_new, along)
            pairs = (pairs + [(s, y)])[-memory:]
        g = g_new
        idx = np.asarray(mem.order)
        S, Y = mem.S[idx], mem.Y[idx]
        np.testing.assert_allclose(mem.SY[np.ix_(idx, idx)], S @ Y.T, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(mem.YY[np.ix_(idx, idx)], Y @ Y.T, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(mem._Sg[idx], S @ g, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(mem._Yg[idx], Y @ g, rtol=1e-10, atol=1e-10)


def test_a_failed_line_search_ends_the_run_without_scipy_s_warning():
    """A gradient that points uphill: every search fails, the run stops with status "line_search", and scipy's
    LineSearchWarning (handled here) does not reach the user."""
    import warnings

    def wrong(x):
        return float(x @ x), -2 * x

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, f, nit, status = minimize_lbfgs(wrong, np.ones(3), 50, 1e-12)
    assert (nit, status) == (0, "line_search") and f == 3.0
