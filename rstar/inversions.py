"""Inversions: samples (X, Y) -> a symmetric statistic whose signal part has rank r*.

Each inversion (theory §4) accumulates *sums over samples* in a dict of
arrays (``new_stats`` / ``update`` / :func:`merge_stats`), so streaming
(``partial_fit``) and map-reduce come for free. ``whiten`` turns the sums into
a :class:`WhitenedStatistic`: the eigen-decomposition of
``N^{-1/2} C N^{-1/2}``, where ``N`` is the noise Gram, scaled so that pure
noise of variance ``sigma2`` gives a Marchenko–Pastur bulk around ``sigma2``
with ``n_columns`` effective columns. ``fit_operator`` fits the operator in
closed form at a given rank from the same sums (used by ``predict``).

All arrays passed in are already validated and rescaled to unit RMS by the
estimator (so results do not depend on the units of X and Y).

Available inversions:

- :class:`TokenInversion` (B0, linear proxy ``Y = A X V``): ``C = sum Y Y^T``.
- :class:`QueryKeyInversion` (B1, linear QK ``Y = X K X^T X V / c``):
  ``M_i = X_i^+ Y_i = K G_i V + X_i^+ E_i``; with ``centred=True`` it is the
  first-order softmax inversion applied to ``(P X, P Y)``.
- :class:`QueryKeyLeastSquaresInversion` (B1 with a known V): least squares of
  ``K`` on ``Y_i = X_i K G_i V + E_i`` itself, unbiased for any ``T``.
- :class:`QueryKeyCrossFitInversion` (B1 with an unknown V, and ``T <= d`` or
  ``d_v < d``):
  V fitted on one half of the samples, then the least squares of ``K`` with
  that V on the other half, and the same with the halves swapped.
- :class:`SoftmaxExactInversion` (B2 with a known V and ``d, d_v >= T``):
  weighted least squares on ``log S_i`` where ``S_i = Y_i (X_i V)^+``.
- :class:`SoftmaxLeastSquaresInversion` (B2, V known or not): least squares of
  ``K`` (full rank) on ``Y_i = softmax(X_i K X_i^T / sqrt(d)) X_i V + E_i``
  itself, whitened by its information (a Wald statistic).
"""

from dataclasses import dataclass, field

import numpy as np
from scipy import linalg
from scipy.stats import f as f_dist
from sklearn.exceptions import ConvergenceWarning

from . import _bilinear, _softmax_ls, _value_error
from ._linalg import batched_pseudo_inverse, kronecker_rearranged, orthonormal_rows, psd_power, solve_psd, sym
from .exceptions import IllConditionedInversionWarning, UnidentifiableRankWarning
from .marchenko_pastur import MEDIAN_EFFICIENCY, mp_median

__all__ = [
    "WhitenedStatistic",
    "Inversion",
    "TokenInversion",
    "QueryKeyInversion",
    "QueryKeyLeastSquaresInversion",
    "QueryKeyCrossFitInversion",
    "SoftmaxExactInversion",
    "SoftmaxLeastSquaresInversion",
    "coherent_spectrum",
    "proxy_coherent_spectrum",
    "merge_stats",
]

# Moment sums for the closed-form operator are skipped above this many entries
# (e.g. T*d > 4096 for the linear proxy): predict() then says so.
MAX_MOMENT_ENTRIES = 2**25
# The linear proxy's coherent statistic keeps a second copy of the moment sums (the odd half's, for
# its bilinear fit): only up to this many entries.
MAX_COHERENT_ENTRIES = 2**25
# The coherent statistic's bilinear fit on the odd half stops once an iteration adds less than this
# fraction to the explained sum of squares: any V estimate independent of the even half gives a valid
# test, its accuracy only sets the power, and without signal the factors never converge.
COHERENT_FIT_TOL = 1e-4
# ... and after at most this many iterations (a null fit creeps on for hundreds).
COHERENT_MAX_ITER = 50
# Where the moment sums are too large, the proxy's coherent statistic keeps the samples themselves,
# while they number at most this many entries (n T (d + d_v)).
MAX_COHERENT_SAMPLE_ENTRIES = 2**26
# Residual degrees of freedom needed before the residual noise estimate is used.
MIN_NOISE_DOF = 50
# Per-sample residual degrees of freedom needed before samples are reweighted by
# their residual power (first-order softmax): 1/rho_i then has about 30% relative sd.
MIN_SAMPLE_DOF = 20
# Draws of the least-squares query-key estimate's noise for its simulated null, and their seed
# (fixed, so that fit is a deterministic function of the data and partial_fit equals fit).
NULL_DRAWS = 1000
NULL_SEED = 20260
# Aspect ratio min(T, d) / max(T, d) above which X_i^+ is ill-conditioned
# (hard edge of the MP law at ratio 1).
ILL_CONDITIONED_ASPECT = 0.9

#: Cross-fitted query-key inversion (V unknown, T <= d): largest ``n d^4 + d^6``, about the
#: floating-point work of one alternating least-squares iteration over both halves.
MAX_CROSS_FIT_COST = 2**30
#: Beyond it, the fit minimises the profile loss (V eliminated) by L-BFGS while ``n T d (d + d_v)``,
#: about the work of one evaluation over both halves, is at most this.
MAX_PROFILED_FIT_COST = 2**29
#: Starting kernels of its fit: the first-order fit, its transpose and this many random ones.
CROSS_FIT_RANDOM_STARTS = 8
#: Seed of those random starting kernels.
CROSS_FIT_SEED = 20261
#: Warn when a half's fitted V leaves the other half a residual power this many times that
#: half's own fit.
CROSS_FIT_MISFIT = 1.1
#: Least-squares softmax inversion: largest ``n T^2 (d + d_v)``, about the work of one evaluation
#: of its loss (:class:`SoftmaxLeastSquaresInversion`); beyond it the inversion is first order.
MAX_SOFTMAX_FIT_COST = 2**30
#: ... and with V unknown only where the F test of ``V = 0`` under uniform attention rejects at this level.
VALUE_SIGNAL_ALPHA = 1e-3
#: ... and it falls back to first order (with a warning) where its residual variance exceeds this many times
#: the power per degree of freedom outside col(P X_i) (the model does not hold).
SOFTMAX_MISFIT = 1.1
#: ... and while its information of K (``d^2 x d^2``, for the simulated null) costs at most this many
#: multiply-adds (:func:`rstar._softmax_ls.information_matrix_cost`).
MAX_SOFTMAX_INFORMATION_COST = 2**39


@dataclass
class WhitenedStatistic:
    r"""The output of an inversion: a whitened symmetric statistic.

    Attributes
    ----------
    eigenvalues : ndarray of shape (p,)
        Descending eigenvalues of ``N^{-1/2} C N^{-1/2}``; pure noise of
        variance ``sigma2`` gives an MP bulk with ratio ``p / n_columns``
        scaled by ``sigma2``.
    eigenvectors : ndarray of shape (p, p)
        Matching eigenvectors (columns), in whitened coordinates.
    unwhiten : ndarray of shape (p, p)
        ``N^{1/2}``: maps whitened directions back to the original space.
    n_columns : float
        Effective number of independent columns ``m``.
    noise_variance : float or None
        An estimate of ``sigma2`` independent of the spectrum (residual of
        a model that holds under the operator), or None.
    noise_dof : float
        Degrees of freedom of ``noise_variance``.
    structured_bulk : bool
        True when the bulk holds more than white noise (e.g. the higher-order
        terms of the first-order softmax inversion): rules should then fit
        its width instead of trusting ``n_columns``.
    leak_ratio : float or None
        Query–key inversion with fewer (effective) tokens than features: the
        signal leaks out of range(K*) through the random projectors
        ``X_i^+ X_i`` (rank ``t < d``), with relative power about
        ``(d - t) / (d t)`` of the signal (for a Haar projector,
        ``E[P A P] = a A + b tr(A) I`` with ``b / a ~ (d - t) / (d t)``).
        Rules decide from it whether the bulk is structured (see
        :class:`rstar.rules.MarchenkoPasturRule`). None otherwise.
    residual_variance : float or None
        Exact softmax inversion: the log-domain residual variance (reported only).
    residual_power : float or None
        Query–key inversion with tokens to spare (``T_eff > d``): the power per
        degree of freedom of the part of ``Y_i`` outside ``col(X_i)``, averaged
        as the whitened bulk weights each sample (same units as
        ``eigenvalues``). For linear QK it is the noise variance; for the
        first-order softmax inversion it is the level of the noise *plus* the
        higher-order terms, an upper reference for the bulk left inside
        ``col(X_i)`` (:func:`rstar.rules.residual_floor_p_values`). None when
        the residual has fewer than ``MIN_NOISE_DOF`` degrees of freedom.
    null_spectrum : ndarray of shape (p,) or None
        Exact softmax inversion: eigenvalues of the whitened split-half noise
        draw that set ``noise_variance`` (None if a half was too small).
    min_bulk_columns : float or None
        Lower bound on the structured bulk's number of columns: the
        (weight-)effective number of independent samples summed into the
        statistic, ``(sum w_i)^2 / sum w_i^2`` (each adds at least one
        independent direction), or None.
    mp_shaped_bulk : bool
        Whether the eigenvalues below the spikes follow an MP law (of known
        or fitted width), so that the part of the bulk below any eigenvalue
        can be fitted on its own (:func:`rstar.rules.top_down_p_values`).
        False for the exact softmax inversion, whose clipped, weighted
        log-domain bulk is irregular.
    coherent_eigenvalues : ndarray or None
        A second, *coherent* spectrum whose noise is a white Wishart with
        ``coherent_columns`` columns at ``noise_variance`` and whose signal
        has rank at most r\*; rules may count on it too. Linear query–key
        inversion with ``T > d`` and a residual noise level: the whitened
        first moment ``sum_i w_i M_i`` (:func:`coherent_spectrum`, shape
        ``(min(d, d_v),)``, signal rank ``min(r*, d_v)`` for a
        well-conditioned V). Token inversion with two sample halves that each
        fit the bilinear model (odd half: V) and the restricted regression
        for A given V (even half): :func:`proxy_coherent_spectrum`, shape
        ``(T,)``. None otherwise.
    coherent_columns : float or None
        The ``m`` of that Wishart: ``max(d, d_v)`` (query–key) or ``T``
        (token).
    coherent_noise_variance, coherent_noise_dof : float or None
        Linear proxy with ``n <= T d`` (no residual of the unconstrained
        regression): the noise level for the coherent statistic alone, from
        the residual of its restricted regression on the even samples
        (exact chi-square with ``coherent_noise_dof`` degrees of freedom
        under the null; a little above the noise with signal). None otherwise.
    statistic_matrix : ndarray of shape (p, p) or None
        Least-squares query–key inversion: the whitened kernel estimate
        ``K~`` whose ``K~ K~^T / d`` has the eigenvalues above (so rules can
        deflate it). None otherwise.
    null_draws : ndarray of shape (B, p, p) or None
        Least-squares query–key inversion: ``B`` draws of the whitened
        estimate's exact Gaussian noise (covariance ``sigma2`` times the
        whitened inverse normal matrix, at ``noise_variance``), for the
        simulated sequential test :func:`rstar.rules.simulated_null_p_values`.
        None otherwise.
    cross_fit : WhitenedStatistic or None
        Cross-fitted query–key inversion: the same statistic with the two
        halves of the samples swapped (V fitted on the even half, K on the
        odd one). The rule counts a spike where either statistic does at
        half the level (a Bonferroni union; each carries its fitted V's
        error in ``null_shift``). None otherwise.
    poor_fit : bool
        Cross-fitted query–key inversion: the V this statistic is tested
        with comes from a fit that is provably not the least squares of the
        half it was fitted on (the other half's V, with its own best K,
        leaves that half a smaller residual) and that leaves this half more
        than ``CROSS_FIT_MISFIT`` times its own residual power. The union
        then leaves this direction out (the other keeps its level alpha / 2).
    null_shift : ValueMapErrorLeak or None
        Cross-fitted query–key inversion: what the fitted value map's error
        adds to the noise of ``statistic_matrix``, linear in the kernel
        (:class:`rstar._value_error.ValueMapErrorLeak`; the ``null_shift`` of
        :func:`rstar.rules.simulated_null_p_values`). None otherwise.
    least_squares_factors : tuple or None
        Least-squares query–key inversion: ``(L, A^{1/2}, B^{1/2}, A^{-1/2},
        B^{-1/2})``, the Cholesky factor of the normal matrix, the whitening
        factors and their (pseudo-)inverses.
    warnings : list of (Warning subclass, str)
        Conditions the estimator must report.
    """

    eigenvalues: np.ndarray
    eigenvectors: np.ndarray
    unwhiten: np.ndarray
    n_columns: float
    noise_variance: float = None
    noise_dof: float = 0.0
    warnings: list = field(default_factory=list)
    structured_bulk: bool = False
    min_bulk_columns: float = None
    leak_ratio: float = None
    residual_variance: float = None
    null_spectrum: np.ndarray = None
    mp_shaped_bulk: bool = True
    residual_power: float = None
    coherent_eigenvalues: np.ndarray = None
    coherent_columns: float = None
    statistic_matrix: np.ndarray = None
    null_draws: np.ndarray = None
    coherent_noise_variance: float = None
    coherent_noise_dof: float = None
    cross_fit: "WhitenedStatistic" = None
    poor_fit: bool = False
    null_shift: object = None
    least_squares_factors: tuple = None

    @property
    def dim(self):
        return self.eigenvalues.size

    def components(self, k):
        """Orthonormal basis (rows) of the top-``k`` subspace in original coordinates."""
        return orthonormal_rows(self.unwhiten @ self.eigenvectors[:, :k])


