"""The rank allocations users run today, ported from their published algorithms, beside rstar's plans.

Each function returns a plan in the form of :func:`rstar.heads.rank_plan` (rows ``layer, head, d_head, rank``), to
be put into the model by :func:`rstar.heads.truncated_heads`; the two anchors that come with their own truncation
have it there (``metric="activations"``, ``metric="whitened"``). Written from the papers and the authors' released
algorithms (no code copied); where a port departs from them it says so.

- Saxena, U. et al. (2024). Eigen Attention: attention in low-rank space for KV cache compression,
  arXiv:2408.05646 — :func:`eigen_attention_sweep`, :func:`eigen_attention_plan`, :func:`activation_basis_factors`.
- Wang, X. et al. (2024). SVD-LLM: truncation-aware singular value decomposition for large language model
  compression, arXiv:2403.07378 — :func:`whitened_factors` with one ratio for every head (:func:`uniform_plan`).
- Chang, C.-C. et al. (2024). Palu: compressing KV-cache with low-rank projection, arXiv:2407.21118 —
  :func:`head_fisher_scores`, :func:`fisher_share_plan`.
- Paischer, F. et al. (2024). One initialization to rule them all: fine-tuning via explained variance adaptation
  (EVA), arXiv:2410.07170, as run by PEFT's ``get_eva_state_dict`` — :func:`eva_plan`.
"""

import numpy as np

from ..inversions._numerics.rotary import rotate
from ._collect import _batches, attention_rows, centred_sum_of_squares
from ._compress import (_descending_eigen, _layer_key_basis, _normalised_singular_values,
                        activation_singular_values, truncated_heads)
from ._plan import _check_budget, _rows, _table, allocate_ranks

__all__ = ["EIGEN_ATTENTION_THRESHOLDS", "eigen_attention_head_curve", "eigen_attention_head_rank",
           "eigen_attention_plan", "eigen_attention_sweep", "eva_plan",
           "fisher_share_plan", "head_fisher_scores", "uniform_plan", "weight_energy_plan"]


# -- helpers ---------------------------------------------------------------------------------------------------
def _heads_of(layers):
    """``(layer, position, head index, d_head)`` for every head held, in the layers' order."""
    out = []
    for layer in layers:
        out += [(layer, pos, h, int(layer.query.shape[2])) for pos, h in enumerate(layer.held_heads)]
    if not out:
        raise ValueError("no heads: give the layers of rstar.heads.collect_attention.")
    return out


def _plan(heads, ranks, **columns):
    rows = [dict(layer=int(layer.index), head=int(h), d_head=dh, rank=int(k))
            for (layer, _, h, dh), k in zip(heads, ranks)]
    for name, values in columns.items():
        for row, v in zip(rows, values):
            row[name] = v
    return _table(rows)


def _split_evenly(total, parts, cap):
    """``total`` split over ``parts`` as evenly as whole numbers allow (the first take the remainder), each at most
    ``cap``."""
    base, extra = divmod(int(total), parts)
    return [min(cap, base + (1 if k < extra else 0)) for k in range(parts)]


def _gram(layer):
    """``Z^T Z`` of the layer's features (its tokens, with the constant feature where it has biases)."""
    Z = layer.head(0).features()
    Z = Z.reshape(-1, Z.shape[-1])
    return Z.T @ Z


def _bias_rows(layer):
    return slice(None) if layer.has_bias else slice(0, -1)


# -- allocations ------------------------------------------------------------------------------------------------
def uniform_plan(layers, budget):
    """One width for every head: ``budget`` split evenly (SVD-LLM's one compression ratio for every matrix, and
    the fallback of the fine-tuning libraries).

    Parameters
    ----------
    layers : list of AttentionLayer
        From :func:`rstar.heads.collect_attention`.
    budget : int
        The total query–key width (the sum of the heads' ranks).

    Returns
    -------
    plan : DataFrame (list of dict without pandas) with ``layer, head, d_head, rank``
    """
    heads = _heads_of(layers)
    budget = _check_budget(budget)
    return _plan(heads, _split_evenly(budget, len(heads), min(dh for *_, dh in heads)))


