"""Whether the data identify r*: every gate that widens ``rank_interval_`` or warns that r* is not identified.

An inversion reports facts about its statistic (:class:`~rstar.inversions.Finding`, in
``WhitenedStatistic.findings``: its shape, whether its fit settled, what ran out, why it fell back); a rule
reports facts about its count (``RuleResult.findings``). This module decides what they mean for the rank: each
gate is a pure function of those facts and the data's shape, returning a :class:`Verdict` -- the warning to
issue and the range r* is known to lie in, which ``rank_interval_`` must cover -- or None where r* stays
identified. The estimator calls :func:`statistic_verdicts` and :func:`estimator_verdicts` once, after the rule,
and the gates of the risk curve (:func:`tolerance_verdicts`) and of the model checks
(:func:`first_order_misfit_verdict`, :func:`operator_misfit_verdict`) after the curve and the checks.

A verdict unpacks as ``(category, message)`` (as the warnings lists always did) and carries ``reason`` (a
stable name for tests and programs: :data:`REASONS`) and ``bounds`` (``(lo, hi)``, either None: the end left
as it is).
"""

from ..exceptions import (IllConditionedInversionWarning, OperatorMisfitWarning, UnidentifiableRankWarning)
from ..calibration import DEFAULT_CALIBRATION
from ..inversions._statistic import curve_resolution_misses

__all__ = ["REASONS", "Verdict", "covering", "estimator_verdicts", "fallback_verdict", "first_order_misfit_verdict",
           "operator_misfit_verdict", "rule_verdict", "said_by_the_inversion", "statistic_verdicts",
           "tolerance_verdicts", "within_class"]


class Verdict(tuple):
    """A gate's decision: ``(category, message)`` with ``reason`` and ``bounds`` attached.

    Attributes
    ----------
    category : Warning subclass
    message : str
    reason : str
        One of :data:`REASONS`.
    bounds : tuple of (int or None, int or None) or None
        The range ``rank_interval_`` must cover (None: only a warning); an end that is None is left as it is.
    """

    def __new__(cls, reason, category, message, bounds=None):
        self = super().__new__(cls, (category, message))
        self.reason, self.bounds = reason, bounds
        return self

    @property
    def category(self):
        return self[0]

    @property
    def message(self):
        return self[1]

    def __reduce__(self):
        return (Verdict, (self.reason, self[0], self[1], self.bounds))

    def __repr__(self):
        return f"Verdict({self.reason!r}, {self[0].__name__}, bounds={self.bounds})"

    def warning(self):
        """The warning instance to issue, with ``reason`` and ``bounds`` attached to it."""
        w = self[0](self[1])
        w.reason, w.bounds = self.reason, self.bounds
        return w


#: Every reason a verdict can give, with what it means.
REASONS = {
    # the statistic's shape and fit (inversions)
    "first_order_near_square": "first-order softmax statistic with T - 1 close to d from below: no model check",
    "first_order_too_few_tokens": "first-order softmax statistic with d > first_order_max_aspect (T - 1)",
    "first_order_qk_too_few_tokens": "first-order query-key statistic with d > first_order_qk_max_aspect T",
    "factored_unsettled": "the factored least squares stopped before its split-half count settled",
    "factored_at_cap": "the factored least squares filled its largest rank q (the rule says so)",
    "exact_no_split_half": "the exact softmax inversion has no split-half draw to set the noise level",
    "value_map_misfit": "a half's fitted value map leaves the other half's residual unexplained (cross-fit)",
    # fallbacks of the softmax least squares (the reason it fell back)
    "no_output": "Y is all zero",
    "no_value_signal": "no value signal: the least squares cannot identify K",
    "softmax_misfit": "the least squares of softmax attention rejects its own model",
    "not_converged": "the least squares did not converge",
    "singular_information": "the least squares' information is singular",
    # the samples (estimator)
    "too_few_noise_columns": "fewer independent noise columns than dimensions",
    "single_token": "one token per sample: softmax or query-key attention does not see K's rank",
    # model checks
    "first_order_kurtosis": "first-order softmax statistic on heavy-tailed tokens without a model check",
    "first_order_misfit": "the first-order softmax operator leaves more than the noise outside the span",
    "operator_misfit": "the data do not follow the operator's class",
    # the rules' counts
    "bulk_too_wide": "the eigenvalues left after the count spread wider than white noise",
    "bulk_exhausted": "too few eigenvalues left to estimate the noise level",
    "mostly_spikes": "most eigenvalues are spikes: the bulk's noise level decides nothing",
    "energy_discounts": "the energy rank counts fewer directions than the noise-aware test",
    "numerical_outside": "the numerical rank lies outside the noise-aware test's range",
    "split_half_band": "split-half directions in the band between noise edge and margin",
    "split_half_at_cap": "the factored fit's count filled its largest rank q",
    # the risk curve
    "curve_against_unidentified_fit": "the risk curve is measured against a fit that did not identify r*",
    "curve_resolution": "the halves' fits disagree by more than the tolerance allows",
    "curve_floor_gap": "the full models' floor is known only within more than the tolerance (held out against "
                       "in sample), so the curve may understate the excess by that much",
    "tolerance_below_noise": "the rank read at the tolerance exceeds the noise-floor estimate's upper end "
                             "(the interval runs from the noise floor's lower end to d)",
    "tolerance_beyond_class_bound": "the curve reaches the tolerance only beyond the class's bound on r* "
                                    "(max_rank): read at the bound, the interval every rank the class allows",
}


