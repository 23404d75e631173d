"""Speed and memory of data-only r* against training, and how the fit scales in n, d and T.

Everything is measured in one run, on this machine, through the public API
(``fit``, ``fit_batches``, ``partial_fit``; students through
``rstar.students.AttentionStudent``), so ratios are comparable even on shared,
noisy cores. Parts:

1. **Head to head** (n = 2000): ``RStarEstimator().fit``, one
   over-parameterised student (``rank=None``), a rank sweep of students
   ``r = 1 ... r* + 1`` (the fewest ranks that locate r*: the smallest rank
   whose held-out risk is within 5% of the best swept) and its extrapolation
   to a full sweep ``r = 1 ... d`` (``d`` times the mean student), and the
   bare one-pass reference ``sum_i M_i M_i^T`` with ``M_i = pinv(X_i) Y_i``
   (batched numpy, no statistic, no rule); on the softmax task also the
   one-pass data-only fit, ``SoftmaxInversionEstimator(method="first_order")``
   (with its default predict sums, and with ``predict_sums=False``: rank only).
2. **Scaling in n, streamed**: batches of 2000 drawn from one fixed teacher
   and passed to ``fit_batches`` (never all in memory), beside the bare
   reference over the same batches: the one-pass first-order
   statistic up to 10^6 samples, and the least-squares fit read in passes
   (its samples over a 1 MiB budget) up to ``--passes-max-n``; time, peak
   traced memory (``tracemalloc``: every numpy allocation of the fit, the
   current batch included) and the rank read at each n.
3. **Scaling in d and in T** (n = 2000): ``RStarEstimator().fit`` time,
   peak memory and the inversion that ran (beyond its budgets the least
   squares falls back, with a warning, to first order).
4. **Figures**: log–log time and memory against n, d and T.
5. **Real size** (``--real-size``, MiniLM's heads through :mod:`rstar.heads`, or
   ``--model smollm2``: SmolLM2-135M-Instruct's rotary, grouped heads): the
   forward pass that reads the layers' inputs and heads' outputs, the physical
   limit (the whole model's plain forward pass plus one ``d x d`` Gram per
   layer), each head's
   ``estimate_heads`` (the noise floor, r*(ε) for ε = 1% and 5%, and the
   truncation check) on numpy and on torch (``device="auto"``), an Eigen
   Attention-style per-head energy sweep (the rank of the head's keys and
   queries at energy 1 - ε, from the same forward pass), and a distilled
   student rank sweep on one head (``rstar.students.AttentionStudent`` at
   ranks 1 ... r̂(1%) + 1, each one's training timed; the sweep's time is their
   sum; a rotary head's students are causal rotary students with its value
   map held fixed; ``--student-ranks`` trains some of the widths and scales
   their time to the sweep, said so). With ``--all-heads`` every head of the
   layers is fitted (the whole-model time); otherwise the whole model's time
   is the measured heads' mean times the model's heads, said so in the table.
6. **Token subspace** (``--token-subspace``): whether MiniLM's heads could be
   fitted in a few principal directions of their tokens: per layer the
   directions that hold all but 1%, 0.1%, 0.01% of the tokens' energy, and
   per head what its own kernel's (row-centred) logits lose when the tokens
   are projected on the top k = 32 ... 192 of them.

Usage::

    python benchmarks/speed.py                      # about 12 min on 2 cores
    python benchmarks/speed.py --full --qk-students # d up to 768, students of the linear-QK task too
    python benchmarks/speed.py --quick              # about 2 min: smaller n, fewer points, no students
    python benchmarks/speed.py --out benchmarks/out/speed --docs-figures docs/img
    python benchmarks/speed.py --device auto        # the least-squares fits in torch, on CUDA when present
    python benchmarks/speed.py --head-to-head --qk-students   # part 1 alone, both tasks' students (about 15 min)
    python benchmarks/speed.py --real-size --layers 0,3 --heads 0,1,2   # part 5 on 6 MiniLM heads (about 15 min)
    python benchmarks/speed.py --real-size --all-heads --devices auto   # part 5, all 72 heads on torch
    python benchmarks/speed.py --real-size --model smollm2 --layers 0,15,29 --heads 0 --devices auto \
        --student-ranks 1,8 --student-epochs 300   # part 5 on three SmolLM2 heads, two students of the sweep
    python benchmarks/speed.py --dask-memory        # a 781 MiB dask array fitted within memory_budget=2**26
    python benchmarks/speed.py --token-subspace --all-heads   # part 6 on every layer and head (about 1 min)

Writes ``speed.json`` (every number) and ``speed.md`` (the tables) under
``--out``, and ``speed_*.png`` under ``--docs-figures`` when given.
"""

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402

from rstar import RStarEstimator, SoftmaxInversionEstimator  # noqa: E402
from rstar.datasets import make_attention_task, softmax_attention  # noqa: E402


#: ``device`` of the data-only fits (``--device``): "cpu" (numpy), "auto" or "cuda" (torch)
DEVICE = "cpu"


def _timed(fn, trace=True):
    """``(result, seconds, peak traced MiB)`` of ``fn()``; with ``trace=False`` no memory is traced (peak None):
    ``tracemalloc`` slows every numpy allocation (the default softmax fit by about a quarter) and not torch's,
    so the head-to-head times are taken without it."""
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn()
    seconds = time.perf_counter() - t0
    peak = None
    if trace:
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    return out, seconds, peak


