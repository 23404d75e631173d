"""The log-attention least squares' loss and gradient on torch (CPU threads or CUDA), in float32 or float64.

The twin of :func:`rstar.inversions._numerics.log_attention.log_attention_loss`: the targets ``(L, W, U, C)`` are
read once on numpy in float64 (:func:`rstar.inversions._numerics.log_attention.log_attention_targets`) and moved
to the device with the half's tokens; each L-BFGS evaluation sends the factors ``A, B`` (d x q) and brings back
the loss and its gradients as numpy float64. The per-sample work (``X_i A``, the rotation, the T x T logits, the
weighted row centring, the one-sided bound and the back-propagation) runs in the chosen dtype; the loss and the
gradients are accumulated over chunks in float64.

With ``l = rotate(X A) rotate(X B)^T / sqrt(d)``, ``e = l - L``, the row constant ``ebar`` (e's W-weighted mean)
and ``h = max(0, l - ebar - U)`` on rows with a known entry: ``f = sum W (e - ebar)^2 + sum C h^2`` and
``df/dl = 2 (W (e - ebar) + C h - W rowsum(C h) / rowsum(W))``.
"""

import numpy as np
import torch

from .factored import TokensInBasis, factor_gradients, query_key_tensors, sample_chunks

__all__ = ["LogAttentionHalfLoss"]


class LogAttentionHalfLoss:
    """One half's tokens and log-attention targets on a device, and its loss in the factored losses' signature:
    ``loss(A, B, V, value_grad=False) -> (f, grad_A, grad_B, None)``.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    targets : tuple of four ndarrays of shape (n, T, T)
        ``(L, W, U, C)`` of :func:`rstar.inversions._numerics.log_attention.log_attention_targets`.
    device : torch.device
    dtype : torch.dtype
        The dtype of the per-sample work (float32 or float64).
    chunk_entries : int
        The numpy path's bound on a chunk's largest temporary (``chunk T^2`` or ``chunk T d`` float64 entries);
        twice as many entries in float32 (the same bytes).
    rotary : RotaryPositions or None
        A rotary head's positions (:mod:`rstar.inversions._numerics.rotary`).

    Notes
    -----
    ``basis=P``: the factors in preconditioned coordinates, as
    :class:`rstar._torch_backend.factored.FactoredHalfLoss` takes them.
    """

    takes_basis = True

    def __init__(self, X, targets, device, dtype, chunk_entries, rotary=None):
        self.device, self.dtype = device, dtype
        n, T, d = X.shape
        self.shape = (n, T, d)

        def put(a):
            return torch.as_tensor(np.ascontiguousarray(a, dtype=float), device=device).to(dtype)

        self.rot = None if rotary is None else (put(rotary.cos), put(rotary.sin))
        self.X = put(X)
        L, W, U, C = targets
        self.L, self.W, self.U, self.C = (put(t) for t in (L, W, U, C))
        mass = self.W.sum(dim=2, keepdim=True)
        self.has = (mass > 0).to(dtype)                                  # rows with a known entry
        self.inv_mass = torch.where(mass > 0, 1.0 / torch.where(mass > 0, mass, torch.ones_like(mass)),
                                    torch.zeros_like(mass))
        self.parts = sample_chunks(n, T, d, dtype, chunk_entries)
        self.tokens = TokensInBasis(self.X, self.parts)

    def __call__(self, A, B, V=None, value_grad=False, basis=None):
        """``(f, grad_A, grad_B, None)`` as numpy float64 (V, the known value map the targets were read with, is
        not fitted); with ``basis=P`` the factors are ``P A, P B`` and the gradients those in A and B."""
        if value_grad:
            raise ValueError("the log-attention loss reads the attention with a known value map; it fits no V.")
        d, q = self.shape[2], A.shape[1]
        c = 1.0 / np.sqrt(d)
        AB = torch.as_tensor(np.hstack([np.asarray(A, dtype=float) * c, np.asarray(B, dtype=float)]),
                             device=self.device).to(self.dtype)
        f = torch.zeros((), dtype=torch.float64, device=self.device)
        g = torch.zeros((d, 2 * q), dtype=torch.float64, device=self.device)
        Xq = self.tokens(basis)
        for part in self.parts:
            W, U, C, has, inv_mass = self.W[part], self.U[part], self.C[part], self.has[part], self.inv_mass[part]
            Xf, XA, XB = query_key_tensors(Xq[part], AB, self.rot)
            G = XA @ XB.transpose(1, 2)
            E = G - self.L[part]
            ebar = (W * E).sum(dim=2, keepdim=True) * inv_mass
            E = E - ebar
            H = torch.clamp(G - ebar - U, min=0.0) * has
            WE, CH = W * E, C * H
            f += ((WE * E).sum() + (CH * H).sum()).to(torch.float64)
            dG = 2.0 * (WE + CH - W * (CH.sum(dim=2, keepdim=True) * inv_mass))
            g += factor_gradients(Xf, dG @ XB, dG.transpose(1, 2) @ XA, self.rot)
        g = g.cpu().numpy()
        return float(f), g[:, :q] * c, g[:, q:].copy(), None
