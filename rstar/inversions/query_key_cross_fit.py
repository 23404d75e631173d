"""Cross-fitted least-squares inversion of linear query–key attention with an unknown value map (theory §4, B1)."""

import numpy as np
from sklearn.exceptions import ConvergenceWarning

from ._numerics import bilinear as _bilinear, value_error as _value_error
from ._numerics.linalg import batched_pseudo_inverse
from ..budgets import DEFAULT_BUDGET, cross_fit_als_cost, cross_fit_profiled_cost
from ..calibration import DEFAULT_CALIBRATION
from ._base import KeptSamplesMixin, kept_half
from ._statistic import CrossFitNull, Finding
from .query_key import QueryKeyInversion
from .query_key_least_squares import QueryKeyLeastSquaresInversion, least_squares_samples

__all__ = ["QueryKeyCrossFitInversion", "cross_fit_method", "cross_fit_sizes_fit", "cross_fit_blocker"]

def cross_fit_method(n, T, d, d_v, budget=DEFAULT_BUDGET, *, calibration=DEFAULT_CALIBRATION):
    """How each half's ``(K, V)`` is fitted for n samples in all: ``"als"`` (alternating least squares,
    :func:`rstar.inversions._numerics.bilinear.fit_query_key_restarts`) while :func:`rstar.budgets.cross_fit_als_cost` is within
    the compute budget; else ``"profiled"`` (L-BFGS on the profile loss,
    :func:`rstar.inversions._numerics.bilinear.fit_query_key_profiled`) while :func:`rstar.budgets.cross_fit_profiled_cost` is;
    else None (no cross-fit)."""
    if budget.allows_compute(cross_fit_als_cost(n, d, calibration=calibration)):
        return "als"
    profiled = cross_fit_profiled_cost(n, T, d, d_v, calibration=calibration)
    return "profiled" if budget.allows_compute(profiled) else None


def cross_fit_blocker(n, T, d, d_v, budget=DEFAULT_BUDGET, *, calibration=DEFAULT_CALIBRATION):
    """Why n samples of this shape cannot be cross-fitted (None if they can): they must be kept within the memory
    budget, fitted within the compute budget by :func:`cross_fit_method` (with ``T > d``, where the first-order
    inversion is consistent and the cross-fit only adds power, by alternating least squares only), and each
    half must be large enough for the least squares (full-rank normal matrix and the calibration's
    ``min_noise_dof`` residual degrees of freedom)."""
    half = n // 2
    min_dof = calibration.min_noise_dof
    if half < least_squares_samples(T, d, d_v) or half * T * d_v - d * d < min_dof:
        return (f"{n} samples are too few for the least squares on each half at T={T}, d={d}, d_v={d_v} (each half "
                f"needs {least_squares_samples(T, d, d_v)} and {min_dof} residual degrees of freedom)")
    if not budget.allows_samples(n, T, d, d_v):
        return f"keeping the {n} samples exceeds the memory budget ({budget.describe()})"
    method = cross_fit_method(n, T, d, d_v, budget, calibration=calibration)
    if method is None:
        return f"fitting K and V on {n} samples exceeds the compute budget ({budget.describe()})"
    if method != "als" and T > d:
        return (f"with T > d only the alternating least squares is spent, and on {n} samples it exceeds the "
                f"compute budget ({budget.describe()})")
    return None


def cross_fit_sizes_fit(n, T, d, d_v, budget=DEFAULT_BUDGET, *, calibration=DEFAULT_CALIBRATION):
    """Whether n samples of this shape can be cross-fitted (:func:`cross_fit_blocker` is None)."""
    return cross_fit_blocker(n, T, d, d_v, budget, calibration=calibration) is None