def bare_gram(X, Y):
    """The reference one-pass statistic: ``sum_i M_i M_i^T`` with ``M_i = pinv(X_i) Y_i`` (batched)."""
    M = np.linalg.pinv(X) @ Y
    return np.einsum("nij,nkj->ik", M, M)


def _mse(est, X, Y):
    return float(np.mean((est.predict(X) - Y) ** 2))


def head_to_head(tasks, n, sweep, seed):
    from rstar.students import AttentionStudent

    rows = []
    for kind, T, d, r in tasks:
        # one teacher: n samples to fit, n / 2 held out for the students' risks
        X_all, Y_all = make_attention_task(n + n // 2, kind=kind, seq_len=T, n_features=d, rank=r,
                                           random_state=seed)
        X, Y, Xt, Yt = X_all[:n], Y_all[:n], X_all[n:], Y_all[n:]
        operator = "softmax" if kind == "softmax" else "linear_qk"
        # times untraced (students and data-only fits alike); the peak memory from a second, traced fit
        est, t_rstar, _ = _timed(lambda: RStarEstimator(operator=operator, device=DEVICE).fit(X, Y), trace=False)
        _, _, m_rstar = _timed(lambda: RStarEstimator(operator=operator, device=DEVICE).fit(X, Y))
        _, t_gram, _ = _timed(lambda: bare_gram(X, Y), trace=False)
        _, _, m_gram = _timed(lambda: bare_gram(X, Y))
        row = dict(task=f"{kind} T={T} d={d} r*={r}", n=n, rstar_seconds=t_rstar, rstar_rank=est.rank_,
                   rstar_interval=list(est.rank_interval_), rstar_inversion=est.inversion_, rstar_peak_mib=m_rstar,
                   gram_seconds=t_gram, gram_peak_mib=m_gram)
        if kind == "softmax":
            # the one-pass data-only estimator (the paper's first-order inversion), with its default predict sums
            # and without them (rank_ only)
            for key, sums in (("one_pass", True), ("one_pass_rank_only", False)):
                one, t_one, _ = _timed(lambda: SoftmaxInversionEstimator(method="first_order", predict_sums=sums,
                                                                         device=DEVICE).fit(X, Y),
                                      trace=False)
                row.update({f"{key}_seconds": t_one, f"{key}_rank": one.rank_,
                            f"{key}_interval": list(one.rank_interval_)})
        if sweep:
            student_kind = "softmax" if kind == "softmax" else "linear_qk"
            over, t_over, _ = _timed(lambda: AttentionStudent(kind=student_kind, device="cpu",
                                                              random_state=seed).fit(X, Y), trace=False)
            risks, times = [], []
            for rank in range(1, r + 2):
                s, t_s, _ = _timed(lambda: AttentionStudent(kind=student_kind, rank=rank, device="cpu",
                                                            random_state=seed).fit(X, Y), trace=False)
                risks.append(_mse(s, Xt, Yt))
                times.append(t_s)
            best = min(risks)
            found = 1 + next(i for i, v in enumerate(risks) if v <= 1.05 * best)
            row.update(student_seconds=t_over, student_rank=over.rank_, sweep_ranks=f"1..{r + 1}",
                       sweep_seconds=float(sum(times)), sweep_rank=found, sweep_risks=risks,
                       full_sweep_seconds=float(np.mean(times) * d))
            for key in ("rstar", "one_pass", "one_pass_rank_only"):
                if f"{key}_seconds" in row:
                    t_fit = row[f"{key}_seconds"]
                    prefix = "" if key == "rstar" else f"{key}_"
                    row.update({f"{prefix}speedup_student": t_over / t_fit,
                                f"{prefix}speedup_sweep": row["sweep_seconds"] / t_fit,
                                f"{prefix}speedup_full_sweep": row["full_sweep_seconds"] / t_fit})
        row["rstar_over_gram"] = t_rstar / t_gram
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "sweep_risks"}, default=float), flush=True)
    return rows


def _teacher_batches(teacher, n, T, d, batch, seed):
    """A function returning a fresh iterator over n samples of one teacher, drawn batch by batch (the same
    samples at every pass)."""
    K, V, sigma = teacher.kernel, teacher.value_map, teacher.noise

    def batches():
        rng = np.random.default_rng(seed)
        for start in range(0, n, batch):
            b = min(batch, n - start)
            X = rng.standard_normal((b, T, d))
            Y = softmax_attention(X, K, V) + sigma * rng.standard_normal((b, T, V.shape[1]))
            yield X, Y

    return batches


