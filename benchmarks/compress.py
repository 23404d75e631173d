"""Rank plans put back into MiniLM: sentence-embedding fidelity of each allocation at equal query–key width.

For the heads of the layers given, fitted once by ``rstar heads`` (its ``heads.json``, with tolerances) or here,
each allocation's ranks are put into the model (:func:`rstar.heads.truncated_heads`: each head's query–key map
truncated to its rank, by SVD in the metric of the layer's tokens — what rstar's curves measure — and by the
weights' own SVD; value maps untouched), and the model's sentence embeddings (mean-pooled last hidden
states, normalised, as all-MiniLM-L6-v2 is used) on other windows of text (another seed) are compared with the
full model's: the mean and the smallest cosine similarity. Allocations at each width W:

- ``rstar tolerance``: each head's r*(ε) (its width is W);
- ``rstar budget``: W split to minimise the summed predicted excess (:func:`rstar.heads.rank_plan`);
- ``uniform``: W split evenly;
- ``weight energy``: W split to keep the most of the heads' own kernel SVD energy (the weights alone, no data).

Not yet: Eigen Attention's, SVD-LLM's, Palu's and EVA's allocations, trained students, SmolLM2.

Usage::

    rstar heads --layers 1 --budget 192 --out runs/l1          # the fits (about 6 min on 2 cores)
    python benchmarks/compress.py --table runs/l1/heads.json     # about 1 min
"""

import argparse
import json
from pathlib import Path

import numpy as np


def _embed(model, windows, batch=50):
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, len(windows), batch):
            h = model(torch.as_tensor(windows[s:s + batch])).last_hidden_state.mean(dim=1)
            out.append(torch.nn.functional.normalize(h, dim=1).double().numpy())
    return np.concatenate(out)


def _records(table):
    return table.to_dict("records") if hasattr(table, "to_dict") else table


def _energy_curves(layers, rows):
    by_index = {layer.index: layer for layer in layers}
    curves = []
    for r in rows:
        s = by_index[int(r["layer"])].head(int(r["head"])).kernel_singular_values() ** 2
        curves.append(1.0 - np.r_[0.0, np.cumsum(s)] / s.sum())
    return curves


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", required=True,
                   help="heads.json of `rstar heads` with tolerances (its rows, and the windows it fitted on)")
    p.add_argument("--n-eval", type=int, default=500, help="windows the embeddings are compared on")
    p.add_argument("--seed", type=int, default=1, help="seed of those windows (not the fits' --seed)")
    p.add_argument("--out", default="benchmarks/out/compress")
    args = p.parse_args(argv)

    from rstar.heads import (allocate_ranks, collect_attention, load_minilm, rank_plan, text_windows,
                             truncated_heads)

    run = json.loads(Path(args.table).read_text())
    rows, T = run["rows"], run["seq_len"]
    if run["seed"] == args.seed:
        raise SystemExit(f"--seed {args.seed} is the fits' own: give another for the windows compared on.")
    model, tok = load_minilm()
    model.eval()
    windows = text_windows(tok, T, args.n_eval, random_state=args.seed)
    # the layers' tokens for the truncation metric: the windows the fits read (their seed and count)
    fit_windows = text_windows(tok, T, run["n_samples"], random_state=run["seed"])
    layers = collect_attention(model, fit_windows, layers=sorted({int(r["layer"]) for r in rows}))
    full = _embed(model, windows)
    energy = _energy_curves(layers, rows)
    tolerances = sorted(float(k[len("rank_at_"):]) for k in rows[0] if k.startswith("rank_at_"))
    results = []
    for tol in tolerances:
        by_tol = _records(rank_plan(rows, tolerance=tol))
        width = int(sum(p["rank"] for p in by_tol))
        n = len(rows)
        plans = {
            "rstar tolerance": [p["rank"] for p in by_tol],
            "rstar budget": [p["rank"] for p in _records(rank_plan(rows, budget=width))],
            "uniform": [width // n + (1 if k < width % n else 0) for k in range(n)],
            "weight energy": allocate_ranks(energy, width),
        }
        for (name, ranks), metric in ((item, m) for m in ("tokens", "weights") for item in plans.items()):
            plan = [dict(layer=r["layer"], head=r["head"], rank=int(k)) for r, k in zip(rows, ranks)]
            with truncated_heads(model, plan, layers, metric=metric):
                emb = _embed(model, windows)
            cos = np.sum(emb * full, axis=1)
            res = dict(tolerance=tol, width=width, allocation=name, truncation=metric, ranks=[int(k) for k in ranks],
                       mean_cosine=float(cos.mean()), min_cosine=float(cos.min()))
            results.append(res)
            print(f"eps {tol:g}, width {width}, {metric} truncation: {name:16s} mean cosine {res['mean_cosine']:.6f} "
                  f"(min {res['min_cosine']:.5f}), 1 - cosine {1 - res['mean_cosine']:.2e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compress.json").write_text(json.dumps(results, indent=1))
    lines = ["| ε | width | truncation | allocation | mean cosine to the full model | 1 − cosine | min cosine |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tolerance']:g} | {r['width']} | {r['truncation']} | {r['allocation']} | {r['mean_cosine']:.6f} | "
              f"{1 - r['mean_cosine']:.2e} | {r['min_cosine']:.5f} |" for r in results]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