def weight_energy_plan(layers, budget):
    """The weights alone: ``budget`` split to keep the most of the heads' summed kernel SVD energy
    (``sum_{i>r} s_i^2 / sum_i s_i^2`` per head, minimised in total by :func:`rstar.heads.allocate_ranks`)."""
    heads = _heads_of(layers)
    curves = []
    for layer, pos, h, _ in heads:
        s = layer.head(pos).kernel_singular_values() ** 2
        curves.append(1.0 - np.r_[0.0, np.cumsum(s)] / s.sum() if s.sum() > 0 else np.zeros(s.size + 1))
    return _plan(heads, allocate_ranks(curves, _check_budget(budget)))


def eva_plan(layers, budget, rho=2.0):
    """EVA's allocation: the layers' input components ranked together by explained variance ratio.

    For each layer, the explained variance ratios of its tokens (centred PCA of all tokens as rows: EVA's
    incremental PCA of the inputs of the layer's query and key projections, which share them) keep at most
    ``round(rho * budget / n_layers)`` components (EVA's ``rho``, default 2); the ``budget`` largest ratios over
    all layers give each layer its count, split evenly over its heads (a LoRA rank on a projection spans all the
    layer's heads; here each head gets an equal share of its layer's query–key width).

    Parameters
    ----------
    layers : list of AttentionLayer
    budget : int
    rho : float, default=2.0
        At least 1.

    Returns
    -------
    plan : DataFrame (list of dict without pandas) with ``layer, head, d_head, rank``
    """
    budget = _check_budget(budget)
    if not float(rho) >= 1.0:
        raise ValueError(f"rho must be >= 1 (EVA's cap on a layer's share), got {rho!r}.")
    heads = _heads_of(layers)
    cap = max(1, int(round(float(rho) * budget / len(layers))))
    entries = []
    for k, layer in enumerate(layers):
        X = layer.X.reshape(-1, layer.X.shape[-1])
        lam = np.clip(np.linalg.eigvalsh(np.cov(X, rowvar=False))[::-1], 0.0, None)
        room = sum(dh for lay, _, _, dh in heads if lay is layer)
        ratios = lam / lam.sum() if lam.sum() > 0 else lam
        entries += [(float(v), k) for v in ratios[:min(cap, room)]]
    order = sorted(range(len(entries)), key=lambda i: -entries[i][0])[:budget]
    counts = np.bincount([entries[i][1] for i in order], minlength=len(layers))
    ranks = []
    for k, layer in enumerate(layers):
        mine = [dh for lay, _, _, dh in heads if lay is layer]
        ranks += _split_evenly(counts[k], len(mine), min(mine))
    return _plan(heads, ranks)


def fisher_share_plan(scores, budget):
    """Palu's allocation: ranks in proportion to each head's share of the Fisher information.

    ``rank_h = budget * F_h / sum F`` rounded down and capped at ``d_head``; what rounding and the caps leave is
    given one dimension at a time to the heads with the largest fractional parts (Palu hands it out in its own
    order, then rounds every rank to blocks of 32: at heads of 32–64 dimensions that leaves each head all or
    nothing, so the blocks are not ported).

    Parameters
    ----------
    scores : DataFrame or list of dict
        Rows ``layer, head, d_head, fisher`` (:func:`head_fisher_scores`).
    budget : int

    Returns
    -------
    plan : DataFrame (list of dict without pandas) with ``layer, head, d_head, rank, fisher``
    """
    budget = _check_budget(budget)
    rows = _rows(scores, ("layer", "head", "d_head", "fisher"))
    if not rows:
        raise ValueError("no heads in the scores.")
    F = np.array([float(r["fisher"]) for r in rows])
    cap = np.array([int(r["d_head"]) for r in rows])
    if not np.all(np.isfinite(F)) or np.any(F < 0):
        raise ValueError("the Fisher scores must be finite and >= 0.")
    budget = min(budget, int(cap.sum()))
    share = budget * F / F.sum() if F.sum() > 0 else np.full(F.size, budget / F.size)
    ranks = np.minimum(np.floor(share).astype(int), cap)
    left = budget - int(ranks.sum())
    while left > 0:
        room = ranks < cap
        order = [i for i in np.argsort(-(share - ranks), kind="stable") if room[i]]
        for i in order[:left]:
            ranks[i] += 1
        left = budget - int(ranks.sum())
    out = [dict(layer=int(r["layer"]), head=int(r["head"]), d_head=int(r["d_head"]), rank=int(k),
                fisher=float(f)) for r, k, f in zip(rows, ranks, F)]
    return _table(out)


