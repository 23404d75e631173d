"""Every tuned number of rstar in one object: :class:`Calibration`.

The gates that decide when a statistic is trusted, the margins and levels of the tests, the optimisers' stopping
rules, the default budgets and the sizes of the chunks work is done in were module constants spread over the
package. They are the fields of one frozen dataclass; each field's ``metadata`` says what it means
(``"meaning"``), the command that sets it (``"set_by"``), the data it was set on (``"data"``) and its group
(``"group"``). :meth:`Calibration.table` lists them (docs/calibration.md is generated from it).

Every inversion, rule and pure function that reads one of them takes a calibration (``calibration=None`` on the
classes, ``calibration=DEFAULT_CALIBRATION`` on the functions) and defaults to :data:`DEFAULT_CALIBRATION`, so
results with the defaults are those of the constants they replace, bit for bit. A different calibration is a
copy with some fields changed::

    from rstar.calibration import DEFAULT_CALIBRATION

    cal = DEFAULT_CALIBRATION.replace(split_half_margin=2.0, first_order_max_kurtosis=0.05)

Where two constants were one idea they are one field, and the field's meaning says which:
``least_squares_misfit_ratio`` (the softmax least squares' ``SOFTMAX_MISFIT`` and the query-key cross-fit's
``CROSS_FIT_MISFIT``), ``least_squares_loss_tol`` (``SOFTMAX_LOSS_TOL`` and the factored fit's
``FACTORED_LOSS_TOL``) and ``chunk_entries`` (the samples' ``CHUNK_ENTRIES`` and the factored loss's chunks).

Left out, because they are not tuned:

- mathematical facts: ``MEDIAN_EFFICIENCY = 2 / pi`` (the asymptotic efficiency of the median, in
  :mod:`rstar.marchenko_pastur` and the rules), quadrature node counts (``_N_NOISE_NODES``), the float size
  (``rstar.budgets._FLOAT_BYTES``), the MP median's quantile 0.5 and the lenient level's cap 1/2;
- names and tuples of names (``INVERSIONS``, ``METHODS``, ``FACTORED_NAME``, ``KINDS``, ...), and the paper's
  experiment configurations (``rstar.paper.experiments.CONFIGS``), which are its protocol;
- user-facing parameters whose default is a choice, not a measurement: the estimators' and rules' ``alpha``
  (0.01), ``clip``, ``rtol``, ``tolerance_level`` and :func:`rstar.heads.estimate_heads`' ``tolerances``;
- numerical guards of the linear algebra and of the private optimisers: ``rcond`` of the pseudo-inverses,
  ridges of 1e-8 to 1e-12 times a trace that only keep a matrix invertible, the line search's Wolfe constants
  and the iteration caps of the closed-form alternating least squares (keyword defaults of
  :mod:`rstar.inversions._numerics`, none set on data).
"""

import dataclasses
import numbers
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Calibration", "DEFAULT_CALIBRATION", "GROUPS"]

#: The groups, in the order the table lists them.
GROUPS = ("identifiability gates", "noise and null", "levels", "split-half test", "factored fit", "optimisers",
          "budgets", "memory chunks", "risk curve", "model check", "students")

#: What each domain admits (checked in ``__post_init__``).
_DOMAINS = {
    "level": "a number in (0, 1)",
    "fraction": "a number in [0, 1)",
    "aspect": "a number in (0, 1]",
    "positive": "a finite number > 0",
    "nonnegative": "a finite number >= 0",
    "at_least_one": "a finite number >= 1",
    "count": "an integer >= 1",
    "count0": "an integer >= 0",
}

_BY_HAND = "none: set by hand"


def _value(default, group, domain, meaning, set_by, data):
    return field(default=default, metadata={"meaning": meaning, "set_by": set_by, "data": data, "group": group,
                                            "domain": domain})


