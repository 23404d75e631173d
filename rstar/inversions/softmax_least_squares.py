"""Least-squares (Gaussian maximum-likelihood) inversion of softmax attention, V known or not (theory §4, B2)."""

import numpy as np
from scipy import linalg
from scipy.stats import f as f_dist

from ._numerics import softmax_factored as sf, softmax_ls as _softmax_ls
from .._backend import NUMPY
from ._numerics.linalg import factored_svd, solve_psd
from ..streaming import ArrayPartsSamples
from ..budgets import DEFAULT_BUDGET, information_cost, largest_count, softmax_fit_cost
from ..calibration import DEFAULT_CALIBRATION
from ._base import KeptSamplesMixin, fell_back, kept_half, operator_residuals
from ._kernel import SoftmaxOperator, kernel_statistic_with_null_draws, nearest_kronecker_product
from ._statistic import split_half_counts
from ._numerics.softmax_factored import causal_mask as sf_causal_mask, token_metric_roots_of_sums, token_metric_sums
from .query_key import QueryKeyInversion
from .softmax_rotary import (
    ROTARY_NAMES,
    rotary_inversion_name,
    rotary_fit_blocker,
    rotary_half_disagreement,
    rotary_operator,
    rotary_output_distances,
    rotary_rank_residuals,
    rotary_statistic,
)
from .softmax_factored import (
    FACTORED_NAME,
    factored_capacity,
    factored_fit_blocker,
    factored_half_disagreement,
    factored_output_distances,
    factored_operator,
    factored_rank_residuals,
    factored_statistic,
)

__all__ = ["SoftmaxLeastSquaresInversion", "softmax_fit_sizes_fit", "softmax_fit_blocker", "softmax_fit_capacity",
           "softmax_fit_starts"]

def softmax_fit_starts(T, d, value_map_known, *, calibration=DEFAULT_CALIBRATION):
    """How many starts the least squares runs: 1 + the calibration's ``softmax_restarts`` with V unknown and
    ``T - 1 <= d``, else 1.

    With V unknown and no residual outside col(P X_i) to check the fit against (``T - 1 <= d``) a local minimum
    cannot be told from the model's failure, so the fit also starts from seeded random kernels (of the norm of the
    fit from K = 0) and keeps the lowest residual; the compute budget counts every start.
    """
    return 1 + calibration.softmax_restarts if not value_map_known and T - 1 <= d else 1


def residual_dof(n, T, d, d_v, value_map_known=False):
    """Degrees of freedom of the least-squares residual: ``n T d_v - d^2`` (``- d d_v`` with V fitted)."""
    return n * T * d_v - d * d - (0 if value_map_known else d * d_v)


def softmax_fit_blocker(n, T, d, d_v, value_map_known=False, budget=DEFAULT_BUDGET, samples_in_memory=True, *,
                        calibration=DEFAULT_CALIBRATION):
    """Why n samples of this shape cannot be fitted by least squares (None if they can): kept within the memory
    budget (unless ``samples_in_memory=False``: the fit then reads them in passes, e.g.
    :meth:`rstar.RStarEstimator.fit_batches`), fitted within the compute budget
    (:func:`rstar.budgets.softmax_fit_cost`), their information formed within it
    (:func:`rstar.budgets.information_cost`), and the calibration's ``min_noise_dof`` residual degrees of
    freedom."""
    if residual_dof(n, T, d, d_v, value_map_known) < calibration.min_noise_dof:
        return (f"{n} samples leave fewer than {calibration.min_noise_dof} residual degrees of freedom for the least "
                f"squares at T={T}, d={d}, d_v={d_v}")
    if samples_in_memory and not budget.allows_samples(n, T, d, d_v):
        return f"keeping the {n} samples exceeds the memory budget ({budget.describe()})"
    if not budget.allows_kernel_matrix(d):
        return (f"the information of K (d^2 x d^2 at d={d}, {8 * d**4 / 2**20:.4g} MiB) exceeds half the memory "
                f"budget ({budget.describe()})")
    if not budget.allows_compute(softmax_fit_cost(n, T, d, d_v, calibration=calibration)
                                 * softmax_fit_starts(T, d, value_map_known, calibration=calibration)):
        return f"the fit on {n} samples exceeds the compute budget ({budget.describe()})"
    if not budget.allows_compute(information_cost(n, T, d, d_v, not value_map_known)):
        return f"the information of K (d^2 x d^2 at d={d}) exceeds the compute budget ({budget.describe()})"
    return None