def _query_key_linears(model, layer, what):
    """The layer's query and key projections: BERT's ``query``/``key`` or Llama's ``q_proj``/``k_proj``."""
    module = dict(model.named_modules())[layer.name]
    if layer.style == "bert":
        return module.query, module.key
    if layer.style == "llama":
        return module.q_proj, module.k_proj
    raise ValueError(f"layer {layer.index} ({layer.name}) is {layer.style}-style; {what} reads BERT-style "
                     "(query, key) and Llama-style (q_proj, k_proj) attention so far.")


def head_fisher_scores(model, layers, windows, *, loss=None, batch_size=32, random_state=0):
    """Palu's Fisher score of each head's query and key weights.

    For every batch of ``windows`` the loss is back-propagated; each weight's score is the root mean square of its
    gradients over the batches, and a head's the mean of its scores over its rows of the query and key
    projections (Palu's per-group mean over its key and value rows; here the query–key map is compressed).

    Parameters
    ----------
    model : torch.nn.Module
    layers : list of AttentionLayer
        BERT-style (``query``, ``key``) or Llama-style (``q_proj``, ``k_proj``) layers; a key head shared by a
        group of query heads gives each of them its score.
    windows : ndarray of int, shape (n, T)
        Calibration token ids.
    loss : callable or None
        ``loss(output, batch)`` -> scalar tensor. None: the model's next-token cross-entropy where its output has
        ``logits`` (Palu's calibration loss), else the Fisher information of a unit Gaussian likelihood on its
        first output (the last hidden state): the loss ``<eta, output>`` with ``eta ~ N(0, I)`` drawn afresh for
        every batch, whose squared gradient is, in expectation, the diagonal of ``J^T J``.
    batch_size : int, default=32
    random_state : int, default=0
        Seeds the draws of ``eta``.

    Returns
    -------
    scores : DataFrame (list of dict without pandas) with ``layer, head, d_head, fisher, fisher_loss``
        ``fisher_loss`` says which loss the scores are of: ``"given"``, ``"next-token cross-entropy"`` or
        ``"unit Gaussian likelihood on the last hidden state"``.
    """
    import torch

    heads = _heads_of(layers)
    linears = {layer.index: _query_key_linears(model, layer, "head_fisher_scores") for layer in layers}
    gen = torch.Generator().manual_seed(int(random_state))
    params = [lin.weight for pair in linears.values() for lin in pair]
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    was = [p.requires_grad for p in params]
    count, used = 0, "given"
    try:
        for p in params:
            p.requires_grad_(True)
        for batch in _batches(windows, batch_size):
            model.zero_grad(set_to_none=True)
            out = model(batch)
            if loss is not None:
                value = loss(out, batch)
            elif getattr(out, "logits", None) is not None:
                logits = out.logits[:, :-1]
                value = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                          batch[:, 1:].reshape(-1))
                used = "next-token cross-entropy"
            else:
                h = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "last_hidden_state") else out
                eta = torch.randn(h.shape, generator=gen, dtype=h.dtype)
                value = (eta * h).sum()
                used = "unit Gaussian likelihood on the last hidden state"
            value.backward()
            for s, p in zip(sums, params):
                s += p.grad.detach().double() ** 2
            count += 1
    finally:
        model.zero_grad(set_to_none=True)
        for p, w in zip(params, was):
            p.requires_grad_(w)
    if count == 0:
        raise ValueError("windows holds no sequences.")
    rms = {}
    for k, layer in enumerate(layers):
        rms[layer.index] = ((sums[2 * k] / count).sqrt().numpy(), (sums[2 * k + 1] / count).sqrt().numpy())
    out = []
    for layer, pos, h, dh in heads:
        q, kk = rms[layer.index]
        # a key head shared by a group of query heads (grouped-query attention) scores each of them
        g = layer.kv_group(pos)
        out.append(dict(layer=int(layer.index), head=int(h), d_head=dh,
                        fisher=float((q[h * dh:(h + 1) * dh].mean() + kk[g * dh:(g + 1) * dh].mean()) / 2),
                        fisher_loss=used))
    return _table(out)


#: Eigen Attention's thresholds on the normalised singular values, as its authors lower them (from 0.98 in steps
#: of 0.02 while above 0.3), after 1.0 (every direction kept).
EIGEN_ATTENTION_THRESHOLDS = tuple(np.round(np.r_[1.0, np.arange(0.98, 0.3 - 1e-9, -0.02)], 2))


