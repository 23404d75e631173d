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

import numpy as np

from ._validation import check_X_Y

__all__ = ["Samples", "ArraySamples", "BatchSamples", "DaskSamples", "is_dask_collection"]

#: Float entries of one chunk's largest temporary (e.g. its attention weights, ``chunk x T^2``).
CHUNK_ENTRIES = 2**20


def chunk_slices(n, per_sample):
    """Slices of ``range(n)`` holding at most ``CHUNK_ENTRIES // per_sample`` samples each (at least one)."""
    step = max(1, CHUNK_ENTRIES // max(int(per_sample), 1))
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


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
    """``(X, Y)`` of the samples kept under ``key``, concatenated."""
    X, Y = zip(*stats[key])
    return np.concatenate(X), np.concatenate(Y)


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
    #: number of samples and ``(T, d, d_v)``, known after a first pass (:meth:`set_shape`)
    n_samples = None
    dims = None

    def set_shape(self, n_samples, dims):
        """Record what the first pass found: the number of samples and ``(T, d, d_v)``."""
        self.n_samples, self.dims = int(n_samples), tuple(int(v) for v in dims)
        return self

    def mean_squares(self):
        """``(mean X**2, mean Y**2)`` over every entry (one pass)."""
        sx, sy = self.map_sum(_sums_of_squares, 1)
        T, d, d_v = self.dims
        return sx / (self.n_samples * T * d), sy / (self.n_samples * T * d_v)

    def batches(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _scaled_batches(self):
        for X, Y in self.batches():
            X, Y = check_X_Y(X, Y)
            yield X / self.x_scale, Y / self.y_scale

    def chunks(self, per_sample=1):
        """The samples of one pass, in order, as ``(X, Y)`` float arrays of at most ``CHUNK_ENTRIES // per_sample``
        samples each."""
        for X, Y in self._scaled_batches():
            for part in chunk_slices(X.shape[0], per_sample):
                yield X[part], Y[part]

    def map_sum(self, fn, per_sample, *args):
        """``sum over chunks of fn(X_chunk, Y_chunk, *args)`` (tuples summed entry-wise), in chunk order."""
        total = None
        for X, Y in self.chunks(per_sample):
            total = _add(total, fn(X, Y, *args))
        return total

    def y_sum_of_squares(self):
        """``sum Y**2`` over every entry (one pass)."""
        return float(self.map_sum(_sums_of_squares, 1)[1])

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
    """Samples held in memory as arrays (already validated and scaled), read in chunks.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.streaming import ArraySamples
    >>> s = ArraySamples(np.ones((10, 4, 3)), np.ones((10, 4, 2)))
    >>> s.map_sum(lambda X, Y: float(np.sum(Y)), 4)
    80.0
    """

    def __init__(self, X, Y):
        self.X, self.Y = X, Y
        self.n_samples = X.shape[0]
        self.dims = (X.shape[1], X.shape[2], 0 if Y is None else Y.shape[2])

    def chunks(self, per_sample=1):
        for part in chunk_slices(self.n_samples, per_sample):
            yield self.X[part], None if self.Y is None else self.Y[part]

    def mean_squares(self):
        return float(np.mean(self.X**2)), float(np.mean(self.Y**2))

    def y_sum_of_squares(self):
        return float(np.sum(self.Y**2))

    def rescaled(self, fx, fy):
        return ArraySamples(self.X / fx, self.Y / fy)

    def batches(self):
        yield self.X, self.Y

    def _scaled_batches(self):
        yield self.X, self.Y


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


def _block_statistic(inv, X, Y, x_scale, y_scale, start):
    """The sums of one chunk of samples whose global indices start at ``start`` (the split halves follow the
    global index), without keeping the samples: ``[stats]`` (a dask bag partition)."""

    X, Y = check_X_Y(X, Y)
    stats = inv.new_stats(X.shape[1], X.shape[2], Y.shape[2])
    stop_keeping_samples(stats)
    stats["n"] = int(start)
    inv.update(stats, X / x_scale, Y / y_scale)
    stats["n"] -= int(start)
    return [stats]


def _merge_all(parts):

    parts = list(parts)
    out = parts[0]
    for part in parts[1:]:
        out = merge_stats(out, part)
    return out


def _dask_block_sum(X, Y, fn, per_sample, x_scale, y_scale, args):
    """One dask chunk's share of :meth:`Samples.map_sum` (runs where the chunk lives)."""
    X, Y = check_X_Y(X, Y)
    return ArraySamples(X / x_scale, Y / y_scale).map_sum(fn, per_sample, *args)


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

    def statistic(self, inversion, x_scale, y_scale, split_every=8):
        """An inversion's sums over every chunk (without the samples), each chunk's computed where it lives and
        reduced by ``dask.bag``'s tree reduction, in units ``X / x_scale``, ``Y / y_scale``."""
        import dask
        import dask.bag as db

        starts = np.concatenate([[0], np.cumsum(self.X.chunks[0])[:-1]])
        parts = [dask.delayed(_block_statistic)(inversion, xb, yb, x_scale, y_scale, int(start))
                 for (xb, yb), start in zip(self.delayed_blocks(), starts)]
        return db.from_delayed(parts).reduction(_merge_all, _merge_all, split_every=split_every).compute()

    def map_sum(self, fn, per_sample, *args):
        import dask

        parts = [dask.delayed(_dask_block_sum)(xb, yb, fn, per_sample, self.x_scale, self.y_scale, args)
                 for xb, yb in self.delayed_blocks()]
        total = None
        for part in dask.compute(*parts):
            total = _add(total, part)
        return total
