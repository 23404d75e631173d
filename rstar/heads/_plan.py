"""Rank plans: each head's query–key rank from one table of fits, by tolerance or within a total width."""

import numpy as np

__all__ = ["allocate_ranks", "rank_pattern", "rank_plan", "smallest_budget_plan"]


def _rows(table, required=()):
    """A table's rows as dicts: a DataFrame's records, or a list of dicts (without pandas) as given; a one-line
    error where a row lacks one of the ``required`` columns."""
    rows = table.to_dict("records") if hasattr(table, "to_dict") else [dict(r) for r in table]
    for row in rows:
        missing = [key for key in required if key not in row]
        if missing:
            raise ValueError(f"a row of the table has no {missing[0]!r} column (each needs {', '.join(required)}).")
    return rows


def _table(rows):
    """Rows as a DataFrame, or the list of dicts itself without pandas."""
    try:
        import pandas as pd
    except ImportError:   # pragma: no cover - depends on the environment
        return rows
    return pd.DataFrame(rows)


def _check_budget(budget):
    """A total query–key width: a whole number >= 0."""
    if isinstance(budget, bool) or not float(budget).is_integer():
        raise ValueError(f"budget must be a whole number of query-key dimensions, got {budget!r}.")
    if int(budget) < 0:
        raise ValueError(f"budget must be >= 0, got {int(budget)}.")
    return int(budget)


def _floor_gap(row):
    """How far the head's cross-fitted curve may understate its fit's own model: its held-out floor less the same
    full models in sample (``risk_curve_floor - risk_curve_floor_in_sample``, at least 0); None where the row has
    no such pair (a table without the floors, or a curve measured in sample)."""
    pair = [row.get("risk_curve_floor"), row.get("risk_curve_floor_in_sample")]
    if any(v is None or not np.isfinite(float(v)) for v in pair):
        return None
    return max(float(pair[0]) - float(pair[1]), 0.0)


def _curve(row):
    """The head's predicted excess at ranks 0 ... d_head (the curve its r*(ε) is read from), non-increasing."""
    curve = row.get("risk_curve")
    if curve is None or (isinstance(curve, float) and np.isnan(curve)) or len(curve) == 0:
        raise ValueError(f"layer {row['layer']} head {row['head']} has no risk_curve: the plan needs the table of "
                         "estimate_heads with tolerances (its rows' risk_curve), not a noise-floor-only table.")
    d_head = int(row["d_head"])
    c = np.asarray(curve, dtype=float)[:d_head + 1]
    if not np.all(np.isfinite(c)):
        raise ValueError(f"layer {row['layer']} head {row['head']}: its risk_curve holds NaN or inf.")
    # measured up to the rank reaching half the smallest tolerance: beyond, the last value bounds it; and a rank-r
    # model is at least as good as a rank-(r-1) one (its factors with a zero column), so the curve is made monotone
    c = np.concatenate([c, np.full(d_head + 1 - c.size, c[-1])])
    return np.minimum.accumulate(np.maximum(c, 0.0))


