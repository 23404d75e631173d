"""Data-only estimates on the paper's tasks, and how long fit takes.

Prints, for every estimator, the rank it returns on the issue's reference
tasks (Table 1 linear proxy; linear QK with unknown V; softmax; pure noise)
and the wall time of ``fit`` at n=2000, T=64, d=32. Times are medians of
``--repeat`` runs in this process; compare ratios, not absolute seconds, on
a shared machine.

    python benchmarks/data_only.py [--repeat 3]
"""

import argparse
import time
import warnings

import numpy as np

from rstar import (
    EnergyRankEstimator,
    MPRankEstimator,
    NumericalRankEstimator,
    RStarEstimator,
    SoftmaxInversionEstimator,
)
from rstar.datasets import make_attention_task, make_linear_proxy


def tasks():
    rng = np.random.default_rng(0)
    Xn = rng.standard_normal((1000, 32, 12))
    yield "Table 1 proxy (T=16,d=12,r*=3,n=1000)", "linear_proxy", make_linear_proxy(1000, random_state=0), 3
    yield ("linear QK, V unknown (T=64,d=32,r*=4,n=2000)", "linear_qk",
           make_attention_task(2000, kind="linear_qk", seq_len=64, n_features=32, rank=4, random_state=1), 4)
    yield ("softmax (T=32,d=16,r*=3,scale 2,n=2000)", "softmax",
           make_attention_task(2000, seq_len=32, n_features=16, rank=3, logit_scale=2.0, random_state=2), 3)
    yield "pure noise (T=32,d=12,n=1000)", None, (Xn, 0.05 * rng.standard_normal((1000, 32, 12))), 0


def estimators(operator):
    ops = [operator] if operator else ["linear_proxy", "linear_qk", "softmax"]
    for op in ops:
        for cls in (NumericalRankEstimator, MPRankEstimator, EnergyRankEstimator, RStarEstimator):
            yield f"{cls.__name__}({op})", cls(operator=op)
        if op == "softmax":
            yield "SoftmaxInversionEstimator()", SoftmaxInversionEstimator()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("## Data-only rank on the reference tasks\n")
    print("| task | estimator | r* | rank_ | effective_rank_ |")
    print("|---|---|---|---|---|")
    for name, op, (X, Y), r in tasks():
        for ename, est in estimators(op):
            est.fit(X, Y)
            print(f"| {name} | {ename} | {r} | {est.rank_} | {est.effective_rank_:.3f} |")
    print("\n## fit time, n=2000, T=64, d=32, d_v=32 (median of %d)\n" % args.repeat)
    X, Y = make_attention_task(2000, kind="linear_qk", seq_len=64, n_features=32, rank=4, random_state=1)
    print("| estimator | seconds |")
    print("|---|---|")
    for ename, est in estimators(None):
        if ename.startswith(("NumericalRank", "EnergyRank")):
            continue
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            est.fit(X, Y)
            times.append(time.perf_counter() - t0)
        print(f"| {ename} | {np.median(times):.2f} |")


if __name__ == "__main__":
    main()
