"""Rank plans put back into a torch model: each head's query–key map truncated to its planned rank, reversibly."""

from contextlib import contextmanager

import numpy as np

from ..inversions._numerics.linalg import factored_svd, psd_power
from ..inversions._numerics.rotary import family_svd, pair_rotations, truncated_rotary_head
from ..inversions._numerics.softmax_factored import token_metric_roots
from ._collect import _batches, _llama_kv_groups, _llama_weights
from ._plan import _rows

__all__ = ["activation_basis_factors", "activation_singular_values", "hidden_state_error", "rotary_key_basis",
           "rotary_query_projection", "truncated_head_factors", "truncated_heads", "whitened_factors"]


def _descending_eigen(C):
    """Eigenvalues (descending, clipped at 0) and eigenvectors of a Gram matrix ``C = A^T A``: the squared singular
    values and right-singular directions of A."""
    w, V = np.linalg.eigh((C + C.T) / 2)
    return np.clip(w[::-1], 0.0, None), V[:, ::-1]


def _stacked_activations(query, key, gram):
    """:func:`_descending_eigen` of ``[Z key; Z query]^T [Z key; Z query]`` (``gram = Z^T Z``): the squared singular
    values and right-singular directions of a head's stacked key and query activations."""
    query, key = np.asarray(query, dtype=float), np.asarray(key, dtype=float)
    return _descending_eigen(key.T @ gram @ key + query.T @ gram @ query)


def _normalised_singular_values(squared):
    """Singular values from their squares, normalised to sum 1 (as Eigen Attention's threshold reads them)."""
    s = np.sqrt(squared)
    return s / s.sum() if s.sum() > 0 else s


def activation_singular_values(query, key, gram):
    """Eigen Attention's spectrum of a head: the singular values of its key and query activations stacked as rows
    (``[Z key; Z query]``, uncentred, ``gram = Z^T Z``), descending, normalised to sum 1 (singular values, not
    their squares, as the authors' threshold reads them)."""
    return _normalised_singular_values(_stacked_activations(query, key, gram)[0])


def activation_basis_factors(query, key, gram, rank):
    """Eigen Attention's truncation of a head: its queries and keys projected on the top ``rank`` right-singular
    directions of the stacked activations ``[Z key; Z query]`` (one basis for both sides, so the logits are
    ``(q U_r)(k U_r)^T``).

    Parameters
    ----------
    query, key : ndarray of shape (p, d_head)
        The head's maps on the features Z (``[W; b]`` on ``[x, 1]``, or ``W`` on x).
    gram : ndarray of shape (p, p)
        ``Z^T Z`` over the calibration tokens.
    rank : int

    Returns
    -------
    query_r, key_r : ndarray of shape (p, d_head)

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, Z = rng.standard_normal((5, 3)), rng.standard_normal((5, 3)), rng.standard_normal((40, 5))
    >>> q2, k2 = activation_basis_factors(q, k, Z.T @ Z, 1)
    >>> int(np.linalg.matrix_rank(q2 @ k2.T))
    1
    """
    U = _stacked_activations(query, key, gram)[1][:, :int(rank)]
    P = U @ U.T
    return np.asarray(query, dtype=float) @ P, np.asarray(key, dtype=float) @ P


def whitened_factors(query, key, gram, rank):
    """SVD-LLM's truncation, each of the head's query and key maps on its own: ``W`` truncated where
    ``||Z (W - W_r)||`` is least — the SVD of ``S W`` with ``S`` any square root of ``gram = Z^T Z`` (the authors
    whiten by its Cholesky factor; any root gives the same ``Z W_r``), mapped back by ``S^+``; the part of ``W``
    the calibration tokens do not reach is kept unchanged.

    Parameters and returns as :func:`activation_basis_factors`; the head's kernel ``query_r key_r^T`` has rank at
    most ``rank``.
    """
    return _whitened(query, key, _gram_roots(gram), rank)


def _gram_roots(gram):
    """``(S, S^+)``: the square root of a Gram matrix and its pseudo-inverse (:func:`psd_power`)."""
    return psd_power(gram, 0.5), psd_power(gram, -0.5)