def allocate_ranks(curves, budget):
    """The ranks ``r_h`` with ``sum_h r_h <= budget`` that minimise ``sum_h curves[h][r_h]``, exactly.

    A multiple-choice knapsack solved by dynamic programming over the total width (``O(H budget R)``): no
    assumption on the curves' shape. (A greedy allocation on marginal gains is optimal only for convex curves;
    real heads' curves are not all convex.) Among allocations of equal summed excess the one of least total width
    is returned.

    Parameters
    ----------
    curves : list of 1-D arrays
        ``curves[h][r]``: head h's excess at rank r, r = 0 ... R_h.
    budget : int
        The total width, at least 0.

    Returns
    -------
    ranks : list of int

    Examples
    --------
    >>> allocate_ranks([[1.0, 0.2, 0.1], [1.0, 0.9, 0.0]], 2)   # not greedy: the second head's gain comes at 2
    [0, 2]
    """
    budget = _check_budget(budget)
    curves = [np.asarray(c, dtype=float) for c in curves]
    if any(c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) for c in curves):
        raise ValueError("each curve must be a non-empty 1-D array of finite excess risks (ranks 0, 1, ...).")
    best = np.zeros(budget + 1)   # best[b]: the least summed excess of the heads so far within width b
    choices = []
    for c in curves:
        new = np.full(budget + 1, np.inf)
        pick = np.zeros(budget + 1, dtype=int)
        for r in range(min(c.size, budget + 1)):
            cand = np.full(budget + 1, np.inf)
            cand[r:] = best[:budget + 1 - r] + c[r]
            # strictly better only: at equal excess the smaller rank (taken first) stays
            finite = np.isfinite(new)
            better = ~finite & np.isfinite(cand)
            better[finite] = cand[finite] < new[finite] - 1e-15 * np.maximum(np.abs(new[finite]), 1.0)
            new[better], pick[better] = cand[better], r
        best = new
        choices.append(pick)
    # the least total width that reaches the least excess
    b = int(np.flatnonzero(best <= best.min() + 1e-15 * max(abs(best.min()), 1.0))[0])
    ranks = []
    for pick in reversed(choices):
        r = int(pick[b])
        ranks.append(r)
        b -= r
    return ranks[::-1]