def within_class(rank, interval, dim):
    """A reading and its interval kept within the ranks the class allows, from 0 to ``dim``.

    ``dim`` is the smaller of d and the estimator's ``max_rank``: ``r*(tolerance) <= r* <= dim``, whatever a curve
    read (where it read beyond, the verdict ``tolerance_beyond_class_bound`` of :func:`tolerance_verdicts` says so).

    Examples
    --------
    >>> within_class(43, (0, 46), 32)
    (32, (0, 32))
    """
    dim = int(dim)
    return min(int(rank), dim), (min(int(interval[0]), dim), min(int(interval[1]), dim))


def covering(interval, verdicts):
    """``interval`` widened to cover every verdict's bounds."""
    lo, hi = interval
    for v in verdicts:
        if v.bounds is None:
            continue
        b_lo, b_hi = v.bounds
        if b_lo is not None:
            lo = min(lo, int(b_lo))
        if b_hi is not None:
            hi = max(hi, int(b_hi))
    return (lo, hi)


# -- the statistic: what the inversion found ---------------------------------------------------------------


def _first_order_shape(facts, calibration):
    """The first-order statistic's aspect gates (query-key and softmax first order)."""
    centred, T_eff, d = facts["centred"], facts["tokens"], facts["features"]
    aspect = min(T_eff, d) / max(T_eff, d)
    out = []
    if centred and aspect > calibration.ill_conditioned_aspect and T_eff <= d:
        # softmax at T - 1 close to d, from below: no degrees of freedom outside col(P X_i) for the model check
        # (first_order_misfit), and on real tokens the count is far off (MiniLM's tokens on their top 32
        # principal directions, T = 32: planted r* = 8 and 16 read 2 and 5)
        out.append(Verdict(
            "first_order_near_square", UnidentifiableRankWarning,
            f"the first-order softmax statistic at T-1={T_eff} centred tokens and d={d} features has "
            "no residual outside col(P X_i) to check its model against, and near T - 1 = d its "
            "higher-order terms and the tokens' anisotropy are not told from signal (on real "
            "tokens planted ranks were under-counted several-fold): rank_ may be far off; "
            f"rank_interval_ is (0, {d}). What would help: T - 1 > d (sequences longer than "
            "the feature count, where the model check applies), or the least-squares fit "
            "(RStarEstimator), which is well posed here.", (0, d)))
    limit = calibration.first_order_max_aspect
    if centred and d > limit * T_eff:
        out.append(Verdict(
            "first_order_too_few_tokens", UnidentifiableRankWarning,
            f"the first-order softmax statistic cannot identify r* at d={d} features with only "
            f"T-1={T_eff} centred tokens per sample (d > {limit:g} (T-1)): the "
            "higher-order terms of its expansion, and any anisotropy of the tokens, fill a bulk "
            f"its null does not model, so rank_ may be far off; rank_interval_ is (0, {d}). What "
            "would help: longer sequences, fewer features (project the tokens on their leading "
            "principal directions, or choose the subspace of interest), or the least-squares fit "
            "within its budgets (RStarEstimator, with a larger compute_budget/memory_budget).", (0, d)))
    limit = calibration.first_order_qk_max_aspect
    if not centred and d > limit * T_eff:
        out.append(Verdict(
            "first_order_qk_too_few_tokens", UnidentifiableRankWarning,
            f"the first-order query-key statistic cannot identify r* at d={d} features with only "
            f"T={T_eff} tokens per sample (d > {limit:g} T): each sample sees "
            "the kernel through the random projection X_i^+ X_i, whose leaked signal (and, with "
            "few samples, the noise) forms a bulk its null models only on average, so rank_ is "
            f"often too large (a planted 3 read 5-14 here, pure noise up to 6); rank_interval_ is "
            f"(0, {d}). What would help: longer sequences, fewer features (the tokens' leading "
            "principal directions, or the subspace of interest), or the least-squares fit within "
            "its budgets (a larger memory_budget/compute_budget: query_key_cross_fit, or "
            "query_key_least_squares with a known value_map).", (0, d)))
    return out