def _record(rows, **row):
    """Append a row of the streamed tables and print it."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def _stream(est, batches):
    for X, Y in batches():
        est.partial_fit(X, Y)
    est.rank_   # the fitted attributes are computed when first read: inside the timing
    return est


def recovery_at_n_and_10n(T, d, r, n, teachers, seed, batch=2000):
    """``rank_`` of the default estimator fed by ``partial_fit`` with n and 10 n samples of the same teachers."""
    rows = []
    for k in range(teachers):
        _, _, teacher = make_attention_task(10, seq_len=T, n_features=d, rank=r, random_state=seed + 100 + k,
                                            return_teacher=True)
        for m in (n, 10 * n):
            batches = _teacher_batches(teacher, m, T, d, batch, seed + 200 + k)
            est, seconds, _ = _timed(lambda: _stream(RStarEstimator(predict_sums=False, device=DEVICE), batches))
            _record(rows, teacher=k, n=m, rank=est.rank_, r=r, seconds=seconds, inversion=est.inversion_)
    return rows


def stream_default(T, d, r, ns, seed, batch=2000):
    """The default ``RStarEstimator`` fed by ``partial_fit``: time, peak traced memory and rank at each n."""
    _, _, teacher = make_attention_task(10, seq_len=T, n_features=d, rank=r, random_state=seed,
                                        return_teacher=True)
    rows = []
    for n in ns:
        batches = _teacher_batches(teacher, n, T, d, batch, seed + 1)
        _, t_gen, _ = _timed(lambda: [None for _ in batches()])
        est, seconds, peak = _timed(lambda: _stream(RStarEstimator(predict_sums=False, device=DEVICE), batches))
        _record(rows, T=T, d=d, r=r, n=n, fit="RStar partial_fit (default budget)", seconds=seconds,
                generation_seconds=t_gen, peak_mib=peak, rank=est.rank_, inversion=est.inversion_)
    return rows


def scaling_n(T, d, r, ns, passes_max_n, seed, batch=2000):
    _, _, teacher = make_attention_task(10, seq_len=T, n_features=d, rank=r, random_state=seed,
                                        return_teacher=True)
    rows = []
    for n in ns:
        batches = _teacher_batches(teacher, n, T, d, batch, seed + 1)
        # generating the samples is part of every pass: timed alone to subtract it
        _, t_gen, _ = _timed(lambda: [None for _ in batches()])
        # the bare one-pass reference over the same batches
        _, t_ref, m_ref = _timed(lambda: sum(bare_gram(X, Y) for X, Y in batches()))
        _record(rows, T=T, d=d, r=r, n=n, fit="bare pinv Gram (reference)", seconds=t_ref, generation_seconds=t_gen,
                peak_mib=m_ref, rank=None, inversion=None)
        fits = [("one pass (first order)", lambda: SoftmaxInversionEstimator(predict_sums=False))]
        if n <= passes_max_n:
            fits.append(("least squares in passes",
                         lambda: RStarEstimator(memory_budget=2**20, predict_sums=False, device=DEVICE)))
        runs = [(label, lambda make=make: make().fit_batches(batches)) for label, make in fits]
        if n >= 10_000:
            # the default estimator fed by partial_fit: the least squares on the samples within its budgets
            runs.append(("RStar partial_fit (default budget)",
                         lambda: _stream(RStarEstimator(predict_sums=False, device=DEVICE), batches)))
        for label, run in runs:
            est, seconds, peak = _timed(run)
            _record(rows, T=T, d=d, r=r, n=n, fit=label, seconds=seconds, generation_seconds=t_gen,
                    peak_mib=peak, rank=est.rank_, inversion=est.inversion_)
    return rows


def scaling_shape(points, n, seed):
    rows = []
    for T, d, r in points:
        X, Y = make_attention_task(n, seq_len=T, n_features=d, rank=r, random_state=seed)
        est, seconds, peak = _timed(lambda: RStarEstimator(predict_sums=False, device=DEVICE).fit(X, Y))
        _, t_gram, _ = _timed(lambda: bare_gram(X, Y))
        rows.append(dict(T=T, d=d, r=r, n=n, seconds=seconds, peak_mib=peak, data_mib=(X.nbytes + Y.nbytes) / 2**20,
                         rank=est.rank_, inversion=est.inversion_, gram_seconds=t_gram))
        print(json.dumps(rows[-1]), flush=True)
        X = Y = None   # free the data before the next shape
    return rows


def dask_memory(seed, n=100_000, T=32, d=16, chunk=5000, budget=2**26):
    """Traced peak memory of ``RStarEstimator(memory_budget=budget).fit`` on lazily generated dask arrays (softmax
    attention of a rank-3 kernel plus noise, generated chunk by chunk), threaded scheduler with two workers,
    against a plain dask reduction over the same arrays (dask's own working set)."""
    import dask
    import dask.array as da

    rng = np.random.default_rng(seed)
    K = rng.standard_normal((d, 3)) @ rng.standard_normal((3, d)) / 4

    def head(Xb):
        L = Xb @ K @ Xb.transpose(0, 2, 1) / np.sqrt(d)
        P = np.exp(L - L.max(-1, keepdims=True))
        P /= P.sum(-1, keepdims=True)
        return P @ Xb + 0.1 * np.random.default_rng(Xb.shape[0]).standard_normal(Xb.shape)

    def arrays():
        X = da.random.RandomState(seed).standard_normal((n, T, d), chunks=(chunk, T, d))
        return X, X.map_blocks(head, dtype=float)

    out = dict(budget_mib=budget / 2**20)
    with dask.config.set(scheduler="threads", num_workers=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        X, Y = arrays()
        out["array_mib"] = (X.nbytes + Y.nbytes) / 2**20
        tracemalloc.start()
        t = time.perf_counter()
        (X.sum(axis=0).sum() + (Y**2).sum()).compute()
        out["plain_seconds"], out["plain_peak_mib"] = time.perf_counter() - t, tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        X, Y = arrays()
        tracemalloc.start()
        t = time.perf_counter()
        est = RStarEstimator(memory_budget=budget).fit(X, Y)
        out["fit_seconds"], out["fit_peak_mib"] = time.perf_counter() - t, tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    out.update(rank=int(est.rank_), inversion=est.inversion_)
    return out


def _peak_rss_mib():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


MODELS = {"minilm": "all-MiniLM-L6-v2", "smollm2": "SmolLM2-135M-Instruct"}


def real_size(layers, heads, T, n, devices, student_epochs, seed, no_students=False, model_name="minilm",
              student_ranks=None):
    """Part 5: a real model's heads (MiniLM at the README's size, T = 32, n = 500 by default; or SmolLM2's rotary
    heads), through the public API. ``student_ranks``: the widths of the distilled sweep to train (None: every
    width 1 ... r̂(1%) + 1); the sweep's time is their training time, scaled to the full sweep where fewer were
    trained."""
    import torch

    from _runs import head_student
    from rstar.heads import collect_attention, estimate_heads, text_windows

    from threadpoolctl import threadpool_limits

    # every core for both back-ends here (the other parts run on one thread): torch's threads, and numpy's BLAS
    # threads during the numpy fits only (OpenBLAS's spinning threads beside torch's slow torch down severalfold)
    torch.set_num_threads(os.cpu_count() or 1)
    from _runs import load_model

    model, tok = load_model(model_name)
    windows = text_windows(tok, T, n, random_state=seed)
    res = dict(machine=f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               date=time.strftime("%Y-%m-%d"), T=T, n=n, devices=devices, model=MODELS[model_name])
    # reading the heads: the forward pass to the last layer read, with each head's outputs recomputed and checked
    t = time.perf_counter()
    collected = collect_attention(model, windows, layers=layers)
    res["forward_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    for layer in collected:
        Xf = layer.X.reshape(-1, layer.X.shape[-1]).astype(float)
        Xf.T @ Xf
    res["gram_seconds"] = time.perf_counter() - t
    res["n_layers_model"] = len(collect_attention(model, windows[:2]))
    # the physical limit of the whole model: the plain forward pass of its layers over the windows (no hooks; the
    # base model, without a language model's vocabulary projection), and one d x d Gram of the tokens per layer
    # (each costs the same: the layers read's mean)
    ids = torch.as_tensor(np.asarray(windows))
    t = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(ids), 32):
            model.base_model(input_ids=ids[start:start + 32])
    res["model_forward_seconds"] = time.perf_counter() - t
    res["physical_limit_seconds"] = (res["model_forward_seconds"]
                                     + res["gram_seconds"] / len(collected) * res["n_layers_model"])
    res["heads_per_layer"] = collected[0].n_heads
    if heads is not None:
        collected = [layer.select_heads(heads) for layer in collected]
    rows = []
    for layer in collected:
        for head in layer.heads():
            row = dict(layer=layer.index, head=head.head, d=int(head.features().shape[-1]), d_head=head.d_head)
            for dev in devices:
                blas = (os.cpu_count() or 1) if dev == "cpu" else 1
                with warnings.catch_warnings(), threadpool_limits(limits=blas, user_api="blas"):
                    warnings.simplefilter("ignore")
                    t = time.perf_counter()
                    table = estimate_heads([layer.select_heads([head.head])], RStarEstimator(device=dev),
                                           tolerances=(0.01, 0.05))
                    row[f"seconds_{dev}"] = time.perf_counter() - t
                r = table.iloc[0] if hasattr(table, "iloc") else table[0]
                row[f"rank_{dev}"] = int(r["rank"])
                row[f"rank_at_0.01_{dev}"], row[f"rank_at_0.05_{dev}"] = r["rank_at_0.01"], r["rank_at_0.05"]
                row["truncation_rank_at_0.05"] = int(r["truncation_rank_at_0.05"])
                print(f"layer {layer.index} head {head.head} {dev}: {row[f'seconds_{dev}']:.1f} s, r*={row[f'rank_{dev}']}"
                      f", r*(1%)={row[f'rank_at_0.01_{dev}']}, r*(5%)={row[f'rank_at_0.05_{dev}']}", flush=True)
            # Eigen Attention's sizing: the rank of the head's keys and queries at energy 1 - eps (their PCA)
            t = time.perf_counter()
            Xh = head.features().reshape(-1, row["d"]).astype(float)
            for W in (head.query, head.key):
                # [W; b] against the features: the constant feature only where the layer has biases
                s2 = np.linalg.svd(Xh @ W[: Xh.shape[1]], compute_uv=False) ** 2
                share = np.cumsum(s2) / s2.sum()
                row.setdefault("energy_rank", []).append({eps: int(np.searchsorted(share, 1 - eps) + 1)
                                                          for eps in (0.01, 0.05)})
            row["energy_seconds"] = time.perf_counter() - t
            rows.append(row)
    res["heads"] = rows
    res["peak_rss_mib"] = _peak_rss_mib()
    if not no_students and rows:
        # a distilled-student sweep on the first head: ranks 1 ... r_hat(1%) + 1, each student's training timed
        # (fit_time_: without the rank measurement after it, which a sweep does not need)
        layer, first = collected[0], rows[0]
        head = layer.head(first["head"])
        target = int(first[f"rank_at_0.01_{devices[-1]}"] or 1)
        full = list(range(1, target + 2))
        trained = full if student_ranks is None else [r for r in student_ranks
                                                      if 1 <= r <= min(head.d_head, target + 1)]
        dropped = sorted(set(student_ranks or ()) - set(trained))
        if dropped:
            print(f"student widths {dropped} are outside the sweep 1 ... {len(full)}: not trained", flush=True)
        X, Y = head.features(), head.Y
        sweep = []
        for rank in trained:
            # a rotary head's students hold its value map fixed, as its data-only fit does; MiniLM's learn it
            st = head_student(head, rank, student_epochs, seed, value_map_known=head.rotary is not None).fit(X, Y)
            sweep.append(dict(rank=rank, seconds=float(st.fit_time_), epochs=int(st.n_iter_),
                              r2=float(st.score(X, Y))))
            print(f"student rank {rank}: {sweep[-1]['seconds']:.1f} s of training ({sweep[-1]['epochs']} epochs), "
                  f"R^2 {sweep[-1]['r2']:.4f}", flush=True)
        if sweep:
            spent = sum(s["seconds"] for s in sweep)
            res["student_sweep"] = dict(layer=layer.index, head=first["head"], ranks=sweep, widths=len(full),
                                        epochs=student_epochs, extrapolated=len(sweep) < len(full), dropped=dropped,
                                        seconds=spent / len(sweep) * len(full))
    return res


def token_subspace(layers, heads, T, n, seed, ks=(32, 64, 128, 192), energies=(1e-2, 1e-3, 1e-4)):
    """Part 6: whether MiniLM's heads could be fitted in a subspace of the tokens (issue 37, item 3).

    Per layer, the principal directions of the layer's input tokens (with the constant feature): how many hold all
    but 1%, 0.1%, 0.01% of their energy. Per head, what its own kernel loses when the tokens are projected on the
    top k of them: ``||L_k - L|| / ||L||`` for the logits ``L = X K X^T`` (each row centred: the softmax ignores
    a row's shift), on the first 100 windows. A fit in such a subspace costs ``k / d`` of a full one; it is only
    sound where that loss is small.
    """
    from rstar.heads import collect_attention, load_minilm, text_windows

    model, tok = load_minilm()
    collected = collect_attention(model, text_windows(tok, T, n, random_state=seed), layers=layers)
    rows = []
    for layer in collected:
        X = layer.head(0).features().astype(float)
        d = X.shape[-1]
        w, U = np.linalg.eigh(np.einsum("ntd,nte->de", X, X) / (X.shape[0] * X.shape[1]))
        w, U = w[::-1], U[:, ::-1]
        left = 1.0 - np.cumsum(w) / w.sum()
        row = dict(layer=layer.index, d=d, dims={e: int(np.argmax(left <= e) + 1) for e in energies}, heads={})
        Xs = X[:100]
        for h in (heads if heads is not None else range(layer.n_heads)):
            K = layer.head(h).kernel()

            def centred_logits(Z):
                L = (Z @ K) @ Z.transpose(0, 2, 1)
                return L - L.mean(axis=2, keepdims=True)

            full = centred_logits(Xs)
            row["heads"][h] = {k: float(np.linalg.norm(centred_logits(Xs @ U[:, :k] @ U[:, :k].T) - full)
                                        / np.linalg.norm(full)) for k in ks if k < d}
        rows.append(row)
        print(f"layer {layer.index}: d = {d}, dims for {energies}: {list(row['dims'].values())}; logit loss at "
              f"k = {list(ks)}: " + "; ".join(f"head {h} " + " ".join(f"{v:.2f}" for v in r.values())
                                              for h, r in row["heads"].items()), flush=True)
    return dict(T=T, n=n, ks=list(ks), energies=list(energies), layers=rows)


def _token_subspace_markdown(res):
    ks = res["ks"]
    lines = [f"MiniLM, T = {res['T']}, n = {res['n']}: principal directions of each layer's tokens",
             "", "| layer | d | " + " | ".join(f"dims for {e:g} left" for e in res["energies"])
             + " | " + " | ".join(f"logit loss at k = {k} (heads: min-max)" for k in ks) + " |",
             "|---|---|" + "---|" * (len(res["energies"]) + len(ks))]
    for r in res["layers"]:
        losses = [[h[k] for h in r["heads"].values() if k in h] for k in ks]
        lines.append(f"| {r['layer']} | {r['d']} | " + " | ".join(str(v) for v in r["dims"].values()) + " | "
                     + " | ".join(f"{min(v):.2f}-{max(v):.2f}" if v else "-" for v in losses) + " |")
    return "\n".join(lines)


def _real_size_markdown(res):
    rows, devices = res["heads"], res["devices"]
    lines = [f"{res.get('model', MODELS['minilm'])}, T = {res['T']}, n = {res['n']}; {res['machine']}; "
             f"GPU: {res['gpu'] or 'none'}; {res['date']}", "",
             f"Reading the heads (forward pass with hooks, every head recomputed and checked): "
             f"{res['forward_seconds']:.1f} s for the layers read, their Grams {res['gram_seconds']:.2f} s. "
             + (f"Physical limit of the whole model (its plain forward pass, {res['model_forward_seconds']:.1f} s, "
                f"its layers without a vocabulary projection, and one Gram per layer): "
                f"{res['physical_limit_seconds']:.1f} s. " if "physical_limit_seconds" in res
                else "") + f"Peak RSS {res['peak_rss_mib']:.0f} MiB.", "",
             "| layer | head | " + " | ".join(f"{dev}: s | r* | r*(1%) | r*(5%)" for dev in devices)
             + " | truncation r(5%) | energy sweep s |",
             "|---|---|" + "---|---|---|---|" * len(devices) + "---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['head']} | " + " | ".join(
            f"{r[f'seconds_{d}']:.1f} | {r[f'rank_{d}']} | {r[f'rank_at_0.01_{d}']} | {r[f'rank_at_0.05_{d}']}"
            for d in devices) + f" | {r['truncation_rank_at_0.05']} | {r['energy_seconds']:.2f} |")
    n_model = res["n_layers_model"] * res["heads_per_layer"]
    for dev in devices:
        mean = float(np.mean([r[f"seconds_{dev}"] for r in rows]))
        whole = "measured" if len(rows) == n_model else f"extrapolated from {len(rows)} heads"
        limit, of = ((res["physical_limit_seconds"], "the whole model's physical limit")
                     if "physical_limit_seconds" in res else
                     (res["forward_seconds"] + res["gram_seconds"], "the physical limit of the layers read"))
        lines.append(f"\n{dev}: {mean:.1f} s per head; the whole model ({n_model} heads) "
                     f"{mean * n_model / 60:.1f} min ({whole}), {mean * n_model / limit:.0f}x {of}")
    if "student_sweep" in res:
        sw = res["student_sweep"]
        per_head = rows[0][f"seconds_{devices[-1]}"]
        widths = sw.get("widths", len(sw["ranks"]))
        how = (f"widths {', '.join(str(r['rank']) for r in sw['ranks'])} trained, scaled to all {widths}"
               if sw.get("extrapolated") else "each trained")
        lines.append(f"\nStudent sweep on layer {sw['layer']} head {sw['head']} (widths 1 ... {widths}; {how}): "
                     f"{sw['seconds']:.0f} s of training, {sw['seconds'] / per_head:.0f}x rstar's "
                     f"{per_head:.0f} s on {devices[-1]}")
    return "\n".join(lines)


def _markdown(res):
    out = [f"Machine: {res['machine']}; one BLAS thread; {res['date']}.", ""]
    if res["head_to_head"]:
        out += ["| task (n = %d) | RStar fit | inversion | r̂ | bare Gram | RStar / Gram | over-param. student "
                "| its r̂ | sweep | sweep's r̂ | full sweep 1..d (extrap.) | × student | × sweep | × full sweep |"
                % res["head_to_head"][0]["n"],
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["head_to_head"]:
            if "student_seconds" in r:
                out.append(f"| {r['task']} | {r['rstar_seconds']:.2f} s | {r['rstar_inversion']} | {r['rstar_rank']} "
                           f"| {r['gram_seconds']:.3f} s | {r['rstar_over_gram']:.1f} | {r['student_seconds']:.1f} s "
                           f"| {r['student_rank']} | {r['sweep_seconds']:.1f} s ({r['sweep_ranks']}) "
                           f"| {r['sweep_rank']} | {r['full_sweep_seconds']:.0f} s | {r['speedup_student']:.0f}× "
                           f"| {r['speedup_sweep']:.0f}× | {r['speedup_full_sweep']:.0f}× |")
            else:
                out.append(f"| {r['task']} | {r['rstar_seconds']:.2f} s | {r['rstar_inversion']} | {r['rstar_rank']} "
                           f"| {r['gram_seconds']:.3f} s | {r['rstar_over_gram']:.1f} | — | | | | | | | |")
        out.append("")
        one = [r for r in res["head_to_head"] if "one_pass_seconds" in r]
        if one:
            out += ["| task (n = %d) | one-pass fit | its r̂ (interval) | × student | × sweep | × full sweep |"
                    % one[0]["n"], "|---|---|---|---|---|---|"]
            for r in one:
                for key, label in (("one_pass", "predict sums (default)"), ("one_pass_rank_only", "rank only")):
                    ratios = "| — | — | — |"
                    if "student_seconds" in r:
                        ratios = (f"| {r[key + '_speedup_student']:.0f}× | {r[key + '_speedup_sweep']:.0f}× "
                                  f"| {r[key + '_speedup_full_sweep']:.0f}× |")
                    lo, hi = r[key + "_interval"]
                    out.append(f"| {r['task']} | {r[key + '_seconds']:.2f} s ({label}) | {r[key + '_rank']} "
                               f"({lo}, {hi}) {ratios}")
            out.append("")
    if not res.get("scaling_n"):
        return "\n".join(out) + "\n"
    out += ["| T | d | n (streamed) | fit | time | sample generation | peak traced memory | r̂ (r* = %d) |"
            % res["scaling_n"][0]["r"], "|---|---|---|---|---|---|---|---|"]
    for r in res["scaling_n"]:
        out.append(f"| {r['T']} | {r['d']} | {r['n']:,} | {r['fit']} | {r['seconds']:.1f} s "
                   f"| {r['generation_seconds']:.1f} s | {r['peak_mib']:.1f} MiB | {'—' if r['rank'] is None else r['rank']} |")
    rec = res.get("recovery_n_10n", [])
    if rec:
        ns = sorted({r["n"] for r in rec})
        out += ["", "| n (partial_fit, default RStarEstimator) | exact r̂ = r* | r̂ per teacher | mean time |",
                "|---|---|---|---|"]
        for m in ns:
            rows = [r for r in rec if r["n"] == m]
            out.append(f"| {m:,} | {sum(r['rank'] == r['r'] for r in rows)} / {len(rows)} "
                       f"| {', '.join(str(r['rank']) for r in rows)} | {np.mean([r['seconds'] for r in rows]):.1f} s |")
    out += ["", "| T | d | n | RStar fit | bare Gram | peak traced memory | data (X, Y) | inversion | r̂ / r* |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in res["scaling_shape"]:
        out.append(f"| {r['T']} | {r['d']} | {r['n']} | {r['seconds']:.2f} s | {r['gram_seconds']:.2f} s "
                   f"| {r['peak_mib']:.0f} MiB | {r['data_mib']:.0f} MiB | {r['inversion']} | {r['rank']} / {r['r']} |")
    return "\n".join(out) + "\n"


def _figures(res, folder):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label in sorted({r["fit"] for r in res["scaling_n"]}):
        rows = [r for r in res["scaling_n"] if r["fit"] == label]
        n = [r["n"] for r in rows]
        axes[0].loglog(n, [r["seconds"] for r in rows], "o-", label=label)
        axes[1].loglog(n, [r["peak_mib"] for r in rows], "o-", label=label)
    axes[0].set(xlabel="samples n (streamed)", ylabel="fit time (s)", title="fit time against n")
    axes[1].set(xlabel="samples n (streamed)", ylabel="peak traced memory (MiB)", title="peak memory against n")
    for ax, where in zip(axes, ("lower right", "upper left")):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc=where, fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "speed_n.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    shape = res["scaling_shape"]
    T0 = shape[0]["T"]
    by_d = sorted((r for r in shape if r["T"] == T0), key=lambda r: r["d"])
    d0 = min(r["d"] for r in shape)
    by_T = sorted((r for r in shape if r["d"] == d0), key=lambda r: r["T"])
    for ax, rows, key in ((axes[0], by_d, "d"), (axes[1], by_T, "T")):
        x = [r[key] for r in rows]
        ax.loglog(x, [r["seconds"] for r in rows], "o-", label="RStarEstimator().fit")
        ax.loglog(x, [r["gram_seconds"] for r in rows], "s--", label="bare pinv Gram")
        for r in rows:
            ax.annotate(r["inversion"].replace("softmax_", ""), (r[key], r["seconds"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel=key, ylabel="seconds (n = %d)" % rows[0]["n"],
               title=f"fit time against {key} ({'T = %d' % T0 if key == 'd' else 'd = %d' % d0})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(x, [str(v) for v in x])
    fig.tight_layout()
    fig.savefig(folder / "speed_shape.png", dpi=110)
    plt.close(fig)


def _save(folder, name, res):
    """Write ``res`` to ``folder/name.json`` (the folder made if needed) and return the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=float))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/out/speed")
    p.add_argument("--docs-figures", default=None)
    p.add_argument("--passes-max-n", type=int, default=None,
                   help="largest n for the least squares read in passes (default 30 000; 10 000 with --quick)")
    p.add_argument("--no-students", action="store_true")
    p.add_argument("--qk-students", action="store_true", help="also train the students of the linear-QK task")
    p.add_argument("--full", action="store_true", help="the shape scan up to d = 768 (X alone is 786 MB)")
    p.add_argument("--device", default="cpu", help="device of the data-only fits: cpu (numpy), auto, cuda")
    p.add_argument("--replot", metavar="JSON", help="only redraw the figures from a speed.json")
    p.add_argument("--shapes", metavar="TxDxR,...",
                   help="only the shape scan at these points (n = 2000), e.g. 64x128x8,64x384x8; rows printed and "
                        "written to shapes.json")
    p.add_argument("--head-to-head", action="store_true",
                   help="only the head-to-head part (with the students unless --no-students); head_to_head.json")
    p.add_argument("--stream-head", action="store_true",
                   help="only stream 10^4, 10^5 and 10^6 samples of T = d = 64 through partial_fit (about 30 min)")
    p.add_argument("--real-size", action="store_true", help="only part 5: a real model's heads (--model)")
    p.add_argument("--model", choices=sorted(MODELS), default="minilm",
                   help="--real-size: all-MiniLM-L6-v2 (minilm) or SmolLM2-135M-Instruct's rotary heads (smollm2)")
    p.add_argument("--student-ranks", default=None,
                   help="--real-size: comma-separated widths of the student sweep to train (default: all of "
                        "1 ... r*(1%%) + 1); the sweep's time is scaled to all of them")
    p.add_argument("--dask-memory", action="store_true",
                   help="only the distributed fit's memory: a 781 MiB lazily generated dask array, two threads, "
                        "memory_budget=2**26, against a plain dask reduction over the same arrays")
    p.add_argument("--token-subspace", action="store_true",
                   help="only part 6: how many principal directions MiniLM's tokens need, and what the heads' own "
                        "kernels lose in fewer")
    p.add_argument("--layers", default="0,3", help="--real-size, --token-subspace: comma-separated layers")
    p.add_argument("--heads", default="0,1,2", help="--real-size, --token-subspace: comma-separated heads of each layer")
    p.add_argument("--all-heads", action="store_true", help="--real-size, --token-subspace: all layers and heads (the whole model)")
    p.add_argument("--devices", default="cpu,auto", help="--real-size: devices of the per-head fits")
    p.add_argument("--seq-len", type=int, default=32, help="--real-size, --token-subspace: tokens per window")
    p.add_argument("--n-samples", type=int, default=500, help="--real-size, --token-subspace: windows")
    p.add_argument("--student-epochs", type=int, default=3000, help="--real-size: max_epochs of each student")
    args = p.parse_args(argv)
    if args.dask_memory:
        res = dask_memory(args.seed)
        print(f"| {res['array_mib']:.0f} MiB | plain reduction {res['plain_peak_mib']:.0f} MiB, {res['plain_seconds']:.1f} s"
              f" | fit {res['fit_peak_mib']:.0f} MiB, {res['fit_seconds']:.1f} s (r = {res['rank']}, "
              f"{res['inversion']}) | budget {res['budget_mib']:.0f} MiB | over the plain peak: "
              f"{res['fit_peak_mib'] - res['plain_peak_mib']:.0f} MiB |")
        return
    layers = None if args.all_heads else [int(v) for v in args.layers.split(",")]
    heads = None if args.all_heads else [int(v) for v in args.heads.split(",")]
    if args.real_size:
        ranks = None if args.student_ranks is None else [int(v) for v in args.student_ranks.split(",")]
        res = real_size(layers, heads, args.seq_len, args.n_samples, args.devices.split(","), args.student_epochs,
                        args.seed, no_students=args.no_students, model_name=args.model, student_ranks=ranks)
        _save(args.out, "real_size", res)
        print(_real_size_markdown(res))
        return
    if args.token_subspace:
        res = token_subspace(layers, heads, args.seq_len, args.n_samples, args.seed)
        _save(args.out, "token_subspace", res)
        print(_token_subspace_markdown(res))
        return
    if args.replot:
        _figures(json.loads(Path(args.replot).read_text()), Path(args.docs_figures or args.out))
        return
    global DEVICE
    DEVICE = args.device
    if args.shapes:
        points = [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]
        rows = scaling_shape(points, 2000, args.seed)
        _save(args.out, "shapes", rows)
        for r in rows:
            print(f"| {r['T']} | {r['d']} | {r['n']} | {r['seconds']:.2f} s | {r['gram_seconds']:.2f} s | "
                  f"{r['peak_mib']:.0f} MiB | {r['data_mib']:.0f} MiB | {r['inversion']} | {r['rank']} / {r['r']} |")
        return
    if args.stream_head:
        rows = stream_default(64, 64, 8, [10_000, 100_000, 1_000_000], args.seed)
        _save(args.out, "stream_head", rows)
        for r in rows:
            print(f"| {r['T']} | {r['d']} | {r['n']:,} | {r['fit']} | {r['seconds']:.0f} s | "
                  f"{r['generation_seconds']:.0f} s | {r['peak_mib']:.0f} MiB | {r['rank']} ({r['inversion']}) |")
        return
    quick = args.quick
    seed = args.seed
    res = dict(machine=f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
               date=time.strftime("%Y-%m-%d"), quick=quick, device=DEVICE)
    students = not (quick or args.no_students)
    res["head_to_head"] = head_to_head([("softmax", 32, 16, 3)], 1000 if quick else 2000, students, seed)
    if not quick:
        # linear QK: the students' sweep there costs about 10 minutes more (--qk-students)
        res["head_to_head"] += head_to_head([("linear_qk", 64, 32, 3)], 2000, students and args.qk_students, seed)
    if args.head_to_head:
        _save(args.out, "head_to_head", res)
        print(_markdown(res))
        return
    ns = [1000, 10_000, 100_000] if quick else [1000, 10_000, 100_000, 1_000_000]
    passes_max = args.passes_max_n or (10_000 if quick else 30_000)
    res["scaling_n"] = scaling_n(32, 16, 3, ns, passes_max, seed)
    res["recovery_n_10n"] = recovery_at_n_and_10n(32, 16, 3, 500 if quick else 2000, 2 if quick else 5, seed)
    points = ([(64, d, 4) for d in (16, 64, 128)] + [(T, 16, 4) for T in (8, 128)]) if quick else \
        ([(64, d, 8) for d in (16, 32, 64, 128, 384) + ((768,) if args.full else ())]
         + [(T, 16, 4) for T in (8, 32, 128, 512)])
    res["scaling_shape"] = scaling_shape(points, 2000, seed)
    out = _save(args.out, "speed", res)
    table = _markdown(res)
    (out / "speed.md").write_text(table)
    print(table)
    if args.docs_figures:
        _figures(res, Path(args.docs_figures))


if __name__ == "__main__":
    main()