def _whitened(query, key, roots, rank):
    """:func:`whitened_factors` from the Gram's roots (computed once per layer)."""
    S, S_pinv = roots
    r = int(rank)
    out = []
    for W in (np.asarray(query, dtype=float), np.asarray(key, dtype=float)):
        SW = S @ W
        U, s, Vt = np.linalg.svd(SW, full_matrices=False)
        # S^+ S W is W's part the tokens reach: replaced by its truncation, the rest kept
        out.append(W - S_pinv @ SW + S_pinv @ ((U[:, :r] * s[:r]) @ Vt[:r]))
    return tuple(out)


def truncated_head_factors(query, key, rank, metric=None):
    """``(query_r, key_r)`` of shape (d + 1, d_head): the head's ``[W; b]`` maps with ``query_r key_r^T`` the best
    rank-``rank`` approximation of ``query key^T`` (its SVD, through the ``d_head x d_head`` core), split evenly,
    columns beyond ``rank`` zero.

    ``metric=None`` truncates the weights' product itself (the truncation of
    :func:`rstar.heads.kernel_truncation_curve`). ``metric=(Mq_half, Mq_inv_half, Mk_half, Mk_inv_half)``, the
    token metric's roots (the layer's tokens, and the tokens centred within their sequence), truncates
    ``M_q^{1/2} query key^T M_k^{1/2}`` — the kernel as it acts on the data, the metric rstar's statistic and risk
    curve are measured in; it keeps the directions the tokens excite rather than those of largest weight (the
    bilinear analogue of SVD-LLM's whitened truncation, Wang et al. 2024) — and maps back.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((9, 4)), rng.standard_normal((9, 4))
    >>> q2, k2 = truncated_head_factors(q, k, 2)
    >>> q2.shape, int(np.linalg.matrix_rank(q2 @ k2.T))
    ((9, 4), 2)
    >>> bool(np.allclose(truncated_head_factors(q, k, 4)[0] @ truncated_head_factors(q, k, 4)[1].T, q @ k.T))
    True
    """
    query, key = np.asarray(query, dtype=float), np.asarray(key, dtype=float)
    if metric is not None:
        query, key = metric[0] @ query, metric[2] @ key
    U, s, W = factored_svd(query, key)
    r = int(rank)
    root = np.sqrt(s[:r])
    out_q, out_k = np.zeros_like(U), np.zeros_like(W)
    out_q[:, :r], out_k[:, :r] = U[:, :r] * root, W[:, :r] * root
    if metric is not None:
        out_q, out_k = metric[1] @ out_q, metric[3] @ out_k
    return out_q, out_k


def _model_factors(pair, shape, layer, head):
    """A fitted model's factors ``(A, B)`` (rstar's convention: logits ``x~ A B^T x~'^T / sqrt(d~)``) as the
    module's query and key maps (logits ``x~ q k^T x~'^T / sqrt(d_head)``), padded to ``d_head`` columns."""
    A, B = (np.asarray(f, dtype=float) for f in pair)
    p, d_head = shape
    if A.ndim != 2 or A.shape != B.shape or A.shape[0] != p or A.shape[1] > d_head:
        raise ValueError(f"layer {layer} head {head}: its factors must be two arrays of shape ({p}, r) with "
                         f"r <= d_head = {d_head} (the head's columns), got {A.shape} and {B.shape}.")
    c = (d_head / p) ** 0.25
    pad = ((0, 0), (0, d_head - A.shape[1]))
    return np.pad(A * c, pad), np.pad(B * c, pad)


