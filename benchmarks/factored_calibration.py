"""Calibration of the factored least squares' split-half test: null directions against the half-difference.

For each task (Gaussian tokens, softmax attention with a planted rank r*, 5% noise) ``RStarEstimator`` runs the
factored least squares (``memory_budget`` set so that the d^2 x d^2 information does not fit, as at real
sizes) and the script records, from the fitted statistic (``statistic_``), the ratio of the half-sum's first
null singular value (index r*) to the half-difference's largest — the quantity the calibration's
``split_half_margin`` and ``split_half_noise_edge`` (:mod:`rstar.calibration`) must clear — and the weakest
planted direction's ratio.

Usage::

    python benchmarks/factored_calibration.py [--seeds 8] [--out benchmarks/out/factored_calibration]
"""

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from rstar import RStarEstimator
from rstar.datasets import make_attention_task
from rstar.paper.experiments import markdown_table
from rstar.calibration import DEFAULT_CALIBRATION

SHAPES = ((8, 48, 600), (16, 96, 600))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--ranks", default="0,2")
    p.add_argument("--out", default="benchmarks/out/factored_calibration")
    args = p.parse_args()
    rows = []
    t_all = time.perf_counter()
    for T, d, n in SHAPES:
        for r in (int(v) for v in args.ranks.split(",")):
            for seed in range(args.seeds):
                X, Y, teacher = make_attention_task(n, seq_len=T, n_features=d, value_dim=8, rank=r, noise=0.05,
                                                    random_state=seed, return_teacher=True)
                for known in (True, False):
                    est = RStarEstimator(value_map=teacher.value_map if known else None,
                                         memory_budget=12 * d**4)   # the information (8 d^4 bytes) over half of it
                    t0 = time.perf_counter()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        est.fit(X, Y)
                    secs = time.perf_counter() - t0
                    if est.inversion_ != "softmax_factored_least_squares":
                        raise SystemExit(f"expected the factored inversion, got {est.inversion_}")
                    s = np.sqrt(np.maximum(est.spectrum_, 0.0))
                    edge = float(np.sqrt(est.statistic_.null.null_eigenvalues[0]))
                    row = dict(T=T, d=d, n=n, r=r, seed=seed, V="known" if known else "unknown",
                               rank=int(est.rank_), interval=list(est.rank_interval_),
                               null_ratio=round(float(s[r] / edge), 4),
                               weakest_signal_ratio=round(float(s[r - 1] / edge), 2) if r else None,
                               q=int(est.statistic_.null.fitted_rank), seconds=round(secs, 2),
                               warnings=sorted({w.category.__name__ for w in caught}))
                    rows.append(row)
                    print(row, flush=True)
    nulls = np.array([row["null_ratio"] for row in rows])
    signals = np.array([row["weakest_signal_ratio"] for row in rows if row["weakest_signal_ratio"] is not None])
    summary = [dict(fits=len(rows), null_ratio_median=float(np.median(nulls)), null_ratio_max=float(nulls.max()),
                    noise_edge=DEFAULT_CALIBRATION.split_half_noise_edge, margin=DEFAULT_CALIBRATION.split_half_margin,
                    nulls_above_edge=int(np.sum(nulls > DEFAULT_CALIBRATION.split_half_noise_edge)),
                    weakest_signal_min=float(signals.min()) if signals.size else None,
                    exact=sum(row["rank"] == row["r"] for row in rows))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "factored_calibration.json").write_text(json.dumps(dict(command=sys.argv, rows=rows, summary=summary,
                                                                   elapsed_s=time.perf_counter() - t_all), indent=1))
    md = markdown_table(summary, list(summary[0]))
    (out / "factored_calibration.md").write_text(md + "\n\n" + markdown_table(rows, list(rows[0])) + "\n")
    print("\n" + md)
    print(f"\n[{time.perf_counter() - t_all:.0f} s; wrote {out}/]")


if __name__ == "__main__":
    main()
