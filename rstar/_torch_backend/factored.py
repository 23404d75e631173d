"""The factored softmax fit's loss and gradient on torch (CPU threads or CUDA), in float32 or float64.

One half's samples are moved to the device once (:class:`FactoredHalfLoss`); each L-BFGS evaluation sends the
small factors ``A, B`` (d x q) and V (d x d_v) and brings back the loss and their gradients as numpy float64. The
per-sample work (``X_i A``, the T x T logits and their softmax, the residual and its back-propagation) runs in the
chosen dtype; the loss and the gradients are accumulated over chunks in float64, so a float32 fit rounds each
term, not the sums (the model's residual sum of squares is later computed again in float64 on the CPU:
:func:`rstar.inversions._numerics.softmax_factored.factored_rss`).

The formulas are those of :func:`rstar.inversions._numerics.softmax_factored.joint_loss_terms`: with ``P_i`` the
attention, ``R_i = P_i X_i V - Y_i``, ``dL_i = (dP_i - rowsum(dP_i * P_i)) * P_i / sqrt(d)`` for
``dP_i = 2 R_i (X_i V)^T``: ``grad_A = sum_i X_i^T dL_i X_i B``, ``grad_B = sum_i X_i^T dL_i^T X_i A`` and
``grad_V = 2 sum_i X_i^T P_i^T R_i``.
"""

import numpy as np
import torch

__all__ = ["FactoredHalfLoss", "TokensInBasis", "rotate_tensor", "sample_chunks", "query_key_tensors",
           "factor_gradients"]


def rotate_tensor(U, rot, sign=1.0):
    """``U cos + sign rotate_half(U) sin`` for ``rot = (cos, sin)`` (sign -1: the adjoint rotation), U of shape
    (m, T, 2P): :func:`rstar.inversions._numerics.rotary.rotate` on torch.

    One new tensor, the sine terms added into its halves in place: building ``rotate_half(U)`` and two products
    took 2.8 ms for a chunk of 250 SmolLM2 windows (T = 32, 2P = 64, float32, one thread) where this takes 0.4."""
    cos, sin = rot
    P = U.shape[-1] // 2
    out = U * cos
    out[..., :P].addcmul_(U[..., P:], sin[..., :P], value=-sign)
    out[..., P:].addcmul_(U[..., :P], sin[..., P:], value=sign)
    return out


