"""Torch modules of the student classes B0–B3 (theory §2 and §6).

Every module exposes the learned operator through :meth:`operator` (the
token-mixing matrix ``A = P Q^T`` for B0, the query–key kernel
``K = W_Q W_K^T`` for B1–B3) and can evaluate the network with an explicit
operator in its place (:meth:`forward_with_operator`), which is what the
finite-sample noise level of the learned operator is computed from.

Parameters are drawn from a :class:`torch.Generator` on the CPU, so a seeded
student starts from the same weights whatever device it trains on.

This module imports torch; it is only imported by
:class:`rstar.students.AttentionStudent` when a student is fitted.
"""

import math

import torch
from torch import nn

__all__ = ["LinearProxy", "LinearQK", "LinearQKFull", "SoftmaxAttention", "RotarySoftmaxAttention", "AttentionBlock",
           "build_module"]


def _normal(shape, std, generator):
    return nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64) * std)


class _Student(nn.Module):
    """Common interface: ``forward(X) = forward_with_operator(X, operator())``. ``values``, where given, is ``X V``
    computed beforehand (a value map held fixed: the same every epoch), shape (n, T, d_v)."""

    def operator(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def forward_with_operator(self, X, K, values=None):  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, X, values=None):
        return self.forward_with_operator(X, self.operator(), values)

    def _values(self, X, values):
        return X @ self.V if values is None else values


class _Factored(_Student):
    """Operator ``L R^T`` from two factors of inner dimension ``width``, or a full matrix."""

    def _init_operator(self, rows, cols, rank, init_scale, generator, full=False):
        if full:
            self.K = _normal((rows, cols), init_scale, generator)
        else:
            width = min(rows, cols) if rank is None else rank
            self.L = _normal((rows, width), init_scale, generator)
            self.R = _normal((cols, width), init_scale, generator)
        self.full = full

    def operator(self):
        return self.K if self.full else self.L @ self.R.T


class LinearProxy(_Factored):
    """B0, token mixing ``Y = A X V`` with ``A = P Q^T`` (T x T, rank <= r).

    Parameters
    ----------
    seq_len : int
        T; the operator is T x T, so the module only accepts T tokens.
    n_features, value_dim : int
        d and d_v.
    rank : int or None
        Inner dimension r of ``P Q^T``; None means T (over-parameterised).
    init_scale : float
        Standard deviation of the entries of P and Q.
    generator : torch.Generator
    """

    def __init__(self, seq_len, n_features, value_dim, rank, init_scale, generator):
        super().__init__()
        self._init_operator(seq_len, seq_len, rank, init_scale, generator)
        self.V = _normal((n_features, value_dim), 1.0 / math.sqrt(n_features), generator)

    def forward_with_operator(self, X, A, values=None):
        # X: (n, T, d) -> (n, T, d_v)
        return A @ self._values(X, values)


class _QueryKey(_Factored):
    """A query–key student: its kernel enters only through the logits ``logit_scale * X K X^T`` (row t feeds
    token t only); subclasses set ``logit_scale`` and ``forward_with_logits``."""

    def logits(self, X, K):
        """``logit_scale * X K X^T``, shape (n, T, T), for a given kernel K (the Fisher information's path)."""
        return (X @ K @ X.transpose(-1, -2)) * self.logit_scale

    def query_key_logits(self, X):
        """The same logits without forming K: ``(X L)(X R)^T`` for factors of width r costs ``n T d r``
        multiply-adds, not the ``n T d^2`` of ``X K`` (a rank-20 student at MiniLM's d = 385)."""
        if self.full:
            return self.logits(X, self.K)
        return ((X @ self.L) @ (X @ self.R).transpose(-1, -2)) * self.logit_scale

    def forward_with_operator(self, X, K, values=None):
        return self.forward_with_logits(X, self.logits(X, K), values)

    def forward(self, X, values=None):
        return self.forward_with_logits(X, self.query_key_logits(X), values)


class LinearQK(_QueryKey):
    """B1, linear query–key attention ``Y = (X W_Q)(X W_K)^T X V / c``.

    ``c`` is a fixed normaliser (``sqrt(T d)`` with the T seen in ``fit``,
    as in :func:`rstar.datasets.make_attention_task`); it changes no rank.
    With ``full=True`` the kernel is an unconstrained d x d matrix (B1c).
    """

    def __init__(self, n_features, value_dim, rank, init_scale, generator, normalizer, full=False):
        super().__init__()
        self._init_operator(n_features, n_features, rank, init_scale, generator, full=full)
        self.V = _normal((n_features, value_dim), 1.0 / math.sqrt(n_features), generator)
        self.normalizer = float(normalizer)

    #: the logits are ``logit_scale * X K X^T``
    logit_scale = 1.0

    def forward_with_logits(self, X, S, values=None):
        return S @ self._values(X, values) / self.normalizer


