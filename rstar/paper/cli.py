"""``rstar reproduce``: the paper's experiments from the command line (:mod:`rstar.paper.experiments`).

The subcommand's parser and runner; :mod:`rstar.cli` only mounts them beside the library's own subcommands.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from .experiments import EXPERIMENTS

__all__ = ["add_reproduce_parser", "reproduce", "versions"]


def add_reproduce_parser(subparsers):
    """Add the ``reproduce`` subcommand to an ``argparse`` subparsers object."""
    rep = subparsers.add_parser("reproduce", help="run the paper's experiments and write tables, figures and JSON",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         description="Reproduce the paper's tables (theory §3) with trained students and the "
                                     "data-only estimators.")
    rep.add_argument("what", nargs="?", default="all", choices=list(EXPERIMENTS) + ["all"],
                     help="which experiment")
    rep.add_argument("--quick", action="store_true",
                     help="small configuration (all four in under 3 minutes on 2 CPU cores)")
    rep.add_argument("--device", default="auto",
                     help="torch device for the students: auto (CUDA if available), cpu, cuda, cuda:1 ...")
    rep.add_argument("--out", default="rstar-out", help="output folder")
    rep.add_argument("--seed", type=int, default=0, help="base random seed")
    rep.add_argument("--threads", type=int, default=None,
                     help="CPU threads for torch and for numpy/scipy's BLAS (None: $OMP_NUM_THREADS if set, "
                          "else 1: these models are small, and two threads stall each other on a busy machine)")
    rep.add_argument("--verbose", "-v", action="count", default=0, help="show training progress bars")
    return rep


def versions():
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in ("numpy", "scipy", "sklearn", "torch", "matplotlib"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    from .. import __version__

    out["rstar"] = __version__
    return out

def _save_figure(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print(f"(matplotlib is not installed: {path.name} not written; pip install \"rstar[plot]\")")
        return None
    fig = result.plot()
    fig.savefig(path, dpi=110)
    return path

def _default_threads():
    try:
        value = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return 1
    return value if value >= 1 else 1

def reproduce(args):
    threads = _default_threads() if args.threads is None else args.threads
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}.")
    from threadpoolctl import threadpool_limits  # a scikit-learn dependency

    with threadpool_limits(limits=threads):  # BLAS / OpenMP of numpy and scipy (data-only estimators)
        return _run_all(args, threads)

def _run_all(args, threads):
    from .experiments import EXPERIMENTS, run_experiment

    names = list(EXPERIMENTS) if args.what == "all" else [args.what]
    try:
        import torch
    except ImportError:
        pass  # the first student reports the missing torch
    else:
        torch.set_num_threads(threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    results = {}
    mode = "quick" if args.quick else "full"
    for name in names:
        print(f"\n## {name} ({mode}, device={args.device}, seed={args.seed}, threads={threads})\n", flush=True)
        res = run_experiment(name, quick=args.quick, device=args.device, random_state=args.seed,
                             verbose=args.verbose)
        print(res.to_markdown())
        png = _save_figure(res, out / f"{name}.png")
        payload = res.to_dict()
        (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
        results[name] = payload
        print(f"\n[{name}: {res.elapsed:.1f} s; wrote {out / (name + '.json')}" + (f", {png}" if png else "") + "]",
              flush=True)
    total = time.perf_counter() - t_all
    (out / "results.json").write_text(json.dumps(
        {"command": sys.argv, "mode": mode, "device": args.device, "seed": args.seed, "threads": threads,
         "elapsed_s": total,
         "versions": versions(), "experiments": results}, indent=1))
    print(f"\nTotal: {total:.1f} s. Results in {out}/")
    return 0
