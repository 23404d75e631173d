"""Calibration of RStarEstimator's p-values and rank_interval_ on null (r* = 0) tasks.

For each null regime, fits ``RStarEstimator`` at alpha = 0.01 on
``--tasks`` independent pure-noise data sets and prints how often ``rank_``,
the strict and the lenient ends of ``rank_interval_`` are above 0, and how the
first sequential p-value is distributed (a calibrated p-value is uniform:
P(p < 0.1) = 0.1, P(p < 0.5) = 0.5). The estimator's default level
``rstar.calibration.DEFAULT_CALIBRATION.rstar_alpha`` (0.003) is too small for 1000 tasks to
resolve its tails, so the levels are checked at 1%; the column "rank_ > 0 at
the default" is P(p₀ < rstar_alpha), the false-alarm rate of the default
estimator (``rank_ > 0`` exactly when the first p-value is below alpha). The regimes are those of
``tests/rules/test_intervals.py::NULL_TASKS``, plus linear QK with a known V
(the least-squares inversion, tested in ``tests/inversions/test_query_key_least_squares.py``)
and softmax least squares at T = d, with Student-t tokens and with a known V.

Usage::

    python benchmarks/null_calibration.py              # 1000 tasks per regime
    python benchmarks/null_calibration.py --tasks 200
    python benchmarks/null_calibration.py --only softmax
"""

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402

from rstar import RStarEstimator  # noqa: E402
from rstar.datasets import make_attention_task, make_linear_proxy  # noqa: E402
from rstar.calibration import DEFAULT_CALIBRATION  # noqa: E402

RSTAR_ALPHA = DEFAULT_CALIBRATION.rstar_alpha

def _known_v(task):
    X, Y, teacher = task
    return X, Y, teacher.value_map


REGIMES = {
    "linear proxy, residual σ² (T=12, d=8, n=200)":
        ("linear_proxy", lambda s: make_linear_proxy(200, seq_len=12, n_features=8, rank=0, random_state=s)),
    "linear proxy, bulk σ² (T=12, d=8, n=60 < T·d)":
        ("linear_proxy", lambda s: make_linear_proxy(60, seq_len=12, n_features=8, rank=0, random_state=s)),
    "linear QK, residual σ² (T=24, d=8, n=150)":
        ("linear_qk", lambda s: make_attention_task(150, kind="linear_qk", seq_len=24, n_features=8, rank=0,
                                                    random_state=s)),
    "linear QK, T < d (T=6, d=8, n=150)":
        ("linear_qk", lambda s: make_attention_task(150, kind="linear_qk", seq_len=6, n_features=8, rank=0,
                                                    random_state=s)),
    "linear QK, T = d (T=8, d=8, n=150)":
        ("linear_qk", lambda s: make_attention_task(150, kind="linear_qk", seq_len=8, n_features=8, rank=0,
                                                    random_state=s)),
    "linear QK, T > d, d_v < d (T=12, d=8, d_v=4, n=150)":
        ("linear_qk", lambda s: make_attention_task(150, kind="linear_qk", seq_len=12, n_features=8, value_dim=4,
                                                    rank=0, random_state=s)),
    "linear QK, V known, T < d (T=6, d=8, n=150)":
        ("linear_qk", lambda s: _known_v(make_attention_task(150, kind="linear_qk", seq_len=6, n_features=8, rank=0,
                                                             random_state=s, return_teacher=True))),
    "linear QK, V known, T = d (T=16, d=16, n=300)":
        ("linear_qk", lambda s: _known_v(make_attention_task(300, kind="linear_qk", seq_len=16, n_features=16,
                                                             rank=0, random_state=s, return_teacher=True))),
    "softmax least squares (T=24, d=8, n=150)":
        ("softmax", lambda s: make_attention_task(150, kind="softmax", seq_len=24, n_features=8, rank=0,
                                                  random_state=s)),
    "softmax least squares, T = d (T=8, d=8, n=150)":
        ("softmax", lambda s: make_attention_task(150, kind="softmax", seq_len=8, n_features=8, rank=0,
                                                  random_state=s)),
    "softmax least squares, Student-t tokens (T=16, d=8, n=150)":
        ("softmax", lambda s: make_attention_task(150, kind="softmax", seq_len=16, n_features=8, rank=0,
                                                  token_distribution="student_t", random_state=s)),
    "softmax least squares, V known (T=16, d=8, d_v=4, n=150)":
        ("softmax", lambda s: _known_v(make_attention_task(150, kind="softmax", seq_len=16, n_features=8, value_dim=4,
                                                           rank=0, random_state=s, return_teacher=True))),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000, help="null data sets per regime (default 1000)")
    parser.add_argument("--only", default="", help="run only the regimes whose name contains this text")
    args = parser.parse_args(argv)
    print("| null regime (RStarEstimator) | tasks | rank_ > 0 (α = 1%) | p₀ < 0.1 | p₀ < 0.5 | "
          f"lower > 0 (α/10) | upper > 0 (10α) | rank_ > 0 at the default α = {100 * RSTAR_ALPHA:g}% | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (operator, make) in REGIMES.items():
        if args.only not in name:
            continue
        t0 = time.perf_counter()
        ranks, p0, lo, hi = [], [], [], []
        for seed in range(args.tasks):
            X, Y, *V = make(seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                est = RStarEstimator(operator, value_map=V[0] if V else None, alpha=0.01).fit(X, Y)
            ranks.append(est.rank_)
            p0.append(est.p_values_[0])
            lo.append(est.rank_interval_[0])
            hi.append(est.rank_interval_[1])
        ranks, p0, lo, hi = map(np.asarray, (ranks, p0, lo, hi))
        pct = lambda x: f"{100 * np.mean(x):.1f}%"  # noqa: E731
        print(f"| {name} | {args.tasks} | {pct(ranks > 0)} | {pct(p0 < 0.1)} | {pct(p0 < 0.5)} | {pct(lo > 0)} | "
              f"{pct(hi > 0)} | {pct(p0 < RSTAR_ALPHA)} | {time.perf_counter() - t0:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
