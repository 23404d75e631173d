"""Every data-only estimator at the edges of real sizes: d = 768 with T = 8, and T = 512 with d = 384.

Real tokens, not Gaussian draws: all-MiniLM-L6-v2's hidden states on English text (the ``minilm`` extra; nothing
is downloaded). d = 384 is its width; for d = 768 each token is the concatenation of its layer-0 and layer-3
hidden states (both LayerNorm'd, anisotropic, with MiniLM's outlier features), the width of BERT-base and
GPT-2. A rank-r kernel is planted (logits of standard deviation 2), the value map is layer 0 head 0's W_V
(stacked twice at d = 768), and Y carries 5% Gaussian noise, as in ``benchmarks/real_heads.py``.

Each estimator is fitted once per shape with its default budgets; a row records the time, the peak traced
memory (``tracemalloc``: every numpy allocation of the fit), the inversion that ran, ``rank_``,
``rank_interval_`` and the outcome for the softmax operator: *exact*, *warned* (an ``UnidentifiableRankWarning``
and an interval that covers r) or *wrong*. An exception (MemoryError, LinAlgError, ...) is a row too.

Usage::

    python benchmarks/real_sizes.py [--rank 8] [--out benchmarks/out/real_sizes] [--threads 1]
                                    [--shapes 8x768x2000,512x384x200]   # T x d x n
"""

import argparse
import json
import os
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

import numpy as np

from rstar.paper.experiments import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_heads import _outcome, planted_task  # noqa: E402  (the same kernels and outcomes as real_heads.py)


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--shapes", default="8x768x2000,512x384x200", help="comma-separated T x d x n")
    p.add_argument("--out", default="benchmarks/out/real_sizes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--estimators", default=None, help="comma-separated names of the rows to run (default: all)")
    return p.parse_args()


def real_tokens(model, tok, T, d, n, seed=0):
    """(X, V): MiniLM hidden states of n windows of T tokens, d = 384 (layer 0) or 768 (layers 0 and 3)."""
    from rstar.heads import collect_attention, text_windows

    windows = text_windows(tok, T, n, random_state=seed)
    if d == 384:
        layer = collect_attention(model, windows, layers=[0])[0]
        return layer.X, layer.head(0).value_map()[:-1]
    if d == 768:
        l0, l3 = collect_attention(model, windows, layers=[0, 3])
        V = l0.head(0).value_map()[:-1]
        return np.concatenate([l0.X, l3.X], axis=-1), np.concatenate([V, V], axis=0) / np.sqrt(2)
    raise ValueError("d is 384 or 768 here")


def estimators(V):
    from rstar import (EnergyRankEstimator, MPRankEstimator, NumericalRankEstimator, RStarEstimator,
                       SoftmaxInversionEstimator)

    return [
        ("RStarEstimator()", "softmax", lambda: RStarEstimator()),
        ("RStarEstimator(value_map=V)", "softmax", lambda: RStarEstimator(value_map=V)),
        ("SoftmaxInversionEstimator()", "softmax", lambda: SoftmaxInversionEstimator()),
        ("SoftmaxInversionEstimator(value_map=V)", "softmax", lambda: SoftmaxInversionEstimator(value_map=V)),
        ("MPRankEstimator('softmax')", "softmax", lambda: MPRankEstimator("softmax")),
        ("EnergyRankEstimator('softmax')", "softmax", lambda: EnergyRankEstimator("softmax")),
        ("NumericalRankEstimator('softmax')", "softmax", lambda: NumericalRankEstimator("softmax")),
        ("RStarEstimator('linear_qk')", "linear_qk", lambda: RStarEstimator("linear_qk")),
        ("MPRankEstimator('linear_proxy')", "linear_proxy", lambda: MPRankEstimator("linear_proxy")),
    ]


def fit_row(name, operator, make, X, Y, r):
    est = make()
    tracemalloc.start()
    t0 = time.perf_counter()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(X, Y)
        except Exception as exc:  # a row, not a crash: the table must show it
            error = f"{type(exc).__name__}: {str(exc)[:120]}"
    secs = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    row = dict(T=X.shape[1], d=X.shape[2], n=X.shape[0], r=r, estimator=name, seconds=round(secs, 1),
               peak_mib=round(peak), warnings=sorted({w.category.__name__ for w in caught}))
    if error:
        row.update(rank=None, interval=None, inversion=None, outcome="error: " + error)
        return row
    outcome = _outcome(est, caught, r) if operator == "softmax" else "(other model class)"
    row.update(rank=int(est.rank_), interval=[int(v) for v in est.rank_interval_], inversion=est.inversion_,
               outcome=outcome)
    return row


def main():
    args = _args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from threadpoolctl import threadpool_limits

    from rstar.heads import load_minilm

    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    model, tok = load_minilm()
    keep = None if args.estimators is None else set(args.estimators.split(","))
    rows = []
    with threadpool_limits(limits=args.threads):
        for shape in args.shapes.split(","):
            T, d, n = (int(v) for v in shape.split("x"))
            X, V = real_tokens(model, tok, T, d, n)
            Y = planted_task(X, V, args.rank)
            data_mib = (X.nbytes + Y.nbytes) / 2**20
            print(f"T={T} d={d} n={n}: X and Y {data_mib:.0f} MiB", flush=True)
            for name, operator, make in estimators(V):
                if keep is not None and name not in keep:
                    continue
                row = fit_row(name, operator, make, X, Y, args.rank)
                row["data_mib"] = round(data_mib)
                rows.append(row)
                print(f"  {name:40s} r_hat={row['rank']!s:5s} {str(row['interval']):12s} "
                      f"{row['inversion']!s:32s} {row['outcome']:8s} {row['seconds']:7.1f} s "
                      f"{row['peak_mib']:6d} MiB", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(command=sys.argv, rank=args.rank, rows=rows, elapsed_s=time.perf_counter() - t_all)
    (out / "real_sizes.json").write_text(json.dumps(payload, indent=1))
    table = markdown_table(rows, ["T", "d", "n", "r", "estimator", "rank", "interval", "inversion", "outcome",
                                  "seconds", "peak_mib", "data_mib"])
    (out / "real_sizes.md").write_text(table + "\n")
    print("\n" + table)
    print(f"\n[{time.perf_counter() - t_all:.0f} s; wrote {out}/]")


if __name__ == "__main__":
    main()
