"""Exact-recovery rate on softmax teachers with V unknown: first order against least squares.

A 96-task grid: T in {16, 32, 64}, d in {8, 16, 32} with T > d, r* in
{0, 1, 3, 5}, logit scale in {1, 2, 4, 6}, n = 1000 (seed 0). Each task is
read by the paper's first-order inversion (``SoftmaxInversionEstimator()``)
and by ``RStarEstimator()`` (least squares on the model itself, first order
beyond its budget). Prints every miss with its whitened spectrum (in units of
the fitted noise level), the rate per logit scale and the fit times.

    python benchmarks/softmax_first_order.py
"""

import itertools
import time
import warnings

import numpy as np

from rstar import RStarEstimator, SoftmaxInversionEstimator
from rstar.datasets import make_attention_task

ESTIMATORS = {"first order": SoftmaxInversionEstimator, "RStar (least squares)": RStarEstimator}


def main(n_samples=1000, seed=0):
    warnings.simplefilter("ignore")
    hits = {name: {} for name in ESTIMATORS}
    seconds = {name: 0.0 for name in ESTIMATORS}
    for T, d, r, scale in itertools.product([16, 32, 64], [8, 16, 32], [0, 1, 3, 5], [1, 2, 4, 6]):
        if T <= d:
            continue
        X, Y = make_attention_task(n_samples, seq_len=T, n_features=d, rank=r, logit_scale=scale,
                                   random_state=seed)
        for name, cls in ESTIMATORS.items():
            t0 = time.perf_counter()
            est = cls().fit(X, Y)
            seconds[name] += time.perf_counter() - t0
            hits[name].setdefault(scale, []).append(est.rank_ == r)
            if est.rank_ != r:
                lam = np.round(est.spectrum_[: r + 3] / est.noise_variance_, 2)
                print(f"miss ({name}): T={T} d={d} r*={r} logit={scale}: rank_={est.rank_}, "
                      f"spectrum/noise={lam}")
    names = list(ESTIMATORS)
    print("\n| logit scale | tasks | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for scale in sorted(hits[names[0]]):
        rates = " | ".join(f"{np.mean(hits[name][scale]):.3f}" for name in names)
        print(f"| {scale} | {len(hits[names[0]][scale])} | {rates} |")
    print("\nfit time (s): " + ", ".join(f"{name} {seconds[name]:.0f}" for name in names))


if __name__ == "__main__":
    main()
