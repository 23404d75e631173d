"""Rotary positions (RoPE) on projected tokens (pure functions on arrays).

A rotary head (theory §2, "Rotary positions") projects each token to ``q_t = W_Q^T x_t`` and ``k_t = W_K^T x_t``
(``2P`` coordinates) and rotates them by position before the logits::

    logit_ts = (R_t q_t)^T (R_s k_t) = x_t^T W_Q R_t^T R_s W_K^T x_s,

``R_t`` block-diagonal: plane ``p`` (coordinates ``p`` and ``p + P``, the "rotate half" layout of Hugging Face's
Llama-family models) turned by the angle ``phi_tp`` (``t theta_p`` at frequency ``theta_p``, or as a model's
scaled position embedding gives it). In complex form plane p is ``u_t = (a_p + i a'_p)^T x_t e^{i phi_tp}``, so
the plane's part of the logits is ``Re(x_t^T M_p x_s e^{i (phi_tp - phi_sp)})`` with the complex ``d x d`` kernel
``M_p = alpha_p beta_p^H``: a plane is two real dimensions of the head's width, and the rank of the rotary head
is ``2 sum_p rank_C(M_p)`` (one plane per frequency in a trained head, so at most ``2P = d_head``).
"""

from dataclasses import dataclass

import numpy as np

__all__ = ["RotaryPositions", "rotate", "rotate_adjoint", "plane_kernels", "plane_strengths"]


@dataclass(frozen=True, eq=False)
class RotaryPositions:
    """The angles of a rotary head's planes at each position of a window.

    Parameters
    ----------
    angles : array-like of shape (T, P)
        ``angles[t, p]``: the angle plane p is turned by at position t (``t theta_p`` for plain RoPE).

    Attributes
    ----------
    cos, sin : ndarray of shape (T, 2P)
        The tables in the "rotate half" layout (each plane's value twice), as a model applies them.

    Examples
    --------
    >>> import numpy as np
    >>> pos = RotaryPositions.from_frequencies(10000.0 ** -(np.arange(4) / 4), length=16)
    >>> pos.length, pos.n_planes, pos.width
    (16, 4, 8)
    """

    angles: np.ndarray

    def __post_init__(self):
        a = np.asarray(self.angles, dtype=float)
        if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
            raise ValueError(f"rotary angles must be a 2-D array (T positions, P planes); got shape {a.shape}.")
        if not np.all(np.isfinite(a)):
            raise ValueError("rotary angles contain NaN or infinite values.")
        a = a.copy()
        a.setflags(write=False)
        object.__setattr__(self, "angles", a)

    @classmethod
    def from_frequencies(cls, frequencies, length, offset=0):
        """Plain RoPE: plane p turned by ``(offset + t) theta_p`` at positions t = 0 ... length - 1."""
        theta = np.asarray(frequencies, dtype=float).ravel()
        if theta.size < 1 or not np.all(np.isfinite(theta)):
            raise ValueError("rotary frequencies must be a non-empty 1-D array of finite values.")
        t = np.arange(int(offset), int(offset) + int(length), dtype=float)
        return cls(np.outer(t, theta))

    @classmethod
    def from_tables(cls, cos, sin):
        """From a model's ``(cos, sin)`` position embeddings of shape (T, 2P) in the rotate-half layout.

        Returns ``(positions, amplitude)``: a scaled RoPE (e.g. YaRN's attention factor) multiplies both tables by
        ``amplitude``, which scales the logits by ``amplitude**2`` and is returned apart from the angles.
        """
        cos, sin = np.asarray(cos, dtype=float), np.asarray(sin, dtype=float)
        if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[1] % 2:
            raise ValueError(f"rotary tables must be two (T, 2P) arrays of one shape; got {cos.shape} and {sin.shape}.")
        P = cos.shape[1] // 2
        if not (np.allclose(cos[:, :P], cos[:, P:]) and np.allclose(sin[:, :P], sin[:, P:])):
            raise ValueError("rotary tables are not in the rotate-half layout (each plane's value at p and p + P).")
        amp = np.hypot(cos[:, :P], sin[:, :P])
        amplitude = float(np.median(amp))
        if not amplitude > 0 or not np.allclose(amp, amplitude, rtol=1e-4):
            raise ValueError("rotary tables do not have one amplitude (cos^2 + sin^2 varies): not a rotation.")
        return cls(np.arctan2(sin[:, :P], cos[:, :P])), amplitude

    @property
    def length(self):
        return self.angles.shape[0]

    @property
    def n_planes(self):
        return self.angles.shape[1]

    @property
    def width(self):
        """The head width ``2P`` the rotation acts on."""
        return 2 * self.angles.shape[1]

    @property
    def cos(self):
        return np.tile(np.cos(self.angles), 2)

    @property
    def sin(self):
        return np.tile(np.sin(self.angles), 2)