def softmax_fit_capacity(T, d, d_v, value_map_known=False, budget=DEFAULT_BUDGET, samples_in_memory=True, *,
                         calibration=DEFAULT_CALIBRATION):
    """The most samples the least squares can be fitted on within the budgets: kept within the memory budget
    (unless ``samples_in_memory=False``), the fit and its information within the compute budget (the costs grow
    with n; the degrees-of-freedom condition is not part of it). 0 if none."""
    def fits(n):
        if samples_in_memory and not budget.allows_samples(n, T, d, d_v):
            return False
        return (budget.allows_compute(softmax_fit_cost(n, T, d, d_v, calibration=calibration)
                                      * softmax_fit_starts(T, d, value_map_known, calibration=calibration))
                and budget.allows_compute(information_cost(n, T, d, d_v, not value_map_known)))

    return largest_count(fits, budget.max_samples(T, d, d_v) if samples_in_memory else 2**62)


def softmax_fit_sizes_fit(n, T, d, d_v, value_map_known=False, budget=DEFAULT_BUDGET, samples_in_memory=True, *,
                          calibration=DEFAULT_CALIBRATION):
    """Whether n samples of this shape can be fitted by least squares (:func:`softmax_fit_blocker` is None)."""
    return softmax_fit_blocker(n, T, d, d_v, value_map_known, budget, samples_in_memory,
                               calibration=calibration) is None


