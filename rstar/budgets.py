"""Cost budgets: the one place where rstar decides what a fit may spend.

Every inversion that can cost more than a few passes over the data checks
its memory and its arithmetic against a :class:`CostBudget` before it runs.
The budget is a parameter of every data-only estimator (``memory_budget``
in bytes, ``compute_budget`` in multiply-adds); crossing it never changes
the statistical test silently: :func:`rstar.inversions.choose_inversion`
picks another inversion and says why (an ``InversionFallbackWarning``), or,
where the user asked for that inversion by name, raises ``ValueError``.

What the defaults cost (measured on this project's reference machine, one
core of a shared 2-core x86-64 box, OpenBLAS): ``memory_budget = 512 MiB``
bounds the samples kept for a least-squares fit and each moment-sum array
(at most half of it); ``compute_budget = 2**39`` multiply-adds is of the
order of minutes of one core for the largest fit it admits (the largest
grid tasks of ``benchmarks/recovery.py`` that fit within it took up to
about 6 minutes).

The cost models are deliberately simple and conservative:

- the moment sums of the closed-form operator: ``8 * entries`` bytes per
  array (two arrays), each at most ``memory_budget / 2``;
- the samples a least-squares inversion keeps: ``8 n T (d + d_v)`` bytes;
- normal matrices and information of a ``d x d`` kernel: ``8 d^4`` bytes,
  at most ``memory_budget / 2``;
- alternating least squares of the cross-fitted query–key inversion:
  ``512 (n d^4 + d^6)`` (an allowance of 512 iterations);
- its L-BFGS fit on the profile loss: ``1024 n T d (d + d_v)``;
- the least-squares softmax fit: ``512 n T^2 (d + d_v)``;
- the softmax kernel's information: :func:`information_cost`.

Examples
--------
>>> from rstar.budgets import CostBudget
>>> budget = CostBudget()
>>> budget.memory_bytes // 2**20, budget.multiply_adds == 2**39
(512, True)
>>> budget.allows_samples(n=1000, T=32, d=16, d_v=16)
True
"""

from dataclasses import dataclass

from .calibration import DEFAULT_CALIBRATION

__all__ = [
    "CostBudget",
    "sample_bytes",
    "kernel_matrix_bytes",
    "cross_fit_als_cost",
    "cross_fit_profiled_cost",
    "softmax_fit_cost",
    "information_cost",
    "largest_count",
]

#: Bytes of a float64 (a fact, not calibration).
_FLOAT_BYTES = 8


def sample_bytes(n, T, d, d_v):
    """Bytes of ``n`` kept samples ``(X_i, Y_i)`` in float64: ``8 n T (d + d_v)``."""
    return _FLOAT_BYTES * n * T * (d + d_v)


def kernel_matrix_bytes(d):
    """Bytes of one ``d^2 x d^2`` float64 matrix (a normal matrix or information of a ``d x d`` kernel)."""
    return _FLOAT_BYTES * d**4


def cross_fit_als_cost(n, d, *, calibration=DEFAULT_CALIBRATION):
    """Multiply-adds of the cross-fit's alternating least squares: ``512 (n d^4 + d^6)`` (512 the calibration's
    ``cost_iterations``)."""
    return calibration.cost_iterations * (n * d**4 + d**6)


def cross_fit_profiled_cost(n, T, d, d_v, *, calibration=DEFAULT_CALIBRATION):
    """Multiply-adds of the cross-fit's L-BFGS fit on the profile loss: ``1024 n T d (d + d_v)`` (twice the
    calibration's ``cost_iterations``)."""
    return 2 * calibration.cost_iterations * n * T * d * (d + d_v)


def softmax_fit_cost(n, T, d, d_v, *, calibration=DEFAULT_CALIBRATION):
    """Multiply-adds of the least-squares softmax fit: ``512 n T^2 (d + d_v)`` (512 the calibration's
    ``cost_iterations``)."""
    return calibration.cost_iterations * n * T * T * (d + d_v)


