"""Time the trained students of one full reproduction on the GPU and on the CPU, side by side.

Runs the experiments of ``rstar reproduce`` (default: Table 1, full
configuration — 3 seeds x (9 ranks + 1 over-parameterised) = 30 B0 students
on n=2000, T=16, d=12) once per device, with identical seeds, and reports for
each device the students' fit time (wall time of ``fit`` summed: the Adam loop
and the measurement of the learned operator's rank), their epochs, the time
per epoch, the experiment's wall time and the results (so that both devices
can be checked to tell the same story). The CPU side uses ``--threads``
(default as ``rstar reproduce``: ``$OMP_NUM_THREADS`` or 1).

Sized to finish within 5 minutes on one GPU machine with ``--experiments
table1`` (the default); ``--experiments table1 table2 table3 frontier``
times every training of ``rstar reproduce all``. When no GPU is present the
script says so and times the CPU only.

Usage::

    python benchmarks/students_gpu.py                   # Table 1, full size
    python benchmarks/students_gpu.py --experiments table1 table3 --quick
    python benchmarks/students_gpu.py --out benchmarks/out/gpu.json

Writes a JSON of every number (default ``benchmarks/out/students_gpu.json``).
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402

from rstar.cli import _default_threads  # noqa: E402
from rstar.paper.experiments import run_experiment  # noqa: E402


def _devices(torch):
    devs = []
    if torch.cuda.is_available():
        devs.append("cuda")
    devs.append("cpu")
    return devs


def _time_one(name, device, quick, seed, torch):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = run_experiment(name, quick=quick, device=device, random_state=seed)
    wall = time.perf_counter() - t0
    students = [r for r in res.records if r.get("estimator") in ("AttentionStudent", "student")]
    # table experiments record the student's wall fit time; the frontier records cross_validate's fit_time
    train = float(sum(r["fit_time"] for r in students))
    epochs = int(sum(r.get("n_epochs", 0) for r in students))
    key = [(r.get("rank_param"), r.get("kind", r.get("operator")), round(r.get("risk_ratio", r.get("test_r2", 0)), 3),
            r["rank_"]) for r in students]
    return dict(experiment=name, device=device, n_students=len(students), epochs=epochs, train_s=train,
                ms_per_epoch=1e3 * train / epochs if epochs else None, wall_s=wall, outcome=key)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", nargs="+", default=["table1"],
                        choices=["table1", "table2", "table3", "frontier"])
    parser.add_argument("--quick", action="store_true", help="quick configurations instead of the full ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for the CPU side (default: as `rstar reproduce`: $OMP_NUM_THREADS or 1)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "students_gpu.json"))
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print('torch is not installed: pip install "rstar[torch]"', file=sys.stderr)
        return 2

    torch.set_num_threads(_default_threads() if args.threads is None else args.threads)
    devices = _devices(torch)
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, threads=torch.get_num_threads(),
                cpu_count=os.cpu_count(), platform=platform.platform(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    if "cuda" not in devices:
        print("No CUDA GPU is available: timing the CPU only.")
    else:
        print(f"GPU: {info['gpu']}; timing CUDA and CPU side by side.")
        torch.ones(1, device="cuda")  # initialise the CUDA context outside the timed region
    print(f"torch {info['torch']}, {info['threads']} CPU threads, {info['cpu_count']} cores; "
          f"{'quick' if args.quick else 'full'} configuration of {', '.join(args.experiments)}\n")
    rows = []
    for name in args.experiments:
        for dev in devices:
            row = _time_one(name, dev, args.quick, args.seed, torch)
            rows.append(row)
            print(f"{name:9s} {dev:5s}: {row['n_students']:3d} students, {row['epochs']:6d} epochs, training "
                  f"{row['train_s']:8.1f} s ({row['ms_per_epoch']:.2f} ms/epoch), wall {row['wall_s']:8.1f} s",
                  flush=True)
        if len(devices) == 2:
            gpu, cpu = rows[-2], rows[-1]
            same = [a[1:] == b[1:] for a, b in zip(gpu["outcome"], cpu["outcome"])]
            print(f"{name:9s} CPU/GPU training-time ratio {cpu['train_s'] / gpu['train_s']:.2f}x; "
                  f"same (rank_, rounded risk) on both devices for {int(np.sum(same))}/{len(same)} students")
    print("\n| experiment | device | students | epochs | training s | ms / epoch | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['experiment']} | {r['device']} | {r['n_students']} | {r['epochs']} | {r['train_s']:.1f} | "
              f"{r['ms_per_epoch']:.2f} | {r['wall_s']:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(info=info, quick=args.quick, rows=rows), indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
