"""Per-head attention tasks read off a torch model with forward hooks (torch imported by the caller)."""

from dataclasses import dataclass, field

import numpy as np

from .._backend import NUMPY
from ..inversions._numerics.linalg import factored_svd

__all__ = ["AttentionLayer", "HeadTask", "attention_modules", "collect_attention"]


@dataclass
class HeadTask:
    """One attention head as a task of the softmax class (theory §2, "Real attention layers").

    In homogeneous coordinates ``x~ = [x, 1]`` (when the layer has biases) the head computes
    ``Y = softmax(X~ K X~^T / sqrt(d~) + mask) X~ V`` with ``K = sqrt(d~ / d_head) W~_Q W~_K^T`` and
    ``V = W~_V`` (``W~ = [W; b]``), which is rstar's softmax operator on ``X~``; ``rank(K) <= d_head``.

    Attributes
    ----------
    layer, head : int
    X : ndarray of shape (n, T, d)
        The layer's input hidden states (shared by the layer's heads).
    Y : ndarray of shape (n, T, d_head)
        The head's output before the layer's output projection.
    query, key, value : ndarray of shape (d + 1, d_head)
        ``[W; b]`` of the head (the last row is the bias, zero where the layer has none).
    causal : bool
        Whether the head attends to keys ``j <= i`` only.
    """

    layer: int
    head: int
    X: np.ndarray
    Y: np.ndarray
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    causal: bool = False
    has_bias: bool = True

    @property
    def d_head(self):
        return self.query.shape[1]

    def features(self, X=None):
        """``X~``: the inputs with a constant feature appended where the layer has biases, shape (n, T, d~)."""
        X = self.X if X is None else X
        if not self.has_bias:
            return X
        return np.concatenate([X, np.ones(X.shape[:-1] + (1,), dtype=X.dtype)], axis=-1)

    def _rows(self):
        return slice(None) if self.has_bias else slice(0, -1)

    def kernel(self):
        """The head's kernel ``K`` in rstar's convention on :meth:`features` (logits ``x~ K x~'^T / sqrt(d~)``)."""
        q, k = self.query[self._rows()], self.key[self._rows()]
        return np.sqrt(q.shape[0] / self.d_head) * (q @ k.T)

    def value_map(self):
        """The head's value map ``V`` on :meth:`features`, shape (d~, d_head)."""
        return self.value[self._rows()]

    def kernel_factors(self):
        """``(L, s, R)`` with ``kernel() = L diag(s) R^T``: its thin SVD through the ``d_head x d_head`` core of
        ``W~_Q W~_K^T`` (never the d~ x d~ product); ``s`` descending, ``d_head`` entries."""
        q, k = self.query[self._rows()], self.key[self._rows()]
        U, s, W = factored_svd(q, k)
        return U, np.sqrt(q.shape[0] / self.d_head) * s, W

    def kernel_singular_values(self):
        """Singular values of :meth:`kernel` (at most ``d_head`` non-zero)."""
        return self.kernel_factors()[1]

    def output(self, X=None, kernel=None, value_map=None):
        """The head's output (or that of another kernel/value map) on inputs ``X``, shape (n, T, d_head)."""
        Xt = self.features(X)
        K = self.kernel() if kernel is None else kernel
        V = self.value_map() if value_map is None else value_map
        logits = (Xt @ (K / np.sqrt(Xt.shape[-1]))) @ Xt.transpose(0, 2, 1)
        return attention_rows(logits, self.causal) @ (Xt @ V)


def attention_rows(logits, causal=False):
    """Row-wise softmax of ``logits`` (n, T, T), in place; with ``causal`` row i attends to keys ``j <= i`` only."""
    if causal:
        T = logits.shape[-1]
        logits[..., ~np.tril(np.ones((T, T), dtype=bool))] = -np.inf
    return NUMPY.softmax_rows(logits)


