"""The floor the cross-fitted risk curve subtracts, and how far the curve's point estimate falls from the realised
excess of the fit's own model on other windows.

The factored and rotary least squares measure each rank's excess as ``RSS(r) / TSS - risk_curve_floor_``, both
sums out of sample (each half's model scored on the other half). The floor is then the unconstrained model's
*held-out* risk, which carries that model's estimation error; the same models on their own halves
(``risk_curve_floor_in_sample_``) fit better than the best model. In expectation the best model's risk lies
between the two, so the curve may understate the excess by up to their difference. On a real head, which
reproduces itself exactly (no noise), the best model's risk is 0, and that difference is all estimation error.

For each head asked for: the fit as the tables fit it (V known, ``tolerance=0.01``, ``max_rank=d_head``,
``device="auto"``; SmolLM2's heads rotary and causal) on ``--n-samples``
windows, and on ``--n-held`` other windows the realised excess of ``predict(X, rank=r*(eps))`` over the head's
own output, relative to Var(Y), with its standard error over windows. Beside it three predictions of it at that
rank: the curve's point estimate (``risk_curve_``, against the held-out floor), the same against the in-sample
floor (``+ floor - floor_in_sample``: an upper end in expectation), and against their midpoint. The summary
counts, per prediction, the readings within two standard errors (the curve's and the realised one's combined)
of the realised excess, and those short of it or over it by more. With ``--curves`` each row also keeps the
head's curves and, at every rank, the realised excess of the fit's model and of the head's truncation (held out,
and on the fitted windows), and a second table reads r*(ε) by the fit's rule and with the floor moved to the
midpoint or the in-sample side, judged as ``rotary_real_heads.py`` judges (sufficient, within the truncation rank):
what a rule that accounts for the floor would read, without refitting (``--replot`` prints both tables again).

Usage::

    python benchmarks/curve_floor.py --model smollm2 --heads 2:2,4:4,7:7,10:1,15:6,21:3,25:7,29:2
    python benchmarks/curve_floor.py --model minilm --heads 0:0,1:3,1:8,2:5,3:7
    python benchmarks/curve_floor.py --model smollm2 --heads 0:0,1:1,...,29:2 --curves --out results/curve_floor_diag.json
    python benchmarks/curve_floor.py --replot results/curve_floor_diag.json

Each head is a step of a journal (``OUT.partial.jsonl``): the time left is printed after each, and an interrupted
run continues with ``--resume`` (same options).
"""

import argparse
import json
import os
import time
import warnings

import numpy as np

from _runs import Journal, layer_reader, load_model

TOLERANCES = (0.01, 0.05)
PREDICTIONS = ("held-out floor (the curve)", "midpoint floor", "in-sample floor")