def _factored_fit(facts, calibration):
    q, d, count = facts["fitted_rank"], facts["features"], facts["count"]
    if not facts["settled"]:
        return [Verdict(
            "factored_unsettled", UnidentifiableRankWarning,
            f"the factored least squares ran {facts['iterations']} L-BFGS iterations per half at rank q = {q} "
            f"{'(the compute budget ran out) ' if facts['budget_ran_out'] else ''}and the split-half count was "
            f"still changing ({count[0]} above the margin, {count[1]} above the null): rank_ may be "
            f"off; rank_interval_ is widened to (0, {q}). "
            + ("A larger compute_budget (or compute_budget='auto', which runs the fit to its iteration caps), "
               if facts["budget_ran_out"] else
               "Larger iteration caps (the calibration's factored_max_iter / factored_max_iter_fitted_v), ")
            + "more samples or fewer features would help.", (0, int(q)))]
    if facts["capped"] and count[1] >= q - 1:
        # the count filled the largest q allowed: the rule warns (split_half_at_cap) and reaches d; a risk curve
        # measured against this fit may fall short of the unconstrained model as well
        return [Verdict("factored_at_cap", None, "", (0, int(d)))]
    return []


def _exact_noise_level(facts, calibration):
    why = (f"a half of the {facts['n_samples']} samples is too small to solve the exact softmax inversion (each "
           f"needs {facts['min_samples']})" if facts["half_too_small"] else
           "the split-half noise draw is degenerate (its median eigenvalue is 0)")
    return [Verdict("exact_no_split_half", UnidentifiableRankWarning,
                    f"{why}, so no split-half draw sets the noise level. Fallback in use: the bulk's level "
                    "and width are fitted to the spectrum; more samples give the split-half noise level.")]


def _value_map_misfit(facts, calibration):
    # one verdict per distinct ratio (as printed): the two halves' checks can say the same
    ratios = {f"{r:.2f}": r for r in facts["ratios"]}.values()
    return [Verdict("value_map_misfit", UnidentifiableRankWarning,
                    f"the value map fitted on one half of the samples leaves {ratio:.2f} times "
                    "the other half's own residual power unexplained (the least-squares fit of K "
                    "and V is not convex and may have stopped in a poor local optimum, or "
                    "heavy-tailed tokens amplify the error of the fitted V): part of the "
                    "signal is then tested as noise outside range(K), so rank_ may be an "
                    "over-count.") for ratio in ratios]


def fallback_verdict(finding, calibration):
    """The verdict on a least-squares fit that fell back to the first order (``finding.kind`` its reason)."""
    kind, f = finding.kind, finding.values
    if kind == "no_output":
        return Verdict(kind, UnidentifiableRankWarning,
                       "the outputs Y are all zero: there is no signal to fit. Fallback in use: the first-order "
                       "inversion (rank_ 0).")
    if kind == "no_value_signal":
        return Verdict(kind, UnidentifiableRankWarning,
                       f"the outputs show no value signal (the F test of V = 0 under uniform attention does not "
                       f"reject at {f['alpha']:g}), so the least squares cannot identify K (it would run off to hard "
                       "attention that fits the noise). Fallback in use: the first-order inversion, whose null holds "
                       "without a value signal; a known value_map or more samples would identify K.")
    if kind == "softmax_misfit":
        d = f["features"]
        # the softmax class's r* is not defined for data outside it: every rank stays possible (the first-order
        # count is a linear-QK reading, which operator='linear_qk' makes and checks)
        return Verdict(kind, UnidentifiableRankWarning,
                       f"the least-squares fit of softmax attention leaves {f['ratio']:.2f} "
                       "times the residual power found outside col(P X_i): the data do not follow "
                       "softmax(X K X^T / sqrt(d)) X V (e.g. linear query-key attention: use "
                       "operator='linear_qk'; or X and Y swapped: X the inputs, Y the outputs). Fallback in use: the "
                       "first-order inversion, which holds for "
                       f"both; as a rank of softmax attention its count is not identified: rank_interval_ is (0, {d}).",
                       (0, d))
    if kind == "not_converged":
        # the null draws are the noise of a minimum: an unconverged K holds the optimiser's error too
        return Verdict(kind, UnidentifiableRankWarning,
                       f"the least-squares fit of the softmax kernel stopped after "
                       f"{f['max_iter']} L-BFGS iterations before converging (a flat or "
                       "badly conditioned loss, e.g. heavy-tailed tokens with few samples). Fallback in "
                       "use: the first-order inversion.")
    if kind == "singular_information":
        return Verdict(kind, IllConditionedInversionWarning,
                       "the information of the least-squares softmax kernel is singular (directions of K "
                       "that no sample's attention sees). Fallback in use: the first-order inversion.")
    raise ValueError(f"unknown fallback reason {kind!r}")   # pragma: no cover - a bug