def rotary_query_projection(query, key, rank, pairs, metric=None):
    """The projection ``P`` (d x d, rank ``rank``) that cuts a rotary head to width ``rank`` on its query side:
    ``P query`` on the top ``rank`` query-side directions of the head's logit family ``query R(delta) key^T`` over
    the pairs (:func:`rstar.inversions._numerics.rotary.family_svd`), in the token metric (``metric`` as in
    :func:`truncated_head_factors`; None: the weights' own).

    The projected head's logits ``x^T P query R(delta) key^T x'`` have rank at most ``rank`` at every angle, and
    over the family they are its best rank-``rank`` approximation on the query side (Eckart–Young: projecting the
    rows of ``Z_q = [sqrt(w) K(delta)]`` on its top left singular vectors). The key side is left alone, so a key
    head shared by a group of query heads (grouped-query attention) serves each of them at its own width.
    """
    query, key = np.asarray(query, dtype=float), np.asarray(key, dtype=float)
    if query.ndim != 2 or query.shape != key.shape or not np.all(np.isfinite(query)) or not np.all(np.isfinite(key)):
        raise ValueError(f"query and key must be finite arrays of one shape (d, 2P), got {query.shape} and "
                         f"{key.shape}.")
    if isinstance(rank, bool) or not float(rank).is_integer() or not 0 <= rank <= query.shape[1]:
        raise ValueError(f"rank must be a whole number in 0 ... {query.shape[1]} (the head's width), got {rank!r}.")
    d = query.shape[0]
    if metric is None:
        eye = np.eye(d)
        metric = (eye, eye, eye, eye)
    U = family_svd([(metric[0] @ query, metric[2] @ key)], [1.0], pairs, "q")[0][:, :int(rank)]
    return metric[1] @ U @ U.T @ metric[0]