class SoftmaxLeastSquaresInversion(KeptSamplesMixin, QueryKeyInversion):
    """Least-squares (Gaussian maximum-likelihood) inversion of softmax attention, V known or not.

    ``K`` is fitted at full rank by least squares on the model itself,
    ``Y_i = softmax(X_i K X_i^T / sqrt(d)) X_i V + E_i``, with V known or
    profiled out (:func:`rstar.inversions._numerics.softmax_ls.fit_softmax_least_squares`, L-BFGS
    from ``K = 0``; with V unknown and ``T - 1 <= d`` also from
    the calibration's ``softmax_restarts`` seeded random kernels, the lowest residual kept).
    Unlike the first-order inversion it leaves no
    higher-order terms in a structured bulk, and unlike the exact (log-domain)
    inversion it needs neither ``T <= d`` nor a known V. To first order the
    fitted K has noise ``N(0, sigma2 F^{-1})``, with F the Gauss–Newton
    information of K with V profiled out
    (:func:`rstar.inversions._numerics.softmax_ls.softmax_kernel_information_matrix`) and
    ``sigma2 = RSS / (n T d_v - d^2 - d d_v)`` (``d d_v`` only when V is
    fitted). The statistic is ``K~ K~^T / d`` with ``K~ = A^{1/2} K B^{1/2}``,
    ``A (x) B`` the nearest Kronecker product to F, and it carries
    ``n_null_draws`` draws of the whitened noise, so the rule runs the same
    simulated sequential test as for linear QK with a known V
    (:func:`rstar.rules.simulated_null_p_values`): F need not be a Kronecker
    product (with heavy-tailed tokens it is far from one).

    The samples are kept (lists, so ``partial_fit`` and :func:`merge_stats`
    concatenate) within the memory budget; beyond it the first samples that
    fit it are kept and the fit runs on them alone (``choose_inversion``
    notes it), or on all of them read in passes from a
    :class:`rstar.streaming.Samples` source. The fit runs while its cost
    and that of its information are within the compute budget and the
    residual has at least the calibration's ``min_noise_dof`` degrees of freedom
    (:func:`softmax_fit_sizes_fit`); otherwise this is the first-order inversion
    (:class:`QueryKeyInversion` with ``centred=True``). So it is too where,
    with V unknown, the data show no value signal (the F test of ``V = 0``
    under uniform attention does not reject at ``value_signal_alpha``,
    :meth:`value_signal_p_value`): K is then not identified, and its least
    squares runs off to hard attention that fits the noise. And where the
    fit's residual variance exceeds ``least_squares_misfit_ratio`` times the power per
    degree of freedom outside ``col(P X_i)`` (which softmax data fill with
    the noise plus the higher-order terms), the model does not hold (e.g.
    linear-QK data): first order again, with an ``UnidentifiableRankWarning``;
    likewise where L-BFGS stops at ``softmax_max_iter`` iterations before
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
    >>> ws.inversion, ws.null.kind, ws.null.draws.shape
    ('softmax_least_squares', 'simulated', (1000, 6, 6))
    >>> from rstar.rules import MarchenkoPasturRule
    >>> MarchenkoPasturRule()(ws).rank
    2
    """

    name = "softmax_least_squares"

    def __init__(self, value_map=None, *, budget=None, seed=None, n_null_draws=None, predict_sums=True,
                 causal=False, calibration=None, stopping_count=None, rank_bound=None, rotary=None,
                 reading_tolerance=None):
        super().__init__(centred=True, residual_noise=False, value_map=value_map, budget=budget, seed=seed,
                         n_null_draws=n_null_draws, predict_sums=predict_sums, calibration=calibration)
        self.causal = bool(causal)
        # a rotary head's positions: only the rotary least squares (rstar.inversions.softmax_rotary) models them
        self.rotary = rotary
        # a bound on r* from the model class (the estimators' max_rank): the factored fit's rank q stays within it
        self.rank_bound = None if rank_bound is None else int(rank_bound)
        # the tolerance the risk curve will be read at, which the factored fit must resolve (None: none)
        self.reading_tolerance = None if reading_tolerance is None else float(reading_tolerance)
        # the split-half rule's count, the factored fit's stopping test (None: the split-half null's own)
        self.stopping_count = split_half_counts if stopping_count is None else stopping_count

    def _mask(self, stats):
        """The logits kept: the lower triangle for causal attention, else None (all)."""
        return sf_causal_mask(stats["dims"][0]) if getattr(self, "causal", False) else None

    @property
    def factored_name(self):
        """The factored run's name: the rotary least squares for rotary heads, else the factored one (where the
        d^2 x d^2 information exceeds the memory budget it runs instead of the full-rank least squares)."""
        rotary = getattr(self, "rotary", None)
        if rotary is None:
            return FACTORED_NAME
        d, d_v = (None, None) if self.value_map is None else self.value_map.shape
        return rotary_inversion_name(rotary.length, d, d_v, self.value_map is not None,
                                     calibration=self.calibration)[0]

    @property
    def produces(self):
        return (self.name, self.factored_name, self.first_order_name)

    def _factored_shape(self, d):
        """Whether this d rules the full-rank least squares out (its information over the memory budget), so that
        the factored one (:mod:`rstar.inversions.softmax_factored`) runs instead."""
        return (getattr(self, "causal", False) or getattr(self, "rotary", None) is not None
                or not self.budget.allows_kernel_matrix(d))

    residual_dof = staticmethod(residual_dof)

    #: whiten and fit_operator can read the samples in passes from a rstar.streaming.Samples source
    reads_sample_passes = True
    #: beyond the memory budget the first samples that fit it are kept, and the least squares fitted on them
    keeps_sample_prefix = True

    def new_stats(self, T, d, d_v):
        stats = super().new_stats(T, d, d_v)
        # the prefix kept beyond the budgets: as many samples as the least squares can be fitted on
        known = self.value_map is not None
        cal = self.calibration
        stats["prefix_capacity"] = (factored_capacity(T, d, d_v, known, self.budget, calibration=cal)
                                    if self._factored_shape(d)
                                    else softmax_fit_capacity(T, d, d_v, known, self.budget, calibration=cal))
        return stats

    def fit_possible(self, stats, samples=None):
        """Whether the samples are kept (all, or the leading ones that fit the memory budget; or given as a
        source read in passes) and :func:`softmax_fit_sizes_fit` allows the fit on them."""
        if samples is not None:
            return softmax_fit_sizes_fit(stats["n"], *stats["dims"], value_map_known=self.value_map is not None,
                                         budget=self.budget, samples_in_memory=False, calibration=self.calibration)
        kept = self.n_samples_kept(stats)
        return kept > 0 and softmax_fit_sizes_fit(kept, *stats["dims"], value_map_known=self.value_map is not None,
                                                  budget=self.budget, calibration=self.calibration)

    def _prefix_statistics(self, stats):
        """Where only the leading samples are kept: the sums of those samples alone, with them (so the least
        squares and its tests are exactly those of a fit on them)."""
        T, d, d_v = stats["dims"]
        sub = QueryKeyInversion.new_stats(self, T, d, d_v)
        for key in ("samples_odd", "samples_even"):
            for X, Y in stats[key]:
                QueryKeyInversion.update(self, sub, X, Y)
        sub.update(samples_odd=stats["samples_odd"], samples_even=stats["samples_even"],
                   sample_budget_bytes=stats["sample_budget_bytes"], n_kept=sub["n"],
                   prefix_capacity=stats["prefix_capacity"])
        return sub

    def _on_prefix(self, stats, samples):
        """Whether the least squares runs on the kept leading samples only."""
        return samples is None and 0 < self.n_samples_kept(stats) < stats["n"]

    def factored_possible(self, stats, samples=None):
        """Whether the factored least squares can run: the samples kept in memory (all, or the leading ones)
        and :func:`rstar.inversions.softmax_factored.factored_fit_blocker` None for them."""
        kept = self.n_samples_kept(stats)
        if getattr(self, "rotary", None) is not None:
            return (samples is None and kept > 0
                    and rotary_fit_blocker(kept, *stats["dims"], self.rotary, self.value_map is not None,
                                           self.budget, calibration=self.calibration) is None)
        return (samples is None and kept > 0
                and factored_fit_blocker(kept, *stats["dims"], self.value_map is not None, self.budget,
                                         calibration=self.calibration) is None)

    def default_run(self, stats, samples=None):
        """The least squares where :meth:`fit_possible` (the factored one at a d whose information exceeds the
        memory budget, where it is possible), else first order."""
        if self._factored_shape(stats["dims"][1]):
            return self.factored_name if self.factored_possible(stats, samples) else self.first_order_name
        return self.name if self.fit_possible(stats, samples) else self.first_order_name

    def risk_samples(self, stats, ws, samples):
        """The samples :meth:`rank_residuals` measures on: the kept halves where the factored least squares ran
        (its curve is cross-fitted on them), else ``samples``."""
        if ws.inversion == self.factored_name:
            return ArrayPartsSamples(self._halves(stats), self.calibration.chunk_entries)
        return samples

    def _samples(self, stats, samples=None):
        """The samples: the source given, else the kept halves (odd then even), read from memory in place."""
        if samples is not None:
            return samples
        parts = [kept_half(stats, key) for key in ("samples_odd", "samples_even") if stats[key]]
        return ArrayPartsSamples(parts, self.calibration.chunk_entries)

    def value_signal_p_value(self, stats, Y):
        """p-value of the F test of ``V = 0`` under uniform attention (``Y_i ~ 1 xbar_i^T V``).

        Without a value signal the kernel is not identified: the least
        squares then drives K to hard attention that fits the noise.

        Parameters
        ----------
        stats : dict
        Y : ndarray of shape (n, T, d_v), or float
            The outputs, or their sum of squares.
        """
        T, d, d_v = stats["dims"]
        gram, cross = T * stats["xbar_xbar"], T * stats["xbar_ybar"]
        explained = float(np.sum(cross * solve_psd(gram, cross)))
        dof = stats["n"] * T * d_v - d * d_v
        total = float(np.sum(Y**2)) if isinstance(Y, np.ndarray) else float(Y)
        resid = max(total - explained, np.finfo(float).tiny)
        return float(f_dist.sf((explained / (d * d_v)) / (resid / dof), d * d_v, dof))

    def _value_signal(self, stats, y_power):
        """Outputs not all zero, and a known V or the F test of ``V = 0`` rejects at ``value_signal_alpha``."""
        if not y_power > 0:
            return False
        return (self.value_map is not None
                or self.value_signal_p_value(stats, y_power) <= self.calibration.value_signal_alpha)

    def whiten(self, stats, run=None, samples=None, ops=NUMPY):
        """The statistic of ``run``; the least squares reads the kept samples, or ``samples`` (a
        :class:`rstar.streaming.Samples` source in internal units) in passes, on the back-end ``ops``."""
        run = self._check_run(self.default_run(stats, samples) if run is None else run)
        first_order = self._first_order_statistic
        if run == self.first_order_name:
            return first_order(stats)
        if self._on_prefix(stats, samples):
            # over the memory budget: the least squares of the first samples that fit it (choose_inversion notes it)
            return self.whiten(self._prefix_statistics(stats), run, ops=ops)
        if run == self.factored_name:
            if not self.factored_possible(stats, samples):
                raise ValueError("the factored least-squares softmax fit needs the samples in memory, which were "
                                 "dropped over the memory budget or read in passes.")
        elif not self.fit_possible(stats, samples):
            raise ValueError("the least-squares softmax fit needs the samples, which were dropped over the memory "
                             "budget.")
        T, d, d_v = stats["dims"]
        source = self._samples(stats, samples)
        y_power = source.y_sum_of_squares()
        if not y_power > 0:
            return fell_back(first_order(stats), "no_output")
        if not self._value_signal(stats, y_power):
            # no value signal: the first-order inversion's null is calibrated without one
            return fell_back(first_order(stats), "no_value_signal", alpha=self.calibration.value_signal_alpha)
        if run == self.factored_name and getattr(self, "rotary", None) is not None:
            with ops.sharing_the_cpu():
                ws = rotary_statistic(self._halves(stats), self.value_map, self.rotary, self.budget,
                                      mask=self._mask(stats), calibration=self.calibration,
                                      stopping_count=self.stopping_count, ops=ops, seed=self.seed)
            self._factored_cache = (self._stats_key(stats), ws)
            return ws
        if run == self.factored_name:
            with ops.sharing_the_cpu():
                ws = factored_statistic(self._halves(stats), self.value_map, self.budget, mask=self._mask(stats),
                                        calibration=self.calibration, stopping_count=self.stopping_count, ops=ops,
                                        rank_bound=getattr(self, "rank_bound", None),
                                        reading_tolerance=getattr(self, "reading_tolerance", None))
            self._factored_cache = (self._stats_key(stats), ws)   # for predict's operator: fitted once
            return ws
        K, V, sigma2, converged = self._fit(source, ops=ops)
        if samples is None:
            # the full-rank fit from K = 0, as fit_operator starts from: fitted once for both
            self._full_fit_cache = (self._stats_key(stats), K)
        if converged and softmax_fit_starts(T, d, self.value_map is not None, calibration=self.calibration) > 1:
            K, V, sigma2, converged = self._best_of_restarts(source, (K, V, sigma2, converged), ops)
        # the least-squares operator at full rank (the model check's), in the units of the sums
        self._full_rank_operator = (self._stats_key(stats), SoftmaxOperator(K, V) if converged else None)
        dof = self.residual_dof(source.n_samples, T, d, d_v, self.value_map is not None)
        if (converged and stats["res_dof"] >= self.calibration.min_noise_dof
                and sigma2 > self.calibration.least_squares_misfit_ratio * stats["res"] / stats["res_dof"]):
            # softmax data leave at least the noise outside col(P X_i) (plus the higher-order terms), and
            # the model's own fit no more than the noise: a larger residual says the model does not hold
            return fell_back(first_order(stats), "softmax_misfit", ratio=sigma2 * stats["res_dof"] / stats["res"],
                             features=d)
        if not converged:
            # the null draws are the noise of a minimum: an unconverged K holds the optimiser's error too
            # (on a held-out Student-t task, r* = 4 read 62)
            return fell_back(first_order(stats), "not_converged", max_iter=self.calibration.softmax_max_iter)
        F = _softmax_ls.softmax_kernel_information_matrix(source, K, V, value_map_fitted=self.value_map is None,
                                                          ops=ops)
        F = F + 1e-10 * max(float(np.trace(F)) / F.shape[0], np.finfo(float).tiny) * np.eye(F.shape[0])
        try:
            L = linalg.cholesky(F, lower=True, check_finite=False)
        except linalg.LinAlgError:
            return fell_back(first_order(stats), "singular_information")
        A, B = nearest_kronecker_product(F, d)
        # draws of the estimate's noise to first order: vec N ~ N(0, sigma2 F^{-1})
        return kernel_statistic_with_null_draws(K, L, A, B, sigma2, dof, [], inversion=self.name, seed=self.seed,
                                                n_draws=self.n_null_draws, noise_source="least-squares residual")

    def _best_of_restarts(self, samples, first, ops=NUMPY):
        """The fit of lowest residual among ``first`` (from K = 0) and ``softmax_restarts`` fits from seeded random
        kernels of the norm of ``first``'s (an unconverged restart is not kept)."""
        best = first
        scale = float(np.linalg.norm(first[0]))
        if not scale > 0:
            return best
        rng = np.random.default_rng(self.seed)
        d = first[0].shape[0]
        for _ in range(self.calibration.softmax_restarts):
            G = rng.standard_normal((d, d))
            fit = self._fit(samples, K0=G * (scale / np.linalg.norm(G)), ops=ops)
            if fit[3] and fit[2] < best[2]:
                best = fit
        return best

    def _fit(self, samples, K0=None, basis=None, ops=NUMPY):
        """Least-squares ``(K, V, sigma2, converged)`` on samples scaled to unit RMS (so the optimiser's path does
        not depend on the units, e.g. the first ``partial_fit`` batch's scaling), returned in the units given.
        L-BFGS runs in the tokens' metric, ``K = M_q^{-1/2} M M_k^{-1/2}``
        (:func:`rstar.inversions._numerics.softmax_factored.token_metric_roots`, one more pass): the same minimum, reached in fewer
        evaluations on anisotropic tokens (MiniLM layer-0 tokens projected to d = 64, T = 32, planted rank 3:
        152 instead of 237 with V known, 142 instead of 227 with V fitted; d = 16: 102 and 100 instead of 123
        and 112)."""
        T, d, d_v = samples.dims
        mx, my = samples.mean_squares()
        sx = max(float(np.sqrt(mx)), np.finfo(float).tiny)
        sy = max(float(np.sqrt(my)), np.finfo(float).tiny)
        V0 = None if self.value_map is None else self.value_map * (sx / sy)
        scaled = samples.rescaled(sx, sy)
        K, V, rss, converged = _softmax_ls.fit_softmax_least_squares(
            scaled, None, V0, None if K0 is None else K0 * sx**2, basis, ops=ops,
            precondition=token_metric_roots_of_sums(scaled.map_sum(token_metric_sums, T, self.calibration)),
            calibration=self.calibration)
        sigma2 = rss * sy**2 / self.residual_dof(samples.n_samples, T, d, d_v, self.value_map is not None)
        return K / sx**2, V * (sy / sx), sigma2, converged

    def rank_residual_samples(self, stats, ws, ranks, samples=None, ops=NUMPY):
        """Per-sample residuals of the factored fit's cross-fitted rank-r models (None for the other runs)."""
        if ws.inversion != self.factored_name:
            return None
        residuals = rotary_rank_residuals if ws.inversion in ROTARY_NAMES else factored_rank_residuals
        return residuals(ws, self._halves(stats), self.value_map, ranks, self._mask(stats),
                         per_sample=True, calibration=self.calibration)

    def full_model_in_sample_residual_samples(self, stats, ws):
        """The factored run's half models, each on the half it was fitted on (None for the other runs): the
        in-sample side of the floor the cross-fitted curve subtracts (``risk_curve_floor_in_sample_``)."""
        if ws.inversion != self.factored_name:
            return None
        halves, mask, rotary = self._halves(stats), self._mask(stats), ws.null.rotary
        models = sf.half_models(ws.null.half_kernels, halves, self.value_map, mask, calibration=self.calibration,
                                rotary=rotary)
        return np.concatenate([sf.factored_sample_rss(X, X @ V, Y, A, B, mask, calibration=self.calibration,
                                                      rotary=rotary)
                               for (X, Y), (A, B, V) in zip(halves, models)])

    def cross_fit_blocks(self, stats, ws):
        """The factored run's two blocks (the second half's samples under the first half's model, then the
        first's under the second's: :meth:`rank_residual_samples`' order); None for the other runs."""
        if ws.inversion != self.factored_name:
            return None
        first, second = self._halves(stats)
        return (len(second[0]), len(first[0]))

    def half_disagreement(self, stats, ws):
        """The factored run's :func:`factored_half_disagreement` (None for the other runs)."""
        if ws.inversion != self.factored_name:
            return None
        disagreement = rotary_half_disagreement if ws.inversion in ROTARY_NAMES else factored_half_disagreement
        return disagreement(ws, self._halves(stats), self.value_map, self._mask(stats),
                                          calibration=self.calibration)

    def class_check_models(self, stats, ws, directions=None):
        """What :func:`rstar.model_check.cross_fitted_class_check` tests the factored run on (None for the other
        runs): ``dict(halves, models, outputs, head, causal)`` — the two halves, each half's model ``(A, B, V)``,
        the outputs of a model, its query and key coordinates along its ``directions`` strongest directions (None:
        all) with its attention, and the mask."""
        if ws.inversion != self.factored_name:
            return None
        halves, mask, rotary = self._halves(stats), self._mask(stats), ws.null.rotary
        models = sf.half_models(ws.null.half_kernels, halves, self.value_map, mask, calibration=self.calibration,
                                rotary=rotary)

        def outputs(X, Z, A, B):
            return sf.factored_outputs(X, Z, A, B, mask, calibration=self.calibration, rotary=rotary)

        def head(X, A, B):
            A, B = _strongest_directions(A, B, rotary, directions)
            P, K = sf.query_key_coordinates(X, A / np.sqrt(X.shape[2]), B, rotary)
            return (P, K), sf.attention_from_coordinates(P, K, mask)

        return dict(halves=halves, models=models, outputs=outputs, head=head, causal=mask is not None)

    def rank_output_distance_samples(self, stats, ws, ranks):
        """The factored run's :func:`factored_output_distances` (None for the other runs)."""
        if ws.inversion != self.factored_name:
            return None
        distances = rotary_output_distances if ws.inversion in ROTARY_NAMES else factored_output_distances
        return distances(ws, self._halves(stats), self.value_map, ranks, self._mask(stats),
                         calibration=self.calibration)

    def curve_rank_limit(self, ws):
        """The factored run's half models have rank q and their half-sum at most 2q: nothing changes beyond."""
        if ws.inversion == self.factored_name:
            return min(2 * int(ws.null.fitted_rank), int(ws.dim))
        return int(ws.dim)

    def rank_residuals(self, stats, ws, ranks, samples=None, ops=NUMPY):
        """Residual sums of squares of the rank-r truncations of the fitted kernel, r in ``ranks`` (None: the
        full-rank kernel), V known or profiled out for each, on the samples the least squares read.

        The truncation keeps the top-r directions of the whitened ``K~ = A^{1/2} K B^{1/2}`` (the statistic's
        eigenvectors), ``K_r = A^{-1/2} U_r U_r^T K~ B^{-1/2}``: the information's own metric, so directions the
        data pin down are kept first. It costs one pass per rank (no refit); a refitted rank-r kernel can only
        do better, so the ranks read off the curve suffice. Where the first-order inversion ran, its
        closed-form operators are used instead (:meth:`Inversion.rank_residuals`).
        """
        if ws.inversion == self.factored_name:
            residuals = rotary_rank_residuals if ws.inversion in ROTARY_NAMES else factored_rank_residuals
            return residuals(ws, self._halves(stats), self.value_map, ranks, self._mask(stats),
                             calibration=self.calibration)
        if ws.inversion != self.name:
            return operator_residuals(lambda basis: self.first_order_operator(stats, basis), ws, ranks, samples)
        if self._on_prefix(stats, samples):
            stats, samples = self._prefix_statistics(stats), None
        source = self._samples(stats, samples)
        Kt = ws.null.statistic_matrix
        A_inv_half, B_inv_half = ws.null.factors[3], ws.null.factors[4]
        loss = _softmax_ls.SoftmaxLeastSquaresLoss(source, None, self.value_map, ops=ops,
                                                   max_cached_weights=self.calibration.max_cached_weights)
        out = []
        for r in ranks:
            U = ws.eigenvectors if r is None else ws.eigenvectors[:, :r]
            K = A_inv_half @ (U @ (U.T @ Kt)) @ B_inv_half
            out.append(float(loss.value_map(K)[1]))
        return out

    def _stats_key(self, stats):
        """What the factored statistic depends on: the kept samples (their count, and the shape)."""
        return (self.n_samples_kept(stats), stats["dims"])

    def _halves(self, stats):
        """The kept samples as ``((X_odd, Y_odd), (X_even, Y_even))``."""
        return tuple(kept_half(stats, key) for key in ("samples_odd", "samples_even"))

    def _factored_ws(self, stats):
        """The factored statistic of these sums (fitted once per state of the sums, then cached)."""
        cached = getattr(self, "_factored_cache", None)
        if cached is not None and cached[0] == self._stats_key(stats):
            return cached[1]
        return self.whiten(stats, self.factored_name)   # a fallback (e.g. no value signal) is returned as is

    def full_rank_operator(self, stats):
        """The full-rank least-squares operator :meth:`whiten` fitted on these sums (its best start), or None
        where it did not run, did not converge, or the sums changed since."""
        cached = getattr(self, "_full_rank_operator", None)
        return cached[1] if cached is not None and cached[0] == self._stats_key(stats) else None

    def fit_operator(self, stats, basis, samples=None, ops=NUMPY):
        if samples is None and self.default_run(stats) == self.factored_name:
            ws = self._factored_ws(stats)
            if ws.inversion in ROTARY_NAMES:
                return rotary_operator(ws, self._halves(stats), self.value_map, basis.shape[0],
                                       self._mask(stats), calibration=self.calibration)
            if ws.inversion == self.factored_name:
                K, V = factored_operator(ws, self._halves(stats), self.value_map, basis.shape[0],
                                         self._mask(stats), calibration=self.calibration)
                return SoftmaxOperator(K, V, causal=getattr(self, "causal", False))
        if self._on_prefix(stats, samples) and self.fit_possible(stats):
            return self.fit_operator(self._prefix_statistics(stats), basis, ops=ops)
        if not self.fit_possible(stats, samples):
            return super().fit_operator(stats, basis)
        source = self._samples(stats, samples)
        if not self._value_signal(stats, source.y_sum_of_squares()):
            return super().fit_operator(stats, basis)
        d = stats["dims"][1]
        if basis.shape[0] == 0:
            K = np.zeros((d, d))
            V, _ = _softmax_ls.SoftmaxLeastSquaresLoss(source, None, self.value_map, ops=ops,
                                                       max_cached_weights=self.calibration.max_cached_weights
                                                       ).value_map(K)
            return SoftmaxOperator(K, V)
        cached = getattr(self, "_full_fit_cache", None) if samples is None else None
        if cached is not None and cached[0] == self._stats_key(stats):
            K_full = cached[1]
        else:
            K_full = self._fit(source, ops=ops)[0]
        K, V, _, _ = self._fit(source, K0=K_full, basis=basis, ops=ops)
        return SoftmaxOperator(K, V)


def _strongest_directions(A, B, rotary, k):
    """The factors along their k strongest directions: a position-free head's kernel ``A B^T`` by its SVD (each
    side scaled by the square roots of the singular values), a rotary head's rotated coordinates (kept whole, the
    rotation acts on them) ranked by ``||A_c|| ||B_c||``; k None: all."""
    if rotary is None:
        U, sv, W = factored_svd(A, B)
        A, B = U * np.sqrt(sv), W * np.sqrt(sv)
        return (A, B) if k is None else (A[:, :k], B[:, :k])
    if k is None or k >= A.shape[1]:
        return A, B
    keep = np.zeros(A.shape[1], dtype=bool)
    keep[np.argsort(-np.linalg.norm(A, axis=0) * np.linalg.norm(B, axis=0))[:k]] = True
    return A * keep, B * keep
