"""The model check of the operator's class (``rstar.model_check``, ``OperatorMisfitWarning``): how often it
fires on data inside the class (false alarms, level 0.001 per test) and on data outside it (X and Y swapped,
softmax data fitted as linear query-key attention, linear query-key data fitted as softmax, a head fitted with the
wrong mask, a rotary head fitted without its positions).

    python benchmarks/model_check.py                 # 200 in-class linear-QK tasks, 40 softmax, 20 of each misfit
    python benchmarks/model_check.py --quick         # a tenth of that
    python benchmarks/model_check.py --real          # planted softmax on MiniLM tokens, and the arrays swapped

Public API only; prints one table (markdown).
"""

import argparse
import time
import warnings

import numpy as np

from rstar import OperatorMisfitWarning, RotaryPositions, RStarEstimator
from rstar.datasets import make_attention_task

#: rotary positions of the head cases: 4 planes at 1, 0.1, 0.01, 0.001 rad a position over 12 tokens
POSITIONS = RotaryPositions.from_frequencies(10000.0 ** -(np.arange(4) / 4), 12)


def _fit(kw, X, Y):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = RStarEstimator(random_state=0, **kw).fit(X, Y)
    fired = any(issubclass(w.category, OperatorMisfitWarning) for w in caught)
    return est, fired, bool(caught)


def _row(name, kw, make, seeds):
    fired, ran, wide, quiet, t0 = 0, 0, 0, 0, time.perf_counter()
    ranks = {}
    for seed in seeds:
        X, Y = make(seed)
        est, warned, any_warning = _fit(kw, X, Y)
        ran += est.model_check_ is not None
        fired += warned
        quiet += not any_warning
        ranks[est.rank_] = ranks.get(est.rank_, 0) + 1
        wide += tuple(est.rank_interval_) == (0, X.shape[2])
    fit = ", ".join(f"{k}={'positions' if k == 'rotary' else v}" for k, v in kw.items())
    return {"case": name, "fitted as": fit, "tasks": len(seeds), "check ran": ran, "misfit warned": fired,
            "rate": fired / len(seeds), "interval (0, d)": wide, "no warning": quiet,
            "rank_ (count)": ", ".join(f"{r} ({c})" for r, c in sorted(ranks.items())),
            "s/task": (time.perf_counter() - t0) / len(seeds)}


def real_rows():
    """Planted softmax kernels (rank 0, 3, 8; 5% noise) on MiniLM's layer-0 and layer-3 tokens (2000 windows of
    32 tokens) on their top d = 16 and 32 principal directions, V known and unknown, and the same arrays swapped
    (the outputs as X): one printed line per fit."""
    import os
    import sys

    import numpy as np

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from real_heads import planted_task

    from rstar.heads import collect_attention, load_minilm, text_windows

    model, tok = load_minilm()
    layers = collect_attention(model, text_windows(tok, 32, 2000, random_state=0), layers=[0, 3])
    print("| layer | d | r | V | arrays | rank_ | rank_interval_ | inversion | misfit warned | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layer in layers:
        tokens = layer.X.reshape(-1, layer.X.shape[-1])
        _, vecs = np.linalg.eigh(tokens.T @ tokens)
        for d in (16, 32):
            X = layer.X @ vecs[:, ::-1][:, :d]
            X = X / np.sqrt(np.mean(X**2))
            V = np.random.default_rng(d).standard_normal((d, 8)) / np.sqrt(d)
            for r in (0, 3, 8):
                Y = planted_task(X, V, r, 0)
                for v_known, swapped in ((True, False), (False, False), (False, True)):
                    a, b = (Y, X) if swapped else (X, Y)
                    t0 = time.perf_counter()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        est = RStarEstimator(**({"value_map": V} if v_known else {})).fit(a, b)
                    fired = any(issubclass(w.category, OperatorMisfitWarning) for w in caught)
                    print(f"| {layer.index} | {d} | {r} | {'known' if v_known else 'unknown'} | "
                          f"{'swapped' if swapped else 'X, Y'} | {est.rank_} | {tuple(est.rank_interval_)} | "
                          f"{est.inversion_} | {fired} | {time.perf_counter() - t0:.1f} |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--real", action="store_true", help="the real-token rows instead (MiniLM; minutes)")
    parser.add_argument("--cases", default=None, help="comma-separated row numbers to run (1-based; default: all)")
    args = parser.parse_args(argv)
    if args.real:
        return real_rows()
    k = 10 if args.quick else 1
    qk = dict(kind="linear_qk", seq_len=32, n_features=16, rank=3)
    sm = dict(kind="softmax", seq_len=32, n_features=8, rank=2)
    head = dict(kind="softmax", seq_len=12, n_features=16, value_dim=8, rank=2)
    qk_op, sm_op = {"operator": "linear_qk"}, {"operator": "softmax"}
    cases = [
        ("linear QK, Gaussian tokens", qk_op, lambda s: make_attention_task(1000, random_state=s, **qk), 200),
        ("linear QK, Student-t(3) tokens", qk_op,
         lambda s: make_attention_task(1000, random_state=s, token_distribution="student_t", df=3.0, **qk), 200),
        ("linear QK, pure noise (r* = 0)", qk_op,
         lambda s: make_attention_task(1000, random_state=s, **dict(qk, rank=0)), 200),
        ("softmax, Gaussian tokens", sm_op, lambda s: make_attention_task(1000, random_state=s, **sm), 40),
        ("softmax, pure noise (r* = 0)", sm_op,
         lambda s: make_attention_task(1000, random_state=s, **dict(sm, rank=0)), 40),
        ("softmax data as linear QK", qk_op, lambda s: make_attention_task(1000, random_state=s, **sm), 20),
        ("softmax, X and Y swapped", sm_op, lambda s: make_attention_task(1000, random_state=s, **sm)[::-1], 20),
        ("linear QK, X and Y swapped", qk_op,
         lambda s: make_attention_task(1000, random_state=s, **qk)[::-1], 20),
        # heads (d = 16, T = 12, d_v = 8, r* = 2): the factored and rotary least squares' cross-fitted check
        ("causal head", {"causal": True}, lambda s: make_attention_task(1000, random_state=s, causal=True, **head), 40),
        ("rotary causal head", {"causal": True, "rotary": POSITIONS},
         lambda s: make_attention_task(1000, random_state=s, causal=True, rotary=POSITIONS, **head), 40),
        ("bidirectional head", {"causal": True}, lambda s: make_attention_task(1000, random_state=s, **head), 20),
        ("causal head", {"causal": False},
         lambda s: make_attention_task(1000, random_state=s, causal=True, **head), 20),
        ("rotary causal head", {"causal": True},
         lambda s: make_attention_task(1000, random_state=s, causal=True, rotary=POSITIONS, **head), 20),
    ]
    if args.cases:
        cases = [cases[int(i) - 1] for i in args.cases.split(",")]
    rows = [_row(name, kw, make, range(max(count // k, 2))) for name, kw, make, count in cases]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