@contextmanager
def truncated_heads(model, plan, layers, metric="tokens", factors=None, both_sides=False):
    """Within the ``with`` block, each planned head of ``model`` computes its logits with its query–key map
    truncated to the plan's rank (:func:`truncated_head_factors`); the weights are restored on exit, even after
    an exception. Value maps, output projections and every other head are unchanged.

    Parameters
    ----------
    model : torch.nn.Module
        The model the layers were read from (:func:`rstar.heads.collect_attention`).
    plan : DataFrame or list of dict
        Rows with ``layer, head, rank`` (:func:`rstar.heads.rank_plan`).
    layers : list of AttentionLayer
        The layers of the plan's heads: their module names, styles, weights and tokens.
    metric : {"tokens", "weights", "activations", "whitened"}, default="tokens"
        How a head is truncated: ``"tokens"`` by :func:`truncated_head_factors` in the metric of the layer's tokens
        (``X`` of the layer as collected; what r*(ε) is measured in), ``"weights"`` by the weights' own SVD,
        ``"activations"`` on the top directions of its stacked key and query activations (Eigen Attention:
        :func:`rstar.heads.activation_basis_factors`), ``"whitened"`` each of its query and key maps on its own,
        whitened by the tokens (SVD-LLM: :func:`rstar.heads.whitened_factors`).
    factors : dict or None
        ``{(layer, head): (A, B)}``: truncate these query–key maps instead of the heads' own — a fitted model's
        factors in rstar's convention on the head's features (logits ``x~ A B^T x~'^T / sqrt(d~)``;
        ``estimate_heads(keep_factors=True)``'s ``query_key_factors``, of any width), so that the fit's own rank-r
        models replace the heads. A planned head without an entry keeps its own map.
    both_sides : bool, default=False
        Cut a rotary head on both sides, each with its own query and key maps (what a compressed key cache holds:
        the width-r class its risk curve counts), as ``factors`` with each planned head's own maps would; by
        default a rotary head is cut on its query side only, a wider class. Its prediction is the curve shifted by
        the floors' gap (``rank_plan(model="fitted")``; the user guide, "Which prediction fits the both-sided
        cut"). Only with ``metric`` ``"tokens"`` or ``"weights"``; a BERT-style head's kernel is cut on both sides
        either way.

    Notes
    -----
    A Llama-family head (rotary positions, keys shared by a group of query heads) is cut on its query side by
    ``"tokens"`` and ``"weights"``: its rows of ``q_proj`` projected by :func:`rotary_query_projection` (in the
    tokens' metric, or in the weights' own), so that a shared key head serves each query head of its group at that
    head's width. The anchors' truncations cut the key side too, before the rotation: ``"activations"`` is Eigen
    Attention's for rotary models (the key projected on the top ``rank`` directions of the layer's key activations,
    all its key heads stacked: :func:`rotary_key_basis`; the query kept whole), ``"whitened"`` SVD-LLM's (the head's
    query and key maps each truncated on its own). So that one query head's cut leaves the others of its group as
    they were, the layer's ``k_proj`` and ``v_proj`` are swapped inside the block for copies with one key/value
    head per query head (exact: every query head reads the same keys and values as before) and the module's
    ``num_key_value_groups`` set to 1; the module's own projections and count come back on exit. ``factors`` of one
    rotary head (d_head columns: a rotary student's ``query_key_factors_``) replace its query map and its own key
    copy, cut to the plan's rank on both sides (``"tokens"`` or ``"weights"``). A rotary fit's own factors are
    refused: its model is the mean of its two halves' heads, every plane twice, which one head of the module
    cannot hold.

    Raises
    ------
    ValueError
        A planned layer not among ``layers``, a head it does not hold, a rank outside ``0 ... d_head``, a layer of
        another style than BERT's (separate ``query`` and ``key`` projections) or Llama's (``q_proj``, ``k_proj``),
        or a truncation a rotary layer does not take.
    """
    import torch

    if metric not in ("tokens", "weights", "activations", "whitened"):
        raise ValueError(f"metric must be 'tokens', 'weights', 'activations' or 'whitened', got {metric!r}.")
    if both_sides and metric not in ("tokens", "weights"):
        raise ValueError(f"both_sides=True cuts a head's own query and key maps by 'tokens' or 'weights'; "
                         f"metric={metric!r} has its own key-side cut.")
    modules = dict(model.named_modules())
    roots = {}
    by_index = {layer.index: layer for layer in layers}
    edits = []   # (parameter, new value) per projection touched
    ungroup = {}   # layer -> (Llama-style module, {query head: its own new key map}) for key-side cuts
    for row in _rows(plan, ("layer", "head", "rank")):
        if not float(row["rank"]).is_integer():
            raise ValueError(f"layer {row['layer']} head {row['head']}: rank {row['rank']!r} is not a whole number.")
        index, head, rank = int(row["layer"]), int(row["head"]), int(row["rank"])
        layer = by_index.get(index)
        if layer is None:
            raise ValueError(f"the plan has layer {index}, which is not among the layers given.")
        if layer.style not in ("bert", "llama"):
            raise ValueError(f"layer {index} ({layer.name}) is {layer.style}-style; only BERT-style attention "
                             "(separate query and key projections) and Llama-style (q_proj, k_proj) are rewritten "
                             "so far.")
        held = layer.held_heads
        if head not in held:
            raise ValueError(f"layer {index} holds no head {head} (it holds {held}).")
        pos = held.index(head)
        d_head = layer.query.shape[2]
        if not 0 <= rank <= d_head:
            raise ValueError(f"layer {index} head {head}: rank {rank} is outside 0 ... d_head = {d_head}.")
        module = modules[layer.name]
        if layer.style == "llama":
            own = factors.get((index, head)) if factors is not None else None
            if own is None and both_sides:
                own = layer.head(pos).factors()   # the head's own query and key maps, cut on both sides
            if own is not None:
                q_edits, new_key = _llama_factor_cut(module, layer, pos, head, rank, metric, roots, own)
                edits += q_edits
                ungroup.setdefault(index, (module, {}))[1][head] = new_key
                continue
            if metric in ("tokens", "weights"):
                edits += _llama_query_edits(module, layer, pos, head, rank, metric, roots)
            else:
                q_edits, new_key = _llama_key_side_cut(module, layer, pos, head, rank, metric, roots)
                edits += q_edits
                ungroup.setdefault(index, (module, {}))[1][head] = new_key
            continue
        # [W; b] on [x, 1] where both projections have bias parameters (a truncation in the tokens' metric may give
        # a zero bias a non-zero value), else W on x alone
        biased = module.query.bias is not None and module.key.bias is not None
        rows = slice(None) if biased else slice(0, -1)
        if metric != "weights" and index not in roots:
            Z = _layer_tokens(layer, biased)
            if metric == "tokens":
                roots[index] = token_metric_roots(Z)
            else:
                Z = Z.reshape(-1, Z.shape[-1])
                roots[index] = Z.T @ Z if metric == "activations" else _gram_roots(Z.T @ Z)
        query, key = layer.query[pos][rows], layer.key[pos][rows]
        if factors is not None and (index, head) in factors:
            query, key = _model_factors(factors[(index, head)], query.shape, index, head)
        if metric in ("activations", "whitened"):
            trunc = activation_basis_factors if metric == "activations" else _whitened
            q, k = trunc(query, key, roots[index], rank)
        else:
            q, k = truncated_head_factors(query, key, rank, roots.get(index))
        q, k = q[:, :d_head], k[:, :d_head]
        cols = slice(head * d_head, (head + 1) * d_head)
        d = layer.X.shape[-1]
        for linear, factor in ((module.query, q), (module.key, k)):
            edits.append((linear.weight, (cols, slice(None)), factor[:d].T))
            if biased:
                edits.append((linear.bias, (cols,), factor[d]))
    swaps = [(module, _ungrouped_projections(module, new_keys)) for module, new_keys in ungroup.values()]
    saved = [(param, index, param.data[index].clone()) for param, index, _ in edits]
    own = [(module, module.k_proj, module.v_proj, module.num_key_value_groups) for module, _ in swaps]
    try:
        for module, (k_proj, v_proj) in swaps:
            module.k_proj, module.v_proj, module.num_key_value_groups = k_proj, v_proj, 1
            module._rstar_key_copies = True
        with torch.no_grad():
            for param, index, value in edits:
                param.data[index] = torch.as_tensor(value, dtype=param.dtype, device=param.device)
        yield model
    finally:
        with torch.no_grad():
            for param, index, value in reversed(saved):
                param.data[index] = value
        for module, k_proj, v_proj, groups in own:
            module.k_proj, module.v_proj, module.num_key_value_groups = k_proj, v_proj, groups
            module.__dict__.pop("_rstar_key_copies", None)


