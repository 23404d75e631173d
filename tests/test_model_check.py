"""The model check's sums against their definitions, term by term, on small arrays."""

import numpy as np
import pytest

from rstar.model_check import direction_scale_sums, offset_modulation_sums


def _attention(rng, n, T, causal):
    L = rng.standard_normal((n, T, T))
    if causal:
        L[:, ~np.tril(np.ones((T, T), dtype=bool))] = -np.inf
    A = np.exp(L - L.max(axis=-1, keepdims=True))
    return A / A.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("causal", [True, False])
def test_offset_modulation_sums_are_their_definition(causal):
    """``G[i, o, o'] = sum_{n,t} sum_{s,u: t-s=o, t-u=o'} phi_tsi phi_tui <e_ts, e_tu>`` and
    ``C[i, o] = sum_{n,t} sum_{s: t-s=o} phi_tsi <e_ts, R_t>``, with ``phi_tsi = a_ts p_ti k_si`` and
    ``e_ts = z_s - yhat_t`` (offsets shifted by T - 1 when bidirectional), over chunks that split the samples."""
    rng = np.random.default_rng(3)
    n, T, k, dv = 7, 6, 2, 3
    P, K = rng.standard_normal((2, n, T, k))
    A = _attention(rng, n, T, causal)
    Z, R = rng.standard_normal((2, n, T, dv))
    G, C = offset_modulation_sums((P, K), A, Z, R, causal, chunk=3)
    m = T if causal else 2 * T - 1
    shift = 0 if causal else T - 1
    G_ref, C_ref = np.zeros((k, m, m)), np.zeros((k, m))
    Yhat = A @ Z
    for b in range(n):
        for t in range(T):
            for s in range(T):
                e_s = Z[b, s] - Yhat[b, t]
                for i in range(k):
                    phi_s = A[b, t, s] * P[b, t, i] * K[b, s, i]
                    C_ref[i, t - s + shift] += phi_s * e_s @ R[b, t]
                    for u in range(T):
                        phi_u = A[b, t, u] * P[b, t, i] * K[b, u, i]
                        G_ref[i, t - s + shift, t - u + shift] += phi_s * phi_u * e_s @ (Z[b, u] - Yhat[b, t])
    np.testing.assert_allclose(G, G_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(C, C_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_direction_scale_sums_are_their_definition_over_chunks(causal):
    """The joint scales' normal equations, ``gram[i, j] = sum <c_i, c_j>`` and ``cross[i] = sum <c_i, R>`` with
    ``c_i[n, t] = sum_s a_ts w_{t-s,i} p_ti k_si (z_s - yhat_t)``, summed over chunks of samples (here of 1 and of
    2 samples: the k corrections of every sample are never held at once) equal the same sums over all samples."""
    rng = np.random.default_rng(4)
    n, T, k, dv = 5, 4, 3, 2
    P, K = rng.standard_normal((2, n, T, k))
    A = _attention(rng, n, T, causal)
    Z, R = rng.standard_normal((2, n, T, dv))
    m = T if causal else 2 * T - 1
    shift = 0 if causal else T - 1
    W = rng.standard_normal((k, m))
    Yhat = A @ Z
    c = np.zeros((k, n, T, dv))
    for b in range(n):
        for t in range(T):
            for s in range(T):
                for i in range(k):
                    c[i, b, t] += A[b, t, s] * W[i, t - s + shift] * P[b, t, i] * K[b, s, i] * (Z[b, s] - Yhat[b, t])
    flat = c.reshape(k, -1)
    for entries in (k * T * dv, 2 * k * T * dv, 10**6):
        gram, cross = direction_scale_sums((P, K), A, Z, R, W, causal, chunk_entries=entries)
        np.testing.assert_allclose(gram, flat @ flat.T, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(cross, flat @ R.ravel(), rtol=1e-10, atol=1e-12)
