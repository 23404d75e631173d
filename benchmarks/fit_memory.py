"""What a factored least-squares fit holds beyond the samples its memory budget counts.

``memory_budget`` counts the samples a least-squares inversion keeps (``8 n T (d + d_v)`` bytes); the fit's working
arrays come on top. This measures them on a planted softmax head (Gaussian tokens, rank 4 or ``--rank``, 10% noise,
V known, ``tolerance=0.01``: the fit, its risk curve and its class check, whose offset modulation uses as many
query-key directions as the fit counts: real heads' fits count 20-32), each back-end in its own process:

- ``traced``: the peak of ``tracemalloc`` over the fit (numpy's allocations, not torch's), above what was traced
  before it (the data);
- ``resident``: the process's peak resident set size (``ru_maxrss``) over the fit, above its resident size when
  the fit starts (the data loaded from ``.npy`` files, read in place, and torch imported where the fit uses it):
  what the whole fit added, torch's tensors included.

With ``--rotary D_HEAD`` the planted head is a causal rotary one (a Llama-family head: RoPE at the frequencies
``10000^(-2p / D_HEAD)``, D_HEAD = ``--value-dim`` wide, its query-key width ``--rank``:
:func:`rstar.datasets.make_attention_task` with ``causal=True, rotary=...``), fitted as
``rstar heads`` fits them (``causal=True``, ``rotary=``, ``max_rank=D_HEAD``, V known, ``tolerance=0.01``): the
largest sizes issue 39 names (d = 2048, T = 512, d_head = 128).

Usage::

    python benchmarks/fit_memory.py [--n-samples 2000] [--seq-len 32] [--n-features 256] [--rank 4]
                                    [--devices cpu,auto] [--rotary D_HEAD]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import warnings

import numpy as np


def _peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _resident_mib():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(folder, device):
    """One fit on the saved task, in this process: its memory figures (MiB) as a dict."""
    import tracemalloc

    from rstar import RStarEstimator

    import time

    X, Y, V = (np.load(os.path.join(folder, f"{name}.npy")) for name in ("X", "Y", "V"))
    params = dict(value_map=V, device=device, tolerance=0.01)
    if os.path.exists(os.path.join(folder, "theta.npy")):
        from rstar import RotaryPositions

        rot = RotaryPositions.from_frequencies(np.load(os.path.join(folder, "theta.npy")), X.shape[1])
        params.update(causal=True, rotary=rot, max_rank=V.shape[1])
    if device != "cpu":
        import torch  # noqa: F401  (imported before the baseline, as a fit on torch would)
    before = _resident_mib()
    if _peak_mib() > before + 16:   # the peak over the fit must be the fit's own
        raise RuntimeError(f"the process peaked at {_peak_mib():.0f} MiB before the fit ({before:.0f} MiB now)")
    tracemalloc.start()
    traced_before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = RStarEstimator(**params).fit(X, Y)
    seconds = time.perf_counter() - started
    traced = (tracemalloc.get_traced_memory()[1] - traced_before) / 2**20
    tracemalloc.stop()
    return dict(device=device, inversion=est.inversion_, rank=int(est.rank_), traced_mib=round(traced, 1),
                interval=[int(v) for v in est.rank_interval_], seconds=round(seconds, 1),
                warned=any(w.category.__name__ == "UnidentifiableRankWarning" for w in caught),
                resident_mib=round(_peak_mib() - before, 1), samples_mib=round((X.nbytes + Y.nbytes) / 2**20, 1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-samples", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-features", type=int, default=256)
    p.add_argument("--value-dim", type=int, default=32)
    p.add_argument("--rank", type=int, default=4, help="the planted head's query-key rank")
    p.add_argument("--devices", default="cpu,auto", help="comma-separated: cpu (numpy), auto (torch), cuda")
    p.add_argument("--rotary", type=int, default=None, metavar="D_HEAD",
                   help="plant a causal rotary head D_HEAD wide (V of d x D_HEAD: --value-dim is set to it)")
    p.add_argument("--measure", nargs=2, metavar=("FOLDER", "DEVICE"), help=argparse.SUPPRESS)
    p.add_argument("--make", metavar="FOLDER", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    if args.rotary is not None:
        args.value_dim = args.rotary
    if args.make:
        from rstar import RotaryPositions
        from rstar.datasets import make_attention_task

        rotary = theta = None
        if args.rotary is not None:   # RoPE's frequencies over a head of D_HEAD coordinates
            theta = 10000.0 ** (-2.0 * np.arange(args.rotary // 2) / args.rotary)
            rotary = RotaryPositions.from_frequencies(theta, args.seq_len)
        X, Y, teacher = make_attention_task(args.n_samples, seq_len=args.seq_len, n_features=args.n_features,
                                            value_dim=args.value_dim, rank=args.rank, noise=0.1, random_state=0,
                                            causal=rotary is not None, rotary=rotary, return_teacher=True)
        arrays = [("X", X), ("Y", Y), ("V", teacher["value_map"])] + ([] if theta is None else [("theta", theta)])
        for name, array in arrays:
            np.save(os.path.join(args.make, f"{name}.npy"), array)
        return
    with tempfile.TemporaryDirectory() as tmp:
        # the task drawn in a process of its own: a child process starts with its parent's peak resident size
        subprocess.run([sys.executable, __file__, "--make", tmp, "--n-samples", str(args.n_samples), "--seq-len",
                        str(args.seq_len), "--n-features", str(args.n_features), "--value-dim",
                        str(args.value_dim), "--rank", str(args.rank)]
                       + ([] if args.rotary is None else ["--rotary", str(args.rotary)]), check=True)
        what = "" if args.rotary is None else f"a causal rotary head (d_head = {args.rotary}), "
        print(f"n = {args.n_samples}, T = {args.seq_len}, d = {args.n_features}, d_v = {args.value_dim}, {what}planted "
              f"rank {args.rank}, V known, "
              "tolerance 1%; each fit in its own process\n")
        print("| device | inversion | rank (interval, warned) | seconds | samples | traced peak above the data | "
              "resident peak above the data |")
        print("|---|---|---|---|---|---|---|")
        for device in args.devices.split(","):
            out = subprocess.run([sys.executable, __file__, "--measure", tmp, device], capture_output=True,
                                 text=True)
            if out.returncode:
                sys.exit(f"the {device} fit failed: {out.stderr.strip().splitlines()[-1]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            s = row["samples_mib"]
            print(f"| {device} | {row['inversion']} | {row['rank']} ({row['interval'][0]}, {row['interval'][1]}"
                  f"{', warned' if row['warned'] else ''}) | {row['seconds']} | {s} MiB | {row['traced_mib']} MiB "
                  f"({row['traced_mib'] / s:.2f}x) | {row['resident_mib']} MiB ({row['resident_mib'] / s:.2f}x) |")


if __name__ == "__main__":
    main()