def rank_plan(table, *, tolerance=None, budget=None, model="kernel"):
    """Each head's query–key rank, from the table of :func:`rstar.heads.estimate_heads` (with tolerances).

    Give exactly one of

    - ``tolerance=ε`` (tolerance mode): each head's r*(ε), the smallest rank whose predicted excess is at most
      ε of the head's Var(Y) (where no rank of its curve reaches ε: ``d_head``, flagged ``reached=False``);
    - ``budget=W`` (budget mode): a total width W (the sum of the heads' ranks) split to minimise the summed
      predicted excess, exactly (:func:`allocate_ranks`). Each head's excess is relative to its own Var(Y), so
      the sum weighs every head alike; the heads are treated as independent (the next layers see the changed
      outputs, which the per-head curves do not model).

    The predicted excess is each head's ``risk_curve`` (the upper bound its r*(ε) is read from, cross-fitted;
    beyond the rank where the fit stopped measuring it, its last value; made non-increasing). It predicts the
    head's own kernel cut to that rank. The fit's own rank-r model (``--save-factors``, ``truncated_heads(factors=)``)
    is predicted by ``predicted_excess_fitted_model``: the same curve with its floor moved from the full half models
    held out to the same models in sample (``+ risk_curve_floor - risk_curve_floor_in_sample``), since the held-out
    floor carries estimation error the fit's model does not subtract (a negative gap counts as none); None (NaN in
    a DataFrame) where the table has no such pair (a curve measured in sample). The same shift is the prediction
    for a rotary head's kernel cut on *both* sides (its own query and key maps, ``truncated_heads(both_sides=True)``:
    a key cache compressed): the curve's half models carry part of the floor's estimation error, so its point
    estimate may sit below what a width-r head leaves. On SmolLM2's layers 13-17 (45 heads,
    ``benchmarks/decoder_perplexity.py``) the point estimate plus the gap was within 8% of the both-sided cut's
    summed realised excess (the bare point estimate short by up to 15%), within two standard errors head by head on
    33 and 34 of 45 at 1% and 5% (26 and 24 of 27 on layers 13-15, 7 and 10 of 18 on 16-17: the standard errors
    are the held-out windows', not the fits'), and the ranks read with ``model="fitted"`` held out at most ε on 34
    and 34 of the 45 (the curve's ranks on 20 and 28). A rotary head cut on its query side only
    (``truncated_heads``' default) realises less than the curve in sum.

    ``model`` says which of the two the ranks are chosen by: ``"kernel"`` (the head's kernel cut, the curve itself:
    each head's r*(ε)) or ``"fitted"`` (the fit's own models, to be put back in the heads' place, or the heads'
    kernels cut on both sides: the curve plus the floors' gap, so a head whose fit's model is not predicted within
    ε at any rank gets ``d_head``, flagged ``reached=False``; every row needs both floors). In budget mode the gaps
    shift each head's curve by a constant, so the split is the same either way.

    Returns
    -------
    plan : pandas.DataFrame, or list of dict without pandas
        One row per head: ``layer, head, d_head, rank, predicted_excess, predicted_excess_fitted_model,
        reached`` (whichever ``model`` chose the ranks, both predictions at them); in tolerance mode also
        ``rank_interval``, the reading's interval where the table has it (``rank_interval_at_<ε>``; None
        otherwise).

    Raises
    ------
    ValueError
        Neither or both of tolerance and budget, a tolerance outside (0, 1), a negative budget, a table without
        risk curves, an unknown ``model``, or ``model="fitted"`` on a row without both floors.
    """
    if (tolerance is None) == (budget is None):
        raise ValueError("give exactly one of tolerance (each head's r*(tolerance)) and budget (a total width).")
    if model not in ("kernel", "fitted"):
        raise ValueError(f"model must be 'kernel' (the heads' kernels cut) or 'fitted' (the fits' own models), "
                         f"got {model!r}.")
    rows = _rows(table, ("layer", "head", "d_head", "risk_curve"))
    if not rows:
        raise ValueError("the table has no heads.")
    curves, gaps = [_curve(r) for r in rows], [_floor_gap(r) for r in rows]
    chosen = curves   # the curves the ranks are chosen by
    if model == "fitted":
        missing = next((r for r, g in zip(rows, gaps) if g is None), None)
        if missing is not None:
            raise ValueError(f"model='fitted' needs each head's risk_curve_floor and risk_curve_floor_in_sample; "
                             f"layer {missing['layer']} head {missing['head']} has not both (a table of an older "
                             "rstar, or a curve measured in sample): use model='kernel'.")
        chosen = [c + g for c, g in zip(curves, gaps)]
    if tolerance is not None:
        tol = float(tolerance)
        if not 0.0 < tol < 1.0:
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance}.")
        ranks = [int(np.argmax(c <= tol)) if np.any(c <= tol) else c.size - 1 for c in chosen]
        reached = [bool(np.any(c <= tol)) for c in chosen]
    else:
        ranks = allocate_ranks(chosen, budget)
        reached = [True] * len(rows)
    plan = [dict(layer=int(r["layer"]), head=int(r["head"]), d_head=int(r["d_head"]), rank=k,
                 predicted_excess=float(c[k]), predicted_excess_fitted_model=None if g is None else float(c[k]) + g,
                 reached=ok) for r, c, g, k, ok in zip(rows, curves, gaps, ranks, reached)]
    if tolerance is not None:
        # the reading's interval where the table has it at this tolerance (estimate_heads' rank_interval_at_<ε>):
        # a head whose interval is wide is one the data did not pin down
        key = f"rank_interval_at_{float(tolerance):g}"
        for row, r in zip(plan, rows):
            interval = r.get(key)
            row["rank_interval"] = None if interval is None else [int(v) for v in interval]
    return _table(plan)


def _measured(value, width):
    """``(excess, se)`` from what ``evaluate`` returned: a number, or a pair; a one-line error otherwise."""
    pair = value if isinstance(value, (tuple, list)) else (value, 0.0)
    try:
        excess, se = (float(v) for v in pair)
    except (TypeError, ValueError):
        raise ValueError(f"evaluate must return the model's excess loss, or (excess, standard error), as numbers; "
                         f"got {value!r} at width {width}.") from None
    if not (np.isfinite(excess) and np.isfinite(se) and se >= 0):
        raise ValueError(f"evaluate returned excess {excess} and standard error {se} at width {width}: they must be "
                         "finite, the standard error at least 0.")
    return excess, se


