"""Per-head attention tasks read off a torch model with forward hooks (torch imported by the caller)."""

from dataclasses import dataclass, field

import numpy as np

from .._backend import NUMPY
from ..inversions._numerics.linalg import factored_svd
from ..inversions._numerics.rotary import RotaryPositions, family_svd, pair_rotations, rotate

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
    rotary : RotaryPositions or None
        A rotary head's plane angles at each position (Llama-family heads): its logits are
        ``rotate(x~ W~_Q) rotate(x~' W~_K)^T / sqrt(d_head)`` (theory §2, "Rotary positions"), so no single kernel
        ``K`` describes it (:meth:`kernel` refuses; its factors are ``query`` and ``key``).
    window : int or None
        A sliding window: row i attends to keys ``i - window < j <= i`` only (None: no window).
    kv_group : int
        The key/value head the head reads (grouped-query attention: several query heads share one); its own
        index where every head has its own.
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
    rotary: RotaryPositions = None
    window: int = None
    kv_group: int = None

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

    def _not_rotary(self, what):
        if self.rotary is not None:
            raise ValueError(f"layer {self.layer} head {self.head} is a rotary head: its logits depend on the "
                             f"positions, so it has no single kernel ({what}); use its query/key factors "
                             "(the rotary estimators and truncations do).")

    def mask(self):
        """The logits the head keeps, (T, T) bool (causal and window), or None where it keeps all."""
        return attention_mask(self.X.shape[1], self.causal, self.window)

    def kernel(self):
        """The head's kernel ``K`` in rstar's convention on :meth:`features` (logits ``x~ K x~'^T / sqrt(d~)``)."""
        self._not_rotary("kernel")
        q, k = self.query[self._rows()], self.key[self._rows()]
        return np.sqrt(q.shape[0] / self.d_head) * (q @ k.T)

    def value_map(self):
        """The head's value map ``V`` on :meth:`features`, shape (d~, d_head)."""
        return self.value[self._rows()]

    def kernel_factors(self):
        """``(L, s, R)`` with ``kernel() = L diag(s) R^T``: its thin SVD through the ``d_head x d_head`` core of
        ``W~_Q W~_K^T`` (never the d~ x d~ product); ``s`` descending, ``d_head`` entries."""
        self._not_rotary("kernel_factors")
        q, k = self.query[self._rows()], self.key[self._rows()]
        U, s, W = factored_svd(q, k)
        return U, np.sqrt(q.shape[0] / self.d_head) * s, W

    def kernel_singular_values(self):
        """Singular values of :meth:`kernel` (at most ``d_head`` non-zero); for a rotary head, those of its logit
        family over the window's pairs (:func:`rstar.inversions._numerics.rotary.family_svd`), on the side with
        more at each rank, descending."""
        if self.rotary is not None:
            A, B = self.factors()
            pairs = pair_rotations(self.rotary, self.mask())
            sides = [np.pad(s, (0, max(0, self.d_head - s.size)))[:self.d_head]
                     for s in (family_svd([(A, B)], [1.0], pairs, side)[1] for side in ("q", "k"))]
            return np.maximum(*sides)
        return self.kernel_factors()[1]

    def factors(self):
        """``(A, B)``, shape (d~, d_head) each: the logits are ``f(X~ A) f(X~ B)^T / sqrt(d~)`` with f the rotation
        of a rotary head (identity otherwise), so ``A B^T = kernel()`` where the head has one."""
        q, k = self.query[self._rows()], self.key[self._rows()]
        c = (q.shape[0] / self.d_head) ** 0.25
        return c * q, c * k

    def output(self, X=None, kernel=None, value_map=None, factors=None):
        """The head's output (or that of another kernel, factors ``(A, B)`` or value map) on inputs ``X``, shape
        (n, T, d_head)."""
        Xt = self.features(X)
        V = self.value_map() if value_map is None else value_map
        return attention_rows(self.logits(Xt, kernel, factors), mask=self.mask()) @ (Xt @ V)

    def logits(self, Xt, kernel=None, factors=None):
        """The logits on features ``Xt`` (n, T, d~): of the head, of a kernel, or of factors ``(A, B)``."""
        scale = 1.0 / np.sqrt(Xt.shape[-1])
        if kernel is not None:
            self._not_rotary("a kernel's logits")
            return (Xt @ (kernel * scale)) @ Xt.transpose(0, 2, 1)
        A, B = self.factors() if factors is None else factors
        QA, KB = Xt @ (A * scale), Xt @ B
        if self.rotary is not None:
            QA, KB = rotate(QA, self.rotary), rotate(KB, self.rotary)
        return QA @ KB.transpose(0, 2, 1)


def attention_mask(T, causal=False, window=None):
    """The (T, T) logits a head keeps: causal (``j <= i``), within a sliding window (``i - window < j``); None
    where it keeps all."""
    if not causal and window is None:
        return None
    i, j = np.indices((T, T))
    keep = np.ones((T, T), dtype=bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= np.abs(i - j) < int(window)
    return keep


def centred_sum_of_squares(Y):
    """``sum ||y - mean||^2`` over the tokens of outputs ``Y`` (n, T, d_v), about each column's mean: the total
    sum of squares a head's relative excess is measured against."""
    Yf = Y.reshape(-1, Y.shape[-1])
    return float(np.sum((Yf - Yf.mean(axis=0)) ** 2))


def attention_rows(logits, causal=False, mask=None):
    """Row-wise softmax of ``logits`` (n, T, T), in place; with ``causal`` row i attends to keys ``j <= i`` only,
    with ``mask`` (T, T) to the keys it keeps."""
    if causal:
        T = logits.shape[-1]
        logits[..., ~np.tril(np.ones((T, T), dtype=bool))] = -np.inf
    if mask is not None:
        logits[..., ~mask] = -np.inf
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
        ``"bert"``, ``"gpt2"``, ``"multihead_attention"`` or ``"llama"`` (rotary, grouped key/value heads).
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, n_heads, d_head)
    query, key, value : ndarray of shape (n_heads, d + 1, d_head)
        Per query head (a key/value head shared by a group of query heads is repeated for each).
    causal : bool
    rotary : RotaryPositions or None
        The planes' angles at each position of the windows (rotary layers).
    window : int or None
        The sliding window of the layer, where it has one.
    kv_groups : ndarray of int, shape (n_heads,), or None
        Each head's key/value head (None: each its own).
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
    rotary: RotaryPositions = None
    window: int = None
    kv_groups: np.ndarray = None

    @property
    def n_heads(self):
        return self.Y.shape[2]

    @property
    def held_heads(self):
        """The indices in the layer of the heads held, in order (all of them unless :meth:`select_heads` chose)."""
        return list(range(self.n_heads)) if self.head_indices is None else list(self.head_indices)

    def kv_group(self, h):
        """The key/value head the ``h``-th head held reads (its own index where every head has its own)."""
        return self.held_heads[h] if self.kv_groups is None else int(self.kv_groups[h])

    def head(self, h):
        """The :class:`HeadTask` of the ``h``-th head held (its index in the layer: ``head_indices[h]``)."""
        index = h if self.head_indices is None else self.head_indices[h]
        group = self.kv_group(h)
        return HeadTask(self.index, index, self.X, np.ascontiguousarray(self.Y[:, :, h]), self.query[h], self.key[h],
                        self.value[h], self.causal, self.has_bias, self.rotary, self.window, group)

    def heads(self):
        return [self.head(h) for h in range(self.n_heads)]

    def select_heads(self, heads):
        """This layer with only the heads ``heads`` (indices in the layer), which keep their indices."""
        heads = [int(h) for h in heads]
        have = self.held_heads
        missing = [h for h in heads if h not in have]
        if missing:
            raise ValueError(f"layer {self.index} has no head {missing[0]} (it holds heads {have}).")
        pos = [have.index(h) for h in heads]
        return AttentionLayer(self.index, self.name, self.style, self.X, self.Y[:, :, pos], self.query[pos],
                              self.key[pos], self.value[pos], self.causal, self.has_bias, self.max_abs_error,
                              tuple(heads), self.rotary, self.window,
                              None if self.kv_groups is None else np.asarray(self.kv_groups)[pos])


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
    if all(isinstance(getattr(module, a, None), torch.nn.Linear) for a in ("q_proj", "k_proj", "v_proj", "o_proj")) \
            and hasattr(module, "head_dim"):
        return "llama"
    return None


def attention_modules(model):
    """The self-attention modules of ``model`` rstar reads, in order: ``[(name, module, style), ...]``.

    Recognised: Hugging Face BERT-style self-attention (``query``, ``key``, ``value`` linear maps and
    ``num_attention_heads``: BERT, RoBERTa, MiniLM, ...), GPT-2-style attention (a fused ``c_attn``, causal),
    Llama-family attention (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and ``head_dim``, rotary positions
    passed as the module's ``position_embeddings``, key/value heads shared by groups of query heads: Llama,
    Qwen2, Mistral, SmolLM, ...) and :class:`torch.nn.MultiheadAttention` used as self-attention.
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
    if style == "llama":
        return module.q_proj.out_features // int(module.head_dim)
    return int(module.num_heads)


def _llama_refusal(name, module):
    """Why a Llama-family module is outside rstar's classes (None if it is not)."""
    import torch

    for attr in ("q_norm", "k_norm"):
        norm = getattr(module, attr, None)
        if norm is not None and not isinstance(norm, torch.nn.Identity):
            return (f"attention module {name!r} normalises its queries and keys ({attr}, as Qwen3 and OLMo2 do) "
                    "before the rotation: its logits are not bilinear in the tokens, which every rstar operator "
                    "assumes.")
    config = getattr(module, "config", None)
    if getattr(config, "attn_logit_softcapping", None):
        return (f"attention module {name!r} soft-caps its logits (attn_logit_softcapping): not a softmax of "
                "bilinear logits.")
    return None


def _llama_kv_groups(module):
    """Each query head's key/value head in a Llama-style module, shape (H,): groups of consecutive query heads."""
    dh = int(module.head_dim)
    H = module.q_proj.out_features // dh
    H_kv = module.k_proj.out_features // dh
    if H_kv < 1 or H % H_kv or module.v_proj.out_features != H_kv * dh:
        raise ValueError(f"{H} query heads and {module.k_proj.out_features} key / {module.v_proj.out_features} "
                         f"value features of head_dim {dh}: not grouped-query attention rstar can read.")
    return np.arange(H) // (H // H_kv)


def _batches(windows, batch_size):
    """Token-id windows (n, T) as torch tensors of at most ``batch_size`` windows, in order (one-line errors for a
    batch size that is not a whole number >= 1 and windows that are not two-dimensional)."""
    import torch

    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}.")
    ids = np.asarray(windows)
    if ids.ndim != 2:
        raise ValueError(f"windows must be token ids of shape (n, T), got shape {ids.shape}.")
    for s in range(0, ids.shape[0], int(batch_size)):
        yield torch.as_tensor(ids[s:s + int(batch_size)])


