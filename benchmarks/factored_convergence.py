"""How far the factored least squares gets within its iterations: plain L-BFGS on the factors against the scaled fit.

A noise-free real head has no noise floor for the factored fit's count to settle on: it keeps sharpening until its
iteration cap (``factored_max_iter``, 400 with V known), and what it has reached there sets the curve r*(ε) is read
from. The scaled fit keeps each kernel's query and key factors in balance and rescales their columns every
``factored_rescale_iter`` iterations (scaled gradient descent: Tong, Ma & Chi, JMLR 2021; damped as in PrecGD,
Zhang, Fattahi & Zhang, NeurIPS 2021), with ``factored_scaled_memory`` curvature pairs; ``factored_rescale_iter=0``
is the plain fit (20 pairs).

For each MiniLM head asked for (T = 32, n = 500 fitted windows, as the README's ``rstar heads`` command), three fits
as the heads table fits them (V known, ``tolerance=0.01``, ``max_rank=d_head``, ``device="auto"``):

- ``plain``: ``factored_rescale_iter=0`` (the fit before the scaled one);
- ``scaled``: the defaults;
- ``short``: the scaled fit with half the iteration cap (200): what the cap buys in time and in readings;
- ``reference``: the scaled fit with four times the iteration cap (1600): the most converged fit at hand.

Per fit: r*(1%) and r*(5%) with their intervals, the realised excess of ``predict(X, rank=r*)`` on ``--n-held``
other windows (sufficient: at most ε), the head's truncation rank on the fitted windows (within: r* no larger),
the curve's floors (held out, in sample), the L-BFGS iterations of the last rank's fit and the seconds. The summary
counts per variant the readings equal to the reference's, sufficient, within, and the time; a figure shows each
head's readings. The default heads are the three the constants were chosen on (4:9, 0:0, 5:5) and nine others.

Usage::

    python benchmarks/factored_convergence.py [--heads 4:9,0:0,...] [--out benchmarks/out/factored_convergence.json]
    python benchmarks/factored_convergence.py --replot benchmarks/out/factored_convergence.json

Each head is a journal step (``OUT.partial.jsonl``): the time left is printed after each, ``--resume`` continues.
"""

import argparse
import json
import os
import time
import warnings

import numpy as np

from _runs import Journal, layer_reader

TOLERANCES = (0.01, 0.05)
#: the heads the scaled fit's constants were chosen on, then nine it was not
DEFAULT_HEADS = "4:9,0:0,5:5,0:6,1:3,1:9,2:2,2:7,3:1,3:10,4:4,5:0"
VARIANTS = ("plain", "scaled", "short", "reference")


