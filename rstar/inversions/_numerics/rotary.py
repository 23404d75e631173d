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