def _llama_weights(module):
    """``(query, key, value, kv_groups, has_bias)``: per query head ``[W; b]`` of shape (H, d + 1, d_head), the
    key/value head of each repeated for every query head of its group; the module's logit scale folded into the
    query so that the logits are ``q k^T / sqrt(d_head)``."""
    import torch

    dh = int(module.head_dim)
    H = module.q_proj.out_features // dh
    H_kv = module.k_proj.out_features // dh
    groups = _llama_kv_groups(module)
    out, has_bias = [], False
    with torch.no_grad():
        for lin, heads in ((module.q_proj, H), (module.k_proj, H_kv), (module.v_proj, H_kv)):
            W = lin.weight.detach().double().cpu().numpy().T
            b = np.zeros(W.shape[1]) if lin.bias is None else lin.bias.detach().double().cpu().numpy()
            has_bias = has_bias or bool(np.any(b != 0))
            Wb = np.vstack([W, b[None]]).reshape(W.shape[0] + 1, heads, dh).transpose(1, 0, 2)
            out.append(Wb if heads == H else Wb[groups])
    scaling = float(getattr(module, "scaling", dh ** -0.5))
    query = out[0] * (scaling * np.sqrt(dh))
    return np.ascontiguousarray(query), np.ascontiguousarray(out[1]), np.ascontiguousarray(out[2]), groups, has_bias