_STATISTIC_GATES = {"first_order_shape": _first_order_shape, "factored_fit": _factored_fit,
                    "exact_noise_level": _exact_noise_level, "value_map_misfit": _value_map_misfit}


def statistic_verdicts(ws, calibration):
    """The verdicts on what the inversion found (``ws.findings``, and ``ws.fallback`` where it fell back), in
    the order it found them. A verdict whose ``category`` is None only widens the interval (the rule warns)."""
    out = []
    for finding in ws.findings:
        out.extend(_STATISTIC_GATES[finding.kind](finding.values, calibration))
    if ws.fallback is not None:
        out.append(fallback_verdict(ws.fallback, calibration))
    return out


def said_by_the_inversion(verdicts):
    """Whether the inversion's own verdicts already say r* is not identified (then the operator-class check,
    which would say it again, does not run)."""
    return any(v.category is not None and issubclass(v.category, UnidentifiableRankWarning) for v in verdicts)


# -- the samples: what the estimator sees ---------------------------------------------------------------------


def estimator_verdicts(ws, n_samples, T, operator, identified):
    """The gates on the samples: too few noise columns (only where the statistic is ``identified`` by the
    inversion's own gates) and one token per sample."""
    out = []
    if identified and ws.n_columns < ws.dim:
        # fewer noise columns than dimensions: the statistic's rank is at most n_columns, no bulk of the
        # full dimension is left to set the noise level, and the rules would read every eigenvalue as signal
        need = ws.dim / max(ws.n_columns / n_samples, 1e-12)
        out.append(Verdict(
            "too_few_noise_columns", UnidentifiableRankWarning,
            f"the {ws.inversion} statistic has about {ws.n_columns:.0f} independent noise columns for "
            f"{ws.dim} dimensions (too few samples: each sample adds about d_v columns), so its noise "
            f"bulk cannot be told from signal and rank_ may be far off; rank_interval_ is (0, "
            f"{ws.dim}). What would help: more than {need:.0f} "
            "samples.", (0, ws.dim)))
    if T == 1 and operator in ("softmax", "linear_qk"):
        # one token per sample: softmax attention of one token is 1 whatever K, and linear query-key
        # attention sees K only through x^T K x (its symmetric part), whose rank is not K's
        what = ("softmax attention over one token is 1 whatever K (Y does not depend on K)"
                if operator == "softmax" else
                "linear query-key attention over one token sees K only through x^T K x (its symmetric "
                "part), whose rank is not K's")
        out.append(Verdict(
            "single_token", UnidentifiableRankWarning,
            f"X has T = 1 token per sample (a 2-D X of shape (n, d) is read as T = 1): {what}, so "
            f"r* is not identified by these data; rank_interval_ is (0, {ws.dim}). What would "
            "help: sequences of T >= 2 tokens, X of shape (n_samples, T, d) and Y of shape "
            "(n_samples, T, d_v).", (0, ws.dim)))
    return out


# -- the model checks -----------------------------------------------------------------------------------------


