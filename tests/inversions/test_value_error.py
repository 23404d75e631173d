"""The linearised error of a fitted value map and its move of a least-squares kernel (rstar.inversions._numerics.value_error),
and the rule's null shift that carries it."""

import warnings

import numpy as np
import pytest
from scipy import linalg

from rstar import RStarEstimator
from rstar.inversions._numerics import bilinear as _bilinear
from rstar.inversions._numerics import value_error as ve
from rstar.datasets import make_attention_task
from rstar.inversions import CrossFitNull, QueryKeyCrossFitInversion, QueryKeyLeastSquaresInversion
from rstar.rules import simulated_null_p_values
from rstar.rules.simulated import simulated_null_result


def _spd(rng, d):
    M = rng.standard_normal((d, d))
    return M @ M.T + d * np.eye(d)


def _least_squares_kernel(X, Y, V):
    """K^ of the least squares with a known V, and the Cholesky factor of its normal matrix."""
    T, d, d_v = X.shape[1], X.shape[2], Y.shape[2]
    ls = QueryKeyLeastSquaresInversion(V)
    stats = ls.new_stats(T, d, d_v)
    ls._update_least_squares(stats, X, Y)
    H = QueryKeyLeastSquaresInversion.normal_matrix(stats)
    L = linalg.cholesky(H, lower=True)
    return linalg.cho_solve((L, True), stats["rhs_ls"]).reshape(d, d), L


def test_reduced_value_map_keeps_the_gram_and_the_row_space():
    rng = np.random.default_rng(0)
    for d_v in (3, 5, 9):
        V = rng.standard_normal((5, d_v))
        Vr = ve.reduced_value_map(V)
        assert Vr.shape == (5, min(5, d_v))
        np.testing.assert_allclose(Vr @ Vr.T, V @ V.T, atol=1e-12)
        Q = np.linalg.pinv(Vr) @ V   # V = Vr Q^T with Q orthonormal
        np.testing.assert_allclose(Vr @ Q, V, atol=1e-12)
        np.testing.assert_allclose(Q @ Q.T, np.eye(Vr.shape[1]), atol=1e-12)


@pytest.mark.parametrize("d_v", [3, 6])
def test_leak_is_the_exact_move_of_the_least_squares_kernel(d_v):
    # noise-free Y = X K* G V*, tested with V' = V* + dV: the least squares is linear in Y, so
    # K^(V') - K* = -H'^{-1} vec(sum_i G_i K* G_i dV V'^T G_i) exactly; whitened and summed over the
    # components of the whitened K*, the leak's draws reproduce it
    rng = np.random.default_rng(1)
    n, T, d, r = 60, 3, 4, 2
    X = rng.standard_normal((n, T, d))
    K = rng.standard_normal((d, r)) @ rng.standard_normal((r, d))
    V = rng.standard_normal((d, d_v))
    Y = np.einsum("nta,ab,nsb,nsc,cv->ntv", X, K, X, X, V)
    dV = 0.1 * rng.standard_normal((d, d_v))
    V_test = V + dV
    K_hat, L = _least_squares_kernel(X, Y, V_test)
    Vr = ve.reduced_value_map(V_test)
    Q = np.linalg.pinv(Vr) @ V_test
    D = (dV @ Q.T)[None]                                  # dV V'^T = D V~^T
    A_half, B_half = linalg.sqrtm(_spd(rng, d)).real, linalg.sqrtm(_spd(rng, d)).real
    G = np.matmul(np.swapaxes(X, 1, 2), X)
    leak = ve.ValueMapErrorLeak(G, Vr, D, L, A_half, B_half, np.linalg.inv(A_half), np.linalg.inv(B_half))
    U, s, Wt = np.linalg.svd(A_half @ K @ B_half)
    acc = leak.start()
    np.testing.assert_array_equal(acc.draws(), 0.0)
    for m in range(r):
        acc.add(U[:, m], Wt[m], s[m])
    total = acc.draws()[0]
    expected = A_half @ (K_hat - K) @ B_half
    assert np.linalg.norm(expected) > 1e-3 * np.linalg.norm(A_half @ K @ B_half)
    np.testing.assert_allclose(total, expected, atol=1e-8 * np.abs(expected).max())
    # scaling the error scales the move
    acc2 = leak.scaled(-2.0).start()
    for m in range(r):
        acc2.add(U[:, m], Wt[m], s[m])
    np.testing.assert_allclose(acc2.draws()[0], -2.0 * total, atol=1e-8 * np.abs(expected).max())