def _block(model, layer_name):
    """The item of a ``ModuleList`` that holds the attention module (the transformer block: attention and MLP)."""
    import torch

    modules = dict(model.named_modules())
    parts = layer_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = modules.get(".".join(parts[:cut - 1])) if cut > 1 else model
        if isinstance(parent, torch.nn.ModuleList) and parts[cut - 1].isdigit():
            return modules[".".join(parts[:cut])]
    raise ValueError(f"no transformer block (an item of a ModuleList) holds {layer_name!r}.")


class _Stop(Exception):
    pass


def _block_inputs(model, block, windows, batch_size):
    """The arguments ``block`` is called with on each batch of ``windows`` (the full model's inputs to it), read
    once: the model runs up to the block and stops there, without a cache, so that the block can be re-run on
    them alone."""
    import inspect

    import torch

    got = []

    def hook(module, args, kwargs):
        got.append((args, {k: v for k, v in kwargs.items() if not _is_cache(v)}))
        raise _Stop

    try:
        extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    except (TypeError, ValueError):   # pragma: no cover - a forward without a signature
        extra = {}
    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in _batches(windows, batch_size):
                try:
                    model(batch, **extra)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return got


def _is_cache(value):
    return type(value).__name__.endswith("Cache")


def _run_block(block, inputs):
    """The block's output (its hidden states, float64) on the inputs :func:`_block_inputs` read."""
    import torch

    out = []
    with torch.no_grad():
        for args, kwargs in inputs:
            y = block(*args, **kwargs)
            out.append((y[0] if isinstance(y, tuple) else y).detach().double())
    return torch.cat(out)


def eigen_attention_sweep(model, layers, windows, *, thresholds=EIGEN_ATTENTION_THRESHOLDS, batch_size=32):
    """Eigen Attention's per-layer search, measured once: for each layer and threshold t, the layer's rank and the
    relative error of its block output with every head truncated there.

    A head's rank at t is the number of its normalised activation singular values
    (:func:`activation_singular_values`) whose running sum stays below t; the layer's rank is the largest over its
    heads, and every head of the layer gets it (the authors' one reduced dimension per layer). In a rotary
    (Llama-style) layer the spectrum is the layer's key activations before the rotation, its key heads stacked
    (:func:`rotary_key_basis`, the authors' Llama variant), and the rank is that spectrum's. The error is
    ``||B(x) - B_t(x)|| / ||B(x)||`` over ``windows`` for the layer's transformer block B (attention and MLP), its
    heads truncated by ``truncated_heads(metric="activations")`` and its inputs the full model's, as the authors
    measure it (the block's inputs are read once and the block alone is re-run at each rank). The authors' Llama
    loop also stops once a layer's key rank falls to 45% of its width; the sweep runs on to the last threshold, so
    that plans at small total widths (``eigen_attention_plan(budget=...)``) can take the rule further than they do.

    Parameters
    ----------
    model : torch.nn.Module
    layers : list of AttentionLayer
        BERT-style or Llama-style layers; the heads held are the ones truncated (the authors truncate every
        head of a layer). A rotary layer's spectrum is that of all the module's key heads, whichever are held.
    windows : ndarray of int, shape (n, T)
        Calibration token ids.
    thresholds : sequence of float, default=EIGEN_ATTENTION_THRESHOLDS
        Descending.
    batch_size : int, default=32

    Returns
    -------
    sweep : DataFrame (list of dict without pandas) with ``layer, threshold, rank, error``
    """
    thresholds = [float(t) for t in thresholds]
    if not thresholds or any(b >= a for a, b in zip(thresholds, thresholds[1:])) or not 0 < thresholds[-1]:
        raise ValueError("thresholds must be a non-empty descending sequence of values in (0, 1].")
    out = []
    for layer in layers:
        spectra = _eigen_attention_spectra(model, layer)
        block = _block(model, layer.name)
        inputs = _block_inputs(model, block, windows, batch_size)
        full = _run_block(block, inputs)
        norm = float(full.norm())
        held = layer.held_heads
        d_head = int(layer.query.shape[2])
        errors = {d_head: 0.0}
        for t in thresholds:
            rank = max(int(np.sum(np.cumsum(s) < t - 1e-12)) for s in spectra) if t < 1.0 else d_head
            rank = min(rank, d_head)
            if rank not in errors:
                plan = [dict(layer=layer.index, head=h, rank=rank) for h in held]
                with truncated_heads(model, plan, [layer], metric="activations"):
                    low = _run_block(block, inputs)
                errors[rank] = float((full - low).norm()) / norm if norm > 0 else 0.0
            out.append(dict(layer=int(layer.index), threshold=t, rank=rank, error=errors[rank]))
    return _table(out)