def _calibration(variant, scaled_memory=None):
    from rstar.calibration import DEFAULT_CALIBRATION

    if variant == "plain":
        return DEFAULT_CALIBRATION.replace(factored_rescale_iter=0)
    cal = (DEFAULT_CALIBRATION if scaled_memory is None
           else DEFAULT_CALIBRATION.replace(factored_scaled_memory=int(scaled_memory)))
    if variant == "reference":
        return cal.replace(factored_max_iter=4 * DEFAULT_CALIBRATION.factored_max_iter)
    if variant == "short":
        return cal.replace(factored_max_iter=DEFAULT_CALIBRATION.factored_max_iter // 2)
    return cal


def fit_variant(fit, held, variant, seed, scaled_memory=None):
    """One fit's readings, their held-out realised excess, floors, iterations and time."""
    from rstar import RStarEstimator

    est = RStarEstimator(value_map=fit.value_map(), tolerance=TOLERANCES[0], max_rank=fit.d_head, device="auto",
                         random_state=seed, calibration=_calibration(variant, scaled_memory))
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(fit.features(), fit.Y)
        readings = [est.rank_at_tolerance(e, return_interval=True) for e in TOLERANCES]
    seconds = time.perf_counter() - t
    Yh = held.Y.reshape(-1, held.Y.shape[-1])
    tss = float(np.sum((Yh - Yh.mean(axis=0)) ** 2))
    facts = next((f.values for f in est.statistic_.findings if f.kind == "factored_fit"), {})
    out = dict(variant=variant, seconds=seconds, floor=float(est.risk_curve_floor_),
               floor_in_sample=(None if est.risk_curve_floor_in_sample_ is None
                                else float(est.risk_curve_floor_in_sample_)),
               iterations=int(facts.get("iterations", -1)), fitted_rank=int(facts.get("fitted_rank", -1)),
               settled=bool(facts.get("settled", False)), warned=sorted({type(w.message).__name__ for w in caught}))
    for e, (r, (lo, hi)) in zip(TOLERANCES, readings):
        err = np.sum((held.Y - est.predict(held.features(), rank=int(r))) ** 2)
        out[f"rank_{e:g}"], out[f"interval_{e:g}"] = int(r), [int(lo), int(hi)]
        out[f"realised_{e:g}"] = float(err / tss)
    return out


def head_row(fit, held, seed, variants=VARIANTS, scaled_memory=None):
    from rstar.heads import truncation_rank

    row = dict(head=int(fit.head), d_head=int(fit.d_head),
               truncation={f"{e:g}": int(truncation_rank(fit, e)) for e in TOLERANCES})
    row["fits"] = {v: fit_variant(fit, held, v, seed, scaled_memory) for v in variants}
    return row


def _reference_fits(rows, reference_rows=None):
    """Each row's reference fit: its own, or that of the same head in ``reference_rows`` (an earlier run)."""
    by = {(r["layer"], r["head"]): r["fits"]["reference"] for r in (reference_rows or []) if "reference" in r["fits"]}
    return [row["fits"].get("reference") or by[(row["layer"], row["head"])] for row in rows]


def summary(rows, reference_rows=None):
    """Markdown: per head the fits' readings; per variant the counts and times (against the reference fit of these
    rows, or of ``reference_rows``)."""
    variants = [v for v in VARIANTS if v in rows[0]["fits"]]
    refs = _reference_fits(rows, reference_rows)
    lines = [f"| layer | head | ε | truncation rank | {' | '.join(variants)} | realised {' / '.join(variants)} |",
             "|---|---|---|---|" + "---|" * len(variants) + "---|"]
    for row in rows:
        for e in TOLERANCES:
            k = f"{e:g}"
            cells = [f"{row['fits'][v][f'rank_{k}']} {tuple(row['fits'][v][f'interval_{k}'])}" for v in variants]
            real = " / ".join(f"{row['fits'][v][f'realised_{k}']:.4f}" for v in variants)
            lines.append(f"| {row['layer']} | {row['head']} | {k} | {row['truncation'][k]} | " + " | ".join(cells)
                         + f" | {real} |")
    lines += ["", "| variant | ε | equal to the reference | mean abs. difference | sufficient | within | both | "
                  "heads settled | mean iterations (last rank) | seconds |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        fits = [row["fits"][v] for row in rows]
        for e in TOLERANCES:
            k = f"{e:g}"
            ref = [f[f"rank_{k}"] for f in refs]
            got = [f[f"rank_{k}"] for f in fits]
            suff = [f[f"realised_{k}"] <= e for f in fits]
            within = [f[f"rank_{k}"] <= row["truncation"][k] for f, row in zip(fits, rows)]
            lines.append(f"| {v} | {k} | {sum(a == b for a, b in zip(got, ref))} / {len(rows)} | "
                         f"{np.mean(np.abs(np.subtract(got, ref))):.2f} | {sum(suff)} | {sum(within)} | "
                         f"{sum(a and b for a, b in zip(suff, within))} | {sum(f['settled'] for f in fits)} | "
                         f"{np.mean([f['iterations'] for f in fits]):.0f} | {sum(f['seconds'] for f in fits):.0f} |")
    return "\n".join(lines)


def figure(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    x = np.arange(len(rows))
    labels = [f"{r['layer']}:{r['head']}" for r in rows]
    for ax, e in zip(axes, TOLERANCES):
        k = f"{e:g}"
        for v, marker, dx in zip(VARIANTS, ("o", "s", "v", "^"), (-0.3, -0.1, 0.1, 0.3)):
            if v not in rows[0]["fits"]:
                continue
            ax.plot(x + dx, [r["fits"][v][f"rank_{k}"] for r in rows], marker, label=v, ms=6)
        ax.plot(x, [r["truncation"][k] for r in rows], "k_", ms=14, mew=2, label="truncation rank")
        ax.set_xticks(x, labels, rotation=60)
        ax.set_title(f"r*({e:.0%}) of MiniLM heads (layer:head)")
        ax.set_xlabel("head")
    axes[0].set_ylabel("rank")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure written to {path}")


def _rows(path):
    if not path:
        return None
    with open(path) as fh:
        return json.load(fh)["rows"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default=DEFAULT_HEADS, help="layer:head,layer:head,...")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=500)
    p.add_argument("--n-held", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("benchmarks", "out", "factored_convergence.json"))
    p.add_argument("--figure", default=None, help="PNG of the readings (default: OUT with .png)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from OUT.partial.jsonl")
    p.add_argument("--replot", metavar="JSON", help="print the tables and draw the figure of an earlier run")
    p.add_argument("--variants", default="plain,scaled,reference",
                   help="the fits to run, of plain,scaled,short,reference")
    p.add_argument("--scaled-memory", type=int, default=None,
                   help="factored_scaled_memory of the scaled and reference fits (default: the calibration's)")
    p.add_argument("--reference", metavar="JSON", default=None,
                   help="compare with the reference fits of an earlier run of the same heads (without --variants "
                        "reference)")
    args = p.parse_args()
    fig_path = args.figure or os.path.splitext(args.replot or args.out)[0] + ".png"
    if args.replot:
        with open(args.replot) as fh:
            rows = json.load(fh)["rows"]
        print(summary(rows, _rows(args.reference)))
        figure(rows, fig_path)
        return
    variants = tuple(v for v in args.variants.split(",") if v)
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants takes some of {','.join(VARIANTS)}; got {args.variants!r}")
    if "reference" not in variants and not args.reference:
        p.error("without the reference fit give --reference JSON, an earlier run's rows to compare with")
    from rstar.heads import load_minilm, text_windows

    model, tok = load_minilm()
    pairs = [tuple(int(v) for v in item.split(":")) for item in args.heads.split(",")]
    pairs.sort()   # a layer's heads together: its tokens are read once
    windows = text_windows(tok, args.seq_len, args.n_samples + args.n_held, random_state=args.seed)
    heads = layer_reader(model, windows, args.n_samples)
    record = dict(heads=args.heads, seq_len=args.seq_len, n_samples=args.n_samples, n_held=args.n_held,
                  seed=args.seed, variants=list(variants), scaled_memory=args.scaled_memory)
    journal = Journal(args.out + ".partial.jsonl", record, args.resume, len(pairs))
    rows = []
    for layer, h in pairs:
        row = journal.step(f"{layer}:{h}", lambda: dict(layer=layer, **head_row(*heads(layer, h), args.seed, variants,
                                                                     args.scaled_memory)))
        rows.append(row)
        print(f"layer {layer} head {h}: " + "; ".join(
            f"{v} r*(1%) {row['fits'][v]['rank_0.01']} r*(5%) {row['fits'][v]['rank_0.05']} "
            f"({row['fits'][v]['iterations']} it, {row['fits'][v]['seconds']:.0f} s)" for v in row["fits"]), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(vars(args), rows=rows), fh, indent=1)
    print()
    print(summary(rows, _rows(args.reference)))
    figure(rows, fig_path)
    print(f"\nrows written to {args.out}")


if __name__ == "__main__":
    main()