def _rotate_half(U):
    P = U.shape[-1] // 2
    return np.concatenate([-U[..., P:], U[..., :P]], axis=-1)


def rotate(U, positions):
    """``R_t u_t`` for projected tokens U of shape (..., T, 2P): ``U cos + rotate_half(U) sin``."""
    return U * positions.cos + _rotate_half(U) * positions.sin


def rotate_adjoint(G, positions):
    """``R_t^T g_t``, the adjoint of :func:`rotate` (for gradients): ``G cos - rotate_half(G) sin``."""
    return G * positions.cos - _rotate_half(G) * positions.sin


def plane_kernels(A, B):
    """The complex plane factors of ``(A, B)`` (d x 2P, rotate-half layout): ``alpha_p = A_p + i A_{p+P}`` and
    ``beta_p`` likewise, as two complex (d, P) arrays; plane p's kernel is ``alpha_p beta_p^H``."""
    P = A.shape[1] // 2
    return A[:, :P] + 1j * A[:, P:2 * P], B[:, :P] + 1j * B[:, P:2 * P]


def plane_strengths(A, B, metric=None):
    """Each plane's strength ``||alpha_p|| ||beta_p||`` (the norm of its rank-one kernel ``alpha_p beta_p^H``),
    in the token metric ``(M_q^{1/2}, M_k^{1/2})`` where given: MHA2MLA's ``||q_p|| ||k_p||`` ranking of a head's
    planes, measured on the tokens rather than on one position. Shape (P,)."""
    alpha, beta = plane_kernels(A, B)
    if metric is not None:
        alpha, beta = metric[0] @ alpha, metric[1] @ beta
    return np.linalg.norm(alpha, axis=0) * np.linalg.norm(beta, axis=0)