def smallest_budget_plan(table, evaluate, *, target, confidence_z=2.0, resolution=None):
    """The smallest total width whose budget split keeps the model's loss within ``target``, found by bisection
    on the width with the model itself as judge.

    A head's r*(ε) bounds its own error with the layers before it intact; cut together, the heads' errors compound
    through the layers (on SmolLM2's layers 0-7, a layer's summed excess with every planned head cut was 1.0 to 2.4
    times that with its layer alone cut), so no per-head tolerance states a model-level one. This search asks the
    model: at each width W tried, the heads get :func:`rank_plan`'s budget split of W (the least summed predicted
    excess), ``evaluate`` measures the model with those heads cut, and W passes where the measured excess plus
    ``confidence_z`` standard errors is at most ``target``. It assumes the model's excess does not rise with W
    (likely, not certain: the budget splits of neighbouring widths differ in a few heads; every measurement is in
    ``evaluations`` to check it against) and takes the full width, every head whole, to pass without measuring
    it.

    Parameters
    ----------
    table : DataFrame or list of dict
        :func:`rstar.heads.estimate_heads`' table with tolerances (each row's ``layer, head, d_head, risk_curve``).
    evaluate : callable
        ``evaluate(plan) -> excess`` or ``(excess, standard_error)``: the model's loss with each head of ``plan``
        (a list of dict, :func:`rank_plan`'s rows: ``layer, head, rank, ...``) cut to its rank, over the full
        model's, on held-out data (e.g. :func:`rstar.heads.truncated_heads` around a perplexity or
        embedding-distance measurement).
    target : float
        The largest excess the model may have, in ``evaluate``'s units (> 0).
    confidence_z : float, default=2.0
        Standard errors added to a measured excess before it is compared with ``target`` (0: the estimate itself).
    resolution : int or None, default=None
        Stop once the passing and failing widths are at most this far apart (None: the number of heads, one
        dimension a head).

    Returns
    -------
    result : dict
        ``width`` (the smallest passing width found), ``plan`` (its budget split, as :func:`rank_plan` returns it),
        ``evaluations`` (one dict per width measured, in order: ``width, excess, se, passed``), ``target``,
        ``confidence_z`` and ``full_width``.

    Raises
    ------
    ValueError
        A target that is not a positive number, a negative ``confidence_z``, a resolution below 1, an
        ``evaluate`` that is not callable or returns anything but finite numbers, or a table :func:`rank_plan`
        refuses.

    Examples
    --------
    >>> from rstar.heads import smallest_budget_plan
    >>> table = [dict(layer=0, head=h, d_head=4, risk_curve=[1.0, c, c / 4, 0.0, 0.0]) for h, c in
    ...          enumerate([0.5, 0.1])]
    >>> def evaluate(plan):  # stand-in for the model: its excess is the heads' summed curve at their ranks
    ...     return sum(t["risk_curve"][p["rank"]] for t, p in zip(table, plan))
    >>> smallest_budget_plan(table, evaluate, target=0.2, resolution=1)["width"]
    4
    """
    if isinstance(target, bool) or not isinstance(target, (int, float, np.integer, np.floating)) \
            or not np.isfinite(target) or target <= 0:
        raise ValueError(f"target must be a positive number (the model's largest excess), got {target!r}.")
    if isinstance(confidence_z, bool) or not isinstance(confidence_z, (int, float, np.integer, np.floating)) \
            or not np.isfinite(confidence_z) or confidence_z < 0:
        raise ValueError(f"confidence_z must be a number >= 0 (standard errors), got {confidence_z!r}.")
    if not callable(evaluate):
        raise ValueError(f"evaluate must be a callable evaluate(plan) -> excess or (excess, se), got "
                         f"{type(evaluate).__name__}.")
    rows = _rows(table, ("layer", "head", "d_head", "risk_curve"))
    if not rows:
        raise ValueError("the table has no heads.")
    full = sum(int(r["d_head"]) for r in rows)
    if resolution is None:
        resolution = len(rows)
    if (isinstance(resolution, bool) or not isinstance(resolution, (int, float, np.integer, np.floating))
            or not float(resolution).is_integer() or int(resolution) < 1):
        raise ValueError(f"resolution must be a whole number of dimensions >= 1, got {resolution!r}.")
    resolution = int(resolution)
    for row in rows:
        _curve(row)   # every head's curve, checked before the model is run
    evaluations, plan = [], None
    low, high = -1, full   # invariant: high passes (the full width without measuring), low fails (-1: none)
    while high - low > resolution:
        width = (low + high) // 2
        candidate = rank_plan(rows, budget=width)
        excess, se = _measured(evaluate(_rows(candidate)), width)
        passed = bool(excess + confidence_z * se <= target)
        evaluations.append(dict(width=int(width), excess=excess, se=se, passed=passed))
        low, high, plan = (low, width, candidate) if passed else (width, high, plan)
    if plan is None:   # nothing measured passed: the full width
        plan = rank_plan(rows, budget=high)
    return dict(width=int(high), plan=plan, evaluations=evaluations, target=float(target),
                confidence_z=float(confidence_z), full_width=int(full))


