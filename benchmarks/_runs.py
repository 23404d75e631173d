"""What the benchmarks that run long or put plans into models share: a journal that keeps each finished step and
resumes, and the plans as rows."""

import json
import os
import threading
import time
from pathlib import Path

import numpy as np


def records(table):
    """A table (pandas DataFrame, or list of dict without pandas) as a list of dict."""
    return table.to_dict("records") if hasattr(table, "to_dict") else list(table)


def plan_ranks(plan, keys):
    """The plan's rank of each ``(layer, head)`` in ``keys``, in that order."""
    by = {(int(p["layer"]), int(p["head"])): int(p["rank"]) for p in records(plan)}
    return [by[k] for k in keys]


class Journal:
    """A long run as it goes: each finished step appended as one JSON line to ``path`` (the run's options on the
    first), so an interrupted run continues with ``--resume`` where it stopped (a journal started with other
    options, or one found without ``--resume``, is a one-line refusal); the progress line gives the steps done and
    an estimate of the time left (the mean time of this run's steps so far)."""

    def __init__(self, path, record, resume, total):
        self.path, self.total, self.done, self.t0, self.timed = Path(path), int(total), {}, time.perf_counter(), []
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
        self.timed.append(time.perf_counter() - t)
        self.done[key] = value
        with open(self.path, "a") as fh:
            fh.write(json.dumps(dict(key=key, value=value)) + "\n")
        left = (self.total - len(self.done)) * float(np.mean(self.timed))
        print(f"  [{len(self.done)}/{self.total}] {time.perf_counter() - self.t0:.0f} s, about {left:.0f} s left",
              flush=True)
        return value


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