def _layer_tokens(layer, biased):
    """The layer's tokens, with the constant feature ``[x, 1]`` where the truncated maps act on their bias too."""
    X = layer.X
    return np.concatenate([X, np.ones(X.shape[:-1] + (1,))], axis=-1) if biased else X


def _llama_query_edits(module, layer, pos, head, rank, metric, roots):
    """The edits of ``q_proj`` (and its bias) that cut one Llama-style head to ``rank`` on its query side."""
    # [W; b] on [x, 1] where q_proj has a bias parameter (a projection in the tokens' metric may give a zero bias a
    # value), else W on x alone
    biased = module.q_proj.bias is not None
    rows = slice(None) if biased else slice(0, -1)
    pairs = pair_rotations(layer.rotary, layer.head(pos).mask())
    P = rotary_query_projection(layer.query[pos][rows], layer.key[pos][rows], rank, pairs,
                                _uncentred_roots(roots, layer, biased) if metric == "tokens" else None)
    d_head = layer.query.shape[2]
    cols = slice(head * d_head, (head + 1) * d_head)
    return _query_row_edits(module, cols, P @ _raw_query(module, cols, biased))


def _uncentred_roots(roots, layer, biased):
    """The token metric's roots of a rotary layer (keys uncentred), on ``[x, 1]`` where ``biased``: computed once per
    call of :func:`truncated_heads` (``roots`` its cache) for the heads' own maps and for factors put in their
    place alike."""
    key = ("uncentred", layer.index, biased)
    if key not in roots:
        roots[key] = token_metric_roots(_layer_tokens(layer, biased), keys_centred=False)
    return roots[key]


def _raw_query(module, cols, biased):
    """A Llama-style head's rows ``cols`` of ``q_proj`` as the raw map on the features: ``[W; b]`` on ``[x, 1]``
    where ``biased``, else ``W`` on x (no logit scale folded in)."""
    W = module.q_proj.weight.detach().double().cpu().numpy()[cols].T
    return np.vstack([W, module.q_proj.bias.detach().double().cpu().numpy()[cols][None]]) if biased else W


def _query_row_edits(module, cols, new):
    """The edits that write a new raw query map (:func:`_raw_query`'s shape) into the rows ``cols`` of ``q_proj``."""
    d = module.q_proj.in_features
    edits = [(module.q_proj.weight, (cols, slice(None)), new[:d].T)]
    if new.shape[0] > d:
        edits.append((module.q_proj.bias, (cols,), new[d]))
    return edits