def information_cost(n, T, d, d_v, value_map_fitted=True):
    """Multiply-adds to form the softmax kernel's Gauss-Newton information
    (:func:`rstar.inversions._numerics.softmax_ls.softmax_kernel_information_matrix`) and factor it (``d^6``).

    ``n T d^4 / 4`` for the Kronecker part, ``n T d^3 min(d_v, d / 2)`` for the
    cross term with V (if fitted) and ``d^5 min(d, d_v)`` for its Schur complement.
    """
    cost = n * T * d**4 / 4 + d**6
    if value_map_fitted:
        cost += n * T * d**3 * min(d_v, d / 2) + d**5 * min(d, d_v)
    return cost


def largest_count(fits, hi):
    """The largest count n up to ``hi`` with ``fits(n)`` (bisection; ``fits`` monotone in n), 0 if none."""
    lo = 0
    if fits(hi):
        return hi
    while hi - lo > 1:   # fits(lo) or lo == 0, and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo if fits(lo) else 0


@dataclass(frozen=True)
class CostBudget:
    """What one fit may spend.

    Parameters
    ----------
    memory_bytes : int, default=2**29
        Memory for the statistics an inversion keeps beyond its ``O(d^2)``
        sums: kept samples (at most all of it), each moment-sum array or
        ``d^2 x d^2`` matrix (at most half of it) (the calibration's
        ``memory_budget``, :mod:`rstar.calibration`).
    multiply_adds : float, default=2**39
        Arithmetic of one least-squares fit or information matrix (the calibration's ``compute_budget``).
    fit_multiply_adds : float or None, default=None
        The factored least squares' own allowance (its stages, segments and doublings); None: ``multiply_adds``.
        The estimators' ``compute_budget="auto"`` sets it to infinity, so that the factored fit stops on its
        split-half count or its iteration caps, not on a number that cannot scale with the problem.
    reserved_bytes : int, default=0
        The part of ``memory_bytes`` that passes over samples not kept hold beside the kept ones (a fit on dask
        arrays: its workers' chunk temporaries); the samples kept get the rest.
    """

    memory_bytes: int = DEFAULT_CALIBRATION.memory_budget
    multiply_adds: float = DEFAULT_CALIBRATION.compute_budget
    fit_multiply_adds: float = None
    reserved_bytes: int = 0

    def allows_array(self, entries):
        """Whether one float64 array of ``entries`` entries fits in half the memory budget."""
        return _FLOAT_BYTES * entries <= self.memory_bytes / 2

    def allows_samples(self, n, T, d, d_v):
        """Whether ``n`` samples can be kept (within the memory budget less ``reserved_bytes``)."""
        return sample_bytes(n, T, d, d_v) <= self.memory_bytes - self.reserved_bytes

    def max_samples(self, T, d, d_v):
        """The most samples that can be kept (:meth:`allows_samples`)."""
        return int(max(0, self.memory_bytes - self.reserved_bytes) // sample_bytes(1, T, d, d_v))

    def allows_kernel_matrix(self, d):
        """Whether a ``d^2 x d^2`` matrix fits in half the memory budget."""
        return self.allows_array(d**4)

    def allows_compute(self, multiply_adds):
        """Whether a computation of this many multiply-adds is within the budget."""
        return multiply_adds <= self.multiply_adds

    def allows_fit_compute(self, multiply_adds):
        """Whether the factored least squares may spend this many multiply-adds (``fit_multiply_adds``)."""
        return multiply_adds <= (self.multiply_adds if self.fit_multiply_adds is None else self.fit_multiply_adds)

    @property
    def fit_scales(self):
        """Whether the factored fit runs to its iteration caps (``compute_budget="auto"``)."""
        return self.fit_multiply_adds == float("inf")

    def describe(self):
        """The budget in words, for messages."""
        memory = f"memory_budget={_bytes(self.memory_bytes)}"
        if self.reserved_bytes:
            memory += f" ({_bytes(self.reserved_bytes)} of it for the dask workers' chunks)"
        if self.fit_scales:
            return (f"{memory}, compute_budget='auto' ({self.multiply_adds:.3g} "
                    "multiply-adds to choose the inversion; the factored fit to its iteration caps)")
        return f"{memory}, compute_budget={self.multiply_adds:.3g} multiply-adds"


def _bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} bytes"


DEFAULT_BUDGET = CostBudget()
