"""The floor the cross-fitted risk curve subtracts, and how far the curve's point estimate falls from the realised
excess of the fit's own model on other windows.

The factored and rotary least squares measure each rank's excess as ``RSS(r) / TSS - risk_curve_floor_``, both
sums out of sample (each half's model scored on the other half). The floor is then the unconstrained model's
*held-out* risk, which carries that model's estimation error; the same models on their own halves
(``risk_curve_floor_in_sample_``) fit better than the best model. In expectation the best model's risk lies
between the two, so the curve may understate the excess by up to their difference. On a real head, which
reproduces itself exactly (no noise), the best model's risk is 0, and that difference is all estimation error.

For each head asked for: the fit as the tables fit it (V known, ``tolerance=0.01``, ``max_rank=d_head``; SmolLM2's
heads rotary and causal, MiniLM's with ``device="auto"`` as ``rstar heads`` runs them) on ``--n-samples``
windows, and on ``--n-held`` other windows the realised excess of ``predict(X, rank=r*(eps))`` over the head's
own output, relative to Var(Y), with its standard error over windows. Beside it three predictions of it at that
rank: the curve's point estimate (``risk_curve_``, against the held-out floor), the same against the in-sample
floor (``+ floor - floor_in_sample``: an upper end in expectation), and against their midpoint. The summary
counts, per prediction, the readings within two standard errors (the curve's and the realised one's combined)
of the realised excess, and those below it by more.

Usage::

    python benchmarks/curve_floor.py --model smollm2 --heads 4:4,10:1,15:6,21:3,25:7,29:2
    python benchmarks/curve_floor.py --model minilm --heads 0:0,1:3,1:8,2:5,3:7
"""

import argparse
import json
import os
import time
import warnings

import numpy as np

TOLERANCES = (0.01, 0.05)
PREDICTIONS = ("held-out floor (the curve)", "midpoint floor", "in-sample floor")


def fit_head(fit, held, rotary, seed):
    """One head's row: its fit's floors, and per tolerance the rank, the three predictions and the realised excess
    of the fit's own model on the held-out windows."""
    from rstar import RStarEstimator

    kw = dict(rotary=fit.rotary, causal=True) if rotary else dict(device="auto")
    est = RStarEstimator(value_map=fit.value_map(), tolerance=TOLERANCES[0], max_rank=fit.d_head,
                         random_state=seed, **kw)
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
    return dict(head=int(fit.head), floor=floor,
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "minilm"), required=True)
    p.add_argument("--heads", required=True, help="layer:head,layer:head,...")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=500)
    p.add_argument("--n-held", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON of the rows (default: benchmarks/out/curve_floor_MODEL.json)")
    args = p.parse_args()
    from rstar.heads import collect_attention, load_minilm, text_windows

    if args.model == "smollm2":
        from rotary_truncation import load_smollm2
        model, tok = load_smollm2()
    else:
        model, tok = load_minilm()
    pairs = [tuple(int(v) for v in item.split(":")) for item in args.heads.split(",")]
    windows = text_windows(tok, args.seq_len, args.n_samples + args.n_held, random_state=args.seed)
    rows, read = [], {}
    for layer, h in pairs:
        if read.get("index") != layer:
            read = dict(index=layer, fit=collect_attention(model, windows[:args.n_samples], layers=[layer])[0],
                        held=collect_attention(model, windows[args.n_samples:], layers=[layer])[0])
        row = dict(layer=layer, **fit_head(read["fit"].head(h), read["held"].head(h), args.model == "smollm2",
                                          args.seed))
        rows.append(row)
        print(f"layer {layer} head {h}: floor {row['floor']:.3g} held out, {row['floor_in_sample']:.3g} in sample; "
              + "; ".join(f"r*({rd['tolerance']:g}) = {rd['rank']}: realised {rd['realised']:.4f}, predicted "
                          + " / ".join(f"{v:.4f}" for v in rd["predicted"]) for rd in row["readings"])
              + f" ({row['seconds']:.0f} s)", flush=True)
    print()
    print(summary(rows))
    out = args.out or os.path.join("benchmarks", "out", f"curve_floor_{args.model}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump(dict(vars(args), rows=rows), fh, indent=1)
    print(f"\nrows written to {out}")


if __name__ == "__main__":
    main()