def _eigen_attention_spectra(model, layer):
    """The normalised singular values Eigen Attention's thresholds read in a layer: each head's stacked key and
    query activations (BERT-style), or the layer's key activations before the rotation (Llama-style, one spectrum,
    :func:`rotary_key_basis`)."""
    if layer.style == "llama":
        module = dict(model.named_modules())[layer.name]
        return [_normalised_singular_values(_layer_key_basis(module, layer, module.k_proj.bias is not None)[0])]
    if layer.style != "bert":
        raise ValueError(f"layer {layer.index} ({layer.name}) is {layer.style}-style; eigen_attention_sweep reads "
                         "BERT-style (query, key) and Llama-style (q_proj, k_proj) attention so far.")
    gram = _gram(layer)
    rows = _bias_rows(layer)
    return [activation_singular_values(layer.query[p][rows], layer.key[p][rows], gram) for p in range(layer.n_heads)]


def _head_activations(head, Xt):
    """A head's queries and keys on features ``Xt`` (n, T, d~), after the rotation where it has one: what a KV
    cache holds and what Eigen Attention's projection acts on."""
    q, k = Xt @ head.query[head._rows()], Xt @ head.key[head._rows()]
    if head.rotary is not None:
        q, k = rotate(q, head.rotary), rotate(k, head.rotary)
    return q, k


def eigen_attention_head_curve(head, X=None, Y=None):
    """Eigen Attention's truncation of one head, rank by rank: its queries and keys (after the rotation, for a
    rotary head) projected on the top r right-singular directions of their stacked activations on the head's own
    windows (its calibration), and the relative excess of the head's output on ``X``.

    ``curve[r] = ||Y - Y_r||^2 / TSS`` as in :func:`rstar.heads.kernel_truncation_curve` (TSS about the column
    means), ``Y_r`` the head with logits ``(q U_r)(k U_r)^T / sqrt(d_head)`` and everything else unchanged. For a
    head without rotation this is :func:`rstar.heads.activation_basis_factors`' truncation; for a rotary head the
    projection acts after the rotation (it cannot be folded into ``W_Q`` and ``W_K``), as a cache of projected keys
    would hold them.

    Parameters
    ----------
    head : HeadTask
        Its ``X`` is the calibration the basis is read from.
    X : ndarray of shape (n, T, d) or None
        Inputs to measure on (None: the head's own).
    Y : ndarray of shape (n, T, d_head) or None
        Reference outputs (None: the head's output on ``X``).

    Returns
    -------
    spectrum : ndarray of shape (d_head,)
        The normalised singular values of the stacked calibration activations ``[k; q]`` (descending, sum 1), as
        Eigen Attention's thresholds read them.
    curve : ndarray of shape (d_head + 1,)
    """
    q, k = (a.reshape(-1, a.shape[-1]) for a in _head_activations(head, head.features()))
    w, U = _descending_eigen(k.T @ k + q.T @ q)   # the stacked activations [k; q]: their Gram, never stacked
    spectrum = _normalised_singular_values(w)
    Xt = head.features(head.X if X is None else X)
    Y = head.output(X) if Y is None else Y
    tss = centred_sum_of_squares(Y)
    q, k = _head_activations(head, Xt)
    qc, kc = (q @ U) / np.sqrt(head.d_head), k @ U
    values, mask = Xt @ head.value_map(), head.mask()
    logits = np.zeros(Xt.shape[:2] + (Xt.shape[1],))
    curve = np.empty(head.d_head + 1)
    for r in range(head.d_head + 1):
        if r:   # the rank-r logits are the rank-(r-1) ones plus direction r's outer product
            logits += qc[:, :, r - 1, None] * kc[:, None, :, r - 1]
        S = attention_rows(logits.copy(), mask=mask)
        curve[r] = float(np.sum((Y - S @ values) ** 2)) / tss if tss > 0 else 0.0
    return spectrum, curve