def sample_chunks(n, T, d, dtype, chunk_entries):
    """The samples of each chunk of a loss evaluation: the numpy path's bound on a chunk's largest temporary
    (``chunk T^2`` or ``chunk T d`` float64 entries), twice as many entries in float32 (the same bytes)."""
    entries = int(chunk_entries) * (2 if dtype == torch.float32 else 1)
    step = max(1, entries // max(T * T, T * d))
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


def query_key_tensors(X, AB, rot=None):
    """``(X_flat, X A, X B)`` of a chunk X (m, T, d) for the side-by-side factors ``AB = [A, B]`` (d x 2q), the
    coordinates rotated to their positions where ``rot = (cos, sin)`` is given."""
    m, T, d = X.shape
    q = AB.shape[1] // 2
    Xf = X.reshape(-1, d)
    XAB = Xf @ AB
    XA, XB = XAB[:, :q].reshape(m, T, q), XAB[:, q:].reshape(m, T, q)
    if rot is not None:
        XA, XB = rotate_tensor(XA, rot), rotate_tensor(XB, rot)
    return Xf, XA, XB


def factor_gradients(Xf, dA, dB, rot=None):
    """The gradient in ``[A, B]`` (d x 2q, float64) from the gradients in the (rotated) coordinates dA, dB
    (m, T, q): back through the adjoint rotation and ``X^T``."""
    if rot is not None:
        dA, dB = rotate_tensor(dA, rot, -1.0), rotate_tensor(dB, rot, -1.0)
    q = dA.shape[2]
    return (Xf.T @ torch.cat([dA, dB], dim=2).reshape(-1, 2 * q)).to(torch.float64)


class TokensInBasis:
    """A half's tokens (n, T, d) on the device, and ``X P`` for the last basis P asked for.

    ``tokens(None)`` is X; ``tokens(P)`` is ``X P`` (in X's dtype), formed chunk by chunk where P is neither the
    last basis asked for (the same array) nor equal to it, and then kept: one more tensor of X's size on the
    device from the first basis asked for on (the loss's lifetime: one fit). L-BFGS in the token metric's
    whitened coordinates (``P = M^{-1/2}``) then evaluates ``X P A~`` where it formed ``P A~`` on the CPU (numpy,
    float64) at each evaluation and ``P grad`` after it: on a MiniLM head 6% of the fit's time, on a SmolLM2
    rotary head (d = 577, q = 64) 11%, and on a GPU the one ``d x d`` product per evaluation left on the CPU."""

    def __init__(self, X, parts):
        self.X, self.parts = X, parts
        self._basis, self._key, self._XP = None, None, None

    def __call__(self, basis):
        if basis is None:
            return self.X
        if basis is not self._basis:
            key = np.array(basis, dtype=float)
            if self._key is None or key.shape != self._key.shape or not np.array_equal(key, self._key):
                n, T, d = self.X.shape
                Pt = torch.as_tensor(key, device=self.X.device).to(self.X.dtype)
                self._XP = None          # the old basis's tensor freed before the new one is formed
                XP = torch.empty((n, T, key.shape[1]), dtype=self.X.dtype, device=self.X.device)
                for part in self.parts:
                    XP[part] = self.X[part] @ Pt
                self._XP, self._key = XP, key
            self._basis = basis
        return self._XP


class FactoredHalfLoss:
    """One half's samples on a device and its factored loss.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)
    mask : ndarray of bool, shape (T, T), or None
        The logits kept (causal: lower triangle); None keeps all.
    device : torch.device
    dtype : torch.dtype
        The dtype of the per-sample work (float32 or float64).
    rotary : RotaryPositions or None
        A rotary head's positions: the logits are ``rotate(X_i A) rotate(X_i B)^T / sqrt(d)`` and the gradients
        go back through the adjoint rotation (:mod:`rstar.inversions._numerics.rotary`).
    chunk_entries : int
        The numpy path's bound on a chunk's largest temporary (``chunk T^2`` or ``chunk T d`` float64 entries);
        here twice as many entries in float32 (the same bytes): one chunk of 250 MiniLM windows (T = 32, d = 385)
        evaluated in 10 ms where three took 15.

    Notes
    -----
    Called with ``basis=P`` (a d x d matrix), the factors are taken in the coordinates ``A = P A~``,
    ``B = P B~`` and the gradients returned are those in ``A~, B~``: the tokens' projections run on ``X P``,
    formed once for that basis on the device (:class:`TokensInBasis`), so an optimiser working in preconditioned
    coordinates (:func:`rstar.inversions._numerics.softmax_factored.fit_factored_pair`) makes no ``d x d`` product
    of its own at each evaluation.
    """

    #: the loss takes ``basis=`` (the factors in preconditioned coordinates)
    takes_basis = True

    def __init__(self, X, Y, mask, device, dtype, chunk_entries, rotary=None):
        self.device, self.dtype = device, dtype
        self.rot = None
        if rotary is not None:
            cos, sin = (torch.as_tensor(np.asarray(t, dtype=float), device=device).to(dtype)
                        for t in (rotary.cos, rotary.sin))
            self.rot = (cos, sin)
        n, T, d = X.shape
        self.shape = (n, T, d, Y.shape[2])
        self.X = torch.as_tensor(np.ascontiguousarray(X), device=device).to(dtype)
        self.Y = torch.as_tensor(np.ascontiguousarray(Y), device=device).to(dtype)
        self.mask = None if mask is None else torch.as_tensor(np.asarray(mask, dtype=bool), device=device)
        self.parts = sample_chunks(n, T, d, dtype, chunk_entries)
        self._path = (None, None)
        self.tokens = TokensInBasis(self.X, self.parts)

    def _tensor(self, a):
        return torch.as_tensor(np.asarray(a, dtype=float), device=self.device).to(self.dtype)

    def _value_path(self, V, Vt):
        """``X V`` for every sample, kept while V is unchanged (a known V is the same at every evaluation)."""
        key, Z = self._path
        if key is not None and key.shape == V.shape and np.array_equal(key, V):
            return Z
        n, T, d, _ = self.shape
        Z = (self.X.reshape(-1, d) @ Vt).reshape(n, T, -1)
        self._path = (np.array(V, dtype=float), Z)
        return Z

    def __call__(self, A, B, V, value_grad=False, basis=None):
        """``(f, grad_A, grad_B, grad_V)`` (grad_V None unless ``value_grad``), as numpy float64; with ``basis=P``
        the factors are ``P A, P B`` and grad_A, grad_B those in A and B (the class notes)."""
        _, _, d, d_v = self.shape
        q = A.shape[1]
        c = 1.0 / np.sqrt(d)
        AB = self._tensor(np.hstack([np.asarray(A, dtype=float) * c, np.asarray(B, dtype=float)]))
        Vt = self._tensor(V)
        Z = self._value_path(V, Vt)
        f = torch.zeros((), dtype=torch.float64, device=self.device)
        g = torch.zeros((d, 2 * q), dtype=torch.float64, device=self.device)
        gV = torch.zeros((d, d_v), dtype=torch.float64, device=self.device) if value_grad else None
        Xq = self.tokens(basis)
        for part in self.parts:
            Zp, Y = Z[part], self.Y[part]
            Xf, XA, XB = query_key_tensors(Xq[part], AB, self.rot)
            L = XA @ XB.transpose(1, 2)
            if self.mask is not None:
                L = L.masked_fill(~self.mask, float("-inf"))
            P = torch.softmax(L, dim=-1)
            R = P @ Zp - Y
            f += (R * R).sum().to(torch.float64)
            dP = 2.0 * (R @ Zp.transpose(1, 2))
            dL = (dP - (dP * P).sum(dim=-1, keepdim=True)) * P
            g += factor_gradients(Xf, dL @ XB, dL.transpose(1, 2) @ XA, self.rot)
            if value_grad:
                Xv = self.X[part].reshape(-1, d)     # V's gradient in the tokens' own coordinates
                gV += (2.0 * (Xv.T @ (P.transpose(1, 2) @ R).reshape(-1, d_v))).to(torch.float64)
        g = g.cpu().numpy()
        return (float(f), g[:, :q] * c, g[:, q:].copy(), None if gV is None else gV.cpu().numpy())