def _llama_window(module):
    """The module's sliding window (Qwen2 sets it per layer, Mistral in its config), or None."""
    if hasattr(module, "sliding_window"):
        w = module.sliding_window
    else:
        w = getattr(getattr(module, "config", None), "sliding_window", None)
    return None if w is None else int(w)


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


def _per_head_outputs(X, query, key, value, causal, rotary=None, window=None, chunk=256):
    """Every head's ``softmax(rot(q) rot(k)^T / sqrt(d_head) + mask) v`` on float64 inputs, shape
    (n, T, H, d_head), ``chunk`` windows at a time (no copy of X with its constant feature)."""
    n, T, _ = X.shape
    H, _, dh = query.shape
    mask = attention_mask(T, causal, window)
    out = np.empty((n, T, H, dh))
    for start in range(0, n, chunk):
        Xc = X[start:start + chunk]
        Xt = np.concatenate([Xc, np.ones(Xc.shape[:-1] + (1,))], axis=-1)
        for h in range(H):
            q, k, v = Xt @ query[h], Xt @ key[h], Xt @ value[h]
            if rotary is not None:
                q, k = rotate(q, rotary), rotate(k, rotary)
            out[start:start + chunk, :, h] = attention_rows(q @ k.transpose(0, 2, 1) / np.sqrt(dh), mask=mask) @ v
    return out