@dataclass(frozen=True)
class Calibration:
    """The tuned values of rstar (see the module docstring; each field's ``metadata`` documents it).

    Examples
    --------
    >>> from rstar.calibration import DEFAULT_CALIBRATION
    >>> DEFAULT_CALIBRATION.split_half_margin
    1.5
    >>> cal = DEFAULT_CALIBRATION.replace(split_half_margin=2.0)
    >>> cal.split_half_margin, cal.split_half_noise_edge
    (2.0, 1.25)
    >>> DEFAULT_CALIBRATION.replace(split_half_margin=0)
    Traceback (most recent call last):
    ...
    ValueError: Calibration.split_half_margin must be a finite number > 0, got 0.
    """

    # -- identifiability gates -------------------------------------------------------------------------------
    ill_conditioned_aspect: float = _value(
        0.9, "identifiability gates", "aspect",
        "Aspect ratio min(T, d) / max(T, d) above which X_i^+ is ill-conditioned (the MP law's hard edge at 1): the "
        "first-order query-key statistic warns, and the exact softmax inversion is chosen only where "
        "T <= this times min(d, d_v).",
        _BY_HAND, "the Marchenko-Pastur hard edge at aspect ratio 1; no measurement recorded")
    first_order_max_aspect: float = _value(
        3.0, "identifiability gates", "positive",
        "The first-order softmax statistic identifies r* only while d <= this many times the T - 1 centred tokens; "
        "beyond it the count is warned with rank_interval_ (0, d).",
        "python benchmarks/real_heads.py",
        "r* read by RStarEstimator's first-order fallback: d = 128, T = 64 exact; d = 384, T = 64 read 10 for 8 on "
        "Gaussian tokens; d = 384, T = 32 read 56 for 3 on MiniLM hidden states (docs/user_guide/real_models.md)")
    first_order_qk_max_aspect: float = _value(
        4.0, "identifiability gates", "positive",
        "The first-order query-key statistic (no centring) identifies r* only while d <= this many times T; beyond "
        "it the count is warned with rank_interval_ (0, d).",
        "none: measured by hand with MPRankEstimator('linear_qk') on the first order",
        "planted r* = 3, Gaussian tokens, 3 seeds: T = 8, n = 500: d = 10-32 read 3 on every seed, d = 48 read "
        "4, 3, 5, d = 64 5, 3, 3, d = 96 5, 4, 4 (n = 2000: 4, 3, 4); T = 16, n = 500: d = 64 and 96 read 3; "
        "T = 16, d = 128: 5 and 7 (n = 500); T = 8, d = 192, n = 200: 14 and 12; pure noise at T = 8, "
        "d = 384-768, n = 100-800: up to 6")
    first_order_misfit: float = _value(
        3.0, "identifiability gates", "positive",
        "The first-order softmax model is rejected (warned, rank_interval_ (0, d)) where its operator leaves, per "
        "sample and on average, more than this many times the residual power per degree of freedom outside "
        "col(P X_i) (noise plus higher-order terms).",
        "python benchmarks/real_heads.py",
        "MPRankEstimator, T = 32, d = 16, logits of standard deviation 2: 0.2-0.3 on Gaussian tokens with a signal "
        "and 1.0 without one (n = 1000); 1.7 and 2.1 on Student-t(3) tokens (r* = 3 read 3, r* = 6 read 7); MiniLM "
        "hidden states projected to d = 16 (n = 2000): 6.4 and 53 (r* = 8 and 3 read 9 and 8)")
    first_order_max_kurtosis: float = _value(
        0.03, "identifiability gates", "nonnegative",
        "Where T - 1 <= d (no residual outside col(P X_i) to check the first-order softmax model against) its count "
        "is warned where the centred tokens' multivariate kurtosis (Mardia's, over its Gaussian value) exceeds 1 + "
        "this margin by more than first_order_kurtosis_standard_errors standard errors.",
        "python benchmarks/real_heads.py",
        "MPRankEstimator, T = 32, d = 64, n = 2000, logits of standard deviation 2, planted r* = 3 and 8: Gaussian "
        "tokens 1.000 and tokens on a sphere 0.972 read 3 and 8; Student-t(10) tokens 1.014 read 4 (3, 4) and 8; "
        "Student-t(5) 1.066 read 4 (4, 7) and 9 (9, 11); MiniLM's inputs of layers 0, 1, 3 and 5 on their top 64 "
        "principal directions 1.149, 1.074, 1.091, 1.575 read 5-7 for 3")
    first_order_kurtosis_standard_errors: float = _value(
        3.0, "identifiability gates", "nonnegative",
        "How many standard errors the tokens' kurtosis ratio must exceed 1 + first_order_max_kurtosis by before "
        "the first-order softmax count is warned (the `3.0 * se` of the check).",
        _BY_HAND, "the same measurements as first_order_max_kurtosis (standard errors over samples)")
    least_squares_misfit_ratio: float = _value(
        1.1, "identifiability gates", "positive",
        "One idea, two checks: a least-squares fit is called a misfit where its residual power exceeds this many "
        "times an independent estimate of the noise power it should leave. The softmax least squares falls back "
        "to first order where its residual variance exceeds this times the power per degree of freedom outside "
        "col(P X_i) (was SOFTMAX_MISFIT); the query-key cross-fit warns where a half's fitted V leaves the other "
        "half this times that half's own residual power (was CROSS_FIT_MISFIT).",
        _BY_HAND,
        "a 10% allowance for sampling error of the two variance estimates; no measurement recorded (the softmax "
        "check was added beside the cross-fit's at the same value)")
    exact_clipped_fraction: float = _value(
        0.25, "identifiability gates", "level",
        "The exact softmax inversion warns (IllConditionedInversionWarning) where more than this fraction of the "
        "recovered attention weights fell outside [clip / T, 1] and were clipped before the log.",
        _BY_HAND, "no measurement recorded")

    # -- noise and null --------------------------------------------------------------------------------------
    min_noise_dof: int = _value(
        50, "noise and null", "count",
        "Residual degrees of freedom needed before a residual noise estimate is used (and before a least-squares "
        "inversion runs: its residual must have at least this many).",
        _BY_HAND, "no measurement recorded")
    min_sample_dof: int = _value(
        20, "noise and null", "count",
        "Per-sample residual degrees of freedom needed before the first-order softmax inversion weights samples by "
        "1 / their residual power.",
        _BY_HAND, "at 20 degrees of freedom 1 / rho_i has about 30% relative standard deviation")
    default_seed: int = _value(
        20260, "noise and null", "count0",
        "Seed of the simulations (null draws, random starts) when random_state is None, so that fit is a "
        "deterministic function of the data and partial_fit equals fit (the cross-fit's random starts use it + 1).",
        _BY_HAND, "an arbitrary fixed seed")
    default_null_draws: int = _value(
        1000, "noise and null", "count",
        "Default number of simulated null draws (n_null_draws): the smallest Monte Carlo p-value is "
        "1 / (draws + 1).",
        _BY_HAND, "chosen so that 1 / (draws + 1) lies below rstar_alpha / 10 (the strict end of rank_interval_)")
    top_down_min_bulk: int = _value(
        4, "noise and null", "count",
        "Fewest eigenvalues (the candidate spike and those below it) the top-down scan fits a bulk to.",
        _BY_HAND, "the fewest for which the bulk's quartiles are defined")
    coherent_bonferroni: float = _value(
        4.0, "noise and null", "at_least_one",
        "Bonferroni factor on the coherent query-key p-values: two statistics test each hypothesis (x 2), and the "
        "Tracy-Widom tail is liberal for the small square Wisharts of the coherent statistic (x 2).",
        "python benchmarks/null_calibration.py",
        "on 1000 linear-QK nulls the coherent statistic's first p-value fell below 1% in 1.6% (d = d_v = 8) and "
        "2.1% (16) of fits; with the factor, 1.0% of 1000 nulls at alpha = 1% (T = 24, d = d_v = 8, n = 150)")
    residual_floor_margin: float = _value(
        2.0, "noise and null", "at_least_one",
        "How far above the residual-level bulk edge (the first-order softmax residual's power per degree of "
        "freedom) an eigenvalue must stand to count by the residual floor test.",
        "python benchmarks/recovery.py --seed 1",
        "held-out recovery grid, seed 1 (400 softmax tasks): the largest non-signal eigenvalue exceeded the "
        "residual level's edge in 10% of softmax tasks, 1.5 times it in 5%")
    bulk_width_factor: float = _value(
        4.0, "noise and null", "at_least_one",
        "A white-noise bulk left after the count whose fitted MP width needs this many times fewer columns than "
        "the statistic has is not noise alone: the count is retried with the robust noise level, else warned.",
        "python benchmarks/recovery.py --seed 1",
        "held-out recovery grid (450 linear tasks): fired on 13 of 144 under-counts and on none of 301 correct "
        "counts")
    robust_noise_quantile: float = _value(
        0.25, "noise and null", "level",
        "Quantile of the remaining eigenvalues that sets the noise level when the median is a spike (robust up to "
        "1 - this share of spikes).",
        _BY_HAND, "the lower quartile: robust up to 75% spikes")

    # -- levels ----------------------------------------------------------------------------------------------
    rstar_alpha: float = _value(
        0.003, "levels", "level",
        "RStarEstimator's default false-alarm level per sequential test.",
        "python benchmarks/recovery.py --seed 1 --out benchmarks/out/recovery-full-seed1 && "
        "python benchmarks/alpha_calibration.py benchmarks/out/recovery-full-seed1",
        "the level with the highest exact recovery of r* on the held-out recovery grid (seed 1, recounted from "
        "the p-values at 0.01; docs/validation.md)")
    interval_factor: float = _value(
        10.0, "levels", "at_least_one",
        "rank_interval_ is the range of counts at the false-alarm levels alpha / this .. min(this alpha, 1/2).",
        _BY_HAND, "a decade either side of alpha; no measurement recorded")
    value_signal_alpha: float = _value(
        1e-3, "levels", "level",
        "With V unknown the softmax least squares runs only where the F test of V = 0 under uniform attention "
        "rejects at this level (without a value signal K is not identified).",
        _BY_HAND, "a chosen level, not tuned")

    # -- split-half test -------------------------------------------------------------------------------------
    split_half_margin: float = _value(
        1.5, "split-half test", "positive",
        "A direction of the factored fit's half-sum counts where its singular value exceeds this many times the "
        "half-difference's largest (rank_).",
        "python benchmarks/factored_calibration.py",
        "null directions (Gaussian tokens, T = 8 and 16, d = 48 and 96, n = 600, r* = 0 and 2, V known and "
        "unknown, 8 seeds each, 64 fits): the half-sum's first null direction over the half-difference's largest "
        "ranged 0.83-1.11; planted directions of logit scale 2 stood at 100-150 times it")
    split_half_noise_edge: float = _value(
        1.25, "split-half test", "positive",
        "Directions between this many times the half-difference's largest and split_half_margin times it are not "
        "told from noise: they are warned and widen rank_interval_ (to the fitted rank q).",
        "python benchmarks/factored_calibration.py",
        "the same 64 fits: no null direction reached 1.12")

    # -- factored fit ----------------------------------------------------------------------------------------
    factored_start_rank: int = _value(
        8, "factored fit", "count",
        "First rank q of the factored fit's factors (at least; above the first-order count); it doubles while the "
        "fit fills it.",
        _BY_HAND, "no measurement recorded")
    rotary_start_logit_std: float = _value(
        0.1, "factored fit", "positive",
        "The rotary least squares starts each half from random query and key factors (in the token metric) scaled "
        "so that their logits' standard deviation is this: small, so that the fit grows the directions the data "
        "hold, and not zero, a saddle without gradient.",
        "python benchmarks/rotary_start_scale.py",
        "planted rotary widths 0, 2 and 4 (Gaussian tokens, d = 16, T = 12, 4 planes, n = 3000, causal, V known, "
        "2 seeds): every reading exact at start scales 0.01, 0.03, 0.1, 0.3 and 1 (30 of 30); not a critical value")
    log_attention_variance_floor: float = _value(
        1.0, "factored fit", "positive",
        "tau^2 (nats^2) of the log-attention least squares of rotary heads (V known): an entry of log S counts with "
        "weight 1 / (1 + Var(log S) / tau^2), fully where its log is known to within tau, hardly where the output "
        "noise buries it.",
        "python benchmarks/rotary_planted.py",
        "a scale, not a critical value: on noise-free real heads (benchmarks/rotary_real_heads.py) every entry known "
        "past rounding weighs ~1 at any tau; with output noise it sets how fast buried entries fade, and the fit is "
        "refined on the outputs afterwards")
    coarse_window_ratio: int = _value(
        4, "factored fit", "count",
        "A causal fit (rotary, or the factored fit at its first rank) over windows of T tokens is first run on "
        "the windows cut to T / this many tokens (and T / this^2, ..., while at least coarse_window_min_length), "
        "shortest first, each starting the next: the outputs at the first T' positions depend on the first T' "
        "tokens alone, and an iteration there costs about this^2 times less on the logits.",
        "python benchmarks/rotary_planted.py --seq-len 128",
        "planted rotary widths 2, 8 and 16 on SmolLM2's layer-0 inputs at T = 128, n = 2000, V fitted: from a "
        "random start at T = 128 each ran 600 iterations unsettled (3, 8 and 16 read, warned with (0, 64), 1491, "
        "877 and 2823 s); after a T = 32 stage (width 8: 600 iterations, 152 s) the T = 128 fit settled (width 8: "
        "250 iterations, 251 s) and each read exactly (671, 851 and 924 s); V known, widths 0-16 exact as before, "
        "in 288-472 s instead of 649-1208. Other ratios not measured")
    first_position_samples_ratio: float = _value(
        1.5, "factored fit", "at_least_one",
        "With V fitted, a causal rotary fit short enough for the log-attention (T' <= ill_conditioned_aspect x "
        "min(d, d_v)) reads V from the first position (its query attends to itself alone: y_0 = x_0 V) and starts "
        "on the log-attention read back with it, where each half has at least this many times d samples: the least "
        "squares of V on n first tokens predicts x V out of sample with an error variance of about "
        "d / (n - d - 1) times the noise's, twice it at this ratio (a start: the fit then runs on the outputs "
        "with V fitted).",
        _BY_HAND, "from the regression's out-of-sample error, not tuned; planted rotary widths 0-16 with V fitted at "
        "d_v = 64 (python benchmarks/rotary_planted.py --d-v 64 --value-maps fitted: 1000 samples a half at d = 576, "
        "1.74 d) read exactly with it, width 16 warned with (0, 64) without")
    coarse_window_min_length: int = _value(
        32, "factored fit", "count",
        "The shortest cut window of a causal fit's coarse stages (coarse_window_ratio): the planted rotary heads "
        "on SmolLM2's inputs read exactly at T = 32 (n = 2000).",
        "python benchmarks/rotary_planted.py",
        "SmolLM2 layer 0, T = 32, n = 2000, widths 0-8 exact with V known and fitted")
    factored_segment_iter: int = _value(
        50, "factored fit", "count",
        "The factored fit's L-BFGS iterations run in segments of this many; after each the split-half count is "
        "read, and the fit stops once a segment leaves it unchanged (or the iterations or the budget run out).",
        _BY_HAND, "no measurement recorded")
    factored_stable_rtol: float = _value(
        0.01, "factored fit", "nonnegative",
        "'Unchanged' count: the same count above the margin, and the singular values above it within this relative "
        "change (also: the leading value 'still moves' by more than this).",
        "python benchmarks/real_heads.py",
        "a fourth direction on a planted rank 3 (V fitted, MiniLM's tokens) stood at 0.9-1.8 times the null's "
        "largest for 250 iterations, flipping the count above the null at every check")
    factored_clear_gap: float = _value(
        2.0, "factored fit", "at_least_one",
        "With V fitted a count also settles once it stands clear of the null: its weakest direction at least this "
        "many times the margin and the strongest left out at most 1 / this of the null.",
        "python benchmarks/real_heads.py",
        "V fitted at T = 128 on real tokens: the counted directions of a planted rank 3 kept growing by 5-10% a "
        "segment for 550 iterations while standing at 3-8 times the null, the fourth at 0.13 times it")
    factored_clear_checks: int = _value(
        3, "factored fit", "count",
        "... at this many checks in a row (see factored_clear_gap).",
        "python benchmarks/real_heads.py", "as factored_clear_gap")
    factored_unsettled_segments: int = _value(
        4, "factored fit", "count",
        "A rank whose count has not settled after this many segments is doubled (where d, the residual degrees of "
        "freedom and the budget allow) if the fit uses all q directions and its leading value still moves.",
        "python benchmarks/real_heads.py",
        "a noise-free MiniLM head fitted at q = 8 kept sharpening for 400 iterations (leading value 30 -> 62, its "
        "eighth 8); V fitted on real tokens a planted rank 3 grew its leading value for 200 iterations and carried "
        "a shared fourth direction for 350 (doubling it read 4)")
    factored_fill_ratio: float = _value(
        0.05, "factored fit", "fraction",
        "'Uses all q directions': the half-sum's q-th singular value above this fraction of its first.",
        _BY_HAND, "no measurement recorded")

    factored_rescale_iter: int = _value(
        100, "factored fit", "count0",
        "Every this many L-BFGS iterations an unrotated factored fit re-factors each kernel's query and key factors "
        "in balance and rescales their columns (scaled gradient descent: "
        "rstar.inversions._numerics.softmax_factored.balanced_factor_scales), restarting L-BFGS there; 0 runs plain "
        "L-BFGS on the factors as given.",
        "python benchmarks/factored_convergence.py",
        "MiniLM, T = 32, n = 500, 12 heads (3 the values were chosen on by the loss reached in 400 iterations, "
        "9 others): the scaled fit read the r*(1%) and r*(5%) of a fit with four times the iterations on 12 of 12 "
        "heads (plain L-BFGS: 6 and 8) and 7 of its 12 fits settled within the cap (plain: none); on the 3 heads "
        "the relative in-sample loss after ~400 iterations was 2e-5 to 6e-9 against 1.2e-4 to 4.7e-6. Every 200 "
        "iterations did as well on two of them; not a critical value")
    factored_scale_damping: float = _value(
        0.01, "factored fit", "positive",
        "The damping of those column scales, relative to the kernel's largest singular value (in the token metric): "
        "a column of singular value s moves as if scaled by (s + this x s_1)^(-1/2), so columns the kernel does not "
        "use still move.",
        "python benchmarks/factored_convergence.py",
        "as factored_rescale_iter (0.1 did as well on the one head tried)")
    factored_scaled_memory: int = _value(
        60, "factored fit", "count",
        "Curvature pairs L-BFGS keeps in the scaled factored fit (factored_rescale_iter); the rotary fits and a fit "
        "with factored_rescale_iter = 0 keep 20.",
        "python benchmarks/factored_convergence.py",
        "as factored_rescale_iter: on layer 5 head 5, 0.6 times the loss of 20 pairs after 400 iterations; with 20 "
        "pairs (--variants plain,scaled --scaled-memory 20) the 12 heads read the longer fit's r*(1%) on 10 (two one "
        "short) and r*(5%) on 12, in the plain fit's time (243 s against 254 s); 60 pairs cost about 45% more per iteration at q = 32 when "
        "L-BFGS made seven passes over its pairs an iteration, and as much as 20 since it makes two (layer 2 head 2: "
        "26-33 ms an iteration with 60 scaled, 29-43 with 20 scaled, 31 plain)")

    # -- optimisers ------------------------------------------------------------------------------------------
    least_squares_loss_tol: float = _value(
        0.01, "optimisers", "positive",
        "One idea, two optimisers: L-BFGS stops once an iteration lowers the residual sum of squares by less than "
        "this many times its value per observation (about the noise variance): the full-rank softmax least "
        "squares (was SOFTMAX_LOSS_TOL) and the factored fit (was FACTORED_LOSS_TOL).",
        "python benchmarks/recovery.py --seed 1",
        "full-rank fit, held-out recovery grid: 0.01 and 0.1 gave the same 232 ranks as a relative tolerance of "
        "1e-10, in 55% and 47% of the time")
    softmax_max_iter: int = _value(
        4000, "optimisers", "count",
        "Largest number of L-BFGS iterations of the full-rank softmax least squares (an unconverged fit falls back "
        "to first order).",
        "python benchmarks/recovery.py --seed 1",
        "Student-t tokens at d = 64 with few samples need more than 1000: on the held-out recovery grid the two "
        "fits that stopped there (r* = 4 and 50) converged within 4000 and read r* exactly (196 and 348 s)")
    softmax_restarts: int = _value(
        2, "optimisers", "count0",
        "With V unknown and T - 1 <= d the softmax least squares also starts from this many seeded random kernels "
        "and keeps the lowest residual (the compute budget counts every start).",
        "python benchmarks/real_heads.py --seq-len 8",
        "MiniLM's layer-0 tokens in windows of T = 8 projected to d = 16, planted r* = 3, V unknown: the fit from "
        "K = 0 stopped at a residual sum of squares of 651 (the truth's 209) and read 11; five of six random "
        "starts reached 208.7 and read 3")
    cross_fit_random_starts: int = _value(
        8, "optimisers", "count0",
        "Random starting kernels of each half's fit of (K, V) in the query-key cross-fit (besides the first-order "
        "fit and its transpose).",
        _BY_HAND, "no measurement recorded")
    profile_ftol: float = _value(
        1e-10, "optimisers", "positive",
        "The cross-fit's L-BFGS on the profile loss stops once an iteration lowers the loss by less than this "
        "fraction.",
        _BY_HAND, "no measurement recorded")
    coherent_fit_tol: float = _value(
        1e-4, "optimisers", "positive",
        "The linear proxy's coherent statistic fits V on the odd half by alternating least squares, stopping once "
        "an iteration adds less than this fraction to the explained sum of squares (V only sets the power).",
        _BY_HAND, "any V independent of the even half gives a valid test; without signal the factors never "
                  "converge")
    coherent_max_iter: int = _value(
        50, "optimisers", "count",
        "... and after at most this many iterations.",
        _BY_HAND, "a null fit creeps on for hundreds of iterations")
    factored_max_iter: int = _value(
        400, "optimisers", "count",
        "L-BFGS iterations of one factored fit at one rank at most, V known.",
        "python benchmarks/factored_convergence.py --variants short,scaled,reference",
        "set by hand, checked on 12 MiniLM heads (T = 32, n = 500, V known; 500 windows held out): at 400 the "
        "readings equal those of a fit allowed 1600 (which stopped by itself, after 362 iterations on average) on "
        "12 and 11 of 12 heads at 1% and 5%, sufficient held out on 11 and 11; at 200 on 9 and 9, sufficient on 9 "
        "and 9, in 0.72 times the time (131 s against 181 s)")
    factored_max_iter_fitted_v: int = _value(
        600, "optimisers", "count",
        "The same with V fitted with the factors.",
        "python benchmarks/real_heads.py",
        "on real tokens such a fit grows its leading directions for about 200 iterations and carries a weak "
        "direction both halves share for 350 (a planted rank 3 on MiniLM's tokens, d = 384, whose count settled "
        "between 400 and 500)")
    log_attention_max_iter: int = _value(
        1000, "optimisers", "count",
        "L-BFGS iterations of the rotary log-attention fit at most (it stops earlier once its split-half count "
        "settles).",
        "python benchmarks/rotary_real_heads.py",
        "SmolLM2 layer 3 head 3 (n = 500, T = 32; a one-off run of the estimator at caps 400 and 800, 300 held-out "
        "windows): at 400 its count was still moving (full-width model 0.95 % of Var(Y) off held out, interval "
        "(0, 64)); it settled within 800 (0.16 %, r*(1 %) 60 in (58, 61)); at 1000 the benchmark read 60 (58, 61)")
    value_ridge: float = _value(
        1e-10, "optimisers", "nonnegative",
        "Relative ridge (times the mean eigenvalue) of the value map's normal matrix in the factored fit, where "
        "the tokens span fewer than d directions.",
        _BY_HAND, "a numerical ridge, no measurement recorded")

    # -- budgets ---------------------------------------------------------------------------------------------
    memory_budget: int = _value(
        2**29, "budgets", "count",
        "Default memory_budget of the estimators, in bytes (512 MiB): kept samples, and each moment-sum array or "
        "d^2 x d^2 matrix at most half of it.",
        "python benchmarks/speed.py",
        "the project's reference machine (one core of a shared 2-core x86-64 box, OpenBLAS)")
    compute_budget: float = _value(
        2**39, "budgets", "positive",
        "The multiply-adds (about 5.5e11) within which the estimators' default compute_budget='auto' chooses the "
        "inversion (one least-squares fit or information matrix: minutes of one core for the largest it admits); "
        "the factored fit it chooses then runs to its iteration caps.",
        "python benchmarks/recovery.py",
        "the largest grid tasks of benchmarks/recovery.py that fit within it took up to about 6 minutes on the "
        "reference machine")
    cost_iterations: int = _value(
        512, "budgets", "count",
        "Iterations allowed for by the cost model of an alternating least-squares or L-BFGS fit (its cost is the "
        "per-iteration cost times this; the profiled cross-fit's twice this).",
        _BY_HAND, "an allowance, no measurement recorded")
    line_search_allowance: float = _value(
        1.1, "budgets", "at_least_one",
        "Factor on the factored fit's cost of one loss-and-gradient evaluation for the line search's extra "
        "evaluations.",
        _BY_HAND, "no measurement recorded")

    # -- memory chunks ---------------------------------------------------------------------------------------
    chunk_entries: int = _value(
        2**20, "memory chunks", "count",
        "Float entries of one chunk's largest temporary (e.g. its attention weights, chunk x T^2): the chunks "
        "samples are read in (was rstar.streaming.CHUNK_ENTRIES) and those of the factored fit's loss (was its "
        "_CHUNK_ENTRIES), one idea.",
        _BY_HAND, "a memory bound, not measured")
    update_chunk_entries: int = _value(
        2**22, "memory chunks", "count",
        "A batch is added to the sums in chunks of at most this many entries (32 MiB) of (X, Y) or of the "
        "per-sample d x d temporaries, whichever is larger per sample.",
        "python benchmarks/real_sizes.py",
        "d = 768, T = 8: 200 samples peaked at 1.9 GiB when only X and Y were counted")
    value_error_chunk_entries: int = _value(
        2**22, "memory chunks", "count",
        "Entries of the per-chunk work array of the cross-fit's value-map error leak (its right-hand sides).",
        _BY_HAND, "a memory bound, not measured")
    chunk_temporaries: int = _value(
        8, "memory chunks", "count",
        "Chunk-sized temporaries a pass function holds at once at most (the softmax information's chunk sums hold "
        "six of T d^2 entries per sample; the least-squares loss four of T^2): a dask worker's chunks are this "
        "many times smaller than its share of the memory budget.",
        "python benchmarks/speed.py --dask-memory",
        "a 781 MiB lazily generated dask array (T = 32, d = 16, chunks of 5000, two threads), "
        "memory_budget=2**26: the fit peaked 50 MiB above a plain dask reduction's 285 MiB of traced memory "
        "(three runs alike), with the samples it keeps in the half of the budget the workers' steps leave "
        "(44-83 MiB above when they were kept to the whole budget; 420 MiB in all before the chunks were "
        "rescaled step by step and shared the budget)")
    max_cached_weights: int = _value(
        2**23, "memory chunks", "count0",
        "The softmax least squares keeps the attention weights of all samples between the two passes of a loss "
        "evaluation up to this many entries (samples in memory only).",
        _BY_HAND, "a memory bound, not measured")

    # -- risk curve ------------------------------------------------------------------------------------------
    curve_resolution_fraction: float = _value(
        0.5, "risk curve", "positive",
        "A risk curve measured on models fitted on half the samples (the factored least squares) resolves a "
        "tolerance only where the two halves' full models disagree by at most this fraction of it; beyond, the "
        "factored fit refits at a larger rank from fresh starts (while that helps), and a reading still beyond "
        "is warned and its interval reaches d.",
        "python benchmarks/real_heads.py",
        "settled MiniLM heads: 1e-6 to 1e-5 of Var(Y); a head whose halves settled on different optima (layer 3 "
        "head 8, r*(1%) read 8, held out 1.46%): 0.026")

    # -- model check -----------------------------------------------------------------------------------------
    model_check_alpha: float = _value(
        1e-3, "model check", "level",
        "Level of the model checks' one-sided z tests (a false alarm on data in the class at most this often, per "
        "check).",
        "python benchmarks/model_check.py",
        "set, not tuned: under the class the tests' statistics are conservative; no alarm on 680 in-class tasks, "
        "20/20 on each misfit")

    # -- students --------------------------------------------------------------------------------------------
    fisher_samples: int = _value(
        256, "students", "count",
        "The trained students' operator Fisher information is computed on at most this many training samples "
        "(and rescaled to n).",
        _BY_HAND, "no measurement recorded")
    fisher_chunk: int = _value(
        64, "students", "count",
        "Samples per forward-mode Jacobian of the students' operator Fisher information (a memory bound).",
        _BY_HAND, "a memory bound, not measured")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check(f.name, getattr(self, f.name), f.metadata["domain"])

    def replace(self, **changes):
        """A copy with ``changes`` (field names and values), validated: :func:`dataclasses.replace`."""
        return dataclasses.replace(self, **changes)

    def table(self):
        """One row per field, in declaration (group) order: ``(name, value, meaning, set_by, data, group)``."""
        return [(f.name, getattr(self, f.name), f.metadata["meaning"], f.metadata["set_by"], f.metadata["data"],
                 f.metadata["group"]) for f in dataclasses.fields(self)]


def _check(name, value, domain):
    """ValueError (one line, naming the field) unless ``value`` lies in ``domain``."""
    integer = domain in ("count", "count0")
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok and integer:
        ok = isinstance(value, numbers.Integral)
    if ok:
        v = float(value)
        ok = bool(np.isfinite(v)) and {
            "level": 0 < v < 1,
            "fraction": 0 <= v < 1,
            "aspect": 0 < v <= 1,
            "positive": v > 0,
            "nonnegative": v >= 0,
            "at_least_one": v >= 1,
            "count": v >= 1,
            "count0": v >= 0,
        }[domain]
    if not ok:
        raise ValueError(f"Calibration.{name} must be {_DOMAINS[domain]}, got {value!r}.")


#: The calibration every inversion, rule and function uses unless given another.
DEFAULT_CALIBRATION = Calibration()