def _layer_key_basis(module, layer, biased):
    """:func:`rotary_key_basis` of a Llama-style module: its key heads (the collector's reading of ``k_proj``,
    ``[W; b]`` on ``[x, 1]`` where ``biased``, else ``W``) on the layer's tokens."""
    _, keys, _, groups, _ = _llama_weights(module)
    rows = slice(None) if biased else slice(0, -1)
    keys = keys[np.unique(groups, return_index=True)[1]][:, rows]   # each key head once, not once a query head
    Z = _layer_tokens(layer, biased)
    Z = Z.reshape(-1, Z.shape[-1])
    return rotary_key_basis(keys, Z.T @ Z)


def rotary_key_basis(keys, gram):
    """Eigen Attention's basis for a rotary layer: the squared singular values (descending) and right-singular
    directions of the layer's key activations before the rotation, its key heads stacked as rows
    (``[Z k_1; ...; Z k_G]``, uncentred, ``gram = Z^T Z``). The authors' Llama variant reads one basis per layer
    from the keys alone and caches ``k U_r``; the key is rebuilt as ``k U_r U_r^T`` and rotated, the query kept
    whole, so that the projection acts before the rotation and folds into ``k_proj``.

    Parameters
    ----------
    keys : ndarray of shape (G, p, d_head)
        The layer's key heads on the features Z.
    gram : ndarray of shape (p, p)

    Returns
    -------
    squared : ndarray of shape (d_head,)
    directions : ndarray of shape (d_head, d_head)
        Columns, in the order of ``squared``.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> keys, Z = rng.standard_normal((2, 5, 3)), rng.standard_normal((40, 5))
    >>> s2, U = rotary_key_basis(keys, Z.T @ Z)
    >>> stacked = np.vstack([Z @ k for k in keys])
    >>> bool(np.allclose(s2, np.linalg.svd(stacked, compute_uv=False) ** 2))
    True
    """
    keys = np.asarray(keys, dtype=float)
    return _descending_eigen(sum(k.T @ gram @ k for k in keys))


def _llama_key_side_cut(module, layer, pos, head, rank, metric, roots):
    """The anchors' cuts of one Llama-style head on both sides: the edits of its ``q_proj`` rows and its own new
    key map (p, d_head), Eigen Attention's (``"activations"``: the key on the layer's key basis,
    :func:`rotary_key_basis`) or SVD-LLM's (``"whitened"``)."""
    biased = module.k_proj.bias is not None and (metric == "activations" or module.q_proj.bias is not None)
    rows = slice(None) if biased else slice(0, -1)
    key = layer.key[pos][rows]   # its key head, as read from k_proj (the logit scale is folded into the query)
    if metric == "activations":
        if layer.index not in roots:
            roots[layer.index] = _layer_key_basis(module, layer, biased)[1]
        U = roots[layer.index][:, :int(rank)]
        return [], key @ U @ U.T
    if layer.index not in roots:
        Z = _layer_tokens(layer, biased)
        Z = Z.reshape(-1, Z.shape[-1])
        roots[layer.index] = _gram_roots(Z.T @ Z)
    dh = int(module.head_dim)
    cols = slice(head * dh, (head + 1) * dh)
    query, key = _whitened(_raw_query(module, cols, biased), key, roots[layer.index], rank)
    return _query_row_edits(module, cols, query), key