@dataclass
class AttentionLayer:
    """The inputs and per-head outputs of one self-attention module over all the sequences run.

    Attributes
    ----------
    index : int
        Position of the module among the model's attention modules (its layer).
    name : str
        The module's qualified name in the model.
    style : str
        ``"bert"``, ``"gpt2"`` or ``"multihead_attention"``.
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, n_heads, d_head)
    query, key, value : ndarray of shape (n_heads, d + 1, d_head)
    causal : bool
    """

    index: int
    name: str
    style: str
    X: np.ndarray
    Y: np.ndarray
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    causal: bool
    has_bias: bool
    max_abs_error: float = field(default=0.0)
    head_indices: tuple = None

    @property
    def n_heads(self):
        return self.Y.shape[2]

    def head(self, h):
        """The :class:`HeadTask` of the ``h``-th head held (its index in the layer: ``head_indices[h]``)."""
        index = h if self.head_indices is None else self.head_indices[h]
        return HeadTask(self.index, index, self.X, np.ascontiguousarray(self.Y[:, :, h]), self.query[h], self.key[h],
                        self.value[h], self.causal, self.has_bias)

    def heads(self):
        return [self.head(h) for h in range(self.n_heads)]

    def select_heads(self, heads):
        """This layer with only the heads ``heads`` (indices in the layer), which keep their indices."""
        heads = [int(h) for h in heads]
        have = list(range(self.n_heads)) if self.head_indices is None else list(self.head_indices)
        missing = [h for h in heads if h not in have]
        if missing:
            raise ValueError(f"layer {self.index} has no head {missing[0]} (it holds heads {have}).")
        pos = [have.index(h) for h in heads]
        return AttentionLayer(self.index, self.name, self.style, self.X, self.Y[:, :, pos], self.query[pos],
                              self.key[pos], self.value[pos], self.causal, self.has_bias, self.max_abs_error,
                              tuple(heads))


# -- the attention styles --------------------------------------------------------------------------------------


def _style(module):
    import torch

    if isinstance(module, torch.nn.MultiheadAttention):
        return "multihead_attention"
    if all(isinstance(getattr(module, a, None), torch.nn.Linear) for a in ("query", "key", "value")) and (
            hasattr(module, "num_attention_heads") or hasattr(module, "attention_head_size")):
        return "bert"
    if hasattr(module, "c_attn") and hasattr(module, "c_proj") and hasattr(module, "head_dim"):
        return "gpt2"
    return None


def attention_modules(model):
    """The self-attention modules of ``model`` rstar reads, in order: ``[(name, module, style), ...]``.

    Recognised: Hugging Face BERT-style self-attention (``query``, ``key``, ``value`` linear maps and
    ``num_attention_heads``: BERT, RoBERTa, MiniLM, ...), GPT-2-style attention (a fused ``c_attn``, causal)
    and :class:`torch.nn.MultiheadAttention` used as self-attention.
    """
    found = []
    for name, module in model.named_modules():
        style = _style(module)
        if style is not None:
            found.append((name, module, style))
    return found


def _n_heads(module, style):
    if style == "bert":
        return int(getattr(module, "num_attention_heads", None) or module.config.num_attention_heads)
    return int(module.num_heads)


def _head_weights(module, style, d):
    """``(query, key, value)`` as ``(H, d + 1, d_head)`` arrays ``[W; b]`` and whether there are biases."""
    import torch

    H = _n_heads(module, style)
    with torch.no_grad():
        if style == "bert":
            maps = [(m.weight.T, m.bias) for m in (module.query, module.key, module.value)]
        elif style == "gpt2":
            W, b = module.c_attn.weight, module.c_attn.bias   # Conv1D: (d, 3 d) applied as x W + b
            maps = [(W[:, i * d:(i + 1) * d], None if b is None else b[i * d:(i + 1) * d]) for i in range(3)]
        else:
            W, b = module.in_proj_weight, module.in_proj_bias
            if W is None:
                raise ValueError("torch.nn.MultiheadAttention with separate key/value dimensions (kdim, vdim) is "
                                 "cross-attention, which rstar's self-attention operator does not cover.")
            maps = [(W[i * d:(i + 1) * d].T, None if b is None else b[i * d:(i + 1) * d]) for i in range(3)]
    out, has_bias = [], False
    for W, b in maps:
        W = W.detach().double().cpu().numpy()
        b = np.zeros(W.shape[1]) if b is None else b.detach().double().cpu().numpy()
        has_bias = has_bias or bool(np.any(b != 0))
        Wb = np.vstack([W, b[None]])
        out.append(Wb.reshape(d + 1, H, -1).transpose(1, 0, 2).copy())
    return out[0], out[1], out[2], has_bias


def _per_head_outputs(X, query, key, value, causal):
    """Every head's ``softmax(q k^T / sqrt(d_head) + mask) v`` on float64 inputs, shape (n, T, H, d_head)."""
    Xt = np.concatenate([X, np.ones(X.shape[:-1] + (1,))], axis=-1)
    n, T, _ = X.shape
    H, _, dh = query.shape
    out = np.empty((n, T, H, dh))
    for h in range(H):
        q, k, v = Xt @ query[h], Xt @ key[h], Xt @ value[h]
        out[:, :, h] = attention_rows(q @ k.transpose(0, 2, 1) / np.sqrt(dh), causal) @ v
    return out