def _query_key_modules(layer):
    """The names of a layer's query and key projections, as PEFT's ``target_modules`` name them."""
    if layer.style == "bert":
        return [f"{layer.name}.query", f"{layer.name}.key"]
    if layer.style == "gpt2":
        return [f"{layer.name}.c_attn"]
    if layer.style == "llama":
        return [f"{layer.name}.q_proj", f"{layer.name}.k_proj"]
    return [layer.name]


def _key_side_width(layer, ranks):
    """The width a Llama-family layer's ``k_proj`` needs for the query heads' ``ranks`` (head index to rank): a key
    head shared by a group of query heads serves each of them, so it needs the union of their key-side
    directions, at most the sum of their ranks and at most ``d_head``."""
    groups = {}
    for pos, h in enumerate(layer.held_heads):
        if h in ranks:
            groups[layer.kv_group(pos)] = groups.get(layer.kv_group(pos), 0) + ranks[h]
    d_head = int(layer.query.shape[2])
    return sum(min(w, d_head) for w in groups.values())


def rank_pattern(plan, layers):
    """A PEFT-style ``rank_pattern``: each layer's query and key projections mapped to the layer's query–key width.

    A plan's ranks are per head; a projection module serves every head of its layer, so its rank is the sum of its
    heads' ranks (the width of the layer's block-diagonal rank-r query–key map). Module names are those of
    ``model.named_modules()`` (BERT-style ``<attention>.query`` and ``.key``, GPT-2-style ``<attention>.c_attn``,
    Llama-family ``<attention>.q_proj`` and ``.k_proj``, ``torch.nn.MultiheadAttention`` the module itself). In a
    Llama-family layer whose key/value heads are shared by groups of query heads, ``k_proj``'s rank is summed over
    its key heads, each needing at most the sum of its group's ranks and at most ``d_head``.

    Parameters
    ----------
    plan : DataFrame or list of dict
        From :func:`rank_plan`.
    layers : list of AttentionLayer
        The layers the plan's heads were read from (:func:`rstar.heads.collect_attention`): their names.

    Returns
    -------
    dict of str to int
    """
    ranks = {}   # layer -> head -> rank
    for row in _rows(plan, ("layer", "head", "rank")):
        ranks.setdefault(int(row["layer"]), {})[int(row["head"])] = int(row["rank"])
    by_index = {layer.index: layer for layer in layers}
    missing = sorted(set(ranks) - set(by_index))
    if missing:
        raise ValueError(f"the plan has heads of layer {missing[0]}, which is not among the layers given.")
    pattern = {}
    for i in sorted(ranks):
        layer = by_index[i]
        names = _query_key_modules(layer)
        pattern.update({name: sum(ranks[i].values()) for name in names})
        if layer.style == "llama":
            pattern[names[1]] = _key_side_width(layer, ranks[i])
    return pattern