def eigen_attention_head_rank(spectrum, curve, tolerance, thresholds=EIGEN_ATTENTION_THRESHOLDS):
    """Eigen Attention's search for one head at a tolerance: its threshold lowered step by step (``thresholds``,
    descending from 1) until the truncated head's excess (``curve``, :func:`eigen_attention_head_curve`) exceeds
    ``tolerance``, and the rank of the last threshold before that kept.

    A threshold t keeps the directions whose running sum of ``spectrum`` stays below t (as
    :func:`eigen_attention_sweep`). The authors search per layer, on the block's output error, and give every
    head of a layer one rank; this is their search run on one head with rstar's measure (relative excess of the
    head's output), so that it stands beside r*(ε) head by head.

    Parameters
    ----------
    spectrum : array-like of shape (d_head,)
        Normalised singular values, descending (:func:`eigen_attention_head_curve`'s first value).
    curve : array-like of shape (d_head + 1,)
        The truncated head's relative excess at ranks 0 ... d_head.
    tolerance : float
        The excess the search may reach (rstar's ε).
    thresholds : sequence of float, default=EIGEN_ATTENTION_THRESHOLDS
        Descending, the first 1 (every direction kept).

    Returns
    -------
    rank : int

    Examples
    --------
    Four equal directions: thresholds 0.98 ... 0.76 keep 3 of them, 0.74 ... 0.52 keep 2.

    >>> eigen_attention_head_rank([0.25] * 4, [0.5, 0.2, 0.04, 0.005, 0.0], tolerance=0.05)
    2
    """
    spectrum, curve = np.asarray(spectrum, dtype=float), np.asarray(curve, dtype=float)
    d_head = spectrum.size
    if curve.size != d_head + 1:
        raise ValueError(f"curve must have d_head + 1 = {d_head + 1} entries (ranks 0 ... d_head), got {curve.size}.")
    if not (np.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}.")
    running = np.cumsum(spectrum)
    keep = d_head
    for t in (float(t) for t in thresholds):
        rank = d_head if t >= 1.0 else min(d_head, int(np.sum(running < t - 1e-12)))
        if curve[rank] > tolerance:
            break
        keep = min(keep, rank)
    return int(keep)


def eigen_attention_plan(sweep, layers, *, error_budget=None, budget=None):
    """Eigen Attention's ranks from a sweep (:func:`eigen_attention_sweep`).

    ``error_budget=e``: in each layer the threshold is lowered step by step until the block's error reaches e,
    and the last threshold before it is kept (the authors' rule); every head of the layer gets that threshold's
    rank. ``budget=W``: the smallest error budget whose plan's total width is at most W (the widths fall as the
    error budget grows), for comparisons at equal width; where even the sweep's smallest thresholds give more
    than W, those (the narrowest plan Eigen Attention reaches).

    Returns
    -------
    plan : DataFrame (list of dict without pandas) with ``layer, head, d_head, rank, threshold, error``
    """
    if (error_budget is None) == (budget is None):
        raise ValueError("give exactly one of error_budget (the layers' output error) and budget (a total width).")
    rows = _rows(sweep, ("layer", "threshold", "rank", "error"))
    by_layer = {}
    for r in rows:
        by_layer.setdefault(int(r["layer"]), []).append(r)
    heads = _heads_of(layers)
    missing = sorted({int(lay.index) for lay, *_ in heads} - set(by_layer))
    if missing:
        raise ValueError(f"the sweep has no rows for layer {missing[0]}.")

    def choose(e):
        picked = {}
        for index, steps in by_layer.items():
            steps = sorted(steps, key=lambda r: -float(r["threshold"]))
            keep = steps[0]
            for step in steps[1:]:
                if float(step["error"]) >= e:
                    break
                keep = step
            picked[index] = keep
        return picked

    if error_budget is not None:
        e = float(error_budget)
        if not e > 0:
            raise ValueError(f"error_budget must be > 0, got {error_budget!r}.")
        picked = choose(e)
    else:
        W = _check_budget(budget)
        width = {int(lay.index): sum(1 for l2, *_ in heads if l2 is lay) for lay in layers}
        candidates = sorted({float(r["error"]) for r in rows} | {np.inf})
        picked = None
        for c in candidates:
            e = np.nextafter(c, np.inf) if np.isfinite(c) else np.inf
            trial = choose(e)
            if sum(int(trial[i]["rank"]) * width[i] for i in trial) <= W:
                picked = trial
                break
        if picked is None:   # pragma: no cover - the last candidate keeps the smallest threshold of each layer
            picked = choose(np.inf)
    ranks = [int(picked[int(lay.index)]["rank"]) for lay, *_ in heads]
    return _plan(heads, ranks, threshold=[float(picked[int(lay.index)]["threshold"]) for lay, *_ in heads],
                 error=[float(picked[int(lay.index)]["error"]) for lay, *_ in heads])