def collect_attention(model, input_ids, *, batch_size=32, layers=None, check_tol=1e-3, **model_kwargs):
    """Run ``model`` on token windows and read each self-attention layer's inputs and per-head outputs.

    A forward pre-hook on every recognised attention module (:func:`attention_modules`) records its input hidden
    states X; each head's output before the output projection is then computed from X and the module's own
    weights, and checked against what the module computed in the same forward pass (a forward hook): a module
    that adds anything else (relative or rotary positions, a padding mask, ALiBi) is refused rather than
    misread.

    Parameters
    ----------
    model : torch.nn.Module
        Called as ``model(input_ids_batch, **model_kwargs)`` (a Hugging Face model, or any module whose attention
        layers are of a recognised style). Put in eval mode.
    input_ids : array-like of int, shape (n, T)
        Token windows of one length, without padding (padding would need the attention mask, which the operator
        does not model).
    batch_size : int, default=32
    layers : list of int or None
        Indices (among :func:`attention_modules`) of the layers to keep; None keeps all.
    check_tol : float, default=1e-3
        Largest relative error allowed between the recomputed per-head outputs and the module's own.

    Returns
    -------
    layers : list of AttentionLayer
    """
    import torch

    found = attention_modules(model)
    if not found:
        raise ValueError("the model has no attention module rstar recognises (Hugging Face BERT- or GPT-2-style "
                         "self-attention, torch.nn.MultiheadAttention).")
    keep = range(len(found)) if layers is None else list(layers)
    for i in keep:
        if not 0 <= i < len(found):
            raise ValueError(f"layer {i} is out of range: the model has {len(found)} attention modules.")
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[0] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be a 2-D integer array (n, T) of token windows; got shape {ids.shape} "
                         f"and dtype {ids.dtype}.")
    inputs, outputs = {i: [] for i in keep}, {i: [] for i in keep}
    handles = []

    def batch_major(module, x):
        """(batch, T, features) as float64 numpy (a sequence-first MultiheadAttention gives (T, batch, ...))."""
        if isinstance(module, torch.nn.MultiheadAttention) and not module.batch_first:
            x = x.transpose(0, 1)
        return x.detach().double().cpu().numpy()

    def pre_hook(i):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("query"))
            inputs[i].append(batch_major(module, x))
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, out):
            o = out[0] if isinstance(out, tuple) else out
            outputs[i].append(batch_major(module, o))
        return hook

    def proj_hook(i):
        def hook(module, args):
            outputs[i].append(args[0].detach().double().cpu().numpy())
        return hook

    for i in keep:
        _, module, style = found[i]
        handles.append(module.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        if style == "gpt2":
            # GPT-2 projects inside the module: its heads are read as c_proj's input
            handles.append(module.c_proj.register_forward_pre_hook(proj_hook(i)))
        else:
            handles.append(module.register_forward_hook(post_hook(i), with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[0], batch_size):
                batch = torch.as_tensor(ids[start:start + batch_size], dtype=torch.long)
                model(batch, **model_kwargs)
    finally:
        for hnd in handles:
            hnd.remove()
        model.train(was_training)
    result = []
    for i in keep:
        name, module, style = found[i]
        X = np.concatenate(inputs[i])
        d = X.shape[-1]
        query, key, value, has_bias = _head_weights(module, style, d)
        causal = style == "gpt2"
        Y = _per_head_outputs(X, query, key, value, causal)
        seen = np.concatenate(outputs[i])
        if style == "multihead_attention":
            W = module.out_proj.weight.detach().double().cpu().numpy()
            b = module.out_proj.bias
            b = 0.0 if b is None else b.detach().double().cpu().numpy()
            mine = Y.reshape(Y.shape[0], Y.shape[1], -1) @ W.T + b
        else:
            mine = Y.reshape(seen.shape)
        err = float(np.max(np.abs(mine - seen)) / max(np.max(np.abs(seen)), np.finfo(float).tiny))
        if not err <= check_tol:
            raise ValueError(
                f"attention module {name!r} ({style}) computes something other than softmax(q k^T / sqrt(d_head)) "
                f"v per head (relative error {err:.2g} of the recomputed outputs): a padding or causal mask it "
                "was given, relative or rotary positions, or another variant rstar's operator does not cover.")
        result.append(AttentionLayer(i, name, style, X, Y, query, key, value, causal, has_bias, err))
    return result