def first_order_misfit_verdict(check, calibration):
    """The verdict on the first-order softmax model check (``check``: the facts of
    :meth:`rstar.inversions.QueryKeyInversion.first_order_misfit`, or None where no check applies): a ratio
    above ``first_order_misfit``, or a kurtosis above ``1 + first_order_max_kurtosis`` by more than
    ``first_order_kurtosis_standard_errors`` standard errors, rejects the model."""
    if check is None:
        return None
    d = check["features"]
    if check["kind"] == "kurtosis":
        # the statistic's null holds for Gaussian tokens only: heavy tails, a few standard errors clear of the
        # margin, reject it
        kurt, se = check["kurtosis"], check["se"]
        if not kurt - calibration.first_order_kurtosis_standard_errors * se > 1.0 + calibration.first_order_max_kurtosis:
            return None
        return Verdict(
            "first_order_kurtosis", UnidentifiableRankWarning,
            f"the first-order softmax statistic has no model check at T-1={check['tokens']} centred tokens and "
            f"d={d} features (no residual outside col(P X_i)), and its null holds for Gaussian tokens only: these "
            f"tokens' multivariate kurtosis is {check['kurtosis']:.3g} times the Gaussian value (SE "
            f"{check['se']:.2g}; above {1 + calibration.first_order_max_kurtosis:g} counts were off, e.g. 5-7 for a "
            f"planted 3 on MiniLM hidden states at d = 64, T = 32), so rank_ may be far off; rank_interval_ is (0, "
            f"{d}). What would help: T - 1 > d (sequences longer than the feature count, where the model check "
            "applies), fewer features, or the least-squares fit (RStarEstimator).", (0, d))
    if not check["ratio"] > calibration.first_order_misfit:
        return None
    return Verdict(
        "first_order_misfit", UnidentifiableRankWarning,
        f"the first-order softmax model does not hold for these data: per sample, its operator leaves "
        f"{check['ratio']:.3g} times the residual power per degree of freedom found outside col(P X_i) (noise plus "
        f"higher-order terms; above {calibration.first_order_misfit:g} the expansion near uniform attention misses "
        "structure, e.g. sharp attention on anisotropic tokens), so its spikes are not the kernel's and rank_ may "
        f"be far off; rank_interval_ is (0, {d}). RStarEstimator (the least-squares fit of the model itself) reads "
        "these data where its budgets allow.", (0, d))


def _order_misfit(check, causal, rotary, alpha):
    """``(reason, what would fit)`` for :func:`rstar.model_check.cross_fitted_class_check`'s rejection."""
    head = ("causal" if causal else "bidirectional") + (" rotary" if rotary else "")
    groups = check.get("misfit_groups", {})
    if "order" in check["rejected"]:
        what, gain, p = "one weight per pair of positions on the values", check["misfit_gain"], check["misfit_p"]
    else:
        gain, p = groups["modulation"]
        what = "a weight per offset t - s on each query-key direction's logit"
    reason = (f"on samples each half's {head} head was not fitted on, {what} removes {100 * gain:.1f}% of its "
              f"residual beyond what the two halves' disagreement allows (one-sided p = {p:.2g})")
    hints = []
    later = groups.get("later")
    if later is not None and later[1] < alpha and later[0] > 0:
        hints.append(f"the pairs after each position carry {100 * later[0]:.1f}% of it, so the mask is likely "
                     "wrong: " + ("Y reads later tokens, try causal=False" if causal
                                  else "a decoder head needs causal=True"))
    earlier = groups.get("earlier")
    if not hints and earlier is not None and earlier[1] < alpha and earlier[0] > 0:
        hints.append(f"the pairs up to each position carry {100 * earlier[0]:.1f}%, so order matters: "
                     + ("check that rotary= holds the head's own positions" if rotary
                        else "a head with rotary positions needs rotary=RotaryPositions(...) (rstar.heads passes "
                             "a Llama-family head's), an absolute-position head tokens that carry their positions"))
    modulation = groups.get("modulation")
    if not hints and modulation is not None and modulation[1] < alpha and modulation[0] > 0:
        hints.append(f"scaling each query-key direction's logit by a weight for each offset t - s removes "
                     f"{100 * modulation[0]:.1f}%, so the head attends by relative position: "
                     + ("check that rotary= holds the head's own positions" if rotary
                        else "a rotary head needs rotary=RotaryPositions(...) (rstar.heads passes a Llama-family "
                             "head's)"))
    if not hints:
        hints.append("check that X holds the inputs and Y the outputs, not swapped, and the mask and positions")
    return reason, "; ".join(hints)


