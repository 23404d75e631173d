"""Whole-model time with heads fitted at once: ``estimate_heads(n_jobs=...)`` against one head after another.

The heads of a model are independent fits, each bound by its loss evaluations (a MiniLM head at T = 32, n = 500:
about 1600 of them, each a few products of the 16 000 tokens with d x 2q factors). One fit gains little from a
second thread (1.36 times on MiniLM, where the bare products at its shapes gain 2.3 times: the rest of an iteration
does not spread); several heads at once, each in its own worker process with ``cores / n_jobs`` threads, use the
cores without that loss. This measures it on the heads asked for, with the
README's settings (T = 32, n = 500, ε = 1% and 5%, the default estimator: torch on the CPU's threads, CUDA where
present), once per ``--n-jobs`` value, in one run (so the times compare on shared cores):

- the wall-clock time of all the heads and the heads per minute;
- the summed per-head times (the heads' own ``seconds``: with k at once each takes longer, on fewer threads);
- the readings (``rank``, ``rank_at_0.01``, ``rank_at_0.05``) of each run against the first: the same fits, so
  they should agree (float32 sums on other thread counts may move a reading at a tie).

Usage::

    python benchmarks/heads_parallel.py [--model minilm|smollm2] [--layers 1] [--heads 0,1,2,3,4,5]
                                        [--n-jobs 1,2] [--out benchmarks/out/heads_parallel.json]
"""

import argparse
import json
import os
import platform
import time

from _runs import load_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="minilm", choices=["minilm", "smollm2"])
    p.add_argument("--layers", default="1", help="comma-separated layers")
    p.add_argument("--heads", default="0,1,2,3,4,5", help="comma-separated heads of each layer (all: every head)")
    p.add_argument("--n-jobs", default="1,2", help="comma-separated n_jobs values, the first the reference")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("benchmarks", "out", "heads_parallel.json"))
    args = p.parse_args(argv)
    from rstar.heads import collect_attention, estimate_heads, text_windows

    model, tok = load_model(args.model)
    layers = [int(v) for v in args.layers.split(",")]
    windows = text_windows(tok, args.seq_len, args.n_samples, random_state=args.seed)
    t = time.perf_counter()
    collected = collect_attention(model, windows, layers=layers)
    if args.heads != "all":
        collected = [layer.select_heads([int(v) for v in args.heads.split(",")]) for layer in collected]
    read_s = time.perf_counter() - t
    n_heads = sum(len(list(layer.heads())) for layer in collected)
    print(f"{n_heads} heads of layers {args.layers} read in {read_s:.1f} s ({os.cpu_count()} cores)", flush=True)
    runs = []
    for jobs in (int(v) for v in args.n_jobs.split(",")):
        t = time.perf_counter()
        table = estimate_heads(collected, n_jobs=jobs)
        wall = time.perf_counter() - t
        rows = table.to_dict("records")
        runs.append(dict(n_jobs=jobs, wall_s=wall, summed_head_s=float(sum(r["seconds"] for r in rows)),
                         readings=[[int(r["layer"]), int(r["head"]), int(r["rank"]), int(r["rank_at_0.01"]),
                                    int(r["rank_at_0.05"])] for r in rows]))
        print(f"n_jobs={jobs}: {wall:.1f} s for {n_heads} heads", flush=True)
    ref = runs[0]
    print("\n| n_jobs | wall (s) | heads / min | speed-up | summed head time (s) | readings equal to n_jobs="
          f"{ref['n_jobs']} |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        same = sum(a == b for a, b in zip(run["readings"], ref["readings"]))
        print(f"| {run['n_jobs']} | {run['wall_s']:.1f} | {60 * n_heads / run['wall_s']:.2f} | "
              f"{ref['wall_s'] / run['wall_s']:.2f} | {run['summed_head_s']:.1f} | {same}/{n_heads} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(vars(args), cores=os.cpu_count(), machine=platform.processor() or platform.machine(),
                       read_s=read_s, runs=runs), fh, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