def _llama_factor_cut(module, layer, pos, head, rank, metric, roots, pair):
    """A rotary head ``(A, B)`` in rstar's convention on the head's features (logits ``rot(x~ A) rot(x~ B)^T /
    sqrt(d~)``, d_head columns: one head, e.g. a rotary student's ``query_key_factors_``) cut to ``rank`` on both
    sides (:func:`rstar.inversions._numerics.rotary.truncated_rotary_head`: the top directions of its own logit
    family, in the tokens' metric with the keys uncentred, or in the weights' own for ``"weights"``) and written in
    one Llama-style head's place: the edits of its ``q_proj`` rows (the logit scale ``sqrt(d_head / d~)`` folded
    into the query) and its own key map."""
    if metric not in ("tokens", "weights"):
        raise ValueError(f"layer {layer.index} head {head}: a model's own factors are cut by 'tokens' or 'weights' "
                         f"(the top directions of their logit family), not {metric!r}.")
    A, B = (np.asarray(f, dtype=float) for f in pair)
    d, d_head = layer.X.shape[-1], int(module.head_dim)
    if A.ndim == 2 and A.shape == B.shape and A.shape[1] == 2 * d_head:
        raise ValueError(f"layer {layer.index} head {head}: a rotary fit's own factors are not put back into a "
                         "model: its model is the mean of its two halves' heads, every plane twice "
                         "(query_key_factors has 2 d_head columns), which one head of the module cannot hold; "
                         "truncate the head's own map, or put back a rotary student's factors.")
    if A.ndim != 2 or A.shape != B.shape or A.shape[0] not in (d, d + 1) or A.shape[1] != d_head \
            or not np.all(np.isfinite(A)) or not np.all(np.isfinite(B)):
        raise ValueError(f"layer {layer.index} head {head}: its factors must be two finite arrays of shape "
                         f"({d} or {d + 1}, {d_head}) (the head's features, its d_head rotated coordinates), got "
                         f"{A.shape} and {B.shape}.")
    biased = A.shape[0] == d + 1
    for name, proj, factor in (("query", module.q_proj, A), ("key", module.k_proj, B)):
        if biased and proj.bias is None and np.any(factor[d] != 0):
            raise ValueError(f"layer {layer.index} head {head}: its {name} factor has a bias row, but the module's "
                             f"{'q_proj' if name == 'query' else 'k_proj'} has no bias to hold it.")
    pairs = pair_rotations(layer.rotary, layer.head(pos).mask())
    cut_metric = _uncentred_roots(roots, layer, biased) if metric == "tokens" else (np.eye(A.shape[0]),) * 4
    A, B = truncated_rotary_head(cut_metric, pairs, A, B, rank)

    def held(proj, factor):   # the rows the projection holds: [W; b] where it has a bias (0 for factors without)
        if proj.bias is None:
            return factor[:d]
        return factor if biased else np.vstack([factor, np.zeros((1, d_head))])

    cols = slice(head * d_head, (head + 1) * d_head)
    return _query_row_edits(module, cols, held(module.q_proj, A * np.sqrt(d_head / A.shape[0]))), held(module.k_proj, B)


def _ungrouped_projections(module, new_keys):
    """``k_proj`` and ``v_proj`` for a Llama-style module with one key/value head per query head — each a copy of
    its group's, the heads in ``new_keys`` (``{query head: key map (p, d_head)}``, ``[W; b]`` where it has p = d + 1
    rows) with their own key — so that one query head's key-side cut leaves the rest of its group unchanged."""
    import torch

    if getattr(module, "_rstar_key_copies", False):
        raise ValueError(f"{type(module).__name__} already reads one key head per query head inside another "
                         "truncated_heads block with a key-side cut: nested key-side cuts are refused (their key "
                         "heads would be read from the copies).")
    if not isinstance(getattr(module, "num_key_value_groups", None), int):
        raise ValueError(f"{type(module).__name__} has no num_key_value_groups, which its attention reads to share "
                         "key/value heads: rstar cannot give one query head its own key head there, so a key-side "
                         "cut ('activations', 'whitened') is refused; cut on the query side ('tokens', 'weights').")
    dh = int(module.head_dim)
    groups = _llama_kv_groups(module)
    H = groups.size
    rows = torch.as_tensor(groups[:, None] * dh + np.arange(dh)).reshape(-1)
    out = []
    with torch.no_grad():
        for lin in (module.k_proj, module.v_proj):
            new = torch.nn.Linear(lin.in_features, H * dh, bias=lin.bias is not None, dtype=lin.weight.dtype,
                                  device=lin.weight.device)
            new.weight.copy_(lin.weight[rows])
            if lin.bias is not None:
                new.bias.copy_(lin.bias[rows])
            out.append(new.requires_grad_(lin.weight.requires_grad))
        k_proj, d = out[0], module.k_proj.in_features
        for head, key in new_keys.items():
            cols = slice(head * dh, (head + 1) * dh)
            k_proj.weight[cols] = torch.as_tensor(key[:d].T, dtype=k_proj.weight.dtype, device=k_proj.weight.device)
            if key.shape[0] > d:
                k_proj.bias[cols] = torch.as_tensor(key[d], dtype=k_proj.bias.dtype, device=k_proj.bias.device)
    return out