def _keep_half_samples(stats, X, Y, odd):
    """Append a batch's samples to ``stats["samples_odd"]`` / ``stats["samples_even"]`` (lists, so
    :func:`merge_stats` concatenates), or drop both for good once ``n T (d + d_v)`` exceeds
    ``MAX_COHERENT_SAMPLE_ENTRIES``. ``stats["n"]`` must already count the batch."""
    if stats.get("samples_odd") is None:
        return
    if _drop_samples_over_budget(stats):
        return
    for key, mask in (("samples_odd", odd), ("samples_even", ~odd)):
        if mask.any():
            stats[key].append((np.asarray(X[mask], dtype=float), np.asarray(Y[mask], dtype=float)))


def _drop_samples_over_budget(stats):
    """Drop the kept samples for good once ``n T (d + d_v)`` exceeds ``MAX_COHERENT_SAMPLE_ENTRIES``;
    True if they were dropped."""
    T, d, d_v = stats["dims"]
    if stats["n"] * T * (d + d_v) > MAX_COHERENT_SAMPLE_ENTRIES:
        stats["samples_odd"] = stats["samples_even"] = None
        return True
    return False


def _kept_half(stats, key):
    """``(X, Y)`` of the samples kept under ``key`` by :func:`_keep_half_samples`, concatenated."""
    X, Y = zip(*stats[key])
    return np.concatenate(X), np.concatenate(Y)


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
    out = {}
    for key in a:
        if key == "dims":
            if a[key] != b[key]:
                raise ValueError(f"cannot merge statistics of different shapes {a[key]} and {b[key]}.")
            out[key] = a[key]
        elif a[key] is None or b[key] is None:
            out[key] = None
        else:
            out[key] = a[key] + b[key]
    if out.get("samples_odd") is not None:
        # each shard kept its samples within the budget; together they may not (as in one pass)
        _drop_samples_over_budget(out)
    return out


def coherent_spectrum(M_sum, N_coherent):
    """Eigenvalues of the whitened first moment of the query–key inversion.

    For linear QK with ``T >= d`` every sample gives ``M_i = X_i^+ Y_i =
    K G_i V + X_i^+ E_i`` exactly, so the weighted sum
    ``M = sum_i w_i M_i = K (sum_i w_i G_i) V + E'`` has its signal in
    range(K) with rank ``min(r*, rank V)``, and its noise columns are
    independent ``N(0, sigma2 N_c)`` with ``N_c = sum_i w_i^2 (X_i^T X_i)^+``
    (Gaussian noise: exactly). ``W = N_c^{-1/2} M`` (d × d_v) then has white
    noise, and the eigenvalues of ``W W^T / d_v`` (or of ``W^T W / d`` when
    ``d > d_v``, the same non-zero spectrum rescaled) follow a white Wishart
    with ``p = min(d, d_v)`` rows and ``m = max(d, d_v)`` columns at level
    ``sigma2``, plus spikes. Because the signal adds coherently over samples
    while the noise adds incoherently, a direction of K whose spike in the
    second-moment statistic is ``theta`` has about ``n theta`` here: spikes
    far below that statistic's BBP threshold stand out, as long as V does not
    crush them (the signal is ``K G V``, not ``K``) and ``d_v >= r*``.

    Parameters
    ----------
    M_sum : ndarray of shape (d, d_v)
    N_coherent : ndarray of shape (d, d)

    Returns
    -------
    eigenvalues : ndarray of shape (min(d, d_v),)
        Descending.
    n_columns : float
        ``max(d, d_v)``.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.inversions import QueryKeyInversion
    >>> X, Y = make_attention_task(500, kind="linear_qk", seq_len=24, n_features=8, rank=2, random_state=0)
    >>> inv = QueryKeyInversion()
    >>> stats = inv.new_stats(24, 8, 8)
    >>> inv.update(stats, X, Y)
    >>> ws = inv.whiten(stats)
    >>> lam = ws.coherent_eigenvalues / ws.noise_variance   # white Wishart 8 x 8 (edge 4) plus 2 spikes
    >>> int(np.sum(lam > 10)), ws.coherent_columns
    (2, 8.0)
    """
    M_sum = np.asarray(M_sum, dtype=np.float64)
    N_coherent = np.asarray(N_coherent, dtype=np.float64)
    if M_sum.ndim != 2 or M_sum.size == 0:
        raise ValueError(f"M_sum must be a non-empty 2-D array (d, d_v), got shape {M_sum.shape}.")
    d, d_v = M_sum.shape
    if N_coherent.shape != (d, d):
        raise ValueError(f"N_coherent must have shape ({d}, {d}) to match M_sum, got {N_coherent.shape}.")
    if not (np.all(np.isfinite(M_sum)) and np.all(np.isfinite(N_coherent))):
        raise ValueError("M_sum and N_coherent must be finite.")
    W = psd_power(N_coherent, -0.5) @ M_sum
    S = W @ W.T / d_v if d <= d_v else W.T @ W / d
    lam = np.clip(np.linalg.eigvalsh(sym(S))[::-1], 0.0, None)
    return lam, float(max(d, d_v))


def _eigh_desc(W):
    w, Q = np.linalg.eigh(sym(W))
    return w[::-1].copy(), Q[:, ::-1].copy()


def _whiten(C, N):
    """Eigen-decomposition of N^{-1/2} C N^{-1/2} and the map N^{1/2}."""
    N_isqrt = psd_power(N, -0.5)
    lam, vecs = _eigh_desc(N_isqrt @ C @ N_isqrt)
    return lam, vecs, psd_power(N, 0.5)


class Inversion:
    """Base class: subclasses implement ``new_stats``, ``update``, ``whiten``
    and ``fit_operator``.

    Parameters
    ----------
    value_map : ndarray of shape (d, d_v) or None
        Known value matrix V (already in the estimator's internal units).
    """

    #: which space ``components_`` live in: "tokens" (T) or "features" (d)
    space = "features"

    def __init__(self, value_map=None):
        self.value_map = value_map

    def statistic_dim(self, T, d):
        return d

    def min_samples(self, T, d, d_v):
        """Fewest samples for which the statistic and its noise Gram are defined."""
        return 2

    def new_stats(self, T, d, d_v):  # pragma: no cover - abstract
        raise NotImplementedError

    def update(self, stats, X, Y):  # pragma: no cover - abstract
        raise NotImplementedError

    def whiten(self, stats):  # pragma: no cover - abstract
        raise NotImplementedError

    def fit_operator(self, stats, basis):  # pragma: no cover - abstract
        raise NotImplementedError


def _moments_fit(T, d, d_v, b, c, a, e):
    return b * c * b * c <= MAX_MOMENT_ENTRIES and b * c * a * e <= MAX_MOMENT_ENTRIES