def fit_head(fit, held, rotary, seed, full_curves=False):
    """One head's row: its fit's floors, and per tolerance the rank, the three predictions and the realised excess
    of the fit's own model on the held-out windows."""
    from rstar import RStarEstimator

    kw = dict(rotary=fit.rotary, causal=True) if rotary else {}
    est = RStarEstimator(value_map=fit.value_map(), tolerance=TOLERANCES[0], max_rank=fit.d_head,
                         device="auto", random_state=seed, **kw)
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(fit.features(), fit.Y)
        ranks = [int(est.rank_at_tolerance(e)) for e in TOLERANCES]
    seconds = time.perf_counter() - t
    floor, floor_in = float(est.risk_curve_floor_), est.risk_curve_floor_in_sample_
    Yh = held.Y.reshape(-1, held.Y.shape[-1])
    tss = float(np.sum((Yh - Yh.mean(axis=0)) ** 2))
    curve, se = np.asarray(est.risk_curve_), np.asarray(est.risk_curve_se_)
    readings = []
    for e, r in zip(TOLERANCES, ranks):
        err = np.sum((held.Y - est.predict(held.features(), rank=r)) ** 2, axis=(1, 2))
        k = min(r, curve.size - 1)
        gap = 0.0 if floor_in is None else floor - float(floor_in)
        readings.append(dict(tolerance=e, rank=r, realised=float(err.sum() / tss),
                             realised_se=float(np.sqrt(err.size) * err.std(ddof=1) / tss),
                             predicted=[float(curve[k]), float(curve[k] + gap / 2), float(curve[k] + gap)],
                             predicted_se=float(se[k])))
    curves = {}
    if full_curves:
        # every rank's realised excess of the fit's model on the held-out windows, the head's own truncation there
        # and on the fitted windows: enough to judge any rule read off these curves without refitting
        from rstar.heads import kernel_truncation_curve

        curves = dict(risk_curve=curve.tolist(), risk_curve_se=se.tolist(),
                      risk_curve_upper=np.asarray(est.risk_curve_upper_).tolist(),
                      realised=[float(np.sum((held.Y - est.predict(held.features(), rank=r)) ** 2) / tss)
                                for r in range(fit.d_head + 1)],
                      held_out_truncation=[float(v) for v in kernel_truncation_curve(held)],
                      fitted_truncation=[float(v) for v in kernel_truncation_curve(fit)])
    return dict(head=int(fit.head), floor=floor, **curves,
                floor_in_sample=None if floor_in is None else float(floor_in),
                resolution=est.risk_curve_resolution_, readings=readings, seconds=seconds,
                warned=sorted({type(w.message).__name__ for w in caught}))