def test_value_map_error_draws_match_the_fitted_maps_error():
    # repeated noise on the same tokens: the refitted V's error, in the reduced coordinates and with the
    # scale direction removed, has the delta-method covariance sigma2 P^{-1} (mean Mahalanobis = its dimension)
    rng = np.random.default_rng(2)
    n, T, d, d_v, r, sigma = 300, 3, 4, 3, 2, 0.1
    X = rng.standard_normal((n, T, d))
    K = rng.standard_normal((d, r)) @ rng.standard_normal((r, d))
    K /= np.linalg.norm(K)
    V = rng.standard_normal((d, d_v))
    signal = np.einsum("nta,ab,nsb,nsc,cv->ntv", X, K, X, X, V)
    Vr = ve.reduced_value_map(V)
    Q = np.linalg.pinv(Vr) @ V
    G = np.matmul(np.swapaxes(X, 1, 2), X)
    P = ve.value_map_information(G, K, Vr)
    v = Vr.ravel() / np.linalg.norm(Vr)
    dim = d * Vr.shape[1] - 1
    maha, sizes = [], []
    for rep in range(200):
        Y = signal + sigma * rng.standard_normal(signal.shape)
        K_hat, V_hat, _ = _bilinear.fit_query_key_samples(X, Y, K)
        sign = np.sign(np.sum(K_hat * K))
        D = ((sign * V_hat - V) @ Q.T).ravel()
        D -= v * (v @ D)
        maha.append(D @ P @ D / sigma**2)
        sizes.append(np.sum(D**2))
    assert np.mean(maha) == pytest.approx(dim, rel=0.15)
    draws = ve.value_map_error_draws(G, K, Vr, sigma**2, 2000, 0)
    assert draws.shape == (2000, d, Vr.shape[1])
    np.testing.assert_allclose(draws.reshape(2000, -1) @ v, 0.0, atol=1e-12)   # no scale direction
    assert np.mean(np.sum(draws**2, axis=(1, 2))) == pytest.approx(np.mean(sizes), rel=0.15)


def test_null_shift_leaves_the_first_test_and_raises_the_later_ones():
    rng = np.random.default_rng(3)
    p = 8
    S = np.zeros((p, p))
    S[0, 0], S[1, 1] = 12.0, 3.0
    M = S + 0.3 * rng.standard_normal((p, p))
    Z = 0.3 * rng.standard_normal((500, p, p))
    q, _ = simulated_null_p_values(M, Z, 0.01)
    q_zero, _ = simulated_null_p_values(M, Z, 0.01, null_shift=_RandomShift(np.zeros_like(Z)))
    np.testing.assert_array_equal(q, q_zero)
    assert int(np.sum(np.cumprod(q < 0.01))) == 2
    # a shift that grows with the signal: 0.6 of the kernel's size in random directions
    q_shift, _ = simulated_null_p_values(M, Z, 0.01, null_shift=_RandomShift(0.6 * rng.standard_normal((500, p, p)) / p))
    assert q_shift[0] == q[0]
    assert q_shift[1] > 0.01 > q[1]


class _RandomShift:
    """A null shift whose draws for a rank-one signal of size s are s times fixed draws."""

    def __init__(self, draws):
        self.unit = draws

    def start(self):
        return self

    def add(self, u, w, weight):
        self.total = getattr(self, "total", 0.0) + weight

    def draws(self):
        return self.total * self.unit



def _cross_fit(X, Y):
    inv = QueryKeyCrossFitInversion()
    stats = inv.new_stats(*X.shape[1:], Y.shape[2])
    inv.update(stats, X, Y)
    return inv.whiten(stats)


def test_cross_fit_carries_the_value_maps_error_in_both_directions():
    X, Y = make_attention_task(600, kind="linear_qk", seq_len=6, n_features=12, rank=3, noise=0.05,
                               random_state=0)
    ws = _cross_fit(X, Y)
    assert isinstance(ws.null, CrossFitNull) and len(ws.null.directions) == 2
    for w in ws.null.directions:
        assert isinstance(w.shift, ve.ValueMapErrorLeak)
        q, _ = simulated_null_p_values(w.statistic_matrix, w.draws, 0.01)
        q_shift, _ = simulated_null_p_values(w.statistic_matrix, w.draws, 0.01, null_shift=w.shift)
        assert q_shift[0] == q[0]
        assert np.all(q_shift[:4] >= q[:4] - 2e-3)   # the shift widens the null (up to Monte Carlo noise)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert RStarEstimator("linear_qk").fit(X, Y).rank_ == 3


def test_a_given_noise_level_scales_the_value_maps_error_too():
    X, Y = make_attention_task(600, kind="linear_qk", seq_len=6, n_features=12, rank=3, noise=0.05,
                               random_state=0)
    null = _cross_fit(X, Y).null.directions[0]
    own = simulated_null_result(null, None, 0.01, None)
    same = simulated_null_result(null, null.noise_variance, 0.01, None)
    np.testing.assert_allclose(same.p_values, own.p_values)
    factors = []
    scaled = type(null.shift).scaled

    def spy(self, factor):
        factors.append(factor)
        return scaled(self, factor)

    null.shift.scaled = spy.__get__(null.shift)
    simulated_null_result(null, 4 * null.noise_variance, 0.01, None)
    assert factors == [pytest.approx(2.0)]   # the same factor as the noise draws' (sqrt of the level's ratio)
