"""Readings off a curve measured against an unsettled fit: which the held-out reach vouches for, and which it warns.

A noise-free real head gives the factored least squares no noise floor to settle on: about a third of MiniLM's
heads reach the iteration cap at q = d_head with their split-half count still moving (``factored_unsettled``).
r*(ε) is then read off a curve measured against that fit, and the gate ``curve_against_unidentified_fit`` doubts
it: the full model the curve subtracts may fall short, so the reading may be too small. Where the curve is
cross-fitted, the rank read holds the tolerance on its own held-out risk — the curve's upper bound plus the floor it
subtracts, with the floor's own margin (:func:`rstar.risk.held_out_reach`) — or it does not; where it does, r*(ε)
is at most that rank whatever the full model was, and the gate lets the reading stand.

For each MiniLM head asked for (T = 32, ``--n-samples`` fitted windows, as the README's ``rstar heads`` command;
V known, ``tolerance=0.01``, ``max_rank=d_head``, ``device="auto"``), the readings at 1% and 5% with their
intervals and the reasons they are warned for, the held-out reach, the realised excess of ``predict(X, rank=r)``
on ``--n-held`` other windows (sufficient: at most ε) and the head's truncation rank on the fitted windows (within:
the reading no larger). The summary counts them by group: settled fits unwarned or warned (by any gate), unsettled
fits whose reading the held-out reach vouches for ("unsettled, not warned"), and unsettled fits still warned (by
that gate or another). Sufficiency is that of ``predict``'s model (the halves' mean), which the reading's upper
bound also covers (its distance from the curve's models). The default
heads are the 31 whose readings an earlier run of ``rstar heads`` warned (22 of them for the unsettled fit alone)
and 12 others.

Usage::

    python benchmarks/held_out_reach.py [--heads 0:2,0:4,...] [--out benchmarks/out/held_out_reach.json] [--resume]

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
#: the heads whose readings an earlier `rstar heads --model minilm --seq-len 32 --n-samples 500` run warned, then 12
DEFAULT_HEADS = ("0:2,0:4,0:5,0:6,0:9,1:1,1:4,1:5,1:6,1:7,1:8,1:9,1:10,1:11,2:0,2:2,2:3,2:8,2:9,2:11,3:7,4:3,4:9,"
                 "5:1,5:2,5:3,5:4,5:5,5:7,5:9,5:10,0:0,0:1,1:0,1:2,2:1,2:5,3:0,3:1,3:5,4:0,4:5,5:6")
GROUPS = ("settled, not warned", "settled, warned", "unsettled, not warned", "unsettled, warned")


def _reasons(caught):
    return sorted({getattr(w.message, "reason", type(w.message).__name__) for w in caught})


def head_row(head, held):
    """One head's fit, readings and their held-out check."""
    from rstar import RStarEstimator
    from rstar.heads import truncation_rank
    from rstar.risk import floor_margin, held_out_reach

    est = RStarEstimator(device="auto", tolerance=min(TOLERANCES), value_map=head.value_map(), max_rank=head.d_head)
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(head.features(), head.Y)
    in_sample = est.risk_curve_floor_in_sample_   # None where the fit fell back from the factored least squares
    row = dict(head=head.head, seconds=round(time.perf_counter() - started, 1), fit_reasons=_reasons(caught),
               inversion=est.inversion_, floor=float(est.risk_curve_floor_),
               floor_in_sample=None if in_sample is None else float(in_sample),
               floor_se=None if est.risk_curve_floor_se_ is None else float(est.risk_curve_floor_se_))
    # the reach as the fit's gates read it: the floor with its own margin at the curve's level
    margin = floor_margin(est.risk_curve_floor_se_, est.tolerance_level)
    Y = held.Y
    tss = float(np.sum((Y - Y.reshape(-1, Y.shape[2]).mean(axis=0)) ** 2))
    for tol in TOLERANCES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rank, interval = est.rank_at_tolerance(tol, return_interval=True)
        excess = float(np.sum((est.predict(held.features(), rank=rank) - Y) ** 2)) / tss
        row[f"{tol:g}"] = dict(rank=int(rank), interval=[int(v) for v in interval], reasons=_reasons(caught),
                               reach=held_out_reach(est.risk_curve_upper_, est.risk_curve_floor_,
                                                    est.risk_curve_floor_in_sample_, tol, margin),
                               held_out=excess, truncation=int(truncation_rank(head, tol)))
    return row


def group(row, tol):
    """The row's group at ``tol`` (:data:`GROUPS`)."""
    settled = "factored_unsettled" not in row["fit_reasons"]
    warned = bool(row[f"{tol:g}"]["reasons"])
    return GROUPS[(0 if settled else 2) + int(warned)]


def summary(rows):
    """Markdown: per tolerance and group, the heads, and how many are sufficient, within, both."""
    lines = ["| ε | group | heads | sufficient held out | within the truncation rank | both |",
             "|---|---|---|---|---|---|"]
    for tol in TOLERANCES:
        for name in GROUPS:
            these = [r[f"{tol:g}"] for r in rows if group(r, tol) == name]
            if not these:
                continue
            suff = [v["held_out"] <= tol for v in these]
            within = [v["rank"] <= v["truncation"] for v in these]
            lines.append(f"| {tol:.0%} | {name} | {len(these)} | {sum(suff)} | {sum(within)} | "
                         f"{sum(s and w for s, w in zip(suff, within))} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default=DEFAULT_HEADS, help="layer:head pairs, comma-separated")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=500, help="windows each head is fitted on")
    p.add_argument("--n-held", type=int, default=300, help="other windows the readings are checked on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/out/held_out_reach.json")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    from rstar.heads import load_minilm, text_windows

    model, tok = load_minilm()
    pairs = sorted(tuple(int(v) for v in item.split(":")) for item in args.heads.split(","))
    windows = text_windows(tok, args.seq_len, args.n_samples + args.n_held, random_state=args.seed)
    heads = layer_reader(model, windows, args.n_samples)
    record = dict(heads=args.heads, seq_len=args.seq_len, n_samples=args.n_samples, n_held=args.n_held,
                  seed=args.seed)
    journal = Journal(args.out + ".partial.jsonl", record, args.resume, len(pairs))
    rows = []
    for layer, h in pairs:
        row = journal.step(f"{layer}:{h}", lambda: dict(layer=layer, **head_row(*heads(layer, h))))
        rows.append(row)
        print(f"layer {layer} head {h}: " + "; ".join(
            f"r*({tol:.0%}) {row[f'{tol:g}']['rank']} {tuple(row[f'{tol:g}']['interval'])}, held out "
            f"{row[f'{tol:g}']['held_out']:.4f}, {group(row, tol)}" for tol in TOLERANCES), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(vars(args), rows=rows), fh, indent=1)
    print()
    print(summary(rows))
    print(f"\nrows written to {args.out}")


if __name__ == "__main__":
    main()