class QueryKeyCrossFitInversion(KeptSamplesMixin, QueryKeyInversion):
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
    first-order fit, its transpose and the calibration's ``cross_fit_random_starts`` random
    kernels, since the objective is not convex; then on the samples as
    they are). The least-squares inversion with that V then runs on the
    *other half*. Because the fitted V does not
    depend on the second half's noise, that half's estimate of K has exactly
    the Gaussian noise ``N(0, sigma2 H^{-1})`` of the known-V case when
    ``r* = 0``, so its simulated-null test keeps its level.

    With signal, an error in the fitted V leaves part of the signal in the
    other half, which its least squares partly takes into K, in general
    outside range(K*). Each direction's :class:`~rstar.inversions.SimulatedNull` carries it (``shift``): draws of the fitted V's
    error from the delta method (profiled over K) and the exact move of the
    other half's K that each makes, for the rank-k truncation that test k
    assumes (:mod:`rstar.inversions._numerics.value_error`). The same is done with the halves
    swapped; the two form a :class:`~rstar.inversions.CrossFitNull`, and
    the rule counts a spike where either direction does at half the level
    (a Bonferroni union). An
    ``UnidentifiableRankWarning`` says when a half's fitted V leaves the
    other half more than ``least_squares_misfit_ratio`` (the calibration's) times that half's own residual
    power: a fit in a poor local optimum, whose error no linearisation
    covers. Where, in addition, the other half's V (with its least-squares
    K) fits the first half better than that half's own fit, the fit is
    provably not its half's least squares: that direction is left out of
    the union (its ``poor_fit``; a ``ConvergenceWarning`` says so) and the other
    is tested alone, still at half the level.

    The samples of each half are kept (lists of arrays, so ``partial_fit``
    and :func:`merge_stats` concatenate) within the memory budget. The fit is by alternating least squares while
    :func:`rstar.budgets.cross_fit_als_cost` is within the compute budget
    (about ``d <= 24`` at the default),
    else by L-BFGS on the profile loss while
    :func:`rstar.budgets.cross_fit_profiled_cost` is (:func:`cross_fit_method`).
    With ``T > d`` the first-order inversion is consistent and the
    cross-fit only adds power, so only the first budget is spent. Beyond
    the budgets, or with too few samples per half for the least squares,
    this is the first-order :class:`QueryKeyInversion`
    (:func:`cross_fit_blocker` says why; the estimator warns).

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
    >>> ws.inversion, ws.null.kind, len(ws.null.directions)
    ('query_key_cross_fit', 'cross_fit_union', 2)
    """

    name = "query_key_cross_fit"

    def __init__(self, *, budget=None, seed=None, n_null_draws=None, predict_sums=True, calibration=None):
        super().__init__(centred=False, residual_noise=True, value_map=None, budget=budget, seed=seed,
                         n_null_draws=n_null_draws, predict_sums=predict_sums, calibration=calibration)

    @property
    def produces(self):
        return (self.name, self.first_order_name)

    def cross_fit_possible(self, stats):
        """Whether the samples were kept and :func:`cross_fit_sizes_fit` allows the cross-fit."""
        return self.samples_kept(stats) and cross_fit_sizes_fit(stats["n"], *stats["dims"], self.budget,
                                                                calibration=self.calibration)

    def default_run(self, stats):
        """The cross-fit where :meth:`cross_fit_possible`, else first order."""
        return self.name if self.cross_fit_possible(stats) else self.first_order_name

    @staticmethod
    def fit_half(X, Y, random_starts=None, seed=None, method="als", *, calibration=DEFAULT_CALIBRATION):
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
        random_starts : int or None, default=None
            None: the calibration's ``cross_fit_random_starts``.
        seed : int or None, default=None
            Seed of the random starting kernels (None: the calibration's ``default_seed`` + 1).
        method : {"als", "profiled"}, default="als"
            The optimiser: alternating least squares
            (:func:`rstar.inversions._numerics.bilinear.fit_query_key_restarts`) or L-BFGS on
            the profile loss (:func:`rstar.inversions._numerics.bilinear.fit_query_key_profiled`),
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
        rng = np.random.default_rng(calibration.default_seed + 1 if seed is None else seed)
        if random_starts is None:
            random_starts = calibration.cross_fit_random_starts
        starts = [K1, K1.T] + [rng.standard_normal((d, d)) for _ in range(random_starts)]
        if method == "als":
            K_scaled, _, _ = _bilinear.fit_query_key_restarts(Xn, Yn, starts)
            K, V, rss = _bilinear.fit_query_key_samples(X, Y, K_scaled)
        else:
            ftol = calibration.profile_ftol
            K_scaled, _, _ = _bilinear.fit_query_key_profiled(Xn, Yn, starts, ftol=ftol)
            K, V, rss = _bilinear.fit_query_key_profiled(X, Y, [K_scaled], ftol=ftol)
        return K, V, rss / QueryKeyCrossFitInversion._fit_dof(n, T, d, d_v)

    @staticmethod
    def _fit_dof(n, T, d, d_v):
        """Residual degrees of freedom of the fit of ``(K, V)`` on n samples (one scale is shared)."""
        return max(n * T * d_v - d * d - d * d_v + 1, 1)

    def _tested_on(self, V, X, Y):
        T, d, d_v = X.shape[1], X.shape[2], Y.shape[2]
        ls = QueryKeyLeastSquaresInversion(V, budget=self.budget, seed=self.seed, n_null_draws=self.n_null_draws,
                                           calibration=self.calibration)
        ls_stats = ls.new_stats(T, d, d_v)
        # only the least-squares sums: cross_fit_possible ruled out its first-order fallback
        ls._update_least_squares(ls_stats, X, Y)
        ls_stats["n"] = X.shape[0]
        return ls.whiten(ls_stats, ls.name)

    def _value_map_error(self, ws, fit, G_fit, G_test):
        """The null shift of ``ws`` (the least squares on the half with grams ``G_test``, with the V of ``fit``,
        made on the half with grams ``G_fit``): draws of that V's linearised error
        (:func:`rstar.inversions._numerics.value_error.value_map_error_draws`) and what they move the kernel by
        (:class:`rstar.inversions._numerics.value_error.ValueMapErrorLeak`)."""
        K, V, sigma2 = fit
        Vr = _value_error.reduced_value_map(V)
        draws = _value_error.value_map_error_draws(G_fit, K, Vr, sigma2, self.n_null_draws, self.seed + 1)
        return _value_error.ValueMapErrorLeak(G_test, Vr, draws, *ws.null.factors,
                                              chunk_entries=self.calibration.value_error_chunk_entries)

    def whiten(self, stats, run=None):
        run = self._check_run(self.default_run(stats) if run is None else run)
        if run != self.name:
            return self._first_order_statistic(stats)
        if not self.cross_fit_possible(stats):
            raise ValueError("the cross-fit needs the samples, which were dropped over the memory budget.")
        halves = [kept_half(stats, key) for key in ("samples_odd", "samples_even")]
        method = cross_fit_method(stats["n"], *stats["dims"], self.budget, calibration=self.calibration)
        fits = [self.fit_half(*h, seed=self.seed + 1, method=method, calibration=self.calibration) for h in halves]
        grams = [np.matmul(np.swapaxes(X, 1, 2), X) for X, _ in halves]
        out, misfits = [], []
        for a, b in ((0, 1), (1, 0)):
            ws = self._tested_on(fits[a][1], *halves[b])
            ws.null.shift = self._value_map_error(ws, fits[a], grams[a], grams[b])
            # a fit stuck in a poor local optimum, or a V whose error heavy-tailed tokens amplify,
            # leaves signal in the other half's residual: its noise level then exceeds that half's
            # own fit by far more than sampling error
            misfits.append(ws.null.noise_variance / max(fits[b][2], np.finfo(float).tiny))
            out.append(ws)
        # out[b] tests V_b on half a, with the least-squares K for it: if that leaves half a a smaller
        # residual than half a's own fit (K_a, V_a), that fit is not the least squares of its half
        rss_own = [f[2] * self._fit_dof(len(h[0]), *stats["dims"]) for f, h in zip(fits, halves)]
        beaten = [out[1 - a].null.noise_variance * out[1 - a].null.noise_dof < rss_own[a] for a in (0, 1)]
        leaks = []
        for a, ws in enumerate(out):
            if misfits[a] <= self.calibration.least_squares_misfit_ratio:
                continue
            if beaten[a] and not beaten[1 - a]:
                ws.null.poor_fit = True
                ws.warnings.append((ConvergenceWarning,
                                    f"the fit of K and V on one half of the samples stopped in a poor local optimum "
                                    f"(the other half's V fits it better, and it leaves the other half "
                                    f"{misfits[a]:.2f} times its own residual power): its direction of the "
                                    "cross-fit is left out, and the other is tested alone at the same level "
                                    "alpha / 2."))
            else:
                leaks.append(float(misfits[a]))
        out[0].warnings.extend(w for w in out[1].warnings if w not in out[0].warnings)
        if leaks:
            # a half's fitted V misses the other half's signal: rstar.rules.identifiability judges it
            out[0].findings.append(Finding("value_map_misfit", {"ratios": leaks}))
        out[0].null = CrossFitNull((out[0].null, out[1].null))
        out[0].inversion = self.name
        return out[0]