class _ForwardStopped(Exception):
    """Raised by :func:`collect_attention`'s hooks once the last layer it reads has given its output."""


def collect_attention(model, input_ids, *, batch_size=32, layers=None, check_tol=1e-3, **model_kwargs):
    """Run ``model`` on token windows and read each self-attention layer's inputs and per-head outputs.

    A forward pre-hook on every recognised attention module (:func:`attention_modules`) records its input hidden
    states X (and, for a Llama-family module, the rotary position embeddings it is given); each head's output
    before the output projection is then computed from X and the module's own weights, and checked against what
    the module computed in the same forward pass: a module that adds anything else (relative positions, a
    padding mask, ALiBi, soft-capping) is refused rather than misread. The forward pass stops once the last layer
    asked for has given its output: the layers above it (and a decoder's vocabulary projection) are not run.

    Parameters
    ----------
    model : torch.nn.Module
        Called as ``model(input_ids_batch, **model_kwargs)`` (a Hugging Face model, or any module whose attention
        layers are of a recognised style; ``use_cache=False`` is passed where its forward takes it). Put in eval
        mode.
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
    import inspect

    import torch

    found = attention_modules(model)
    if not found:
        raise ValueError("the model has no attention module rstar recognises (Hugging Face BERT-, GPT-2- or "
                         "Llama-family self-attention, torch.nn.MultiheadAttention).")
    keep = range(len(found)) if layers is None else list(layers)
    for i in keep:
        if not 0 <= i < len(found):
            raise ValueError(f"layer {i} is out of range: the model has {len(found)} attention modules.")
        name, module, style = found[i]
        why = _llama_refusal(name, module) if style == "llama" else None
        if why is not None:
            raise ValueError(why)
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[0] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be a 2-D integer array (n, T) of token windows; got shape {ids.shape} "
                         f"and dtype {ids.dtype}.")
    try:
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):   # pragma: no cover - a forward without a signature
        takes_cache = False
    if takes_cache:
        model_kwargs.setdefault("use_cache", False)   # a decoder's key/value cache is not needed
    # each layer's inputs and module outputs written batch by batch into arrays of all the windows (float64; no
    # per-batch copies to join, which held the layer twice and left the allocator holding as much again)
    n = ids.shape[0]
    inputs, outputs, tables = {i: None for i in keep}, {i: None for i in keep}, {}
    written = {"in": dict.fromkeys(keep, 0), "out": dict.fromkeys(keep, 0)}
    rows = {"start": 0}
    handles = []
    # the forward pass stops once the last layer asked for has given its output (the layers above it, and a
    # decoder's vocabulary projection, are not needed: reading layer 0 of SmolLM2 alone is then one layer's work)
    last, early = (max(keep) if len(keep) else None), {"stop": True}

    def done(i):
        if early["stop"] and i == last:
            raise _ForwardStopped

    def store(kind, where, i, x):
        """Batch ``x`` (a torch tensor, batch first) into its rows of ``where[i]`` (allocated at the first)."""
        x = x.detach().cpu()
        if x.dtype not in (torch.float32, torch.float64):   # half precisions: numpy has no bfloat16
            x = x.double()
        if where[i] is None:
            where[i] = np.empty((n,) + tuple(x.shape[1:]), dtype=float)
        where[i][rows["start"]:rows["start"] + x.shape[0]] = x.numpy()
        written[kind][i] += 1

    def batch_major(module, x):
        """(batch, T, features) (a sequence-first MultiheadAttention gives (T, batch, ...))."""
        if isinstance(module, torch.nn.MultiheadAttention) and not module.batch_first:
            x = x.transpose(0, 1)
        return x

    def pre_hook(i):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("query"))
            store("in", inputs, i, batch_major(module, x))
            pe = kwargs.get("position_embeddings")
            if pe is not None:
                cos, sin = (t.detach().double().cpu().numpy() for t in pe)
                # one table for every window (positions 0 ... T-1, no padding): the first row of each batch
                tables.setdefault(i, []).append((cos.reshape(-1, *cos.shape[-2:]), sin.reshape(-1, *sin.shape[-2:])))
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, out):
            o = out[0] if isinstance(out, tuple) else out
            store("out", outputs, i, batch_major(module, o))
            done(i)
        return hook

    def proj_hook(i):
        def hook(module, args):
            store("out", outputs, i, args[0])
            done(i)
        return hook

    for i in keep:
        _, module, style = found[i]
        handles.append(module.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        if style in ("gpt2", "llama"):
            # these project inside the module: the heads are read as the output projection's input
            proj = module.c_proj if style == "gpt2" else module.o_proj
            handles.append(proj.register_forward_pre_hook(proj_hook(i)))
        else:
            handles.append(module.register_forward_hook(post_hook(i), with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b, start in enumerate(range(0, n, batch_size)):
                rows["start"] = start
                batch = torch.as_tensor(ids[start:start + batch_size], dtype=torch.long)
                try:
                    model(batch, **model_kwargs)
                except _ForwardStopped:
                    pass
                if any(written[kind][i] != b + 1 for kind in written for i in keep):
                    # a model that runs its attention modules in another order than it holds them: this batch
                    # again, to the end (its rows written over), and no early stop from now on
                    early["stop"] = False
                    for kind in written:
                        for i in keep:
                            written[kind][i] = b
                    for i in tables:
                        del tables[i][b:]
                    model(batch, **model_kwargs)
    finally:
        for hnd in handles:
            hnd.remove()
        model.train(was_training)
    result = []
    for i in keep:
        name, module, style = found[i]
        X = inputs.pop(i)
        d = X.shape[-1]
        rotary, window, groups = None, None, None
        if style == "llama":
            query, key, value, groups, has_bias = _llama_weights(module)
            causal = bool(getattr(module, "is_causal", True))
            window = _llama_window(module)
            window = None if window is None or window >= X.shape[1] else window
            if i in tables:
                rotary, amplitude = _rotary_of(name, tables[i], query.shape[2], X.shape[1])
                query = query * amplitude**2   # a scaled RoPE's factor on both q and k, folded into the query
        else:
            query, key, value, has_bias = _head_weights(module, style, d)
            causal = style == "gpt2"
        Y = _per_head_outputs(X, query, key, value, causal, rotary, window)
        err = _recomputation_error(Y, outputs.pop(i), module, style)
        if not err <= check_tol:
            what = ("softmax(rot(q) rot(k)^T / sqrt(d_head)) v" if rotary is not None
                    else "softmax(q k^T / sqrt(d_head)) v")
            raise ValueError(
                f"attention module {name!r} ({style}) computes something other than {what} per head (relative "
                f"error {err:.2g} of the recomputed outputs): a padding mask it was given, relative positions, "
                "ALiBi, or another variant rstar's operator does not cover.")
        result.append(AttentionLayer(i, name, style, X, Y, query, key, value, causal, has_bias, err,
                                     rotary=rotary, window=window, kv_groups=groups))
    return result


def _recomputation_error(Y, seen, module, style, chunk=64):
    """Largest absolute difference between the recomputed heads ``Y`` (n, T, H, d_head) and what the module gave
    (``seen``, (n, T, width)), relative to the largest of the latter: ``chunk`` windows at a time, without a second
    copy of the layer's outputs."""
    W = b = None
    if style == "multihead_attention":
        W = module.out_proj.weight.detach().double().cpu().numpy()
        b = module.out_proj.bias
        b = 0.0 if b is None else b.detach().double().cpu().numpy()
    diff = scale = 0.0
    for start in range(0, seen.shape[0], chunk):
        part, mine = seen[start:start + chunk], Y[start:start + chunk]
        mine = mine.reshape(mine.shape[0], mine.shape[1], -1)
        mine = mine @ W.T + b if W is not None else mine.reshape(part.shape)
        diff, scale = max(diff, float(np.max(np.abs(mine - part)))), max(scale, float(np.max(np.abs(part))))
    return diff / max(scale, np.finfo(float).tiny)


def _rotary_of(name, tables, d_head, T):
    """``(RotaryPositions, amplitude)`` from the ``(cos, sin)`` tables a module was given in every batch, which must
    be one table (the same positions in every window) covering the whole head."""
    cos0, sin0 = tables[0][0][0], tables[0][1][0]
    for cos, sin in tables:
        if not (np.allclose(cos, cos0[None]) and np.allclose(sin, sin0[None])):
            raise ValueError(f"attention module {name!r} was given different rotary positions in different "
                             "windows (position ids or padding): rstar reads windows at positions 0 ... T-1.")
    if cos0.shape != (T, d_head):
        raise ValueError(f"attention module {name!r} rotates {cos0.shape[-1]} of its {d_head} head dimensions "
                         "(partial rotary embeddings, as Phi's): a position-free part beside the planes is not yet "
                         "in rstar's rotary class.")
    return RotaryPositions.from_tables(cos0, sin0)