def pair_rotations(positions, mask=None):
    """The angle differences the logits see, ``phi_s - phi_t`` over the kept pairs (t, s), each once with its
    share of the pairs: ``(deltas, weights)`` of shapes (m, P) and (m,), weights summing to one. Plain RoPE
    gives one per offset ``s - t``."""
    phi = positions.angles
    T = phi.shape[0]
    keep = np.ones((T, T), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    t, s = np.nonzero(keep)
    deltas, counts = np.unique(np.round(phi[s] - phi[t], 12), axis=0, return_counts=True)
    return deltas, counts / counts.sum()


def _turned_gram(M, tables, sign):
    """``sum_delta w_delta R_delta'^T M R_delta'``, ``F R_delta'`` the rows of F (d x 2P) turned by ``sign delta``
    (``F R(delta)^T`` for sign +1, ``F R(delta)`` for -1): the Gram matrix of two factors' turned copies stacked
    over the pairs, ``H^T H'`` (``M = F^T F'``, 2P x 2P), without forming the copies.

    ``R' = C + sign J S`` (C, S the diagonal cos and sin of delta, J the rotate-half map, ``F J = rotate_half(F)``),
    so each term is an entrywise product of M (or its rotated halves) with a weighted table of cos and sin
    products (``tables``: :func:`_pair_tables`), O(P^2) per Gram instead of O(m d P^2) for the stacked copies."""
    cc, cs, sc, ss = tables
    MJ = _rotate_half(M)
    JtM = _rotate_half(M.T).T
    JtMJ = _rotate_half(JtM)
    return M * cc + sign * (MJ * cs + JtM * sc) + JtMJ * ss


def _pair_tables(pairs):
    """``(sum w c c^T, sum w c s^T, sum w s c^T, sum w s s^T)`` over the pairs' angle differences, the cos and
    sin tiled to the rotate-half layout (2P x 2P each)."""
    deltas, shares = pairs
    cos, sin = np.tile(np.cos(deltas), 2), np.tile(np.sin(deltas), 2)
    wc, ws = shares[:, None] * cos, shares[:, None] * sin
    return cos.T @ wc, cos.T @ ws, sin.T @ wc, sin.T @ ws


def family_svd(factors, weights, pairs, side):
    """Thin SVD of ``sum_h w_h Z(A_h, B_h)`` on one side, ``factors`` a list of ``(A, B)`` in the metric wanted
    (e.g. the tokens': ``M_q^{1/2} A``, ``M_k^{1/2} B``). The head's logit maps over the pairs,
    ``K(delta) = A R(delta) B^T`` weighted by their share w, side by side: ``Z_q = [sqrt(w) K(delta)]`` (d x m d)
    ``= A H_q^T`` (side ``"q"``) and ``Z_k = [sqrt(w) K(delta)^T] = B H_k^T`` (side ``"k"``), ``H_q`` the rows of B
    turned by each delta stacked (m d x 2P; ``H_k`` those of A, turned back). Returns ``(U, s)``: the side's
    directions (d, k) and the singular values, descending.

    ``Z = [A_1 ... A_k] diag(w) [H_1 ... H_k]^T``: with ``[A_1 ... A_k] = Q_l R_l`` its left singular vectors and
    values are ``Q_l`` times those of ``R_l diag(w) G^{1/2}``, G the Gram matrix of the H's (:func:`_turned_gram`,
    entrywise from the pairs' cos and sin tables). The stacked H's (m d rows: one turned copy of the factor per
    pair) are never formed; a QR of them cost 1-3 s per call at d = 577, T = 32 (m = 528 pairs) and most of a
    rotary fit. Through the Gram the singular values are exact to about ``sqrt(eps)`` of the largest (1e-8), far
    below any sampling error the rank rules compare them with."""
    lefts, rights, sign = [], [], (1.0 if side == "q" else -1.0)
    for A, B in factors:
        lefts.append(A if side == "q" else B)
        rights.append(B if side == "q" else A)
    tables = _pair_tables(pairs)
    widths = [R.shape[1] for R in rights]
    edges = np.concatenate([[0], np.cumsum(widths)])
    G = np.empty((edges[-1], edges[-1]))
    for i, Fi in enumerate(rights):
        for j in range(i, len(rights)):
            block = _turned_gram(Fi.T @ rights[j], tables, sign)
            G[edges[i]:edges[i + 1], edges[j]:edges[j + 1]] = block
            G[edges[j]:edges[j + 1], edges[i]:edges[i + 1]] = block.T
    lam, V = np.linalg.eigh((G + G.T) / 2)
    root = V * np.sqrt(np.clip(lam, 0.0, None))
    Ql, Rl = np.linalg.qr(np.hstack(lefts))
    k = [L.shape[1] for L in lefts]
    core = (Rl * np.repeat(np.asarray(weights, dtype=float), k)[None, :]) @ root
    u, sv, _ = np.linalg.svd(core)
    return Ql @ u, sv


def projected_head(metric, A, B, Uq, Uk, r):
    """``(P_q A, P_k B)``: a rotary head's factors projected on the top r directions of each side, the directions
    ``Uq``, ``Uk`` orthonormal in the token metric ``(M_q^{1/2}, M_q^{-1/2}, M_k^{1/2}, M_k^{-1/2})``."""
    Mq, Mq_inv, Mk, Mk_inv = metric
    r = max(0, int(r))
    Uq, Uk = Uq[:, :r], Uk[:, :r]
    return Mq_inv @ (Uq @ (Uq.T @ (Mq @ A))), Mk_inv @ (Uk @ (Uk.T @ (Mk @ B)))


def rotary_directions(metric, pairs, A, B):
    """``(U_q, U_k)``: the directions of a rotary head's logit family on each side in the token metric, strongest
    first (:func:`family_svd`), for :func:`projected_head`."""
    whitened = [(metric[0] @ A, metric[2] @ B)]
    return family_svd(whitened, [1.0], pairs, "q")[0], family_svd(whitened, [1.0], pairs, "k")[0]


def truncated_rotary_head(metric, pairs, A, B, r, directions=None):
    """A rotary head truncated to width r (the estimators' and the truncation bound's): its query and key factors
    projected on the top r directions of its own logit family on each side, in the token metric
    (``directions``: :func:`rotary_directions`, computed here if None)."""
    Uq, Uk = rotary_directions(metric, pairs, A, B) if directions is None else directions
    return projected_head(metric, A, B, Uq, Uk, r)
