"""How much the rotary least squares depends on its start scale (``Calibration.rotary_start_logit_std``).

Planted rotary heads of width r in {0, 2, 4} (Gaussian tokens, causal, ``make_attention_task(rotary=...)``, value
map known) are fitted with the start's logit standard deviation at 0.01, 0.03, 0.1 (the default), 0.3 and 1; the
table gives each reading and its interval (``w``: warned) and the fit's time.

Usage::

    python benchmarks/rotary_start_scale.py [--d 16] [--seq-len 12] [--planes 4] [--n-samples 3000] [--seeds 2]
"""

import argparse
import time
import warnings

import numpy as np

SCALES = (0.01, 0.03, 0.1, 0.3, 1.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=12)
    parser.add_argument("--planes", type=int, default=4)
    parser.add_argument("--n-samples", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    from rstar import RotaryPositions, RStarEstimator
    from rstar.calibration import DEFAULT_CALIBRATION
    from rstar.datasets import make_attention_task

    P, T = args.planes, args.seq_len
    pos = RotaryPositions.from_frequencies(10000.0 ** -(np.arange(P) / P), T)
    print("| width | seed | " + " | ".join(f"start {s:g}" for s in SCALES) + " |")
    print("|---|---|" + "---|" * len(SCALES))
    exact = total = 0
    for width in (0, 2, 4):
        for seed in range(args.seeds):
            X, Y, teacher = make_attention_task(args.n_samples, seq_len=T, n_features=args.d, rank=width,
                                                causal=True, rotary=pos, value_dim=8, random_state=seed,
                                                return_teacher=True)
            cells = []
            for s in SCALES:
                cal = DEFAULT_CALIBRATION.replace(rotary_start_logit_std=s)
                t0 = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    est = RStarEstimator(rotary=pos, causal=True, value_map=teacher.value_map, calibration=cal,
                                         random_state=seed).fit(X, Y)
                lo, hi = (int(v) for v in est.rank_interval_)
                exact += int(est.rank_ == width and (lo, hi) == (width, width))
                total += 1
                cells.append(f"{est.rank_} ({lo}, {hi}){' w' if caught else ''}, {time.perf_counter() - t0:.0f} s")
            print(f"| {width} | {seed} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n{exact} of {total} readings exact.")


if __name__ == "__main__":
    main()