class LinearQKFull(LinearQK):
    """B1c, the control: B1 with an unconstrained full-rank d x d kernel."""

    def __init__(self, n_features, value_dim, init_scale, generator, normalizer):
        super().__init__(n_features, value_dim, None, init_scale, generator, normalizer, full=True)


def _causal(S):
    """The logits S (..., T, T) with every key after its query masked out (-inf: weight 0 after the softmax)."""
    T = S.shape[-1]
    keep = torch.ones(T, T, dtype=torch.bool, device=S.device).tril()
    return S.masked_fill(~keep, float("-inf"))


class SoftmaxAttention(_QueryKey):
    """B2, ``Y = softmax(X W_Q W_K^T X^T / sqrt(d)) X V`` (row softmax); with ``causal`` each token attends to
    itself and the tokens before it."""

    def __init__(self, n_features, value_dim, rank, init_scale, generator, causal=False):
        super().__init__()
        self._init_operator(n_features, n_features, rank, init_scale, generator)
        self.V = _normal((n_features, value_dim), 1.0 / math.sqrt(n_features), generator)
        self.logit_scale = 1.0 / math.sqrt(n_features)   # the logits X K X^T / sqrt(d)
        self.causal = bool(causal)

    def query_key_factors(self):
        """``(W_Q, W_K)``, the kernel's factors (d x r, or d x d over-parameterised)."""
        return self.L, self.R

    def attention(self, S):
        """The row softmax of the logits S, the later keys masked where causal."""
        return torch.softmax(_causal(S) if self.causal else S, dim=-1)

    def forward_with_logits(self, X, S, values=None):
        return self.attention(S) @ self._values(X, values)


class RotarySoftmaxAttention(SoftmaxAttention):
    """B2 with rotary positions: ``logit_ts = rot_t(x_t A) . rot_s(x_s B) / sqrt(d)``, A and B (d x 2P) in the
    rotate-half layout of :mod:`rstar.inversions._numerics.rotary`, turned by the positions' angles (the T of
    ``fit``). Of width r (``rank``): ``A = L G_q``, ``B = R G_k`` with L, R of d x r (drawn at ``init_scale``) and
    G of r x 2P (drawn at ``1 / sqrt(r)``, so that A's entries start at about ``init_scale`` as an
    over-parameterised student's do); None is over-parameterised: A and B of d x 2P themselves.

    The logits are not linear in one d x d kernel (each offset has its own, ``A R(delta) B^T``), so the Fisher
    path (:meth:`forward_with_operator`) does not exist; :meth:`operator` is the zero-offset member ``A B^T``."""

    def __init__(self, n_features, value_dim, rank, init_scale, generator, rotary, causal=False):
        _QueryKey.__init__(self)
        width = int(rotary.width)
        inner = width if rank is None else int(rank)
        self.L = _normal((n_features, inner), init_scale, generator)
        self.R = _normal((n_features, inner), init_scale, generator)
        if rank is not None:
            self.G_q = _normal((inner, width), 1.0 / math.sqrt(inner), generator)
            self.G_k = _normal((inner, width), 1.0 / math.sqrt(inner), generator)
        self.factored, self.full = rank is not None, False
        self.V = _normal((n_features, value_dim), 1.0 / math.sqrt(n_features), generator)
        self.logit_scale = 1.0 / math.sqrt(n_features)
        self.causal = bool(causal)
        self.register_buffer("cos", torch.as_tensor(rotary.cos, dtype=torch.float64).clone())
        self.register_buffer("sin", torch.as_tensor(rotary.sin, dtype=torch.float64).clone())

    def query_key_factors(self):
        """``(A, B)``, each d x 2P."""
        if self.factored:
            return self.L @ self.G_q, self.R @ self.G_k
        return self.L, self.R

    def operator(self):
        A, B = self.query_key_factors()
        return A @ B.T

    def query_key_logits(self, X):
        from .._torch_backend.factored import rotate_tensor

        # X L then G (n T d r + n T r 2P multiply-adds) rather than X (L G) (n T d 2P): at SmolLM2's d = 576 and a
        # width of 18 of 64 the projections cost a quarter
        if self.factored:
            XA, XB = (X @ self.L) @ self.G_q, (X @ self.R) @ self.G_k
        else:
            XA, XB = X @ self.L, X @ self.R
        rot = (self.cos, self.sin)
        return (rotate_tensor(XA, rot) @ rotate_tensor(XB, rot).transpose(-1, -2)) * self.logit_scale

    def forward_with_operator(self, X, K, values=None):
        raise ValueError("a rotary student's logits are not linear in one d x d kernel (each offset has its own), "
                         "so it has no Fisher path through one; its rank is read by the split-half test.")


