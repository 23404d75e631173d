"""The ``rstar`` console script.

``rstar reproduce [table1|table2|table3|frontier|all] [--quick] [--device DEV] [--out DIR] [--seed N]
[--threads N]``
runs the paper's experiments (:mod:`rstar.experiments`), prints each table
as markdown and writes, into DIR (default ``rstar-out``), one PNG figure and
one JSON file (every number measured) per experiment, plus ``results.json``
for the whole invocation. ``--threads`` (default: ``$OMP_NUM_THREADS`` if set,
else 1) sets the CPU threads of torch and of numpy/scipy's BLAS.

``rstar demo`` estimates r* of a small softmax-attention task from data alone.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _parser():
    from .experiments import EXPERIMENTS

    parser = argparse.ArgumentParser(prog="rstar", description="Intrinsic rank r* of attention tasks.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("reproduce", help="run the paper's experiments and write tables, figures and JSON",
                         description="Reproduce the paper's tables (theory §3) with trained students and the "
                                     "data-only estimators.")
    rep.add_argument("what", nargs="?", default="all", choices=list(EXPERIMENTS) + ["all"],
                     help="which experiment (default: all)")
    rep.add_argument("--quick", action="store_true",
                     help="small configuration (all four in under 3 minutes on 2 CPU cores)")
    rep.add_argument("--device", default="auto",
                     help="torch device for the students: auto (CUDA if available), cpu, cuda, cuda:1 ...")
    rep.add_argument("--out", default="rstar-out", help="output folder (default: rstar-out)")
    rep.add_argument("--seed", type=int, default=0, help="base random seed (default: 0)")
    rep.add_argument("--threads", type=int, default=None,
                     help="CPU threads for torch and for numpy/scipy's BLAS (default: $OMP_NUM_THREADS if set, "
                          "else 1: these models are small, and two threads stall each other on a busy machine)")
    rep.add_argument("--verbose", "-v", action="count", default=0, help="show training progress bars")
    demo = sub.add_parser("demo", help="estimate r* of a small softmax-attention task from data alone")
    demo.add_argument("--seed", type=int, default=0)
    return parser


def _versions():
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in ("numpy", "scipy", "sklearn", "torch", "matplotlib"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    from . import __version__

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


def _reproduce(args):
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
         "versions": _versions(), "experiments": results}, indent=1))
    print(f"\nTotal: {total:.1f} s. Results in {out}/")
    return 0


def _demo(args):
    from . import RStarEstimator
    from .datasets import make_attention_task

    X, Y, teacher = make_attention_task(1000, kind="softmax", seq_len=16, n_features=12, rank=3,
                                        random_state=args.seed, return_teacher=True)
    t0 = time.perf_counter()
    est = RStarEstimator().fit(X, Y)
    print(f"softmax attention task: n=1000, T=16, d=12, true r* = {teacher.rank}")
    print(f"RStarEstimator (data only, V unknown): r_hat = {est.rank_}, effective rank = "
          f"{est.effective_rank_:.3f}  [{time.perf_counter() - t0:.2f} s]")
    try:
        from .students import AttentionStudent

        t0 = time.perf_counter()
        st = AttentionStudent(kind="softmax", max_epochs=400, patience=30, random_state=args.seed).fit(X, Y)
        print(f"AttentionStudent (trained, over-parameterised): rank_ = {st.rank_}, energy effective rank = "
              f"{st.effective_rank_:.3f}, train risk {st.train_risk_:.3f} (noise floor {teacher.noise_floor:.3f})"
              f"  [{time.perf_counter() - t0:.2f} s]")
    except ImportError as exc:
        print(f"(trained student skipped: {exc})")
    return 0


def main(argv=None):
    """Entry point of the ``rstar`` console script.

    Parameters
    ----------
    argv : list of str or None
        Arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status.
    """
    args = _parser().parse_args(argv)
    try:
        if args.command == "reproduce":
            return _reproduce(args)
        return _demo(args)
    except ImportError as exc:
        print(f"rstar: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"rstar: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
