"""How far a head's risk curve moves from one fit to another, against the standard errors the fit reports.

The factored and rotary least squares measure each rank's excess on the two halves of the windows, each half
scored by the model fitted on the other. ``risk_curve_se_`` is the curve's sampling error over windows with the
models held fixed; ``risk_curve_fit_se_`` adds the models' own variability, from the difference between the two
halves' excess (one degree of freedom; :func:`rstar.risk.excess_risk_fit_standard_error`). Which one describes a
refit is measured here: each head is fitted ``--refits`` times, on as many disjoint sets of ``--n-samples`` text
windows (V known, ``tolerance=0.01``, ``max_rank=d_head``, SmolLM2's heads rotary and causal), and every pair of
fits is set against each other at the ranks that matter (those where the first fit's curve lies between
``--low`` and ``--high`` of Var(Y), around r*(1%) and r*(5%)): a pair agrees within two standard errors where
``|c_a(r) - c_b(r)| <= 2 hypot(se_a(r), se_b(r))``. Errors that describe a refit agree on about 95% of the pairs.

Usage::

    python benchmarks/curve_fit_error.py --model smollm2 --heads 16:0,17:3 --refits 4
    python benchmarks/curve_fit_error.py --replot benchmarks/out/curve_fit_error_smollm2.json

Each fit is a step of a journal (``OUT.partial.jsonl``): the time left is printed after each, and an interrupted
run continues with ``--resume`` (the same options).
"""

import argparse
import itertools
import json
import os
import time
import warnings

import numpy as np

from _runs import Journal, load_model


def fit_curve(head, rotary, seed):
    """One fit's curve, its two standard errors and its floors (ranks 0 ... d_head)."""
    from rstar import RStarEstimator

    kw = dict(rotary=head.rotary, causal=True) if rotary else {}
    est = RStarEstimator(value_map=head.value_map(), tolerance=0.01, max_rank=head.d_head, device="auto",
                         random_state=seed, **kw)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(head.features(), head.Y)
    k = head.d_head + 1
    return dict(risk_curve=np.asarray(est.risk_curve_)[:k].tolist(),
                risk_curve_se=np.asarray(est.risk_curve_se_)[:k].tolist(),
                risk_curve_fit_se=np.asarray(est.risk_curve_fit_se_)[:k].tolist(),
                floor=float(est.risk_curve_floor_), seconds=time.perf_counter() - t)


def pair_agreement(fits, low, high):
    """Per error (``risk_curve_se``, ``risk_curve_fit_se``): the pairs of fits and ranks compared, those within
    two standard errors, the median ratio of the spread over the refits to the error, and the ranks compared."""
    first = np.asarray(fits[0]["risk_curve"])
    n = min(len(f["risk_curve"]) for f in fits)
    ranks = [r for r in range(n) if low <= first[r] <= high]
    out = {}
    for key in ("risk_curve_se", "risk_curve_fit_se"):
        z = [abs(a["risk_curve"][r] - b["risk_curve"][r]) / max(np.hypot(a[key][r], b[key][r]), np.finfo(float).tiny)
             for a, b in itertools.combinations(fits, 2) for r in ranks]
        spread = [np.std([f["risk_curve"][r] for f in fits], ddof=1) for r in ranks]
        error = [np.sqrt(np.mean([f[key][r] ** 2 for f in fits])) for r in ranks]
        out[key] = dict(pairs=len(z), within=int(sum(v <= 2 for v in z)),
                        ratio=float(np.median([s / max(e, np.finfo(float).tiny) for s, e in zip(spread, error)]))
                        if ranks else float("nan"))
    out["ranks"] = ranks
    return out


def summary(rows, low, high):
    """Markdown: per head, the ranks compared and, per error, the pairs within two of it and the median ratio of
    the refits' spread to it; then all heads together."""
    lines = ["| layer | head | ranks compared | over samples (risk_curve_se): pairs within 2 se · spread / se | "
             "with the fits' variability (risk_curve_fit_se): pairs within 2 se · spread / se |",
             "|---|---|---|---|---|"]
    total = {k: [0, 0] for k in ("risk_curve_se", "risk_curve_fit_se")}
    for row in rows:
        agree = pair_agreement(row["fits"], low, high)
        ranks = agree["ranks"]
        cells = []
        for key in total:
            a = agree[key]
            total[key][0] += a["within"]
            total[key][1] += a["pairs"]
            cells.append(f"{a['within']} / {a['pairs']} · {a['ratio']:.2f}")
        span = f"{ranks[0]}–{ranks[-1]}" if ranks else "—–—"
        lines.append(f"| {row['layer']} | {row['head']} | {span} | " + " | ".join(cells) + " |")
    lines.append("| all | | | " + " | ".join(f"{w} / {p} ({100 * w / max(p, 1):.0f}%)" for w, p in total.values())
                 + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "minilm"))
    p.add_argument("--heads", help="layer:head,layer:head,...")
    p.add_argument("--refits", type=int, default=4, help="fits per head, each on its own windows (at least 2)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--low", type=float, default=0.005, help="the ranks compared: the first fit's curve from here")
    p.add_argument("--high", type=float, default=0.1, help="... up to here")
    p.add_argument("--replot", metavar="JSON", help="print the table of an earlier run's rows instead")
    p.add_argument("--out", default=None, help="JSON of the rows (default: benchmarks/out/curve_fit_error_MODEL.json)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from OUT.partial.jsonl")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as fh:
            saved = json.load(fh)
        print(summary(saved["rows"], saved.get("low", args.low), saved.get("high", args.high)))
        return
    if not (args.model and args.heads):
        p.error("give --model and --heads (or --replot JSON)")
    if args.refits < 2:
        p.error("--refits must be at least 2: a spread needs two fits")
    if not 0 <= args.low < args.high:
        p.error("--low must be at least 0 and below --high")
    from rstar.heads import collect_attention, text_windows

    model, tok = load_model(args.model)
    pairs = [tuple(int(v) for v in item.split(":")) for item in args.heads.split(",")]
    out = args.out or os.path.join("benchmarks", "out", f"curve_fit_error_{args.model}.json")
    windows = text_windows(tok, args.seq_len, args.refits * args.n_samples, random_state=args.seed)
    sets = [windows[i * args.n_samples:(i + 1) * args.n_samples] for i in range(args.refits)]
    record = dict(model=args.model, heads=args.heads, refits=args.refits, seq_len=args.seq_len,
                  n_samples=args.n_samples, seed=args.seed)
    journal = Journal(out + ".partial.jsonl", record, args.resume, len(pairs) * args.refits)
    read = {}

    def head(layer, h, i):
        # a layer's attention on one window set, read once for its heads (inside the step: its time counts)
        if read.get("key") != (layer, i):
            read.clear()
            read.update(key=(layer, i), layer=collect_attention(model, sets[i], layers=[layer])[0])
        return read["layer"].head(h)

    rows = []
    for layer, h in pairs:
        fits = [journal.step(f"{layer}:{h}:{i}", lambda i=i: fit_curve(head(layer, h, i), args.model == "smollm2",
                                                                        args.seed + i))
                for i in range(args.refits)]
        rows.append(dict(layer=layer, head=h, fits=fits))
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as fh:
            json.dump(dict(vars(args), rows=rows), fh, indent=1)
        print(f"layer {layer} head {h}: " + ", ".join(f"{f['seconds']:.0f} s" for f in fits), flush=True)
    print()
    print(summary(rows, args.low, args.high))
    print(f"\nrows written to {out}")


if __name__ == "__main__":
    main()