def operator_misfit_verdict(check, operator, dim, *, causal=False, rotary=False, alpha=None):
    """The verdict on :func:`rstar.model_check.operator_class_check`'s (or
    :func:`rstar.model_check.cross_fitted_class_check`'s) outcome ``check`` for ``operator`` (fitted ``causal``,
    with ``rotary`` positions or not)."""
    if check is None or not check["rejected"]:
        return None
    alpha = DEFAULT_CALIBRATION.model_check_alpha if alpha is None else alpha
    if "order" in check["rejected"] or "modulation" in check["rejected"]:
        reason, fit = _order_misfit(check, causal, rotary, alpha)
        wide = (0, int(dim))
        return Verdict(
            "operator_misfit", OperatorMisfitWarning,
            f"the data do not follow the fitted {operator} head's class: {reason}. rank_ is a count inside a class "
            f"these data lie outside, so it may be far off; rank_interval_ is {wide}. What would fit: {fit}.", wide)
    reasons = []
    if "baseline" in check["rejected"]:
        reasons.append(f"a regression with no attention at all (each token's features, its sequence's and "
                       f"prefix's means and its position) leaves {100 * check['baseline_gain']:.1f}% less "
                       f"residual on samples it was not fitted on than the full-rank {operator} fit on "
                       f"its own samples (one-sided p = {check['baseline_p']:.2g})")
    if "span" in check["rejected"]:
        reasons.append(f"the power of Y outside the span of each sample's tokens, which this class leaves to "
                       f"the noise alone, grows with the tokens' norm (correlation "
                       f"{check['span_correlation']:.2f} over samples, one-sided p = {check['span_p']:.2g}): "
                       "there is signal outside the span")
    alternative = {"linear_qk": "operator='softmax' or 'linear_proxy'",
                   "softmax": "operator='linear_qk' or 'linear_proxy'"}[operator]
    wide = (0, int(dim))
    return Verdict(
        "operator_misfit", OperatorMisfitWarning,
        f"the data do not follow the {operator} operator's class: {'; and '.join(reasons)}. rank_ is a "
        f"count inside a class these data lie outside, so it may be far off; rank_interval_ is {wide}. Check "
        "that X holds the inputs (n, T, d) and Y the outputs (n, T, d_v), not swapped, and that the operator "
        f"matches how Y was made (try {alternative}; a decoder head needs causal=True).", wide)


# -- the rules' counts ---------------------------------------------------------------------------------------------


def rule_verdict(reason, **f):
    """The verdict on a rule's finding ``reason`` with its facts ``f`` (the rules call it as they count)."""
    if reason == "bulk_too_wide":
        return Verdict(reason, UnidentifiableRankWarning,
                       f"the {f['p'] - f['k']} eigenvalues left after {f['k']} spike(s) spread like Marchenko-Pastur "
                       f"noise with {f['m_left']:.0f} columns, not {f['n_columns']:.0f}: they hold undetected spikes "
                       "or structured noise, so rank_ may be an under-count (the noise level estimated from "
                       "them is inflated when most of the spectrum is signal). Pass noise_variance=... if "
                       "known, or check spectrum_.")
    if reason == "bulk_exhausted":
        p, rank = f["p"], f["rank"]
        return Verdict(reason, UnidentifiableRankWarning,
                       f"only {p - rank} eigenvalue(s) left in the bulk after {rank} spike(s): the noise level "
                       "cannot be estimated from the spectrum. Fallback: the remaining eigenvalues are "
                       f"not counted, and rank_interval_ reaches {p} (pass noise_variance=... to decide them).",
                       (None, p))
    if reason == "mostly_spikes":
        p, rank, by_coherent = f["p"], f["rank"], f["by_coherent"]
        # (a count the coherent statistic decided rests on its own noise level, not this bulk's)
        return Verdict(reason, UnidentifiableRankWarning,
                       f"{rank} of {p} eigenvalues are spikes: the noise level, estimated from the remaining "
                       "bulk, is unreliable when most of the spectrum is signal, so the count may be mostly "
                       f"noise{'' if by_coherent else '; rank_interval_ reaches down to 0'}. Pass "
                       "noise_variance=... if known, or use an estimator whose null does not rest on the bulk "
                       "(RStarEstimator).", None if by_coherent else (0, rank))
    if reason == "energy_discounts":
        return Verdict(reason, UnidentifiableRankWarning,
                       f"the energy rank {f['rank']} counts fewer directions than the {f['count']} spike(s) the "
                       f"noise-aware test finds above the noise edge ({f['lo']} to {f['hi']} at the strict and "
                       "lenient levels): it discounts the weaker ones, which may belong to r*. "
                       "rank_interval_ reaches the count; MPRankEstimator gives the count, RStarEstimator "
                       "with a tolerance the smallest rank reaching a given risk.")
    if reason == "noise_aware":
        # the noise-aware test's own verdict, passed on by the numerical rule under its own reason
        inner = f["verdict"]
        return Verdict(inner.reason, inner.category, "the noise-aware test beside the numerical rank: " + inner.message)
    if reason == "numerical_outside":
        k, lo, hi = f["k"], f["lo"], f["hi"]
        return Verdict(reason, UnidentifiableRankWarning,
                       f"the numerical rank counts {k} eigenvalue(s) above the tolerance {f['threshold']:.3g}, but "
                       f"the noise-aware test counts {lo} to {hi} spikes: the tolerance "
                       f"{'counts noise' if k > hi else 'misses spikes'} at this noise level. rank_interval_ "
                       "is widened to contain rank_; MPRankEstimator gives the noise-aware count.", (k, k))
    if reason == "split_half_band":
        rank, lenient, upper, fitted = f["rank"], f["lenient"], f["upper"], f["fitted_rank"]
        return Verdict(reason, UnidentifiableRankWarning,
                       f"{lenient - rank} direction(s) of the half-sum kernel stand between "
                       f"{f['noise_edge']:g} and {f['margin']:g} times the largest of the half-difference "
                       "(the split-half noise): they are not told from noise, and weaker directions below them "
                       f"are not resolved either, so r* lies in ({rank}, {upper})"
                       + (f" (the fitted rank q = {fitted})" if upper > lenient else "")
                       + ". More samples, longer sequences or a known value_map would separate them.",
                       (None, upper))
    if reason == "split_half_at_cap":
        return Verdict(reason, UnidentifiableRankWarning,
                       f"the factored least squares was fitted at its largest rank q = {f['fitted_rank']} "
                       f"(the compute budget, or d) and {f['lenient']} of its directions stand above the split-half "
                       "null: r* may exceed q. rank_interval_ reaches d. What would help: a larger "
                       "compute_budget (or fewer samples per fit), or max_rank if r* is known to be small.",
                       (None, f["dim"]))
    raise ValueError(f"unknown rule finding {reason!r}")   # pragma: no cover - a bug


