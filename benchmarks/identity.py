"""Identity check: the fitted answers of a fixed set of cases, recorded once and compared bit for bit later.

A refactor that should not change any answer is checked by recording every fitted quantity a user reads
(``rank_``, ``rank_interval_``, ``spectrum_``, ``p_values_``, ``noise_variance_``, the risk curves, the
inversion and the warning classes) on

- ``grid``: the quick recovery grid (every task, every rstar estimator of ``benchmarks/recovery.py``, and
  ``RStarEstimator(tolerance=0.05)`` for the risk curve);
- ``full``: every twentieth task of the full recovery grid, the same fits;
- ``planted``: planted softmax kernels on MiniLM layer-0 tokens (``benchmarks/real_heads.py``'s
  ``planted_task``) at d = 16, 32 and 64 (r = 0, 3, 8) and 384 (r = 3, 8), V known and unknown,
  ``RStarEstimator()`` at its defaults;
- ``heads``: a dozen MiniLM heads (layers 0, 2, 5; heads 0, 4, 8, 11) fitted by ``rstar.heads.estimate_heads``.

Usage::

    python benchmarks/identity.py --record benchmarks/out/identity/before.pkl      # at the old commit
    python benchmarks/identity.py --compare benchmarks/out/identity/before.pkl     # at the new one
    python benchmarks/identity.py --compare before.pkl --against after.pkl          # two recordings

``--compare`` prints one table row per case group: cases, identical, differing (with the first differing
fields), and writes ``differences.md`` beside the reference. Warning *messages* are compared too but
reported apart: prose may change where the answer does not.
"""

import argparse
import os
import pickle
import sys
import time
import warnings
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

FIELDS = ("rank_", "rank_interval_", "spectrum_", "p_values_", "noise_variance_", "threshold_",
          "noise_floor_rank_", "noise_floor_interval_", "risk_curve_", "risk_curve_se_", "risk_curve_upper_",
          "risk_curve_distance_", "risk_curve_resolution_", "inversion_", "noise_source_")


def snapshot(est, caught):
    """The fitted quantities of ``est`` (missing ones as None) and the warnings raised while fitting it."""
    out = {}
    for f in FIELDS:
        try:
            v = getattr(est, f)
        except AttributeError:
            v = None
        if isinstance(v, np.ndarray):
            v = v.copy()
        elif isinstance(v, tuple):
            v = tuple(int(x) if isinstance(x, (int, np.integer)) else x for x in v)
        out[f] = v
    out["warning_classes"] = sorted({w.category.__name__ for w in caught})
    out["warning_messages"] = sorted({str(w.message) for w in caught})
    return out


def _fit(est, X, Y):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(X, Y)
        except Exception as exc:  # recorded: an error is an answer too
            return {"error": f"{type(exc).__name__}: {exc}"}
    return snapshot(est, caught)


def grid_cases(profile, group, every=1):
    from threadpoolctl import threadpool_limits

    from recovery import _estimators
    from recovery_grid import FAMILIES, generate, make_grid
    from rstar import RStarEstimator

    tasks = [t for t in make_grid(profile, seed=0) if not t.get("detection")][::every]
    out = {}
    with threadpool_limits(1):
        for task in tasks:
            X, Y, teacher, _ = generate(task)
            V = teacher.value_map if FAMILIES[task["family"]][2] else None
            key = f"{group}/{task['task_id']}"
            for name, est in _estimators(task, V, predict_sums=False):
                out[f"{key}/{name}"] = _fit(est, X, Y)
            op = FAMILIES[task["family"]][1]
            out[f"{key}/RStar(tol=0.05)"] = _fit(RStarEstimator(operator=op, value_map=V, tolerance=0.05), X, Y)
    return out


def _minilm_layers(n, seq_len, layers, random_state):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from rstar.heads import collect_attention, load_minilm, text_windows

    torch.set_num_threads(1)
    model, tok = load_minilm()
    windows = text_windows(tok, seq_len, n, random_state=random_state)
    return collect_attention(model, windows, layers=layers)


def planted_cases(dims=(16, 32, 64, 384), ranks=(0, 3, 8)):
    """(d = 384 at r = 3 and 8 only: its V-unknown fits take minutes each on one core.)"""
    from real_heads import planted_task
    from rstar import RStarEstimator

    layer0 = _minilm_layers(2000, 32, [0], 0)[0]
    X_real, V_real = layer0.X, layer0.head(0).value_map()[:-1]
    tokens = X_real.reshape(-1, X_real.shape[-1])
    _, vecs = np.linalg.eigh(tokens.T @ tokens)
    out = {}
    for d in dims:
        if d == X_real.shape[-1]:
            X, V = X_real, V_real
        else:
            X = X_real @ vecs[:, ::-1][:, :d]
            X = X / np.sqrt(np.mean(X**2))
            V = np.random.default_rng(d).standard_normal((d, 8)) / np.sqrt(d)
        for r in ranks if d < 384 else (3, 8):
            Y = planted_task(X, V, r)
            for known in (True, False):
                kw = {"value_map": V} if known else {}
                out[f"planted/d{d}/r{r}/{'known' if known else 'unknown'}"] = _fit(RStarEstimator(**kw), X, Y)
    return out