def _last_hidden_states(model, windows, batch_size):
    """The model's last hidden states on ``windows`` (n, T) of token ids, float64, shape (n, T, d)."""
    import torch

    out = []
    with torch.no_grad():
        for batch in _batches(windows, batch_size):
            result = model(batch)
            hidden = getattr(result, "last_hidden_state", None)
            if hidden is None:
                raise ValueError(f"the model's output ({type(result).__name__}) has no last_hidden_state: give the "
                                 "base model (transformers' AutoModel), whose output carries it.")
            out.append(hidden.double().numpy())
    return np.concatenate(out)


def hidden_state_error(model, layers, windows, *, metric="tokens", batch_size=32):
    """A model-level measure of a rank plan, for :func:`rstar.heads.smallest_budget_plan`: ``evaluate(plan)``
    returns how far the model's last hidden states move when the plan's heads are cut.

    The error is ``sum ||h_cut - h||^2 / sum ||h - mean(h)||^2`` over every token of ``windows`` (the squared
    change of the model's output representation, relative to its variance over the tokens), with its standard
    error over the windows (each window's share of the numerator; the denominator, of the full model, is fixed).
    It needs no task and no labels, for encoders and decoders alike (for a decoder's perplexity, measure it with
    the language-model head instead, as ``benchmarks/decoder_perplexity.py`` does).

    Parameters
    ----------
    model : torch.nn.Module
        The model the ``layers`` were read from; its output has ``last_hidden_state`` (transformers' AutoModel).
    layers : list of AttentionLayer
        The layers of the plans' heads (:func:`rstar.heads.collect_attention`): their tokens set the cut's metric.
    windows : ndarray of shape (n_windows, T)
        Token ids the model is measured on, held out from the fits' windows; at least 2 windows.
    metric : str, default="tokens"
        How each head is cut (:func:`truncated_heads`).
    batch_size : int, default=32
        Windows per forward pass.

    Returns
    -------
    evaluate : callable
        ``evaluate(plan) -> (error, standard_error)``, ``plan`` rows ``layer, head, rank``.

    Examples
    --------
    >>> from rstar.heads import (collect_attention, estimate_heads, hidden_state_error, load_minilm,
    ...                          smallest_budget_plan, text_windows)   # doctest: +SKIP
    >>> model, tok = load_minilm()                                     # doctest: +SKIP
    >>> layers = collect_attention(model, text_windows(tok, 32, 500, random_state=0))   # doctest: +SKIP
    >>> table = estimate_heads(layers, tolerances=(0.01,))             # doctest: +SKIP
    >>> measure = hidden_state_error(model, layers, text_windows(tok, 32, 200, random_state=1))  # doctest: +SKIP
    >>> smallest_budget_plan(table, measure, target=0.01)["width"]     # doctest: +SKIP
    """
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[0] < 2:
        raise ValueError(f"windows must be token ids of shape (n_windows, T) with at least 2 windows, got shape "
                         f"{windows.shape}.")
    if not np.issubdtype(windows.dtype, np.integer):
        raise ValueError(f"windows must be integer token ids (text_windows gives them), got dtype {windows.dtype}.")
    full = _last_hidden_states(model, windows, batch_size)   # (batch_size checked by the batching)
    spread = float(np.sum((full - full.reshape(-1, full.shape[-1]).mean(axis=0)) ** 2))
    if not spread > 0:
        raise ValueError("the model's last hidden states do not vary over these windows: nothing to measure.")

    def evaluate(plan):
        with truncated_heads(model, plan, layers, metric=metric):
            cut = _last_hidden_states(model, windows, batch_size)
        per_window = np.sum((cut - full) ** 2, axis=(1, 2)) / (spread / len(windows))
        return float(per_window.mean()), float(per_window.std(ddof=1) / np.sqrt(per_window.size))

    return evaluate