# -- the risk curve ------------------------------------------------------------------------------------------------


def tolerance_verdicts(*, tolerance, rank, dim, inversion, identified, disagreement, noise_lower, noise_upper,
                       calibration, floor_gap=None, held_out_reach=None):
    """The gates on r*(tolerance) read off a risk curve: a curve measured against a fit that did not identify
    its statistic, a curve that does not resolve the tolerance, a curve whose floor may understate the excess by
    more than the tolerance (``floor_gap``: the full models' residual held out less in sample, relative to
    Var(Y); None where the curve is not cross-fitted), and a tolerance finer than the noise (``noise_lower``,
    ``noise_upper``: the noise-floor estimate's interval).

    ``held_out_reach`` (:func:`rstar.risk.held_out_reach`; None where the curve is not cross-fitted or does not
    reach the tolerance that way) is the smallest rank whose models' own held-out risk is within the tolerance:
    r*(tolerance) is at most it whatever the full model the curve subtracts (up to the held-out estimate's own
    sampling error), so it is the upper end of the unidentified fit's gate, which would otherwise reach ``dim``,
    and a reading at that rank is not one an unidentified fit can have made too small: it is not warned for it.
    (Not the floor gap's gate: its floor exceeds the tolerance, so no rank reaches it that way. Not the noise's:
    directions fitted to noise have read short of the tolerance on other windows while their held-out risk on the
    other half reached it — SmolLM2 layer 7 head 7 below.)

    ``dim`` is every rank the class allows (the smaller of d and ``max_rank``). A ``rank`` read beyond it (a
    factored fit's curve runs to the rank of its halves' mean kernel, up to twice the rank fitted) is the class's
    bound, :func:`within_class`, and the verdict ``tolerance_beyond_class_bound`` says why: the fit's models of
    rank at most ``dim`` fall short of the tolerance, so the data have not placed r*(tolerance) below the bound;
    the other gates read the rank at the bound."""
    tol = float(tolerance)
    out = []
    if rank > dim:
        # the class bounds r*(tolerance) <= r* <= dim (a head's d_head), so a curve that reaches the tolerance
        # only beyond it has models of at most dim that fall short: its reading places nothing below the bound
        # (MiniLM layer 1 head 1, max_rank = 32: read 43 (0, 46) off its halves' mean kernel, of rank up to 64)
        out.append(Verdict(
            "tolerance_beyond_class_bound", UnidentifiableRankWarning,
            f"tolerance={tol:g} is reached by this risk curve only at rank {int(rank)}, beyond the class's bound on "
            f"r* (max_rank, or d: {int(dim)}): its models of rank at most {int(dim)} fall short of the tolerance, "
            f"so the reading is the bound, {int(dim)}, and rank_interval_ is every rank the class allows, "
            f"(0, {int(dim)}). The fit has not found a model of the class that reaches the tolerance: more samples, "
            "a larger compute_budget, or a larger tolerance would help (or a larger max_rank, if the bound is not "
            "the class's).", (0, int(dim))))
        rank = int(dim)
    reach = None if held_out_reach is None else int(held_out_reach)
    upper_end = int(dim) if reach is None else min(reach, int(dim))   # (the verdict is issued for reach > rank)
    if not identified and (reach is None or reach > rank):
        # the inversion could not identify its statistic (e.g. a factored fit whose count had not settled):
        # the full model the curve is measured against may itself fall short, so r*(tolerance) is a lower end,
        # up to the rank whose models reach the tolerance held out on their own
        out.append(Verdict(
            "curve_against_unidentified_fit", UnidentifiableRankWarning,
            f"tolerance={tol:g} is read off a risk curve measured against the {inversion} fit, which did not "
            f"identify its statistic (see the other warning): that fit may fall short of the unconstrained "
            f"model, so the rank read ({rank}) may be too small; rank_interval_ reaches {upper_end}"
            + (" (the rank whose models' own held-out risk is within the tolerance)" if reach is not None else "")
            + ". What would help: the remedy the other warning names.", (None, upper_end)))
    fraction = calibration.curve_resolution_fraction
    halves_apart, floor_unknown = curve_resolution_misses(tol, disagreement, floor_gap, calibration)
    if halves_apart:
        # the curve compares models fitted on half the samples; where those disagree by more than the
        # tolerance allows, it cannot say whether the half-sum model predict uses reaches it
        out.append(Verdict(
            "curve_resolution", UnidentifiableRankWarning,
            f"tolerance={tol:g} is finer than this risk curve resolves: it is measured on the two halves' "
            f"{inversion} fits, whose outputs disagree by {disagreement:.3g} of Var(Y) (a quarter of their "
            "mean squared difference: the excess of a half's model over their mean), more than "
            f"{fraction:g} times the tolerance, so the rank read ({rank}) may be too small "
            "(or larger than needed) for the model predict uses; rank_interval_ is every rank, "
            f"(0, {dim}). The halves settle on different optima where the rank fitted is too small for the task, "
            "or the samples too few: more samples, a larger tolerance, or a larger compute_budget would help.",
            # either way: halves that disagree have not found the model, so neither end of the reading holds
            (0, int(dim))))
    if floor_unknown:
        # the curve subtracts the full models' floor held out; the best unconstrained model's risk lies between
        # that and the same models in sample, so the curve may understate every rank's excess by up to their gap.
        # Beyond the tolerance itself, a reading inside it may be a reading outside it (MiniLM layer 0 head 2,
        # gap 0.08: read 5 (5, 7) at 5%, its kernel truncated to 5 held out 10.9%; layer 0 head 9, gap 0.013:
        # read 12 (8, 14) at 1%, its kernel at 12 held out 2.3%)
        out.append(Verdict(
            "curve_floor_gap", UnidentifiableRankWarning,
            f"tolerance={tol:g} is finer than this risk curve's floor is known: its full models leave "
            f"{floor_gap:.3g} of Var(Y) more on the other half's samples than on their own, so the unconstrained "
            "model's risk, which the curve's excess is measured from, is known only within that much, more than "
            f"the tolerance; the rank read ({rank}) may be too small, and rank_interval_ reaches {dim}. The full "
            "models do not generalise: more samples, or a larger compute_budget, would help.", (None, int(dim))))
    if rank > noise_upper:
        # the directions the reading counts beyond the noise floor are not told from noise: fitted from these
        # samples they carry noise, so the curve along them neither bounds r*(tolerance) from above (better
        # directions could be needed, more of them) nor places it above the noise floor (SmolLM2 layer 7 head 7:
        # read 29 (26, 30) at 1% beside a noise-floor upper end below 29; its truncation needs 32, and the fit's
        # own rank-29 model held out 1.12%)
        out.append(Verdict(
            "tolerance_below_noise", UnidentifiableRankWarning,
            f"tolerance={tol:g} is finer than the noise resolves: the rank it reads ({rank}) exceeds the "
            f"noise-floor estimate's upper end ({noise_upper}), so the directions it counts beyond that are not "
            "told from the noise of these samples, and the curve along them does not place r*(tolerance): it may "
            f"need fewer, or more and better directions; rank_interval_ is widened to ({int(noise_lower)}, "
            f"{int(dim)}). More samples, or a larger tolerance, would help.", (int(noise_lower), int(dim))))
    return out
