"""Samples that live outside the estimator: arrays, re-iterable batches and dask arrays, read in passes.

Every inversion's statistic is a sum over samples (one pass, memory
independent of n). The least-squares softmax inversion needs more: its fit
(L-BFGS) and its information are sums over samples *at the current kernel*,
so each evaluation is a further pass. Where the samples fit within the
memory budget an estimator keeps them; where they do not, these classes let
it make those passes explicitly over data it never holds:

* :class:`ArraySamples` — arrays in memory (the kept samples), read in chunks;
* :class:`BatchSamples` — a list of ``(X, Y)`` batches, or a function that
  returns a fresh iterable of them at each call (e.g. reading files, or a
  model's activations recomputed), for
  :meth:`rstar.RStarEstimator.fit_batches`;
* :class:`DaskSamples` — a pair of ``dask.array`` arrays chunked along
  samples, whose per-chunk sums are computed where the chunks live (a
  ``distributed`` cluster included), for ``fit`` on dask arrays.

Each offers :meth:`Samples.map_sum` (the sum over chunks of a function of
``(X_chunk, Y_chunk)``), :meth:`Samples.chunks` (the chunks in order, one at a
time) and :meth:`Samples.halves` (the odd and even samples by global index,
materialised, for the inversions that need them in memory).
"""

import copy
import dataclasses
import os

import numpy as np
from sklearn.utils.validation import check_is_fitted

from ._backend import resolve_backend
from ._validation import check_X_Y, check_X_Y_and_y_ndim
from .calibration import DEFAULT_CALIBRATION

__all__ = ["Samples", "ArraySamples", "BatchSamples", "DaskSamples", "StreamingFitMixin", "is_dask_collection"]