class TokenInversion(Inversion):
    """Token inversion for the linear proxy ``Y = A* X V* + E`` (theory §4).

    ``C = sum_i Y_i Y_i^T / (n d_v)`` (T x T): signal of rank r* = rank(A*),
    noise ``sigma2 I_T`` with ``m = n d_v`` columns. The noise variance comes
    from the residual of the unconstrained linear regression of ``vec Y`` on
    ``vec X`` when ``n > T d`` (it is exact under the linear proxy), else
    from the bulk. ``fit_operator`` fits ``A = U B`` and ``V`` by alternating
    least squares on the moment sums. A coherent split-half statistic
    (:func:`proxy_coherent_spectrum`) comes with it, from the moment sums
    or, beyond their budget, from the samples kept for it.

    Examples
    --------
    >>> from rstar.datasets import make_linear_proxy
    >>> from rstar.inversions import TokenInversion
    >>> X, Y = make_linear_proxy(500, random_state=0)
    >>> inv = TokenInversion()
    >>> stats = inv.new_stats(16, 12, 12)
    >>> inv.update(stats, X, Y)
    >>> ws = inv.whiten(stats)
    >>> ws.eigenvalues.shape, int((ws.eigenvalues > 0.1).sum())
    ((16,), 3)
    """

    space = "tokens"

    def statistic_dim(self, T, d):
        return T

    def new_stats(self, T, d, d_v):
        moments = _moments_fit(T, d, d_v, T, d, T, d_v)
        split = moments and (T * d) ** 2 <= MAX_COHERENT_ENTRIES and (T * d) * (T * d_v) <= MAX_COHERENT_ENTRIES
        return {
            "dims": (T, d, d_v),
            "n": 0,
            "YY": np.zeros((T, T)),
            "yy": 0.0,
            "HZ": np.zeros((T, d, T, d)) if moments else None,
            "FZ": np.zeros((T, d, T, d_v)) if moments else None,
            # the same sums over the samples with odd global index, for the coherent statistic
            "HZ_odd": np.zeros((T, d, T, d)) if split else None,
            "FZ_odd": np.zeros((T, d, T, d_v)) if split else None,
            "n_odd": 0,
            "yy_odd": 0.0,
            # beyond the moment sums' budget, the samples of each half (lists of (X, Y); merge concatenates)
            "samples_odd": [] if not moments else None,
            "samples_even": [] if not moments else None,
        }

    def update(self, stats, X, Y):
        n = X.shape[0]
        odd = (stats["n"] + np.arange(n)) % 2 == 1
        stats["n"] += n
        stats["YY"] += np.einsum("nta,nsa->ts", Y, Y, optimize=True)
        stats["yy"] += float(np.sum(Y**2))
        stats["n_odd"] += int(odd.sum())
        stats["yy_odd"] += float(np.sum(Y[odd] ** 2))
        _keep_half_samples(stats, X, Y, odd)   # over budget: no coherent statistic
        if stats["HZ"] is None:
            return
        if stats.get("HZ_odd") is None:
            HZ, FZ = _bilinear.moment_sums(X, Y, np.ones(n))
            stats["HZ"] += HZ
            stats["FZ"] += FZ
            return
        # each sample's moments once: the odd and even halves, whose sum is the whole
        for is_odd in (True, False):
            mask = odd == is_odd
            if not mask.any():
                continue
            HZ, FZ = _bilinear.moment_sums(X[mask], Y[mask], np.ones(int(mask.sum())))
            stats["HZ"] += HZ
            stats["FZ"] += FZ
            if is_odd:
                stats["HZ_odd"] += HZ
                stats["FZ_odd"] += FZ

    def whiten(self, stats):
        n = stats["n"]
        T, _, d_v = stats["dims"]
        m = n * d_v
        lam, vecs = _eigh_desc(stats["YY"] / m)
        noise, dof = None, 0.0
        Td = T * stats["dims"][1]
        if stats["HZ"] is not None and T * d_v * (n - Td) >= MIN_NOISE_DOF:
            fitted, rank_H = _regression_fit(stats["HZ"].reshape(Td, Td), stats["FZ"].reshape(Td, -1))
            dof = T * d_v * n - rank_H * T * d_v
            if dof >= MIN_NOISE_DOF:
                noise = max(stats["yy"] - fitted, 0.0) / dof
        coherent, coh_noise, coh_dof = None, None, None
        if stats.get("HZ_odd") is not None or stats.get("samples_odd") is not None:
            coherent = proxy_coherent_spectrum(stats)
            if coherent is not None and noise is None:
                # n <= T d: no regression residual; the even half's restricted residual serves the
                # coherent test alone (the second-moment test keeps its bulk estimate)
                coh_noise, coh_dof = coherent[2], coherent[3]
                if coh_noise is None:
                    coherent = None
        return WhitenedStatistic(lam, vecs, np.eye(T), float(m), noise, float(max(dof, 0)),
                                 coherent_eigenvalues=None if coherent is None else coherent[0],
                                 coherent_columns=None if coherent is None else coherent[1],
                                 coherent_noise_variance=coh_noise, coherent_noise_dof=coh_dof)

    def fit_operator(self, stats, basis):
        if stats["HZ"] is None:
            return None
        L, R = _bilinear.fit_bilinear(stats["HZ"], stats["FZ"], basis.T, R_known=self.value_map)
        return _LinearProxyOperator(L, R)


def proxy_coherent_spectrum(stats):
    r"""Coherent statistic of the linear proxy from split-half fits (None if a half is too small).

    Under ``Y_i = A X_i V + E_i`` every sample carries the same A, so a
    regression that pools the samples adds their signal *coherently*, while
    ``Σ Y_i Y_i^T`` adds it incoherently. V is estimated from the samples
    with odd global index, by alternating least squares of the bilinear model
    with a full-rank A (:func:`rstar._bilinear.fit_bilinear` on their moment
    sums; it needs far fewer than the ``T d`` samples of the unconstrained
    regression of ``vec Y`` on ``vec X``), and normalised to ``U``. Given
    ``U``, the model on the other samples is *linear* in A:
    ``Y_i ≈ Â (X_i U)``, the restricted regression with normal matrix
    ``Ω = Σ_even (X_i U)(X_i U)^T`` (T × T; a contraction of the moment sums
    with ``U U^T``) and right-hand side ``R = Σ_even Y_i (X_i U)^T``.
    Because ``U`` is independent of the even samples' noise, the rows of
    ``Â = R Ω^{-1}`` are independent ``N(·, sigma2 Ω^{-1})``, so
    ``W = Â Ω^{1/2}`` has white noise and the eigenvalues of ``W W^T / T``
    are a white T × T Wishart at level ``sigma2`` plus a signal
    ``A Q`` (``Q`` a T × T matrix) of rank at most r\*. The residual of the
    same restricted regression gives an independent, exactly chi-square
    estimate of ``sigma2`` with ``n_even T d_v - T^2`` degrees of freedom,
    used when the unconstrained regression has none (``n <= T d``).

    Where the moment sums exceed ``MAX_MOMENT_ENTRIES`` the inversion keeps
    the samples of each half instead (while they number at most
    ``MAX_COHERENT_SAMPLE_ENTRIES`` entries): the same fit, each
    iteration a pass over the odd samples
    (:func:`rstar._bilinear.fit_bilinear_samples`), and ``Ω``, ``R`` from one
    pass over the even ones. The bilinear fit stops after
    ``COHERENT_MAX_ITER`` iterations or once one adds less than
    ``COHERENT_FIT_TOL`` of the explained sum of squares: U only sets the
    power.

    Parameters
    ----------
    stats : dict
        :class:`TokenInversion` statistics with the odd-sample moment sums.

    Returns
    -------
    (eigenvalues, n_columns, noise_variance, noise_dof) or None
        ``noise_variance`` is None when the restricted residual has fewer
        than ``MIN_NOISE_DOF`` degrees of freedom.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_linear_proxy
    >>> from rstar.inversions import TokenInversion, proxy_coherent_spectrum
    >>> X, Y = make_linear_proxy(1000, seq_len=8, n_features=6, value_dim=6, rank=2, random_state=0)
    >>> inv = TokenInversion()
    >>> stats = inv.new_stats(8, 6, 6)
    >>> inv.update(stats, X, Y)
    >>> lam, m, sigma2, dof = proxy_coherent_spectrum(stats)
    >>> int(np.sum(lam / sigma2 > 10)), m          # white 8 x 8 Wishart (edge 4) plus 2 spikes
    (2, 8.0)
    >>> # the restricted residual also holds the misfit of the estimated U: a little above the noise
    >>> round(sigma2 / inv.whiten(stats).noise_variance, 2)
    1.03
    """
    T, d, d_v = stats["dims"]
    n_odd, n_even = stats["n_odd"], stats["n"] - stats["n_odd"]
    # the odd half must identify the bilinear model (T^2 + d d_v parameters) and the even half A given U
    if n_odd * T * d_v < 2 * (T * T + d * d_v) or n_odd * T < 2 * d or n_even * d_v < 2 * T:
        return None
    samples = stats.get("HZ_odd") is None
    if samples:
        if not stats.get("samples_odd") or not stats.get("samples_even"):
            return None
        X_odd, Y_odd = _kept_half(stats, "samples_odd")
        _, U = _bilinear.fit_bilinear_samples(X_odd, Y_odd, max_iter=COHERENT_MAX_ITER, fit_tol=COHERENT_FIT_TOL)
        del X_odd, Y_odd
    else:
        _, U = _bilinear.fit_bilinear(stats["HZ_odd"], stats["FZ_odd"], np.eye(T), max_iter=COHERENT_MAX_ITER,
                                      fit_tol=COHERENT_FIT_TOL)
    scale = np.linalg.norm(U)
    if not (np.isfinite(scale) and scale > 0):
        return None
    U = U / scale
    if samples:
        omega, R = np.zeros((T, T)), np.zeros((T, T))
        for X_e, Y_e in stats["samples_even"]:
            XU = np.matmul(X_e, U)
            omega += _bilinear._token_gram(XU, XU)
            R += _bilinear._token_gram(Y_e, XU)
    else:
        UU = U @ U.T
        # the even half's contractions as whole minus odd (no even-half copy of the sums)
        omega = (np.einsum("ab,satb->st", UU, stats["HZ"], optimize=True)
                 - np.einsum("ab,satb->st", UU, stats["HZ_odd"], optimize=True))
        R = (np.einsum("satv,av->ts", stats["FZ"], U, optimize=True)
             - np.einsum("satv,av->ts", stats["FZ_odd"], U, optimize=True))
    vals, vecs = np.linalg.eigh(sym(omega))
    if not vals.min() > 1e-12 * vals.max():
        return None
    W = R @ (vecs / np.sqrt(vals)) @ vecs.T   # Â Ω^{1/2} = R Ω^{-1/2}
    lam = np.clip(np.linalg.eigvalsh(sym(W @ W.T / T))[::-1], 0.0, None)
    dof = n_even * T * d_v - T * T
    noise = None
    if dof >= MIN_NOISE_DOF:
        noise = max(stats["yy"] - stats["yy_odd"] - float(np.sum(W**2)), 0.0) / dof
    return lam, float(T), noise, float(dof)


def _regression_fit(H, F):
    """Explained sum of squares ``tr(F^T H^+ F)`` of a least-squares fit and the rank of ``H``."""
    H = sym(H)
    try:
        factor = linalg.cho_factor(H, check_finite=False)
        diag = np.abs(np.diag(factor[0]))
        if diag.min() > 1e-6 * diag.max():
            return float(np.sum(F * linalg.cho_solve(factor, F, check_finite=False))), H.shape[0]
    except linalg.LinAlgError:
        pass
    w, Q = np.linalg.eigh(H)
    keep = w > 1e-10 * max(w.max(), np.finfo(float).tiny)
    proj = Q[:, keep].T @ F
    return float(np.sum(proj**2 / w[keep, None])), int(keep.sum())


class _LinearProxyOperator:
    def __init__(self, A, V):
        self.A, self.V = A, V

    def predict(self, X):
        return np.einsum("st,ntd,dv->nsv", self.A, X, self.V, optimize=True)