class AttentionBlock(SoftmaxAttention):
    """B3, one post-LayerNorm transformer block and a linear read-out.

    ``H = LN(X + softmax(X K X^T / sqrt(d)) X V)``,
    ``Z = LN(H + W_2 gelu(W_1 H + b_1) + b_2)``, ``Y = Z W_out + b_out``,
    with ``K = W_Q W_K^T`` of inner dimension r, V d x d, an FFN of width
    ``ffn_mult * d`` (Vaswani et al. 2017, post-LN variant).
    """

    def __init__(self, n_features, value_dim, rank, init_scale, generator, ffn_mult=4, causal=False):
        super().__init__(n_features, n_features, rank, init_scale, generator, causal=causal)
        d, h = n_features, ffn_mult * n_features
        self.ln1 = nn.LayerNorm(d, dtype=torch.float64)
        self.ln2 = nn.LayerNorm(d, dtype=torch.float64)
        self.W1 = _normal((d, h), 1.0 / math.sqrt(d), generator)
        self.b1 = nn.Parameter(torch.zeros(h, dtype=torch.float64))
        self.W2 = _normal((h, d), 1.0 / math.sqrt(h), generator)
        self.b2 = nn.Parameter(torch.zeros(d, dtype=torch.float64))
        self.W_out = _normal((d, value_dim), 1.0 / math.sqrt(d), generator)
        self.b_out = nn.Parameter(torch.zeros(value_dim, dtype=torch.float64))

    def forward_with_logits(self, X, S, values=None):
        H = self.ln1(X + self.attention(S) @ self._values(X, values))
        F = torch.nn.functional.gelu(H @ self.W1 + self.b1) @ self.W2 + self.b2
        return self.ln2(H + F) @ self.W_out + self.b_out


def build_module(kind, *, seq_len, n_features, value_dim, rank, init_scale, generator, value_map=None, causal=False,
                 rotary=None):
    """Construct the module of a student class (float64, on the CPU).

    Parameters
    ----------
    kind : {"linear_proxy", "linear_qk", "linear_qk_full", "softmax", "block"}
    seq_len, n_features, value_dim : int
        T, d and d_v of the training data.
    rank : int or None
    init_scale : float
    generator : torch.Generator
    value_map : array-like of shape (n_features, value_dim) or None
        A known value map: ``V`` is then this fixed buffer, not a trained parameter (not for ``"block"``, whose
        value map is d x d inside the block). The initial draws of the other weights are the same either way.
    causal : bool, default=False
        ``"softmax"`` and ``"block"``: each token attends to itself and the tokens before it.
    rotary : RotaryPositions or None, default=None
        ``"softmax"`` only: a rotary head at these positions (:class:`RotarySoftmaxAttention`).

    Returns
    -------
    torch.nn.Module
    """
    if kind == "linear_proxy":
        module = LinearProxy(seq_len, n_features, value_dim, rank, init_scale, generator)
    elif kind == "block":
        if value_map is not None:
            raise ValueError("a block student's value map is d x d inside the block: it cannot be fixed.")
        return AttentionBlock(n_features, value_dim, rank, init_scale, generator, causal=causal)
    elif kind == "linear_qk":
        module = LinearQK(n_features, value_dim, rank, init_scale, generator, math.sqrt(seq_len * n_features))
    elif kind == "linear_qk_full":
        module = LinearQKFull(n_features, value_dim, init_scale, generator, math.sqrt(seq_len * n_features))
    elif kind == "softmax" and rotary is not None:
        module = RotarySoftmaxAttention(n_features, value_dim, rank, init_scale, generator, rotary, causal=causal)
    elif kind == "softmax":
        module = SoftmaxAttention(n_features, value_dim, rank, init_scale, generator, causal=causal)
    else:
        raise ValueError(f"unknown student kind {kind!r}")
    if value_map is not None:
        # drawn as usual (the other weights' draws unchanged), then replaced by the known map, held fixed
        del module.V
        module.register_buffer("V", torch.as_tensor(value_map, dtype=torch.float64).clone())
    return module