def chunk_slices(n, per_sample, chunk_entries=DEFAULT_CALIBRATION.chunk_entries):
    """Slices of ``range(n)`` holding at most ``chunk_entries // per_sample`` samples each (at least one):
    ``chunk_entries`` bounds the float entries of one chunk's largest temporary (e.g. its attention weights,
    ``chunk x T^2``; the calibration's ``chunk_entries``)."""
    step = max(1, chunk_entries // max(int(per_sample), 1))
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


def scaled_chunks(X, Y, per_sample, chunk_entries, x_scale, y_scale):
    """A batch's chunks (:func:`chunk_slices`), validated and each rescaled on its own (``X / x_scale``,
    ``Y / y_scale``): the batch is never copied whole."""
    X, Y = check_X_Y(X, Y)
    for part in chunk_slices(X.shape[0], per_sample, chunk_entries):
        yield X[part] / x_scale, Y[part] / y_scale


def _add(total, part):
    if total is None:
        return part
    if isinstance(part, tuple):
        return tuple(_add(a, b) for a, b in zip(total, part))
    return total + part


def _sums_of_squares(X, Y):
    return float(np.sum(X**2)), float(np.sum(Y**2))


# -- samples kept for least-squares fits ---------------------------------------------------------------


def start_keeping_samples(stats, budget, prefix=False):
    """Mark ``stats`` as keeping its samples in halves (odd / even global index), within ``budget``.

    With ``prefix=True`` the first samples that fit the budget are kept (``stats["n_kept"]`` of them) once the
    others no longer do; otherwise all of them are dropped then."""
    stats["samples_odd"] = []
    stats["samples_even"] = []
    stats["sample_budget_bytes"] = int(budget.memory_bytes)
    if prefix:
        stats["n_kept"] = 0


def keep_half_samples(stats, X, Y, odd):
    """Append a batch's samples to ``stats["samples_odd"]`` / ``stats["samples_even"]`` (lists, so
    :func:`merge_stats` concatenates), or drop both for good once they exceed the memory budget.
    ``stats["n"]`` must already count the batch."""
    if stats.get("samples_odd") is None:
        return
    if "n_kept" in stats:
        room = sample_capacity(stats) - stats["n_kept"]
        if room <= 0:
            return
        X, Y, odd = X[:room], Y[:room], odd[:room]
        stats["n_kept"] += X.shape[0]
    elif drop_samples_over_budget(stats):
        return
    for key, mask in (("samples_odd", odd), ("samples_even", ~odd)):
        if mask.any():
            stats[key].append((np.asarray(X[mask], dtype=float), np.asarray(Y[mask], dtype=float)))


def sample_capacity(stats):
    """How many samples of these dimensions are kept at most: those that fit the sample budget, or fewer where
    the inversion says so (``stats["prefix_capacity"]``)."""
    T, d, d_v = stats["dims"]
    capacity = int(stats["sample_budget_bytes"] // (8 * T * (d + d_v)))
    return min(capacity, int(stats.get("prefix_capacity", capacity)))


def truncate_kept_samples(stats):
    """Keep only the leading samples (in list order, each half) that fit the budget (``n_kept`` mode)."""
    room = sample_capacity(stats)
    if stats["n_kept"] <= room:
        return
    # split the room between the halves as the samples came, odd and even alternating
    counts = [sum(x.shape[0] for x, _ in stats[key]) for key in ("samples_odd", "samples_even")]
    take_odd = min(counts[0], room // 2)
    take = {"samples_odd": take_odd, "samples_even": min(counts[1], room - take_odd)}
    for key, left in take.items():
        kept = []
        for X, Y in stats[key]:
            if left <= 0:
                break
            kept.append((X[:left], Y[:left]))
            left -= min(left, X.shape[0])
        stats[key] = kept
    stats["n_kept"] = take["samples_odd"] + take["samples_even"]


def drop_samples_over_budget(stats):
    """Drop the kept samples for good once ``8 n T (d + d_v)`` bytes exceed the budget; True if dropped."""
    T, d, d_v = stats["dims"]
    if 8 * stats["n"] * T * (d + d_v) > stats["sample_budget_bytes"]:
        stats["samples_odd"] = stats["samples_even"] = None
        return True
    return False


def kept_half(stats, key):
    """``(X, Y)`` of the samples kept under ``key``, concatenated once: the batches are replaced by the joined
    arrays, which later reads share (every fit reads its halves several times; each read had been a copy).
    Read-only: the arrays are the sums' own."""
    parts = stats[key]
    if len(parts) > 1:
        X, Y = zip(*parts)
        stats[key] = parts = [(np.concatenate(X), np.concatenate(Y))]
    return parts[0]


def stop_keeping_samples(stats):
    """Keep no samples in these sums (a pass over a source: they are read again, or materialised, after it)."""
    if "samples_odd" in stats:
        stats["samples_odd"] = stats["samples_even"] = None


def merge_stats(a, b):
    """Sum two statistics dicts from the same inversion (map-reduce).

    Parameters
    ----------
    a, b : dict
        From ``inversion.new_stats`` + ``inversion.update`` on two shards.

    Returns
    -------
    dict

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_linear_proxy
    >>> from rstar.inversions import TokenInversion, merge_stats
    >>> X, Y = make_linear_proxy(400, random_state=0)
    >>> inv = TokenInversion()
    >>> shards = []
    >>> for part in (slice(0, 200), slice(200, 400)):
    ...     stats = inv.new_stats(16, 12, 12)
    ...     inv.update(stats, X[part], Y[part])
    ...     shards.append(stats)
    >>> merged = merge_stats(*shards)
    >>> merged["n"], round(float(inv.whiten(merged).noise_variance), 4)
    (400, 0.0025)
    """
    if a.keys() != b.keys():
        raise ValueError(f"cannot merge statistics accumulated differently (e.g. under different budgets): keys "
                         f"{sorted(set(a) ^ set(b))} are in one only.")
    out = {}
    for key in a:
        if key in ("dims", "sample_budget_bytes", "prefix_capacity"):
            if a[key] != b[key]:
                raise ValueError(f"cannot merge statistics with different {key}: {a[key]} and {b[key]}.")
            out[key] = a[key]
        elif a[key] is None or b[key] is None:
            out[key] = None
        else:
            out[key] = a[key] + b[key]
    if out.get("samples_odd") is not None:
        # each shard kept its samples within the budget; together they may not (as in one pass)
        if "n_kept" in out:
            truncate_kept_samples(out)
        else:
            drop_samples_over_budget(out)
    return out


def is_dask_collection(obj):
    """Whether ``obj`` is a dask collection (without importing dask unless it already is one)."""
    if not type(obj).__module__.startswith("dask"):
        return False
    from dask import is_dask_collection as _is

    return bool(_is(obj))


class Samples:
    """Samples read in passes: the interface the multi-pass fits use.

    Subclasses implement :meth:`batches` (the raw ``(X, Y)`` batches of one
    pass, in a fixed order); a pass validates each and applies the scales
    ``x_scale`` and ``y_scale`` (the estimator's internal units).
    """

    x_scale = 1.0
    y_scale = 1.0
    #: whether the samples are held in memory (a pass costs no reading; per-sample results may be cached)
    in_memory = False
    #: float entries of one chunk's largest temporary (the calibration's ``chunk_entries``)
    chunk_entries = DEFAULT_CALIBRATION.chunk_entries
    #: number of samples and ``(T, d, d_v)``, known after a first pass (:meth:`set_shape`)
    n_samples = None
    dims = None

    def set_shape(self, n_samples, dims):
        """Record what the first pass found: the number of samples and ``(T, d, d_v)``."""
        self.n_samples, self.dims = int(n_samples), tuple(int(v) for v in dims)
        return self

    def mean_squares(self):
        """``(mean X**2, mean Y**2)`` over every entry (one pass)."""
        T, d, d_v = self.dims
        sx, sy = self.map_sum(_sums_of_squares, T * (d + d_v))   # a chunk's squares: T (d + d_v) per sample
        return sx / (self.n_samples * T * d), sy / (self.n_samples * T * d_v)

    def batches(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _scaled_batches(self):
        for X, Y in self.batches():
            X, Y = check_X_Y(X, Y)
            yield X / self.x_scale, Y / self.y_scale

    def chunks(self, per_sample=1):
        """The samples of one pass, in order, as ``(X, Y)`` float arrays of at most ``chunk_entries // per_sample``
        samples each (each chunk rescaled on its own: a batch is never copied whole)."""
        for X, Y in self.batches():
            yield from scaled_chunks(X, Y, per_sample, self.chunk_entries, self.x_scale, self.y_scale)

    def map_sum(self, fn, per_sample, *args):
        """``sum over chunks of fn(X_chunk, Y_chunk, *args)`` (tuples summed entry-wise), in chunk order."""
        total = None
        for X, Y in self.chunks(per_sample):
            total = _add(total, fn(X, Y, *args))
        return total

    def y_sum_of_squares(self):
        """``sum Y**2`` over every entry (one pass)."""
        T, d, d_v = self.dims
        return float(self.map_sum(_sums_of_squares, T * (d + d_v))[1])

    def rescaled(self, fx, fy):
        """This source with X divided by ``fx`` and Y by ``fy`` (a copy; the data are not read)."""
        out = copy.copy(self)
        out.x_scale, out.y_scale = self.x_scale * float(fx), self.y_scale * float(fy)
        return out

    def halves(self, n_first=None):
        """``(odd, even)``: lists of ``(X, Y)`` of the samples with odd / even global index (materialised), of
        the first ``n_first`` samples only if given."""
        odd_parts, even_parts, start = [], [], 0
        for X, Y in self._scaled_batches():
            if n_first is not None:
                if start >= n_first:
                    break
                X, Y = X[:n_first - start], Y[:n_first - start]
            odd = (start + np.arange(X.shape[0])) % 2 == 1
            start += X.shape[0]
            for parts, mask in ((odd_parts, odd), (even_parts, ~odd)):
                if mask.any():
                    parts.append((X[mask], Y[mask]))
        return odd_parts, even_parts

    def with_scales(self, x_scale, y_scale):
        """This source read in the estimator's internal units (``X / x_scale``, ``Y / y_scale``)."""
        self.x_scale, self.y_scale = float(x_scale), float(y_scale)
        return self


class ArraySamples(Samples):
    """Samples held in memory as arrays (already validated and scaled), read in chunks; with
    :meth:`~Samples.with_scales` read in internal units, each chunk rescaled as it is read (no scaled copy of the
    samples is made; :meth:`batches` and :meth:`rescaled` make one).

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)
    chunk_entries : int or None
        Float entries of one chunk's largest temporary (None: the default calibration's ``chunk_entries``).

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.streaming import ArraySamples
    >>> s = ArraySamples(np.ones((10, 4, 3)), np.ones((10, 4, 2)))
    >>> s.map_sum(lambda X, Y: float(np.sum(Y)), 4)
    80.0
    """

    in_memory = True

    def __init__(self, X, Y, chunk_entries=None):
        self.X, self.Y = X, Y
        self.n_samples = X.shape[0]
        if chunk_entries is not None:
            self.chunk_entries = int(chunk_entries)
        self.dims = (X.shape[1], X.shape[2], 0 if Y is None else Y.shape[2])

    def _unscaled(self):
        return self.x_scale == 1.0 and self.y_scale == 1.0

    def chunks(self, per_sample=1):
        for part in chunk_slices(self.n_samples, per_sample, self.chunk_entries):
            X, Y = self.X[part], None if self.Y is None else self.Y[part]
            yield (X, Y) if self._unscaled() else (X / self.x_scale, None if Y is None else Y / self.y_scale)

    def mean_squares(self):
        if self._unscaled():
            return float(np.mean(self.X**2)), float(np.mean(self.Y**2))
        return super().mean_squares()

    def y_sum_of_squares(self):
        return float(np.sum(self.Y**2)) / self.y_scale**2

    def rescaled(self, fx, fy):
        return ArraySamples(self.X / (self.x_scale * fx), self.Y / (self.y_scale * fy), self.chunk_entries)

    def batches(self):
        yield (self.X, self.Y) if self._unscaled() else (self.X / self.x_scale, self.Y / self.y_scale)

    def _scaled_batches(self):
        yield from self.batches()


class ArrayPartsSamples(Samples):
    """Samples held in memory as several array pairs (validated, in internal units), read in chunks in their order
    without joining them (a fit's two halves: odd samples, then even).

    Parameters
    ----------
    parts : sequence of (X, Y)
        Arrays of shapes (n_k, T, d) and (n_k, T, d_v).
    chunk_entries : int or None
        Float entries of one chunk's largest temporary (None: the default calibration's ``chunk_entries``).
    """

    in_memory = True

    def __init__(self, parts, chunk_entries=None):
        self.parts = [(X, Y) for X, Y in parts if X.shape[0]]
        self.n_samples = sum(X.shape[0] for X, _ in self.parts)
        if chunk_entries is not None:
            self.chunk_entries = int(chunk_entries)
        X, Y = self.parts[0]
        self.dims = (X.shape[1], X.shape[2], Y.shape[2])

    def chunks(self, per_sample=1):
        for X, Y in self.parts:
            for part in chunk_slices(X.shape[0], per_sample, self.chunk_entries):
                yield X[part], Y[part]

    def y_sum_of_squares(self):
        return float(sum(np.sum(Y**2) for _, Y in self.parts))

    def rescaled(self, fx, fy):
        return ArrayPartsSamples([(X / fx, Y / fy) for X, Y in self.parts], self.chunk_entries)

    def batches(self):
        yield from self.parts

    def _scaled_batches(self):
        yield from self.parts


class BatchSamples(Samples):
    """Samples given as batches, read again at every pass.

    Parameters
    ----------
    batches : sequence of (X, Y) pairs, or callable
        A list (or tuple) of ``(X_b, Y_b)`` array pairs, or a function of no
        arguments that returns a fresh iterable of them at each call (so a
        generator reading files can be passed as ``lambda: read(files)``).
        Every pass must return the same samples in the same order. A one-shot
        iterator is refused: the multi-pass fits would see it empty.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.streaming import BatchSamples
    >>> s = BatchSamples(lambda: ((np.ones((5, 4, 3)), np.ones((5, 4, 2))) for _ in range(3)))
    >>> s.map_sum(lambda X, Y: X.shape[0], 1)
    15
    """

    def __init__(self, batches):
        if callable(batches):
            self._make = batches
        elif isinstance(batches, (list, tuple)):
            self._make = lambda: batches
        else:
            raise TypeError("batches must be a list or tuple of (X, Y) pairs, or a function returning a fresh "
                            f"iterable of them at each call (got {type(batches).__name__}: a one-shot iterator "
                            "cannot be read more than once).")

    def batches(self):
        for k, batch in enumerate(self._make()):
            try:
                X, Y = batch
            except (TypeError, ValueError) as exc:
                raise ValueError(f"batch {k} must be an (X, Y) pair, got {type(batch).__name__}.") from exc
            yield X, Y


def update_step(T, d, d_v, entries):
    """Samples per update of the sums: ``entries`` bound the rescaled (X, Y) of a step or its per-sample ``d x d``
    temporaries, whichever is larger per sample."""
    return max(1, int(entries) // max(T * (d + d_v), d * d))


def _block_statistic(inv, X, Y, x_scale, y_scale, start, entries):
    """The sums of one chunk of samples whose global indices start at ``start`` (the split halves follow the
    global index), without keeping the samples: ``[stats]`` (a dask bag partition). The chunk is added
    ``update_step(..., entries)`` samples at a time, rescaled step by step (not a rescaled copy of the chunk)."""

    X, Y = check_X_Y(X, Y)
    stats = inv.new_stats(X.shape[1], X.shape[2], Y.shape[2])
    stop_keeping_samples(stats)
    stats["n"] = int(start)
    step = update_step(X.shape[1], X.shape[2], Y.shape[2], entries)
    for lo in range(0, X.shape[0], step):
        inv.update(stats, X[lo:lo + step] / x_scale, Y[lo:lo + step] / y_scale)
    stats["n"] -= int(start)
    return [stats]


def _worker_entries(inv):
    """Float entries one dask worker's update may hold at once: the calibration's ``update_chunk_entries``, and
    at most the memory budget shared by the scheduler's workers (each holding a rescaled step and its
    temporaries: half each). A 781 MiB lazily generated array (T = 32, d = 16, chunks of 5000 samples, two
    threads) fitted with ``memory_budget=2**26`` peaked at 420 MiB of traced memory with whole rescaled chunks.
    The later passes' chunks are the calibration's ``chunk_temporaries`` times smaller, so that they hold half
    the budget, and the samples kept get the other half (the fit's ``CostBudget.reserved_bytes``)."""
    budget = inv.budget.memory_bytes // (8 * 2 * _workers())
    return max(1, min(inv.calibration.update_chunk_entries, budget))


def _workers():
    """The dask scheduler's workers reading chunks side by side (its ``num_workers``, else the cores)."""
    import dask

    return max(1, int(dask.config.get("num_workers", None) or os.cpu_count() or 1))


def _merge_all(parts):

    parts = list(parts)
    out = parts[0]
    for part in parts[1:]:
        out = merge_stats(out, part)
    return out


def _dask_block_sum(X, Y, fn, per_sample, x_scale, y_scale, args, chunk_entries):
    """One dask chunk's share of :meth:`Samples.map_sum` (runs where the chunk lives), its sub-chunks rescaled one
    at a time (not a rescaled copy of the chunk)."""
    total = None
    for Xc, Yc in scaled_chunks(X, Y, per_sample, chunk_entries, x_scale, y_scale):
        total = _add(total, fn(Xc, Yc, *args))
    return total


class DaskSamples(Samples):
    """Samples in a pair of ``dask.array`` arrays, chunked along the samples only.

    :meth:`map_sum` computes each chunk's sum where the chunk lives (on a
    ``distributed`` cluster, its workers) and adds the small results in chunk
    order; :meth:`chunks` computes one chunk at a time.

    Parameters
    ----------
    X : dask.array.Array of shape (n, T, d)
    Y : dask.array.Array of shape (n, T, d_v)
        Rechunked to X's chunks along the samples and to one chunk along the
        other axes.
    """

    def __init__(self, X, Y):
        import dask.array as da

        if not (is_dask_collection(X) and is_dask_collection(Y)):
            raise TypeError("DaskSamples needs X and Y as dask arrays (use dask.array.from_array).")
        for name, A in (("X", X), ("Y", Y)):
            if A.ndim not in (2, 3):
                raise ValueError(f"{name} must have shape (n_samples, T, features) (or 2-D, read as T = 1); got a "
                                 f"dask array with {A.ndim} dimension(s) and shape {A.shape}.")
        X = X[:, None, :] if X.ndim == 2 else X
        Y = Y[:, None, :] if Y.ndim == 2 else Y
        if X.shape[0] != Y.shape[0]:
            raise ValueError(f"X and Y have different numbers of samples: {X.shape[0]} and {Y.shape[0]}.")
        self.X = X.rechunk({1: -1, 2: -1})
        self.Y = da.asarray(Y).rechunk({0: self.X.chunks[0], 1: -1, 2: -1})
        self.n_samples = int(X.shape[0])

    @property
    def n_blocks(self):
        return len(self.X.chunks[0])

    def block(self, k):
        """The k-th chunk's ``(X, Y)``, computed (raw units)."""
        import dask

        return dask.compute(self.X.blocks[k], self.Y.blocks[k])

    def batches(self):
        for k in range(self.n_blocks):
            yield self.block(k)

    def delayed_blocks(self):
        """``[(X_block, Y_block)]`` as ``dask.delayed`` objects, in order."""
        return list(zip(self.X.to_delayed().ravel(), self.Y.to_delayed().ravel()))

    def statistic(self, inversion, x_scale, y_scale, split_every=2):
        """An inversion's sums over every chunk (without the samples), each chunk's computed where it lives and
        reduced by ``dask.bag``'s tree reduction, in units ``X / x_scale``, ``Y / y_scale``."""
        import dask
        import dask.bag as db

        starts = np.concatenate([[0], np.cumsum(self.X.chunks[0])[:-1]])
        entries = _worker_entries(inversion)
        parts = [dask.delayed(_block_statistic)(inversion, xb, yb, x_scale, y_scale, int(start), entries)
                 for (xb, yb), start in zip(self.delayed_blocks(), starts)]
        return db.from_delayed(parts).reduction(_merge_all, _merge_all, split_every=split_every).compute()

    def map_sum(self, fn, per_sample, *args):
        import dask

        parts = [dask.delayed(_dask_block_sum)(xb, yb, fn, per_sample, self.x_scale, self.y_scale, args,
                                               self.chunk_entries)
                 for xb, yb in self.delayed_blocks()]
        total = None
        for part in dask.compute(*parts):
            total = _add(total, part)
        return total


def place_samples(stats, samples, inversion, budget, dims):
    """After a pass over ``samples`` that kept none: keep them in ``stats`` as ``partial_fit`` would (all within
    the memory budget, or the first ones within the compute budget where the inversion keeps a prefix), or
    leave them to be read in passes where the inversion can (:class:`rstar.inversions.Capabilities`).
    The samples kept stay within ``budget.max_samples`` (the memory budget less what it reserves for the passes).
    Returns whether the inversion reads them in passes."""
    if "samples_odd" not in stats:
        return False
    n = stats["n"]
    capacity = budget.max_samples(*dims)
    if "sample_budget_bytes" in stats:
        capacity = min(capacity, sample_capacity(stats))
    if n <= capacity:
        # within the budget: keep them, as partial_fit would
        stats["samples_odd"], stats["samples_even"] = samples.halves()
        if "n_kept" in stats:
            stats["n_kept"] = n
    elif inversion.capabilities.reads_sample_passes and inversion.fit_possible(stats, samples):
        return True   # over the memory budget only: the least squares reads them in passes
    elif "n_kept" in stats:
        # over the compute budget: the first samples within it, as partial_fit would keep
        stats["samples_odd"], stats["samples_even"] = samples.halves(capacity)
        stats["n_kept"] = capacity
    return False


# -- the estimators' streaming, shard and dask fitting ------------------------------------------------------------

#: The fitted attributes :meth:`rstar.estimators._RankEstimator._finalize` sets, computed on first access after
#: ``partial_fit``.
_LAZY_FITTED = ("rank_", "effective_rank_", "spectrum_", "threshold_", "noise_variance_", "spike_strengths_",
                "p_values_", "rank_interval_", "n_columns_", "components_", "inversion_", "inversion_reason_",
                "null_model_", "noise_source_", "noise_floor_rank_", "noise_floor_interval_", "verdicts_",
                "_operator_cache")


def same_config(a, b):
    """Whether two frozen inversion configurations (dicts of parameters, arrays among them) are equal."""
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


class StreamingFitMixin:
    """How a data-only estimator takes its samples: in one array, in batches (``partial_fit``), in passes over
    batches (``fit_batches``), as dask arrays, in shards merged later (``new_shard`` / ``merge``), or from another
    estimator's sums (``fit_from``). The estimator provides ``_validate_params_``, ``_start``,
    ``_inversion_config``, ``_check_rank_params`` and ``_finalize``."""

    def _reset(self):
        for attr in ("_stats", "_inv", "_whitened", "_shared_statistic", "_samples_read_in_passes"):
            if hasattr(self, attr):
                delattr(self, attr)

    def fit_batches(self, batches):
        """Estimate r* from samples given in batches, read in as many passes as the inversion needs.

        The first pass accumulates the sums every inversion is built on
        (memory independent of the number of samples, as with
        :meth:`partial_fit`). Where the inversion needs the samples
        themselves, they are kept if they fit ``memory_budget`` (the result is
        then that of ``partial_fit`` over the same batches); if they do not,
        the least-squares softmax fit reads the batches again at every
        evaluation of its loss (``O(n T^2 (d + d_v))`` each, usually tens to a
        few hundred passes) instead of falling back to first order, and the
        other inversions that need their samples (the query–key cross-fit,
        the linear proxy's split-half statistic beyond its moment sums) fall
        back with an :class:`~rstar.exceptions.InversionFallbackWarning` as
        ``partial_fit`` does. The internal units are set by the first batch.

        Parameters
        ----------
        batches : list of (X, Y) pairs, or callable
            ``(X_b, Y_b)`` pairs of shapes ``(n_b, T, d)`` and
            ``(n_b, T, d_v)``, or a function of no arguments returning a fresh
            iterable of them at each call (e.g. ``lambda: read(files)``); every
            pass must yield the same samples in the same order
            (:class:`rstar.streaming.BatchSamples`).

        Returns
        -------
        self

        Examples
        --------
        >>> from rstar import RStarEstimator
        >>> from rstar.datasets import make_attention_task
        >>> X, Y = make_attention_task(1000, seq_len=32, n_features=16, rank=3, random_state=0)
        >>> batches = lambda: ((X[i:i + 250], Y[i:i + 250]) for i in range(0, 1000, 250))
        >>> est = RStarEstimator(memory_budget=2**20).fit_batches(batches)   # 1 MiB: the samples are not kept
        >>> est.rank_, est.inversion_
        (3, 'softmax_least_squares')
        """
        self._reset()
        return self._fit_samples(BatchSamples(batches))

    def _fit_dask(self, X, Y):
        import dask.array as da

        X, Y = (A if is_dask_collection(A) else da.from_array(np.asarray(A)) for A in (X, Y))
        return self._fit_samples(DaskSamples(X, Y))

    def new_shard(self):
        """An empty copy of this fitted estimator, in its units and configuration, to ``partial_fit`` on a shard
        of the data and :meth:`merge` back (map-reduce).

        Returns
        -------
        shard : estimator
            Unfitted sums (no sample seen) with this estimator's internal units
            and inversion.

        Examples
        --------
        >>> from rstar import MPRankEstimator
        >>> from rstar.datasets import make_linear_proxy
        >>> X, Y = make_linear_proxy(900, rank=3, random_state=0)
        >>> est = MPRankEstimator().partial_fit(X[:300], Y[:300])
        >>> shard = est.new_shard().partial_fit(X[300:], Y[300:])   # e.g. on another machine
        >>> est.merge(shard).n_samples_seen_, est.rank_ == MPRankEstimator().fit(X, Y).rank_
        (900, True)
        """
        check_is_fitted(self, "rank_")
        shard = copy.copy(self)
        shard._stats = self._inv.new_stats(*self._dims)
        shard._shared_statistic = False
        shard._whitened = None
        shard._samples_read_in_passes = False
        for attr in [a for a in vars(shard) if a.endswith("_") and not a.startswith("_") and a != "n_features_in_"]:
            delattr(shard, attr)
        return shard

    def merge(self, *shards):
        """Add the sums of other estimators fitted on other samples: afterwards this estimator is fitted on all
        of them (equal to :meth:`fit` on the union up to round-off and the order of the samples).

        Parameters
        ----------
        *shards : estimators
            Made by :meth:`new_shard` of this estimator (or of one of its
            shards) and fitted with ``partial_fit``: the same units and
            inversion.

        Returns
        -------
        self

        Raises
        ------
        ValueError
            A shard in other units or with another inversion.
        """
        check_is_fitted(self, "rank_")
        for shard in (self,) + shards:
            if getattr(shard, "_samples_read_in_passes", False):
                raise ValueError("cannot merge an estimator that read its samples in passes (fit_batches or dask "
                                 "arrays): its least-squares fit needs them, and they were not kept.")
        for shard in shards:
            if not isinstance(shard, StreamingFitMixin) or not hasattr(shard, "_stats"):
                raise ValueError(f"merge needs shards fitted with partial_fit, got {type(shard).__name__}.")
            if (shard._x_scale, shard._y_scale) != (self._x_scale, self._y_scale) or not same_config(
                    shard._config, self._config):
                raise ValueError("cannot merge a shard in other units or with another inversion: make each shard "
                                 "with new_shard() of one fitted estimator, then partial_fit it.")
        if self._shared_statistic:
            self._stats = copy.deepcopy(self._stats)
            self._shared_statistic = False
        for shard in shards:
            self._stats = merge_stats(self._stats, shard._stats)
        self._whitened = None
        self._finalize()
        return self

    def _fit_samples(self, samples):
        """Fit from a :class:`Samples` source: one pass of sums, then the kept samples or the source read in
        passes."""
        self._validate_params_()
        if isinstance(samples, DaskSamples):
            self._start(*self._validated(*samples.block(0)))
            stats = samples.statistic(self._inv, self._x_scale, self._y_scale)
            self._stats = merge_stats(self._stats, stats)
        else:
            for k, (X, Y) in enumerate(samples.batches()):
                X, Y, y_ndim = self._validated(X, Y)
                if k == 0:
                    self._start(X, Y, y_ndim)
                    stop_keeping_samples(self._stats)
                else:
                    self._check_next(X, Y)
                self._update(X, Y)
            if not hasattr(self, "_stats"):
                raise ValueError("batches gave no (X, Y) batch.")
        samples.set_shape(self._stats["n"], self._dims).with_scales(self._x_scale, self._y_scale)
        samples.chunk_entries = self._config["calibration"].chunk_entries
        if isinstance(samples, DaskSamples):
            # the workers read chunks side by side: their temporaries share the memory budget
            temporaries = self._config["calibration"].chunk_temporaries
            samples.chunk_entries = min(samples.chunk_entries, _worker_entries(self._inv) // temporaries)
            # ... and the passes after this one run beside the samples kept, which get the rest of the budget
            # (the inversion's choice counts the same)
            self._budget = dataclasses.replace(
                self._budget, reserved_bytes=8 * _workers() * temporaries * samples.chunk_entries)
        passes = place_samples(self._stats, samples, self._inv, self._budget, self._dims)
        self._samples_read_in_passes = passes
        self._check_enough_samples()
        self._finalize(samples if passes else None, curve_samples=samples)
        if passes and self.predict_sums:
            # the operator needs the samples too: fitted now, while they can be read
            self._operator_cache["operator"] = self._inv.fit_operator(
                self._stats, self.components_, samples=samples, ops=resolve_backend(self.device))
        return self

    def partial_fit(self, X, Y):
        """Add a batch of samples; after the last batch the fitted attributes
        equal those of :meth:`fit` on all batches together (up to round-off).

        Parameters
        ----------
        X : array-like of shape (n_batch, T, d)
        Y : array-like of shape (n_batch, T, d_v)

        Returns
        -------
        self

        Notes
        -----
        The fitted attributes (``rank_``, ``spectrum_``, ``inversion_`` …)
        are computed when first read after a batch, not at every batch: a
        stream of many batches then costs one inversion and rule, not one per
        batch (the least-squares softmax fit on all samples so far would
        otherwise run again at each). The warnings of that computation are
        issued then. ``n_samples_seen_`` is updated at once, and errors about
        the data (shapes, values, too few samples, a ``rank`` or ``max_rank``
        beyond the statistic's dimension) are raised by ``partial_fit``
        itself.
        """
        return self._fit_batch(X, Y, lazy=True)

    def __getattr__(self, name):
        # after partial_fit the fitted attributes are computed on first access (see partial_fit)
        if name in _LAZY_FITTED and self.__dict__.get("_pending_finalize", False):
            self._finalize()
            return getattr(self, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def fit_from(self, fitted):
        """Fit this estimator's rule on the statistic another estimator has accumulated.

        The rule runs on ``fitted``'s sums and whitened statistic without a
        pass over the data: the result equals ``fit`` on the same data.
        ``fitted`` must have been fitted with the same inversion (operator,
        method, value map, budgets, ``random_state``, ``n_null_draws``,
        ``predict_sums``, ``calibration``); later ``partial_fit`` calls on
        either continue from a copy of the sums.

        Parameters
        ----------
        fitted : fitted rstar data-only estimator

        Returns
        -------
        self

        Raises
        ------
        ValueError
            If ``fitted`` would not build the same inversion.

        Examples
        --------
        >>> from rstar import MPRankEstimator, RStarEstimator
        >>> from rstar.datasets import make_linear_proxy
        >>> X, Y = make_linear_proxy(500, rank=3, random_state=0)
        >>> ref = RStarEstimator(operator="linear_proxy").fit(X, Y)
        >>> MPRankEstimator(alpha=0.003).fit_from(ref).rank_ == MPRankEstimator(alpha=0.003).fit(X, Y).rank_
        True
        """
        check_is_fitted(fitted, "rank_")
        if not isinstance(fitted, StreamingFitMixin):
            raise ValueError(f"fit_from needs a fitted rstar data-only estimator, got {type(fitted).__name__}.")
        self._validate_params_()
        if self.tolerance is not None:
            raise ValueError("tolerance needs the samples (its risk curve measures each rank's model on them), "
                             "which fit_from does not read: fit on the data instead.")
        mine = self._inversion_config(fitted._dims, fitted._x_scale, fitted._y_scale)
        # what fitted's statistic was built with (its parameters may have changed since)
        if not same_config(mine, fitted._config):
            raise ValueError(f"{type(self).__name__} would build a different inversion than {type(fitted).__name__} "
                             "(operator, method, value map, budgets, random_state, n_null_draws, predict_sums or "
                             "calibration differ): fit it on the data instead.")
        for attr in ("n_features_in_", "_dims", "_y_ndim", "_x_scale", "_y_scale", "_inv", "_stats", "_budget",
                     "_seed", "_value_map_internal", "_config", "_samples_read_in_passes"):
            setattr(self, attr, getattr(fitted, attr))
        self._whitened = getattr(fitted, "_whitened", None)
        self._shared_statistic = fitted._shared_statistic = True
        self._finalize()
        return self

    def _validated(self, X, Y):
        """``(X, Y, y_ndim)``: X and Y as 3-D float arrays (a 2-D X read as T = 1, a 1-D Y as one output) and
        the number of dimensions of the Y given (what ``predict`` returns)."""
        return check_X_Y_and_y_ndim(X, Y)

    def _check_next(self, X, Y):
        """A later batch must match the first one's shape and the configuration frozen then."""
        n, T, d = X.shape
        d_v = Y.shape[2]
        T0, d0, dv0 = self._dims
        if d != d0:
            raise ValueError(f"X has {d} features, but {type(self).__name__} is expecting {d0} features "
                             "as input (from the first partial_fit batch).")
        if d_v != dv0:
            raise ValueError(f"Y has {d_v} output features, but earlier batches had d_v={dv0}.")
        if T != T0:
            raise ValueError(f"X has T={T} tokens, but earlier batches had T={T0}; partial_fit batches "
                             "must share the sequence length.")
        if not same_config(self._inversion_config(self._dims, self._x_scale, self._y_scale), self._config):
            raise ValueError("a parameter that defines the inversion (operator, method, value_map, budgets, "
                             "random_state, n_null_draws, predict_sums, calibration) changed since the first "
                             "partial_fit batch: call fit to start again with the new parameters.")

    def _update(self, X, Y):
        """Add a batch to the sums, ``update_chunk_entries`` entries of (X, Y) at a time (so an update's
        temporaries stay bounded whatever the batch size)."""
        step = update_step(*self._dims, self._config["calibration"].update_chunk_entries)
        for start in range(0, X.shape[0], step):
            part = slice(start, start + step)
            self._inv.update(self._stats, X[part] / self._x_scale, Y[part] / self._y_scale)

    def _check_enough_samples(self, so_far=False):
        """One line where the samples are too few for the inversion; ``so_far`` where more batches may follow
        (partial_fit)."""
        n_total = self._stats["n"]
        need = self._inv.min_samples(*self._dims)
        if n_total < need:
            found, more = ((f"{n_total} sample(s) so far", f"add batches of at least {need - n_total} more sample(s)")
                           if so_far else (f"{n_total} sample(s)", "give more samples"))
            raise ValueError(f"Found {found}, but {type(self).__name__} needs at least {need} samples for its "
                             f"{self._inv.name} inversion at T={self._dims[0]}, d={self._dims[1]}: {more}.")

    def _fit_batch(self, X, Y, lazy=False):
        self._validate_params_()
        if lazy and self.tolerance is not None:
            raise ValueError("tolerance needs the samples at the end of the fit (its risk curve measures each rank's "
                             "model on them), which partial_fit does not keep: use fit, or fit_batches with every "
                             "batch.")
        X, Y, y_ndim = self._validated(X, Y)
        if not hasattr(self, "_stats"):
            self._start(X, Y, y_ndim)
        else:
            self._check_next(X, Y)
            if self._samples_read_in_passes:
                raise ValueError("this estimator read its samples in passes (fit_batches or dask arrays) and did "
                                 "not keep them, so partial_fit cannot add to its least-squares fit: call "
                                 "fit_batches again with every batch.")
            if getattr(getattr(self, "_budget", None), "reserved_bytes", 0):
                # a dask fit's samples kept beside its passes; partial_fit reads no passes: the whole budget again
                self._budget = dataclasses.replace(self._budget, reserved_bytes=0)
            if self._shared_statistic:
                # the sums came from another estimator (fit_from): continue from a copy
                self._stats = copy.deepcopy(self._stats)
                self._shared_statistic = False
        self._update(X, Y)
        self._whitened = None
        self._check_enough_samples(so_far=lazy)
        if lazy:
            self._check_rank_params(self._inv.statistic_dim(*self._dims[:2]))
            for attr in _LAZY_FITTED:
                self.__dict__.pop(attr, None)
            self.n_samples_seen_ = int(self._stats["n"])
            self._pending_finalize = True
        else:
            # read in internal units chunk by chunk: a scaled copy of the samples would be held through the fit
            self._finalize(curve_samples=ArraySamples(X, Y, self._config["calibration"].chunk_entries)
                           .with_scales(self._x_scale, self._y_scale))
        return self

    def __getstate__(self):
        # the cached whitened statistic holds the null draws and d^2 x d^2 factors: recomputed on demand
        # (deterministically, from the seed) rather than pickled
        state = super().__getstate__()
        if not state.get("_samples_read_in_passes", False):
            # (a fit that read its samples in passes keeps it: it could not be recomputed)
            state.pop("_whitened", None)
        return state