class QueryKeyInversion(Inversion):
    """Query–key inversion ``M_i = X_i^+ Y_i`` (theory §4; B1, and B2 to first order).

    Columns of ``M_i = K* G_i V* + X_i^+ E_i`` lie in range(K*) whatever V* is.
    ``C = sum_i w_i M_i M_i^T`` and noise Gram ``N = d_v sum_i w_i (X_i^T X_i)^+``
    with sample weights ``w_i = sigma_min(X_i)^2``: each weighted sample then
    has noise covariance at most ``sigma2 I``, which tames the heavy tail of
    ``(X_i^T X_i)^{-1}`` near ``T = d`` (MP hard edge) without moving the
    columns out of range(K*). The effective number of MP columns ``m``
    matches the second moment of the whitened null spectrum: with
    ``A_i = w_i G_i^+``, ``m = d_v (sum_i tr A_i)^2 / sum_i [(tr A_i)^2 + tr A_i^2]``.

    Parameters
    ----------
    centred : bool, default=False
        Centre X and Y over tokens first (``P X``, ``P Y``): the first-order
        softmax inversion, since ``P softmax(Z) X V ~ P Z P X V / T`` near
        uniform attention; it also holds exactly for linear-QK data.
    residual_noise : bool, default=True
        Estimate ``sigma2`` from the part of ``Y_i`` outside ``col(X_i)``
        (exact for linear QK when ``T > d``). For softmax data this residual
        also holds the higher-order terms, and its power per degree of freedom
        matches the level of the structured bulk they leave inside
        ``col(X_i)`` (checked numerically: within 5% over T = 16..64,
        d = 8..32, logit scale 1..6).
    structured_bulk : bool or None
        Flag the bulk as wider than white noise (default: ``centred``).
    value_map : ndarray or None
        Known V: used by ``fit_operator``.
    reweight : bool or None
        Divide each sample's weight by its residual power per degree of
        freedom ``rho_i`` (default: ``centred``), when every sample has at
        least ``MIN_SAMPLE_DOF`` residual degrees of freedom
        (``(T_eff - d) d_v >= 20``). For softmax data the residual holds the
        higher-order terms, whose power varies from sample to sample by
        orders of magnitude with heavy-tailed tokens (a mixture of MP laws
        that no single bulk fits); weighting by ``1 / rho_i`` is generalised
        least squares across samples and leaves the columns in range(K*).
        The residual outside ``col(X_i)`` is independent of the noise inside
        it, so the weights do not bias the statistic.
    """

    def __init__(self, centred=False, residual_noise=True, value_map=None, structured_bulk=None, reweight=None):
        super().__init__(value_map)
        self.centred = centred
        self.residual_noise = residual_noise
        self.structured_bulk = centred if structured_bulk is None else structured_bulk
        self.reweight = centred if reweight is None else reweight

    def _reweighted(self, T, d, d_v):
        T_eff = self._tokens_eff(T)
        return bool(self.reweight) and (T_eff - min(T_eff, d)) * d_v >= MIN_SAMPLE_DOF

    def min_samples(self, T, d, d_v):
        # the noise Gram sum_i w_i (X_i^T X_i)^+ must have full rank d
        T_eff = max(self._tokens_eff(T), 1)
        return max(2, -(-d // min(T_eff, d)) + 1)

    def new_stats(self, T, d, d_v):
        moments = _moments_fit(T, d, d_v, d, d, d, d_v)
        return {
            "dims": (T, d, d_v),
            "n": 0,
            "C": np.zeros((d, d)),
            "N": np.zeros((d, d)),
            "s1": 0.0,
            "s2": 0.0,
            "s2_within": 0.0,
            "w1": 0.0,
            "w2": 0.0,
            "res": 0.0,
            "res_dof": 0.0,
            "res_w": 0.0,
            "wt": 0.0,
            "n_deficient": 0,
            "HZ": np.zeros((d, d, d, d)) if moments else None,
            "FZ": np.zeros((d, d, d, d_v)) if moments else None,
            "xbar_xbar": np.zeros((d, d)),
            "xbar_ybar": np.zeros((d, d_v)),
            # first moment, read only by the linear (uncentred) inversion
            "M_sum": None if self.centred else np.zeros((d, d_v)),
            "N_coherent": None if self.centred else np.zeros((d, d)),
        }

    def _tokens_eff(self, T):
        return T - 1 if self.centred else T

    def update(self, stats, X, Y):
        n, T, d = X.shape
        d_v = Y.shape[2]
        xbar, ybar = X.mean(axis=1), Y.mean(axis=1)
        if self.centred:
            Xc, Yc = X - xbar[:, None, :], Y - ybar[:, None, :]
        else:
            Xc, Yc = X, Y
        G = np.einsum("nta,ntb->nab", Xc, Xc, optimize=True)
        U, inv_s, Wt, smallest, rank = batched_pseudo_inverse(Xc)
        # M_i = X_i^+ Y_i and (X_i^T X_i)^+ from one SVD per sample
        M = np.einsum("nka,nk,ntk,ntv->nav", Wt, inv_s, U, Yc, optimize=True)
        G_pinv = np.einsum("nka,nk,nkb->nab", Wt, inv_s**2, Wt, optimize=True)
        fitted = np.einsum("nta,nav->ntv", Xc, M, optimize=True)
        y_sq = np.sum(Yc**2, axis=(1, 2))
        res_i = np.maximum(y_sq - np.sum(fitted**2, axis=(1, 2)), 0.0)
        dof_i = np.maximum(self._tokens_eff(T) - rank, 0) * d_v
        w = smallest
        if self._reweighted(T, d, d_v):
            power = y_sq / (T * d_v)
            rho = np.maximum(res_i / np.maximum(dof_i, 1), 1e-8 * power + np.finfo(float).tiny)
            w = w / rho
        stats["n"] += n
        stats["C"] += np.einsum("n,nav,nbv->ab", w, M, M, optimize=True)
        stats["N"] += np.einsum("n,nab->ab", w, G_pinv)
        # first moment: sum_i w_i M_i = K (sum_i w_i G_i) V + noise of covariance sigma2 sum_i w_i^2 G_i^+
        if stats.get("M_sum") is not None:
            stats["M_sum"] += np.einsum("n,nav->av", w, M)
            stats["N_coherent"] += np.einsum("n,nab->ab", w**2, G_pinv)
        tr = np.trace(G_pinv, axis1=1, axis2=2) * w
        stats["s1"] += float(tr.sum())
        stats["s2"] += float(np.sum(tr**2))
        stats["s2_within"] += float(np.sum(w**2 * np.sum(inv_s**4, axis=1)))
        # residual power per dof, weighted as the whitened bulk weights each sample
        stats["res_w"] += float(np.sum(tr * res_i / np.maximum(dof_i, 1)))
        stats["wt"] += float(np.sum(tr[dof_i > 0]))
        stats["w1"] += float(w.sum())
        stats["w2"] += float(np.sum(w**2))
        stats["res"] += float(res_i.sum())
        stats["res_dof"] += float(dof_i.sum())
        stats["n_deficient"] += int(np.sum(rank < min(self._tokens_eff(T), d)))
        if stats["HZ"] is not None:
            HZ, FZ = _bilinear.moment_sums(G, M, w)
            stats["HZ"] += HZ
            stats["FZ"] += FZ
        stats["xbar_xbar"] += xbar.T @ xbar
        stats["xbar_ybar"] += xbar.T @ ybar

    def whiten(self, stats):
        T, d, d_v = stats["dims"]
        warnings = []
        if stats["s1"] <= 0:
            # every sample degenerate (e.g. T = 1 with centring): no information
            lam = np.zeros(d)
            return WhitenedStatistic(lam, np.eye(d), np.eye(d), float(max(stats["n"] * d_v, 1)), None, 0.0,
                                     warnings)
        # Match the second moment of the whitened null spectrum: with per-sample noise
        # covariances A_i = w_i (X_i^T X_i)^+ (d_v columns each) and a noise Gram close to a
        # multiple of I, (1/p) E tr S^2 = sigma^4 (1 + p / m) with
        # m = d_v (sum_i tr A_i)^2 / sum_i [(tr A_i)^2 + tr A_i^2].
        # The tr A_i^2 term counts that a sample's d_v columns share one anisotropic covariance;
        # it matters near T = d, where A_i has a few dominant directions, and when T < d.
        m_eff = d_v * stats["s1"] ** 2 / (stats["s2"] + stats["s2_within"])
        T_eff = self._tokens_eff(T)
        lam, vecs, unwhiten = _whiten(stats["C"], d_v * stats["N"])
        aspect = min(T_eff, d) / max(T_eff, d)
        if aspect > ILL_CONDITIONED_ASPECT:
            warnings.append((IllConditionedInversionWarning,
                             f"the query-key inversion is ill-conditioned: {'T-1' if self.centred else 'T'}"
                             f"={T_eff} tokens is close to d={d} features (hard edge of the Marchenko-Pastur "
                             "law), so X_i^+ amplifies noise. Fallback in use: samples are weighted by "
                             "sigma_min(X_i)^2 and the noise Gram is whitened; the estimate rests on the "
                             "better-conditioned samples and may be unreliable. Use T >= 1.5 d or more samples."))
        noise, dof = None, stats["res_dof"]
        # residual power per dof, each sample weighted as the whitened bulk weights it
        power = stats["res_w"] / stats["wt"] if dof >= MIN_NOISE_DOF and stats["wt"] > 0 else None
        if self.residual_noise and dof >= MIN_NOISE_DOF:
            if self._reweighted(T, d, d_v):
                noise = power
            else:
                noise = max(stats["res"], 0.0) / dof
        # With T < d, X_i^+ X_i is a random projector: the signal leaks a flat,
        # non-white bulk (theory §4); the rule decides from its size whether to
        # fit it like the softmax one.
        leak = (d - T_eff) / (d * T_eff) if 0 < T_eff < d else None
        coherent = None
        if (not self.centred and noise is not None and T_eff > d and stats["n_deficient"] == 0
                and stats.get("M_sum") is not None):
            coherent = coherent_spectrum(stats["M_sum"], stats["N_coherent"])
        return WhitenedStatistic(lam, vecs, unwhiten, float(m_eff), noise, float(dof), warnings,
                                 coherent_eigenvalues=None if coherent is None else coherent[0],
                                 coherent_columns=None if coherent is None else coherent[1],
                                 structured_bulk=bool(self.structured_bulk), leak_ratio=leak,
                                 min_bulk_columns=stats["w1"] ** 2 / stats["w2"] if stats["w2"] > 0 else None,
                                 residual_power=power)

    def fit_operator(self, stats, basis):
        if stats["HZ"] is None:
            return None
        T, d, _ = stats["dims"]
        V = self.value_map
        if not self.centred:
            L, R = _bilinear.fit_bilinear(stats["HZ"], stats["FZ"], basis.T, R_known=V)
            return _LinearQKOperator(L, R)
        # First-order softmax: M_i ~ K (X^T P X) V / (T sqrt(d)), scale (K, V) ~ (aK, V/a).
        c = T * np.sqrt(d)
        if V is not None:
            L, _ = _bilinear.fit_bilinear(stats["HZ"], stats["FZ"], basis.T, R_known=V / c)
            return _SoftmaxOperator(L, V)
        Sxx, Sxy = stats["xbar_xbar"], stats["xbar_ybar"]
        if basis.shape[0] == 0:
            return _SoftmaxOperator(np.zeros((d, d)), solve_psd(Sxx, Sxy))
        L, R = _bilinear.fit_bilinear(stats["HZ"], stats["FZ"], basis.T)
        # token means: mean_t Y ~ mean_t X V to first order, which fixes the scale of V
        denom = float(np.sum(R * (Sxx @ R)))
        beta = float(np.sum(Sxy * R)) / denom if denom > 0 else 0.0
        if beta == 0.0 or not np.isfinite(beta):
            return _SoftmaxOperator(np.zeros((d, d)), solve_psd(Sxx, Sxy))
        return _SoftmaxOperator(L * c / beta, beta * R)


class QueryKeyLeastSquaresInversion(QueryKeyInversion):
    """Least-squares inversion of linear QK with a known V (theory §4, B1).

    With V known, ``Y_i = X_i K (G_i V) + E_i`` (``G_i = X_i^T X_i``, the
    scale ``1/c`` absorbed in K) is *linear* in K: ``vec K`` is the
    least-squares solution of the pooled system, with normal matrix
    ``H = sum_i G_i (x) G_i V V^T G_i`` (``d^2 x d^2``) and right-hand side
    ``sum_i vec(X_i^T Y_i V^T G_i)``. Unlike ``M_i = X_i^+ Y_i``, which keeps
    only the projection ``X_i^+ X_i K`` when ``T < d``, it is unbiased for any
    ``T`` (each sample pins the bilinear form of K on the row space of
    ``X_i``; the samples together pin all of K), and its noise is exactly
    Gaussian, ``N(0, sigma2 H^{-1})``, with ``sigma2`` from the residual
    (``n T d_v - d^2`` degrees of freedom).

    The statistic is ``K~ K~^T / d`` with ``K~ = A^{1/2} K B^{1/2}`` and
    ``A (x) B`` the nearest Kronecker product to ``H`` (Van Loan & Pitsianis
    1993), so that its noise is close to white at level ``sigma2`` (MP ratio
    1). Because ``H`` is not exactly a Kronecker product, the rule does not
    lean on the MP law: ``null_draws`` carries ``NULL_DRAWS`` exact draws of
    the whitened noise (seeded with ``NULL_SEED``), and
    :func:`rstar.rules.simulated_null_p_values` tests each eigenvalue
    against them.

    The sums of :class:`QueryKeyInversion` are kept too: with fewer samples
    than the pooled system needs (``n min(T, d) min(T, d, d_v) < d^2``) the
    statistic falls back to that first-order inversion, with a warning.

    Parameters
    ----------
    value_map : ndarray of shape (d, d_v)
        The known V (in the estimator's internal units).

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.inversions import QueryKeyLeastSquaresInversion
    >>> X, Y, t = make_attention_task(300, kind="linear_qk", seq_len=6, n_features=12, rank=3,
    ...                               noise=0.1, random_state=0, return_teacher=True)
    >>> inv = QueryKeyLeastSquaresInversion(t.value_map)
    >>> stats = inv.new_stats(6, 12, 12)
    >>> inv.update(stats, X, Y)
    >>> ws = inv.whiten(stats)
    >>> round(ws.noise_variance / 0.1**2, 2), ws.null_draws.shape
    (1.0, (1000, 12, 12))
    """

    def __init__(self, value_map):
        super().__init__(centred=False, residual_noise=True, value_map=value_map)

    @staticmethod
    def least_squares_samples(T, d, d_v):
        """Fewest samples for which the pooled normal matrix can have full rank ``d^2``."""
        t = min(T, d)
        return max(2, -(-d * d // (t * min(t, d_v))) + 1)

    def new_stats(self, T, d, d_v):
        stats = super().new_stats(T, d, d_v)
        # the first-order sums serve only the fallback; predict uses the least-squares sums
        stats["HZ"] = stats["FZ"] = None
        n_pairs = d * (d + 1) // 2
        stats.update(R_ls=np.zeros((n_pairs, n_pairs)), rhs_ls=np.zeros(d * d), yy=0.0)
        return stats

    def update(self, stats, X, Y, chunk=256):
        super().update(stats, X, Y)
        self._update_least_squares(stats, X, Y, chunk)

    def _update_least_squares(self, stats, X, Y, chunk=256):
        """The least-squares sums alone (``update`` without the first-order ones behind the fallback)."""
        n, _, d = X.shape
        V = self.value_map
        upper = np.triu_indices(d)
        for start in range(0, n, chunk):
            Xb, Yb = X[start:start + chunk], Y[start:start + chunk]
            G = np.einsum("nta,ntb->nab", Xb, Xb, optimize=True)
            GV = G @ V
            P = GV @ np.swapaxes(GV, 1, 2)
            # H[(a,b),(a',b')] = sum_i G_i[a,a'] P_i[b,b']: its rearrangement R[(a,a'),(b,b')]
            # is one matrix product over samples; G_i and P_i are symmetric, so only their upper
            # triangles enter (R[(a,a'),(b,b')] over a <= a', b <= b': 4x fewer products)
            stats["R_ls"] += G[:, upper[0], upper[1]].T @ P[:, upper[0], upper[1]]
            stats["rhs_ls"] += np.einsum("nta,ntv,nbv->ab", Xb, Yb, GV, optimize=True).ravel()
            stats["yy"] += float(np.sum(Yb**2))

    @staticmethod
    def _rearranged_normal_matrix(stats):
        """``R[(a,a'),(b,b')] = sum_i G_i[a,a'] P_i[b,b']`` in full, from its upper-triangle sums."""
        d = stats["dims"][1]
        # position of the pair (a, a') in the upper triangle, for every (a, a')
        pos = np.zeros((d, d), dtype=np.intp)
        pos[np.triu_indices(d)] = np.arange(d * (d + 1) // 2)
        pos = np.maximum(pos, pos.T).ravel()
        return stats["R_ls"][np.ix_(pos, pos)]

    @classmethod
    def normal_matrix(cls, stats):
        """The pooled normal matrix ``H`` (``d^2 x d^2``, row-major ``vec K``) from the sums (exactly symmetric)."""
        return kronecker_rearranged(cls._rearranged_normal_matrix(stats), stats["dims"][1])

    def whiten(self, stats):
        T, d, d_v = stats["dims"]
        n = stats["n"]
        dof = n * T * d_v - d * d
        if n < self.least_squares_samples(T, d, d_v) or dof < MIN_NOISE_DOF:
            return _with_warning(super().whiten(stats), IllConditionedInversionWarning,
                f"{n} samples are too few for the least-squares query-key inversion with a known "
                f"V at T={T}, d={d}, d_v={d_v} (it needs {self.least_squares_samples(T, d, d_v)} "
                f"and {MIN_NOISE_DOF} residual degrees of freedom). Fallback in use: the first-order "
                "inversion M_i = X_i^+ Y_i, biased towards the projections X_i^+ X_i when T < d.")
        R = self._rearranged_normal_matrix(stats)
        H = kronecker_rearranged(R, d)
        scale = float(np.trace(H)) / H.shape[0]
        warnings = []
        try:
            L = linalg.cholesky(H, lower=True, check_finite=False)
            cond_ok = np.min(np.abs(np.diag(L))) > 1e-6 * np.max(np.abs(np.diag(L)))
        except linalg.LinAlgError:
            cond_ok = False
        if not cond_ok:
            # a direction of K no sample sees (e.g. degenerate tokens): a tiny ridge keeps it at zero
            warnings.append((IllConditionedInversionWarning,
                             "the least-squares query-key normal matrix is singular or ill-conditioned (some "
                             "directions of K are not seen by any sample). Fallback in use: a ridge of 1e-8 "
                             "times its mean diagonal, which sets unseen directions of K to zero."))
            H = H + 1e-8 * max(scale, np.finfo(float).tiny) * np.eye(H.shape[0])
            R = kronecker_rearranged(H, d)
            L = linalg.cholesky(H, lower=True, check_finite=False)
        k = linalg.cho_solve((L, True), stats["rhs_ls"], check_finite=False)
        sigma2 = max(stats["yy"] - float(stats["rhs_ls"] @ k), 0.0) / dof
        A, B = _kronecker_factors(R, d)   # nearest Kronecker product to H (R is its rearrangement)
        # exact draws of the whitened noise: vec N ~ N(0, sigma2 H^{-1})
        return _kernel_statistic_with_null_draws(k.reshape(d, d), L, A, B, sigma2, dof, warnings)

    def fit_operator(self, stats, basis):
        return _LinearQKOperator(_kernel_in_basis(self.normal_matrix(stats), stats["rhs_ls"], basis.T),
                                 self.value_map)


def _kernel_statistic_with_null_draws(K, L, A, B, sigma2, dof, warnings):
    """The whitened statistic of a least-squares kernel estimate K (d x d) whose noise is
    ``vec N ~ N(0, sigma2 (L L^T)^{-1})`` (row-major vec; L the Cholesky factor of its normal matrix or
    information): ``K~ K~^T / d`` with ``K~ = A^{1/2} K B^{1/2}`` (``A (x) B`` that matrix's nearest Kronecker
    product) and ``NULL_DRAWS`` draws ``A^{1/2} N B^{1/2}`` (seed ``NULL_SEED``) for the simulated test."""
    d = K.shape[0]
    A_half, B_half = psd_power(A, 0.5), psd_power(B, 0.5)
    A_inv_half, B_inv_half = psd_power(A, -0.5), psd_power(B, -0.5)
    Kt = A_half @ K @ B_half
    lam, vecs = _eigh_desc(Kt @ Kt.T / d)
    lam = np.clip(lam, 0.0, None)
    rng = np.random.default_rng(NULL_SEED)
    Z = linalg.solve_triangular(L, rng.standard_normal((d * d, NULL_DRAWS)), lower=True, trans="T",
                                check_finite=False) * np.sqrt(sigma2)   # sigma L^{-T} z
    draws = np.einsum("ab,bcj,cd->jad", A_half, Z.reshape(d, d, NULL_DRAWS), B_half, optimize=True)
    return WhitenedStatistic(lam, vecs, A_inv_half, float(d), float(sigma2), float(dof), warnings,
                             statistic_matrix=Kt, null_draws=draws,
                             least_squares_factors=(L, A_half, B_half, A_inv_half, B_inv_half))


def _with_warning(ws, category, message):
    """``ws`` (a fallback's whitened statistic) with the warning that says why it is in use."""
    ws.warnings.append((category, message))
    return ws


class _KeptSamples:
    """Mixin for a :class:`QueryKeyInversion` that also keeps its samples, in halves by the parity of their
    global index (:func:`_keep_half_samples`; beyond the budget only the first-order sums remain)."""

    def new_stats(self, T, d, d_v):
        stats = super().new_stats(T, d, d_v)
        stats["samples_odd"] = []
        stats["samples_even"] = []
        return stats

    def update(self, stats, X, Y):
        odd = (stats["n"] + np.arange(X.shape[0])) % 2 == 1
        super().update(stats, X, Y)
        _keep_half_samples(stats, X, Y, odd)   # over budget: first order only


class QueryKeyCrossFitInversion(_KeptSamples, QueryKeyInversion):
    """Cross-fitted least-squares inversion of linear QK with an unknown V, for ``T <= d`` or ``d_v < d``.

    With fewer tokens than features ``M_i = X_i^+ Y_i`` keeps only the
    projection ``X_i^+ X_i K`` of the kernel, whose mean mixes K with its
    transpose and a multiple of the identity, and with ``T = d`` it has no
    residual to take the noise level from. The least squares on
    ``Y_i = X_i K G_i V + E_i`` itself (:class:`QueryKeyLeastSquaresInversion`)
    has neither problem but needs V. With more tokens than features
    ``M_i = K G_i V + X_i^+ E_i`` holds exactly, but the signal of
    ``C = sum_i w_i M_i M_i^T`` is ``K (sum_i w_i G_i V V^T G_i) K^T``: when
    ``d_v < r*``, ``r* - d_v`` directions of range(K) lie outside the
    rank-``d_v`` part of ``E[G_i A G_i] = T (T + 1) A + T tr(A) I``
    (``A = V V^T``, white Gaussian tokens) and see only its isotropic part,
    about a factor ``T / d_v`` weaker, so the first-order test loses power
    there; r* is unknown, so the least squares is used whenever
    ``d_v < d``. Here V is *fitted on one half* of the
    samples (odd global index): ``(K, V)`` by least squares on ``Y_i``
    (:meth:`fit_half`: first on scale-normalised samples, from the
    first-order fit, its transpose and ``CROSS_FIT_RANDOM_STARTS`` random
    kernels, since the objective is not convex; then on the samples as
    they are). The least-squares inversion with that V then runs on the
    *other half*. Because the fitted V does not
    depend on the second half's noise, that half's estimate of K has exactly
    the Gaussian noise ``N(0, sigma2 H^{-1})`` of the known-V case when
    ``r* = 0``, so its simulated-null test keeps its level.

    With signal, an error in the fitted V leaves part of the signal in the
    other half, which its least squares partly takes into K, in general
    outside range(K*). ``null_shift`` carries it: draws of the fitted V's
    error from the delta method (profiled over K) and the exact move of the
    other half's K that each makes, for the rank-k truncation that test k
    assumes (:mod:`rstar._value_error`). The same is done with the halves
    swapped (``cross_fit``); the rule counts a spike where either direction
    does at half the level (a Bonferroni union). An
    ``UnidentifiableRankWarning`` says when a half's fitted V leaves the
    other half more than ``CROSS_FIT_MISFIT`` times that half's own residual
    power: a fit in a poor local optimum, whose error no linearisation
    covers. Where, in addition, the other half's V (with its least-squares
    K) fits the first half better than that half's own fit, the fit is
    provably not its half's least squares: that direction is left out of
    the union (``poor_fit``; a ``ConvergenceWarning`` says so) and the other
    is tested alone, still at half the level.

    The samples of each half are kept (lists of arrays, so ``partial_fit``
    and :func:`merge_stats` concatenate) while they number at most
    ``MAX_COHERENT_SAMPLE_ENTRIES`` entries. The fit is by alternating least
    squares while ``n d^4 + d^6 <= MAX_CROSS_FIT_COST`` (about ``d <= 24``),
    else by L-BFGS on the profile loss while
    ``n T d (d + d_v) <= MAX_PROFILED_FIT_COST`` (:meth:`fit_method`).
    With ``T > d`` the first-order inversion is consistent and the
    cross-fit only adds power, so only the first budget is spent. Beyond
    the budgets, or with too few samples per half for the least squares,
    this is the first-order :class:`QueryKeyInversion`.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.inversions import QueryKeyCrossFitInversion
    >>> X, Y = make_attention_task(600, kind="linear_qk", seq_len=6, n_features=12, rank=3,
    ...                            noise=0.05, random_state=0)
    >>> inv = QueryKeyCrossFitInversion()
    >>> stats = inv.new_stats(6, 12, 12)
    >>> inv.update(stats, X, Y)
    >>> ws = inv.whiten(stats)
    >>> ws.null_draws is not None and ws.cross_fit is not None
    True
    """

    def __init__(self):
        super().__init__(centred=False, residual_noise=True, value_map=None)

    @staticmethod
    def sizes_allow_cross_fit(n, T, d, d_v):
        """Whether n samples of this shape can be cross-fitted: kept within ``MAX_COHERENT_SAMPLE_ENTRIES``,
        fitted within one of the budgets of :meth:`fit_method` (with ``T > d``, where the first-order
        inversion is consistent and the cross-fit only adds power, within the alternating least-squares
        one), and each half large enough for the least squares (full-rank normal matrix and
        ``MIN_NOISE_DOF`` residual degrees of freedom)."""
        half = n // 2
        method = QueryKeyCrossFitInversion.fit_method(n, T, d, d_v)
        return (n * T * (d + d_v) <= MAX_COHERENT_SAMPLE_ENTRIES
                and (method == "als" or (method is not None and T <= d))
                and half >= QueryKeyLeastSquaresInversion.least_squares_samples(T, d, d_v)
                and half * T * d_v - d * d >= MIN_NOISE_DOF)

    @staticmethod
    def fit_method(n, T, d, d_v):
        """How each half's ``(K, V)`` is fitted for n samples in all: ``"als"`` (alternating least
        squares, :func:`rstar._bilinear.fit_query_key_restarts`) while ``n d^4 + d^6 <=
        MAX_CROSS_FIT_COST``; else ``"profiled"`` (L-BFGS on the profile loss,
        :func:`rstar._bilinear.fit_query_key_profiled`) while ``n T d (d + d_v) <=
        MAX_PROFILED_FIT_COST``; else None (no cross-fit)."""
        if n * d**4 + d**6 <= MAX_CROSS_FIT_COST:
            return "als"
        return "profiled" if n * T * d * (d + d_v) <= MAX_PROFILED_FIT_COST else None

    def cross_fit_possible(self, stats):
        """Whether the samples were kept and :meth:`sizes_allow_cross_fit`."""
        return stats.get("samples_odd") is not None and self.sizes_allow_cross_fit(stats["n"], *stats["dims"])

    @staticmethod
    def fit_half(X, Y, random_starts=CROSS_FIT_RANDOM_STARTS, seed=CROSS_FIT_SEED, method="als"):
        """Fit ``Y_i ~ X_i K G_i V`` on one half (see the class notes).

        The signal is homogeneous of degree 3 in ``X_i``, so with
        heavy-tailed tokens a few samples of large norm dominate the least
        squares, and its landscape has poor local optima. The fit therefore
        runs first on *scale-normalised* samples (``X_i / s_i``,
        ``Y_i / s_i^3``, ``s_i`` the root mean square of ``X_i``: the same
        model, every sample's signal of order one), from the first-order
        fit, its transpose and ``random_starts`` random kernels; the
        least squares on the samples as they are then starts from that
        kernel.

        Parameters
        ----------
        X : ndarray of shape (n, T, d)
        Y : ndarray of shape (n, T, d_v)
        random_starts : int, default=CROSS_FIT_RANDOM_STARTS
        seed : int, default=CROSS_FIT_SEED
        method : {"als", "profiled"}, default="als"
            The optimiser: alternating least squares
            (:func:`rstar._bilinear.fit_query_key_restarts`) or L-BFGS on
            the profile loss (:func:`rstar._bilinear.fit_query_key_profiled`),
            which never forms a ``d^2 x d^2`` matrix.

        Returns
        -------
        K : ndarray of shape (d, d)
            Unit Frobenius norm (the scale sits in V).
        V : ndarray of shape (d, d_v)
        noise_variance : float
            The fit's residual power per degree of freedom
            (``n T d_v - d^2 - d d_v + 1`` of them).
        """
        if method not in ("als", "profiled"):
            raise ValueError(f"method must be 'als' or 'profiled', got {method!r}.")
        n, T, d = X.shape
        d_v = Y.shape[2]
        scale = np.sqrt(np.mean(X**2, axis=(1, 2)))
        scale = np.where(scale > 0, scale, 1.0)[:, None, None]
        Xn, Yn = X / scale, Y / scale**3
        # first-order start: M_i = X_i^+ Y_i ~ K G_i V, weighted as QueryKeyInversion weights it
        U, inv_s, Wt, smallest, _ = batched_pseudo_inverse(Xn)
        M = np.einsum("nka,nk,ntk,ntv->nav", Wt, inv_s, U, Yn, optimize=True)
        HZ, FZ = _bilinear.moment_sums(np.matmul(np.swapaxes(Xn, 1, 2), Xn), M, smallest)
        K1, _ = _bilinear.fit_bilinear(HZ, FZ, np.eye(d), max_iter=200, fit_tol=1e-6)
        rng = np.random.default_rng(seed)
        starts = [K1, K1.T] + [rng.standard_normal((d, d)) for _ in range(random_starts)]
        if method == "als":
            K_scaled, _, _ = _bilinear.fit_query_key_restarts(Xn, Yn, starts)
            K, V, rss = _bilinear.fit_query_key_samples(X, Y, K_scaled)
        else:
            K_scaled, _, _ = _bilinear.fit_query_key_profiled(Xn, Yn, starts)
            K, V, rss = _bilinear.fit_query_key_profiled(X, Y, [K_scaled])
        return K, V, rss / QueryKeyCrossFitInversion._fit_dof(n, T, d, d_v)

    @staticmethod
    def _fit_dof(n, T, d, d_v):
        """Residual degrees of freedom of the fit of ``(K, V)`` on n samples (one scale is shared)."""
        return max(n * T * d_v - d * d - d * d_v + 1, 1)

    @staticmethod
    def _tested_on(V, X, Y):
        T, d, d_v = X.shape[1], X.shape[2], Y.shape[2]
        ls = QueryKeyLeastSquaresInversion(V)
        ls_stats = ls.new_stats(T, d, d_v)
        # only the least-squares sums: cross_fit_possible ruled out its first-order fallback
        ls._update_least_squares(ls_stats, X, Y)
        ls_stats["n"] = X.shape[0]
        return ls.whiten(ls_stats)

    @staticmethod
    def _value_map_error(ws, fit, G_fit, G_test):
        """The null shift of ``ws`` (the least squares on the half with grams ``G_test``, with the V of ``fit``,
        made on the half with grams ``G_fit``): draws of that V's linearised error
        (:func:`rstar._value_error.value_map_error_draws`) and what they move the kernel by
        (:class:`rstar._value_error.ValueMapErrorLeak`)."""
        K, V, sigma2 = fit
        Vr = _value_error.reduced_value_map(V)
        draws = _value_error.value_map_error_draws(G_fit, K, Vr, sigma2, NULL_DRAWS, NULL_SEED + 1)
        return _value_error.ValueMapErrorLeak(G_test, Vr, draws, *ws.least_squares_factors)

    def whiten(self, stats):
        if not self.cross_fit_possible(stats):
            return super().whiten(stats)
        halves = [_kept_half(stats, key) for key in ("samples_odd", "samples_even")]
        method = self.fit_method(stats["n"], *stats["dims"])
        fits = [self.fit_half(*h, method=method) for h in halves]
        grams = [np.matmul(np.swapaxes(X, 1, 2), X) for X, _ in halves]
        out, misfits = [], []
        for a, b in ((0, 1), (1, 0)):
            ws = self._tested_on(fits[a][1], *halves[b])
            ws.null_shift = self._value_map_error(ws, fits[a], grams[a], grams[b])
            # a fit stuck in a poor local optimum, or a V whose error heavy-tailed tokens amplify,
            # leaves signal in the other half's residual: its noise level then exceeds that half's
            # own fit by far more than sampling error
            misfits.append(ws.noise_variance / max(fits[b][2], np.finfo(float).tiny))
            out.append(ws)
        # out[b] tests V_b on half a, with the least-squares K for it: if that leaves half a a smaller
        # residual than half a's own fit (K_a, V_a), that fit is not the least squares of its half
        rss_own = [f[2] * self._fit_dof(len(h[0]), *stats["dims"]) for f, h in zip(fits, halves)]
        beaten = [out[1 - a].noise_variance * out[1 - a].noise_dof < rss_own[a] for a in (0, 1)]
        for a, ws in enumerate(out):
            if misfits[a] <= CROSS_FIT_MISFIT:
                continue
            if beaten[a] and not beaten[1 - a]:
                ws.poor_fit = True
                ws.warnings.append((ConvergenceWarning,
                                    f"the fit of K and V on one half of the samples stopped in a poor local optimum "
                                    f"(the other half's V fits it better, and it leaves the other half "
                                    f"{misfits[a]:.2f} times its own residual power): its direction of the "
                                    "cross-fit is left out, and the other is tested alone at the same level "
                                    "alpha / 2."))
            else:
                ws.warnings.append((UnidentifiableRankWarning,
                                    f"the value map fitted on one half of the samples leaves {misfits[a]:.2f} times "
                                    "the other half's own residual power unexplained (the least-squares fit of K "
                                    "and V is not convex and may have stopped in a poor local optimum, or "
                                    "heavy-tailed tokens amplify the error of the fitted V): part of the "
                                    "signal is then tested as noise outside range(K), so rank_ may be an "
                                    "over-count."))
        out[0].cross_fit = out[1]
        out[0].warnings.extend(w for w in out[1].warnings if w not in out[0].warnings)
        return out[0]


def _kernel_in_basis(H, rhs, U):
    """Least-squares kernel ``K = U B`` (range in the columns of ``U``, d x r) from the normal
    equations ``H vec K = rhs`` of a row-major ``vec K`` (``H``: d^2 x d^2)."""
    d, r = U.shape
    if r == 0:
        return np.zeros((d, d))
    J = np.kron(U, np.eye(d))  # vec_row(U B) = J vec_row(B)
    b = solve_psd(J.T @ H @ J, J.T @ rhs)
    return U @ b.reshape(r, d)


class _LinearQKOperator:
    def __init__(self, K, V):
        self.K, self.V = K, V

    def predict(self, X):
        return np.einsum("nta,ab,nsb,nsc,cv->ntv", X, self.K, X, X, self.V, optimize=True)


class _SoftmaxOperator:
    def __init__(self, K, V):
        self.K, self.V = K, V

    def predict(self, X):
        return _softmax_ls.attention_weights(X, self.K) @ (X @ self.V)


class SoftmaxExactInversion(Inversion):
    """Exact softmax inversion with a known V (theory §4), for ``d, d_v >= T``.

    ``S_i = Y_i (X_i V)^+`` recovers the attention matrix; each entry gives the
    equation ``x_j^T K x_k / sqrt(d) - c_ij = log S_ijk`` with a per-row
    nuisance ``c_ij`` (the log-normaliser). Noisy ``S`` is clipped to
    ``[clip / T, 1]`` before the log, and the equations are weighted by
    ``(T S_ijk)^2`` (delta method: ``Var log S ~ Var S / S^2``); the row
    nuisances are removed by weighted centring (Frisch–Waugh). ``K`` is the
    weighted least-squares solution of the pooled system. The statistic is
    ``K~ K~^T / d`` with ``K~ = A^{1/2} K B^{1/2}``, where ``A (x) B`` is the
    nearest Kronecker product (Van Loan & Pitsianis 1993) to the normal
    matrix; its noise part is MP with ratio 1 scaled by the log-domain
    residual variance.

    Parameters
    ----------
    value_map : ndarray of shape (d, d_v)
    clip : float, default=1e-3
    """

    def __init__(self, value_map, clip=1e-3):
        super().__init__(value_map)
        self.clip = clip

    def min_samples(self, T, d, d_v):
        # n T (T - 1) log-attention equations for d^2 unknowns (plus the row nuisances)
        return max(2, -(-d * d // max(T * (T - 1), 1)) + 1)

    def new_stats(self, T, d, d_v):
        return {"dims": (T, d, d_v), "n": 0, "H": np.zeros((d * d, d * d)), "rhs": np.zeros(d * d),
                "n_odd": 0, "H_odd": np.zeros((d * d, d * d)), "rhs_odd": np.zeros(d * d), "ll": 0.0, "n_eq": 0.0,
                "n_rows": 0.0, "n_clipped": 0.0, "n_entries": 0.0}

    def update(self, stats, X, Y, chunk=256):
        n = X.shape[0]
        # the sums of samples with odd global index are also kept apart: the split-half
        # difference of the two estimates is a draw of the estimate's noise (see whiten)
        odd = (stats["n"] + np.arange(n)) % 2 == 1
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            for is_odd in (False, True):
                mask = odd[part] == is_odd
                if not mask.any():
                    continue
                sums = self._sums(X[part][mask], Y[part][mask])
                for key, value in sums.items():
                    stats[key] += value
                if is_odd:
                    stats["H_odd"] += sums["H"]
                    stats["rhs_odd"] += sums["rhs"]
        stats["n"] += n
        stats["n_odd"] += int(odd.sum())

    def _sums(self, Xb, Yb):
        """This inversion's sums over the samples ``Xb, Yb`` (one chunk)."""
        T, d = Xb.shape[1], Xb.shape[2]
        V = self.value_map
        XV = Xb @ V
        gram = XV @ np.swapaxes(XV, 1, 2)
        S = np.swapaxes(np.linalg.solve(gram, XV @ np.swapaxes(Yb, 1, 2)), 1, 2)
        lo = self.clip / T
        n_clipped = float(np.sum((S < lo) | (S > 1)))
        S = np.clip(S, lo, 1.0)
        w = (T * S) ** 2
        logS = np.log(S)
        wsum = w.sum(axis=2, keepdims=True)
        # weighted centring over k within each row j
        xk_mean = np.einsum("njk,nkb->njb", w, Xb) / wsum
        l_mean = np.sum(w * logS, axis=2, keepdims=True) / wsum
        lt = logS - l_mean
        # Each equation's regressor is phi_jk = x_j (x) (x_k - m_j) / sqrt(d), m_j the weighted
        # mean, so sum_k w_jk phi_jk phi_jk^T = (x_j x_j^T) (x) B_j / d with
        # B_j = sum_k w_jk (x_k - m_j)(x_k - m_j)^T: O(n T d^4) instead of O(n T^2 d^4).
        B = (np.einsum("njk,nka,nkb->njab", w, Xb, Xb, optimize=True)
             - wsum[..., None] * np.einsum("nja,njb->njab", xk_mean, xk_mean))
        # sum_k w_jk lt_jk (x_k - m_j) = sum_k w_jk lt_jk x_k, since sum_k w_jk lt_jk = 0
        g = np.einsum("njk,nkc->njc", w * lt, Xb, optimize=True)
        return {
            "H": np.einsum("nja,njb,njce->acbe", Xb, Xb, B, optimize=True).reshape(d * d, d * d) / d,
            "rhs": np.einsum("nja,njc->ac", Xb, g, optimize=True).reshape(-1) / np.sqrt(d),
            "ll": float(np.sum(w * lt**2)),
            "n_eq": float(w.size),
            "n_rows": float(Xb.shape[0] * T),
            "n_clipped": n_clipped,
            "n_entries": float(S.size),
        }

    def _split_half_noise(self, stats, A_half, B_half):
        """Eigenvalues of the whitened split-half noise draw, or None if a half is too small."""
        T, d, d_v = stats["dims"]
        n_odd = stats["n_odd"]
        need = self.min_samples(T, d, d_v)  # for each half
        if min(n_odd, stats["n"] - n_odd) < need:
            return None
        k_odd = solve_psd(stats["H_odd"], stats["rhs_odd"])
        k_even = solve_psd(stats["H"] - stats["H_odd"], stats["rhs"] - stats["rhs_odd"])
        Z = A_half @ ((k_odd - k_even) / 2).reshape(d, d) @ B_half
        return np.sort(np.linalg.eigvalsh(sym(Z @ Z.T / d)))[::-1]

    def _solve(self, stats):
        return solve_psd(stats["H"], stats["rhs"])

    def whiten(self, stats):
        d = stats["dims"][1]
        k = self._solve(stats)
        dof = stats["n_eq"] - stats["n_rows"] - d * d
        resid = stats["ll"] - float(k @ stats["H"] @ k)
        tau2 = max(resid, 0.0) / dof if dof > 0 else None
        A, B = nearest_kronecker_product(stats["H"], d)
        A_half, B_half = psd_power(A, 0.5), psd_power(B, 0.5)
        K = k.reshape(d, d)
        Kt = A_half @ K @ B_half
        lam, vecs = _eigh_desc(Kt @ Kt.T / d)
        warnings = []
        T, _, d_v = stats["dims"]
        if T > ILL_CONDITIONED_ASPECT * min(d, d_v):
            warnings.append((IllConditionedInversionWarning,
                             f"the exact softmax inversion is ill-conditioned: T={T} tokens is close to "
                             f"min(d, d_v)={min(d, d_v)} (hard edge of the Marchenko-Pastur law), so "
                             "S_i = Y_i (X_i V)^+ amplifies noise and the log-attention bulk spreads over decades. "
                             "Use method='auto' (first-order inversion here) or T <= 0.9 min(d, d_v)."))
        frac = stats["n_clipped"] / max(stats["n_entries"], 1.0)
        if frac > 0.25:
            warnings.append((IllConditionedInversionWarning,
                             f"{100 * frac:.1f}% of the recovered attention weights fell outside "
                             f"[{self.clip}/T, 1] and were clipped before the log: much of the exact softmax "
                             "inversion is noise-dominated. Fallback in use: equations are weighted by (T S)^2, "
                             "so clipped ones carry little weight; check the gap in spectrum_."))
        # Clipping and the weights leave a bulk wider than MP(ratio 1) at the log-domain
        # residual variance tau2, so tau2 is only reported. The noise level comes from the
        # split-half draw: (K_odd - K_even) / 2 has the noise law of the pooled estimate
        # (misspecification included), and its whitened spectrum is MP(ratio 1) shaped.
        null = self._split_half_noise(stats, A_half, B_half)
        if null is not None and np.median(null) > 0:
            noise = float(np.median(null) / mp_median(1.0))
            return WhitenedStatistic(lam, vecs, psd_power(A, -0.5), float(d), noise, MEDIAN_EFFICIENCY * d * d,
                                     warnings, residual_variance=tau2, null_spectrum=null, mp_shaped_bulk=False)
        # a half too small to solve: fit the bulk's level and width instead
        return WhitenedStatistic(lam, vecs, psd_power(A, -0.5), float(d), None, float(max(dof, 0)), warnings,
                                 structured_bulk=True, residual_variance=tau2, null_spectrum=null,
                                 mp_shaped_bulk=False)

    def fit_operator(self, stats, basis):
        return _SoftmaxOperator(_kernel_in_basis(stats["H"], stats["rhs"], basis.T), self.value_map)


class SoftmaxLeastSquaresInversion(_KeptSamples, QueryKeyInversion):
    """Least-squares (Gaussian maximum-likelihood) inversion of softmax attention, V known or not.

    ``K`` is fitted at full rank by least squares on the model itself,
    ``Y_i = softmax(X_i K X_i^T / sqrt(d)) X_i V + E_i``, with V known or
    profiled out (:func:`rstar._softmax_ls.fit_softmax_least_squares`, L-BFGS
    from ``K = 0``). Unlike the first-order inversion it leaves no
    higher-order terms in a structured bulk, and unlike the exact (log-domain)
    inversion it needs neither ``T <= d`` nor a known V. To first order the
    fitted K has noise ``N(0, sigma2 F^{-1})``, with F the Gauss–Newton
    information of K with V profiled out
    (:func:`rstar._softmax_ls.softmax_kernel_information_matrix`) and
    ``sigma2 = RSS / (n T d_v - d^2 - d d_v)`` (``d d_v`` only when V is
    fitted). The statistic is ``K~ K~^T / d`` with ``K~ = A^{1/2} K B^{1/2}``,
    ``A (x) B`` the nearest Kronecker product to F, and it carries
    ``NULL_DRAWS`` draws of the whitened noise, so the rule runs the same
    simulated sequential test as for linear QK with a known V
    (:func:`rstar.rules.simulated_null_p_values`): F need not be a Kronecker
    product (with heavy-tailed tokens it is far from one).

    The samples are kept (lists, so ``partial_fit`` and :func:`merge_stats`
    concatenate) while ``n T (d + d_v) <= MAX_COHERENT_SAMPLE_ENTRIES``, and
    the fit runs while ``n T^2 (d + d_v) <= MAX_SOFTMAX_FIT_COST``,
    the information costs at most ``MAX_SOFTMAX_INFORMATION_COST`` and the
    residual has at least ``MIN_NOISE_DOF`` degrees of freedom
    (:meth:`sizes_allow_fit`); otherwise this is the first-order inversion
    (:class:`QueryKeyInversion` with ``centred=True``). So it is too where,
    with V unknown, the data show no value signal (the F test of ``V = 0``
    under uniform attention does not reject at ``VALUE_SIGNAL_ALPHA``,
    :meth:`value_signal_p_value`): K is then not identified, and its least
    squares runs off to hard attention that fits the noise. And where the
    fit's residual variance exceeds ``SOFTMAX_MISFIT`` times the power per
    degree of freedom outside ``col(P X_i)`` (which softmax data fill with
    the noise plus the higher-order terms), the model does not hold (e.g.
    linear-QK data): first order again, with an ``UnidentifiableRankWarning``;
    likewise where L-BFGS stops at ``SOFTMAX_MAX_ITER`` iterations before
    converging (the null draws are the noise of a minimum, not of the
    optimiser's error).

    Parameters
    ----------
    value_map : ndarray of shape (d, d_v) or None

    Examples
    --------
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.inversions import SoftmaxLeastSquaresInversion
    >>> X, Y = make_attention_task(400, seq_len=12, n_features=6, rank=2, noise=0.05, random_state=0)
    >>> inv = SoftmaxLeastSquaresInversion()
    >>> stats = inv.new_stats(12, 6, 6)
    >>> inv.update(stats, X, Y)
    >>> ws = inv.whiten(stats)
    >>> ws.null_draws.shape
    (1000, 6, 6)
    >>> from rstar.rules import MarchenkoPasturRule
    >>> MarchenkoPasturRule()(ws).rank
    2
    """

    def __init__(self, value_map=None):
        super().__init__(centred=True, residual_noise=False, value_map=value_map)

    @staticmethod
    def residual_dof(n, T, d, d_v, value_map_known=False):
        """Degrees of freedom of the least-squares residual: ``n T d_v - d^2`` (``- d d_v`` with V fitted)."""
        return n * T * d_v - d * d - (0 if value_map_known else d * d_v)

    @staticmethod
    def sizes_allow_fit(n, T, d, d_v, value_map_known=False):
        """Whether n samples of this shape are kept (``n T (d + d_v) <= MAX_COHERENT_SAMPLE_ENTRIES``), fitted
        within ``MAX_SOFTMAX_FIT_COST`` (``n T^2 (d + d_v)``, about one evaluation of the loss), their
        information formed within ``MAX_SOFTMAX_INFORMATION_COST`` (:func:`~rstar._softmax_ls.information_matrix_cost`), and the
        residual has ``MIN_NOISE_DOF`` degrees of freedom."""
        dof = SoftmaxLeastSquaresInversion.residual_dof(n, T, d, d_v, value_map_known)
        return (n * T * (d + d_v) <= MAX_COHERENT_SAMPLE_ENTRIES and n * T * T * (d + d_v) <= MAX_SOFTMAX_FIT_COST
                and _softmax_ls.information_matrix_cost(n, T, d, d_v, not value_map_known) <= MAX_SOFTMAX_INFORMATION_COST
                and dof >= MIN_NOISE_DOF)

    def fit_possible(self, stats):
        """Whether the samples were kept and :meth:`sizes_allow_fit`."""
        return stats.get("samples_odd") is not None and self.sizes_allow_fit(
            stats["n"], *stats["dims"], value_map_known=self.value_map is not None)

    @staticmethod
    def _samples(stats):
        parts = [_kept_half(stats, key) for key in ("samples_odd", "samples_even") if stats[key]]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def value_signal_p_value(self, stats, Y):
        """p-value of the F test of ``V = 0`` under uniform attention (``Y_i ~ 1 xbar_i^T V``).

        Without a value signal the kernel is not identified: the least
        squares then drives K to hard attention that fits the noise.
        """
        T, d, d_v = stats["dims"]
        gram, cross = T * stats["xbar_xbar"], T * stats["xbar_ybar"]
        explained = float(np.sum(cross * solve_psd(gram, cross)))
        dof = stats["n"] * T * d_v - d * d_v
        resid = max(float(np.sum(Y**2)) - explained, np.finfo(float).tiny)
        return float(f_dist.sf((explained / (d * d_v)) / (resid / dof), d * d_v, dof))

    def _value_signal(self, stats, Y):
        """A known V, or the F test of ``V = 0`` rejects at ``VALUE_SIGNAL_ALPHA``."""
        return self.value_map is not None or self.value_signal_p_value(stats, Y) <= VALUE_SIGNAL_ALPHA

    def whiten(self, stats):
        if not self.fit_possible(stats):
            return super().whiten(stats)
        T, d, d_v = stats["dims"]
        X, Y = self._samples(stats)
        if not self._value_signal(stats, Y):
            # no value signal: the first-order inversion's null is calibrated without one
            return super().whiten(stats)
        K, V, sigma2, converged = self._fit(X, Y)
        dof = self.residual_dof(X.shape[0], T, d, d_v, self.value_map is not None)
        if (converged and stats["res_dof"] >= MIN_NOISE_DOF
                and sigma2 > SOFTMAX_MISFIT * stats["res"] / stats["res_dof"]):
            # softmax data leave at least the noise outside col(P X_i) (plus the higher-order terms), and
            # the model's own fit no more than the noise: a larger residual says the model does not hold
            return _with_warning(super().whiten(stats), UnidentifiableRankWarning,
                f"the least-squares fit of softmax attention leaves {sigma2 * stats['res_dof'] / stats['res']:.2f} "
                "times the residual power found outside col(P X_i): the data do not follow "
                "softmax(X K X^T / sqrt(d)) X V (e.g. linear query-key attention: use "
                "operator='linear_qk'). Fallback in use: the first-order inversion, which holds for "
                "both.")
        if not converged:
            # the null draws are the noise of a minimum: an unconverged K holds the optimiser's error too
            # (on a held-out Student-t task, r* = 4 read 62)
            return _with_warning(super().whiten(stats), UnidentifiableRankWarning,
                f"the least-squares fit of the softmax kernel stopped after "
                f"{_softmax_ls.SOFTMAX_MAX_ITER} L-BFGS iterations before converging (a flat or "
                "badly conditioned loss, e.g. heavy-tailed tokens with few samples). Fallback in "
                "use: the first-order inversion.")
        F = _softmax_ls.softmax_kernel_information_matrix(X, K, V, value_map_fitted=self.value_map is None)
        F = F + 1e-10 * max(float(np.trace(F)) / F.shape[0], np.finfo(float).tiny) * np.eye(F.shape[0])
        try:
            L = linalg.cholesky(F, lower=True, check_finite=False)
        except linalg.LinAlgError:
            return _with_warning(super().whiten(stats), IllConditionedInversionWarning,
                "the information of the least-squares softmax kernel is singular (directions of K "
                "that no sample's attention sees). Fallback in use: the first-order inversion.")
        A, B = nearest_kronecker_product(F, d)
        # draws of the estimate's noise to first order: vec N ~ N(0, sigma2 F^{-1})
        return _kernel_statistic_with_null_draws(K, L, A, B, sigma2, dof, [])

    def _fit(self, X, Y, K0=None, basis=None):
        """Least-squares ``(K, V, sigma2, converged)`` on samples scaled to unit RMS (so the optimiser's path does
        not depend on the units, e.g. the first ``partial_fit`` batch's scaling), returned in the units given."""
        T, d, d_v = X.shape[1], X.shape[2], Y.shape[2]
        sx = max(float(np.sqrt(np.mean(X**2))), np.finfo(float).tiny)
        sy = max(float(np.sqrt(np.mean(Y**2))), np.finfo(float).tiny)
        V0 = None if self.value_map is None else self.value_map * (sx / sy)
        K, V, rss, converged = _softmax_ls.fit_softmax_least_squares(
            X / sx, Y / sy, V0, None if K0 is None else K0 * sx**2, basis)
        sigma2 = rss * sy**2 / self.residual_dof(X.shape[0], T, d, d_v, self.value_map is not None)
        return K / sx**2, V * (sy / sx), sigma2, converged

    def fit_operator(self, stats, basis):
        if not self.fit_possible(stats):
            return super().fit_operator(stats, basis)
        X, Y = self._samples(stats)
        if not self._value_signal(stats, Y):
            return super().fit_operator(stats, basis)
        d = stats["dims"][1]
        if basis.shape[0] == 0:
            K = np.zeros((d, d))
            V, _ = _softmax_ls.SoftmaxLeastSquaresLoss(X, Y, self.value_map).value_map(K)
            return _SoftmaxOperator(K, V)
        K_full = self._fit(X, Y)[0]
        K, V, _, _ = self._fit(X, Y, K0=K_full, basis=basis)
        return _SoftmaxOperator(K, V)


def nearest_kronecker_product(H, d, n_iter=100):
    """Symmetric PSD ``A, B`` (d x d) with ``kron(A, B)`` closest to ``H`` in Frobenius norm.

    Van Loan & Pitsianis (1993): the rearrangement
    ``R[(i,k),(j,l)] = H[(i,j),(k,l)]`` turns the problem into a rank-one
    approximation, solved here by power iteration.

    Parameters
    ----------
    H : ndarray of shape (d*d, d*d)
    d : int

    Returns
    -------
    A, B : ndarray of shape (d, d)
    """
    return _kronecker_factors(kronecker_rearranged(H, d), d, n_iter)


def _kronecker_factors(R, d, n_iter=100):
    """:func:`nearest_kronecker_product` from the rearranged matrix ``R``."""
    v = np.eye(d).ravel() / np.sqrt(d)
    for _ in range(n_iter):
        u = R @ v
        nu = np.linalg.norm(u)
        if nu == 0:
            break
        u /= nu
        v_new = R.T @ u
        s = np.linalg.norm(v_new)
        v_new /= s
        if np.linalg.norm(v_new - v) < 1e-12:
            v = v_new
            break
        v = v_new
    s = float(u @ R @ v)
    A, B = sym(u.reshape(d, d)), sym(v.reshape(d, d))
    if np.trace(A) < 0:
        A, B = -A, -B
    if np.trace(B) < 0:
        A, B, s = A, -B, -s
    scale = np.sqrt(abs(s))
    return psd_power(A, 1.0) * scale, psd_power(B, 1.0) * scale