def head_cases():
    from rstar import RStarEstimator
    from rstar.heads import estimate_heads

    layers = _minilm_layers(500, 32, [0, 2, 5], 1)
    layers = [L.select_heads([0, 4, 8, 11]) for L in layers]
    out = {}
    for layer in layers:
        for h, head in enumerate(layer.heads()):
            est = RStarEstimator(value_map=head.value_map(), tolerance=0.01)
            out[f"heads/L{layer.index}/h{head.head}"] = _fit(est, head.features(), head.Y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = estimate_heads(layers[:1], truncation=False)
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    for row in rows:
        out[f"heads/table/L{row['layer']}/h{row['head']}"] = {k: v for k, v in row.items() if k != "seconds"}
    return out


GROUPS = {"grid": lambda: grid_cases("quick", "grid"), "full": lambda: grid_cases("full", "full", every=20),
          "planted": planted_cases, "heads": head_cases}


def _same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def compare(ref, new):
    """Per group: ``(cases, identical, answer_diffs, message_only_diffs)``; and the differing cases' fields."""
    groups, detail = {}, []
    for key in sorted(set(ref) | set(new)):
        group = key.split("/")[0]
        g = groups.setdefault(group, [0, 0, 0, 0])
        g[0] += 1
        a, b = ref.get(key), new.get(key)
        if a is None or b is None:
            g[2] += 1
            detail.append((key, ["missing in " + ("reference" if a is None else "new run")]))
            continue
        fields = [k for k in sorted(set(a) | set(b)) if k != "warning_messages" and not _same(a.get(k), b.get(k))]
        if fields:
            g[2] += 1
            detail.append((key, [f"{k}: {a.get(k)!r:.80} -> {b.get(k)!r:.80}" for k in fields]))
        elif not _same(a.get("warning_messages"), b.get("warning_messages")):
            g[3] += 1
        else:
            g[1] += 1
    return groups, detail


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", metavar="PKL", help="write the answers here")
    p.add_argument("--compare", metavar="PKL", help="compare against answers recorded here")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated among {', '.join(GROUPS)}")
    p.add_argument("--against", metavar="PKL[,PKL...]", default=None,
                   help="with --compare: compare against answers recorded here (by another checkout, e.g. in "
                        "parallel) instead of computing them now")
    args = p.parse_args(argv)
    if bool(args.record) == bool(args.compare):
        p.error("give exactly one of --record and --compare")
    groups = args.groups.split(",")
    unknown = set(groups) - set(GROUPS)
    if unknown:
        p.error(f"unknown groups {sorted(unknown)}; known: {', '.join(GROUPS)}")
    answers = {}
    for path in ([] if args.against is None else args.against.split(",")):
        with open(path, "rb") as fh:
            answers.update(pickle.load(fh))
    for g in groups if args.against is None else ():
        t0 = time.perf_counter()
        answers.update(GROUPS[g]())
        print(f"{g}: {sum(k.startswith(g + '/') for k in answers)} cases in {time.perf_counter() - t0:.0f} s",
              flush=True)
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        with open(args.record, "wb") as fh:
            pickle.dump(answers, fh)
        return
    ref = {}
    for path in args.compare.split(","):
        with open(path, "rb") as fh:
            ref.update(pickle.load(fh))
    # (the first recording keyed the quick grid by its profile's name)
    ref = {("grid/" + k[len("quick/"):] if k.startswith("quick/") else k): v for k, v in ref.items()}
    ref = {k: v for k, v in ref.items() if k.split("/")[0] in groups}
    answers = {k: v for k, v in answers.items() if k.split("/")[0] in groups}
    summary, detail = compare(ref, answers)
    lines = ["| group | cases | identical | answers differ | messages differ only |", "|---|---|---|---|---|"]
    lines += [f"| {g} | {c} | {i} | {d} | {m} |" for g, (c, i, d, m) in summary.items()]
    lines += ["", *[f"- `{k}`: " + "; ".join(fs) for k, fs in detail]]
    text = "\n".join(lines)
    print(text)
    (Path(args.compare.split(",")[0]).parent / "differences.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