def summary(rows):
    """Markdown: per head its floors and readings; per tolerance and prediction the readings within two standard
    errors of the realised excess, and below it by more."""
    lines = ["| layer | head | floor held out / in sample | ε | rank | realised ± se | the curve | midpoint floor | "
             "in-sample floor |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for rd in row["readings"]:
            floor_in = "—" if row["floor_in_sample"] is None else f"{row['floor_in_sample']:.2g}"
            lines.append(f"| {row['layer']} | {row['head']} | {row['floor']:.2g} / {floor_in} | {rd['tolerance']:g} | "
                         f"{rd['rank']} | {rd['realised']:.4f} ± {rd['realised_se']:.4f} | "
                         + " | ".join(f"{p:.4f}" for p in rd["predicted"]) + " |")
    lines += ["", "| ε | prediction | within 2 se | short of the realised by more | over it by more | "
                  "median realised / predicted |",
              "|---|---|---|---|---|---|"]
    for e in TOLERANCES:
        rds = [rd for row in rows for rd in row["readings"] if rd["tolerance"] == e]
        for i, name in enumerate(PREDICTIONS):
            z = [(rd["realised"] - rd["predicted"][i]) / max(np.hypot(rd["realised_se"], rd["predicted_se"]),
                                                            np.finfo(float).tiny) for rd in rds]
            ratio = np.median([rd["realised"] / rd["predicted"][i] for rd in rds if rd["predicted"][i] > 0])
            lines.append(f"| {e:g} | {name} | {sum(abs(v) <= 2 for v in z)} / {len(z)} | "
                         f"{sum(v > 2 for v in z)} | {sum(v < -2 for v in z)} | {ratio:.2f} |")
    return "\n".join(lines)


def rules_summary(rows):
    """Markdown: r*(ε) read by the fit's rule (its curve's upper bound against the held-out floor) and by the same
    bound moved up by half the floor's gap and by all of it, on the rows kept with ``--curves``: sufficient where
    the fit's own model or the head's truncation at that width holds out at most ε, within where no larger than
    the head's truncation rank on the fitted windows."""
    from scipy.stats import norm

    from rstar.risk import rank_at_tolerance

    z = norm.ppf(0.95)
    rows = [r for r in rows if "risk_curve" in r]
    lines = ["| ε | rule | widths summed | sufficient (fit's model / truncation / either) | within | both |",
             "|---|---|---|---|---|---|"]
    for e in TOLERANCES:
        for name, share in (("the fit's (held-out floor)", 0.0), ("+ gap / 2 (midpoint floor)", 0.5),
                            ("+ gap (in-sample floor)", 1.0)):
            total = fit_ok = trunc_ok = either = within = both = 0
            for r in rows:
                gap = 0.0 if r["floor_in_sample"] is None else r["floor"] - r["floor_in_sample"]
                point = np.asarray(r["risk_curve"]) + share * gap + z * np.asarray(r["risk_curve_se"])
                upper = np.maximum(np.asarray(r["risk_curve_upper"]), point)
                d = len(r["realised"]) - 1
                k = rank_at_tolerance(upper, e)
                k = d if k is None else min(k, d)
                held_trunc = r["held_out_truncation"][min(k, len(r["held_out_truncation"]) - 1)]
                trunc_rank = rank_at_tolerance(r["fitted_truncation"], e)
                a, b = r["realised"][k] <= e, held_trunc <= e
                w = k <= (d if trunc_rank is None else trunc_rank)
                total, fit_ok, trunc_ok, either = total + k, fit_ok + a, trunc_ok + b, either + (a or b)
                within, both = within + w, both + ((a or b) and w)
            lines.append(f"| {e:g} | {name} | {total} | {fit_ok} / {trunc_ok} / {either} of {len(rows)} | "
                         f"{within} | {both} |")
    return "\n".join(lines)


def _save(out, args, rows):
    """The rows so far (rewritten after each head: an interrupted run keeps what it did)."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump(dict(vars(args), rows=rows), fh, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "minilm"))
    p.add_argument("--heads", help="layer:head,layer:head,...")
    p.add_argument("--replot", metavar="JSON", help="print the tables of an earlier run's rows instead")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=500)
    p.add_argument("--n-held", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curves", action="store_true",
                   help="also keep each head's curves and, at every rank, the realised excess of the fit's model and "
                        "the head's truncation (held out and fitted): rules can then be judged without refitting")
    p.add_argument("--out", default=None, help="JSON of the rows (default: benchmarks/out/curve_floor_MODEL.json)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from OUT.partial.jsonl (the same options and heads)")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as fh:
            rows = json.load(fh)["rows"]
        print(summary(rows))
        if any("risk_curve" in r for r in rows):
            print()
            print(rules_summary(rows))
        return
    if not (args.model and args.heads):
        p.error("give --model and --heads (or --replot JSON)")
    from rstar.heads import text_windows

    model, tok = load_model(args.model)
    pairs = [tuple(int(v) for v in item.split(":")) for item in args.heads.split(",")]
    out = args.out or os.path.join("benchmarks", "out", f"curve_floor_{args.model}.json")
    windows = text_windows(tok, args.seq_len, args.n_samples + args.n_held, random_state=args.seed)
    heads, rows = layer_reader(model, windows, args.n_samples), []
    # one journal step per head: the time left after each, and --resume continues where a run stopped
    record = dict(model=args.model, heads=args.heads, seq_len=args.seq_len, n_samples=args.n_samples,
                  n_held=args.n_held, seed=args.seed, curves=bool(args.curves))
    journal = Journal(out + ".partial.jsonl", record, args.resume, len(pairs))
    for layer, h in pairs:
        row = journal.step(f"{layer}:{h}", lambda: dict(
            layer=layer, **fit_head(*heads(layer, h), args.model == "smollm2", args.seed, args.curves)))
        rows.append(row)
        _save(out, args, rows)
        print(f"layer {layer} head {h}: floor {row['floor']:.3g} held out, {row['floor_in_sample']:.3g} in sample; "
              + "; ".join(f"r*({rd['tolerance']:g}) = {rd['rank']}: realised {rd['realised']:.4f}, predicted "
                          + " / ".join(f"{v:.4f}" for v in rd["predicted"]) for rd in row["readings"])
              + f" ({row['seconds']:.0f} s)", flush=True)
    print()
    print(summary(rows))
    if args.curves:
        print()
        print(rules_summary(rows))
    print(f"\nrows written to {out}")


if __name__ == "__main__":
    main()
