"""Which inversion runs: decided once, by one pure function, with its reason.

:func:`choose_inversion` maps (operator, known value map, shape, number of
samples, requested method, cost budget) to an :class:`InversionChoice`:
the name of the inversion that will produce ``spectrum_``, why, and — when
it is not the one the method prefers — what it replaces and why (a
*fallback*, which the estimators report as an
:class:`~rstar.exceptions.InversionFallbackWarning`). The estimators call it
at every fit and record the result (``inversion_``, ``inversion_reason_``);
:func:`decision_table` renders its branches for the documentation.

Where the inversion is asked for by name and the shape alone rules it out
(a budget it would exceed whatever n, a shape it cannot invert),
``ValueError`` is raised instead: the user asked for something that cannot
run. Data-dependent fallbacks (the least-squares softmax fit that does not
converge, or finds no value signal) are decided by the inversion itself
while it runs and reported in the same way; ``inversion_`` names what ran.
"""

from dataclasses import dataclass

from ._numerics import softmax_factored as sf
from ..budgets import DEFAULT_BUDGET, CostBudget
from ..calibration import DEFAULT_CALIBRATION
from .query_key_cross_fit import cross_fit_blocker
from .query_key_least_squares import least_squares_sizes_fit
from .softmax_exact import exact_softmax_memory_fits, exact_softmax_shape_ok, exact_softmax_well_conditioned
from .softmax_factored import FACTORED_NAME, factored_capacity, factored_fit_blocker
from .softmax_rotary import ROTARY_LOG_NAME, ROTARY_NAME, coarse_stages, rotary_fit_blocker, rotary_inversion_name
from .softmax_least_squares import softmax_fit_blocker, softmax_fit_capacity
from .token import moment_sums_fit

__all__ = ["InversionChoice", "choose_inversion", "decision_table", "decision_table_markdown", "INVERSIONS", "METHODS"]

#: The inversions by name, with the operator they invert and a one-line description.
INVERSIONS = {
    "token": ("linear_proxy", "C = sum Y_i Y_i^T (token space), with a coherent split-half statistic"),
    "query_key_first_order": ("linear_qk", "M_i = X_i^+ Y_i, C = sum w_i M_i M_i^T (first order; exact for T > d)"),
    "query_key_least_squares": ("linear_qk", "least squares of K on Y_i = X_i K X_i^T X_i V, V known"),
    "query_key_cross_fit": ("linear_qk", "least squares of K on each half with V fitted on the other half"),
    "softmax_first_order": ("softmax", "the query-key inversion of the token-centred (P X, P Y)"),
    "softmax_exact": ("softmax", "weighted least squares on log S_i, S_i = Y_i (X_i V)^+, V known"),
    "softmax_least_squares": ("softmax", "least squares of K (full rank) on the softmax model itself"),
    FACTORED_NAME: ("softmax", "least squares of K = A B^T (rank q) on each half, tested against their difference"),
    ROTARY_NAME: ("softmax", "least squares of a rotary head (its planes at the given frequencies) on each half, "
                  "tested plane by plane against their difference"),
    ROTARY_LOG_NAME: ("softmax", "least squares of a rotary head on each half's log-attention log S_i, "
                      "S_i = Y_i (X_i V)^+ (V known, T well below d_v), refined on the outputs, tested plane by "
                      "plane against their difference"),
}
#: The methods an estimator can ask for.
METHODS = ("auto", "first_order", "exact", "least_squares")


@dataclass(frozen=True)
class InversionChoice:
    """The outcome of :func:`choose_inversion`.

    Attributes
    ----------
    name : str
        The inversion that runs (a key of :data:`INVERSIONS`).
    reason : str
        Why, in words.
    preferred : str
        The inversion the method prefers for this operator, value map and shape (``name`` unless a budget or
        the number of samples ruled it out).
    fallback_reason : str or None
        Why ``preferred`` does not run (None when ``name == preferred``).
    notes : tuple of str
        Budget-driven changes inside the inversion that runs (e.g. the linear proxy's noise level taken from
        the bulk because its regression sums exceed the memory budget); reported like fallbacks.
    """

    name: str
    reason: str
    preferred: str
    fallback_reason: str = None
    notes: tuple = ()

    @property
    def is_fallback(self):
        return self.name != self.preferred

    def messages(self):
        """The warnings this choice implies (empty when nothing falls back)."""
        out = []
        if self.is_fallback:
            out.append(f"{self.preferred} inversion not used: {self.fallback_reason}. Fallback in use: the "
                       f"{self.name} inversion ({self.reason}).")
        out.extend(self.notes)
        return out


def _check_method(operator, method):
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}.")
    if method == "least_squares" and operator != "softmax":
        raise ValueError(f"method must be 'auto', 'first_order' or 'exact' for operator={operator!r} "
                         "('least_squares' is the softmax inversion).")


def choose_inversion(operator, *, value_map_known=False, shape, n_samples=None, method="auto", budget=None,
                     samples_in_memory=True, causal=False, calibration=None, rotary=None):
    """Decide the inversion for an operator, value map, shape, sample count and budget.

    Parameters
    ----------
    operator : {"linear_proxy", "linear_qk", "softmax"}
    value_map_known : bool, default=False
    shape : tuple (T, d, d_v)
    n_samples : int or None, default=None
        None decides from the shape alone (the inversion to accumulate for),
        as if the samples were enough and within the budgets.
    method : {"auto", "first_order", "exact", "least_squares"}, default="auto"
        ``"auto"``: linear QK takes the least squares (V known) or the
        cross-fit (V unknown, ``T <= d`` or ``d_v < d``) where the budget
        allows, else first order; softmax takes the exact inversion with a
        known V where ``X_i V`` is well conditioned (``T <= 0.9 min(d, d_v)``),
        else first order (the paper's estimators). ``"least_squares"``
        (softmax only): least squares on the model itself, first order
        beyond its budgets. ``"exact"``: the exact inversion (needs V).
        ``"first_order"``: the first-order inversion.
    budget : CostBudget or None
    samples_in_memory : bool, default=True
        False where the samples are read in passes from their source
        (:meth:`rstar.RStarEstimator.fit_batches`, ``fit`` on dask arrays)
        instead of kept: the least-squares softmax fit then needs no memory
        for them (the other inversions that keep samples still do).
    causal : bool, default=False
        Causal (decoder) attention: token t attends to tokens ``s <= t``.
        Only the factored least squares models the mask, so it is chosen
        whatever d (softmax, ``method="least_squares"``); where it cannot run,
        ``ValueError`` (no other inversion would fit the right model).
    rotary : RotaryPositions or None, default=None
        A rotary head's positions (:mod:`rstar.inversions._numerics.rotary`): only the rotary least squares
        models them, so it is chosen (softmax, ``method="least_squares"``); where it cannot run, ``ValueError``.
    calibration : Calibration or None, default=None
        The tuned values the choice reads (residual degrees of freedom, the aspect ratio of a well-conditioned
        exact inversion, the cost model: :mod:`rstar.calibration`); None: ``DEFAULT_CALIBRATION``.

    Returns
    -------
    InversionChoice

    Raises
    ------
    ValueError
        Unknown operator or method, or an inversion asked for by name that
        this value map, shape or budget cannot run.

    Examples
    --------
    >>> from rstar.inversions import choose_inversion
    >>> choose_inversion("linear_qk", shape=(6, 12, 12), n_samples=600).name
    'query_key_cross_fit'
    >>> c = choose_inversion("linear_qk", shape=(6, 12, 12), n_samples=8)
    >>> c.name, c.preferred, c.is_fallback
    ('query_key_first_order', 'query_key_cross_fit', True)
    >>> choose_inversion("softmax", shape=(32, 16, 16), n_samples=2000, method="least_squares").name
    'softmax_least_squares'
    """
    budget = DEFAULT_BUDGET if budget is None else budget
    cal = DEFAULT_CALIBRATION if calibration is None else calibration
    _check_method(operator, method)
    T, d, d_v = (int(v) for v in shape)
    n = n_samples
    if operator == "linear_proxy":
        return _choose_token(T, d, d_v, n, budget, cal)
    if operator == "linear_qk":
        return _choose_query_key(value_map_known, T, d, d_v, n, method, budget, cal)
    if rotary is not None:
        if operator != "softmax" or method != "least_squares":
            raise ValueError("rotary positions need the softmax operator's least squares (RStarEstimator with "
                             f"operator='softmax'): got operator={operator!r}, method={method!r}.")
        blocker = None if n is None else rotary_fit_blocker(n, T, d, d_v, rotary, value_map_known, budget,
                                                            samples_in_memory, calibration=cal)
        if blocker is not None:
            raise ValueError(f"the rotary least squares, the only inversion of rotary heads, cannot run here: "
                             f"{blocker}.")
        name, why = rotary_inversion_name(T, d, d_v, value_map_known, calibration=cal)
        loss = "the log-attention" if name == ROTARY_LOG_NAME else "the outputs"
        stages = (coarse_stages(T, d, d_v, value_map_known, sf.causal_mask(T), None if n is None else n // 2,
                                calibration=cal) if causal else [])
        cuts = [T_c for T_c, _ in stages if T_c < T]
        on_log = [T_c for T_c, loss_c in stages if loss_c == "log_attention" and T_c < T]
        read = ("V known" if value_map_known else
                "V read from the first position's outputs, whose query attends to itself alone: y_0 = x_0 V")
        coarse = ("" if not cuts else
                  "; " + _cut_windows_reason(cuts)
                  + ("" if not on_log else
                     f", those of {', '.join(map(str, on_log))} tokens on their log-attention ({read}, and "
                     f"T' <= {cal.ill_conditioned_aspect} x min(d, d_v): the attention read back from the "
                     "outputs)"))
        if (T, "log_attention") in stages:
            coarse += (f"; first on the log-attention read back with each half's V from the first position's outputs "
                       f"(its query attends to itself alone: y_0 = x_0 V; T={T} <= {cal.ill_conditioned_aspect} x "
                       f"min(d, d_v) and at least {cal.first_position_samples_ratio} x d samples a half), then on "
                       "the outputs with V fitted from there")
        return InversionChoice(name, f"rotary positions: a rotary head of width 2P at the given frequencies is "
                               f"fitted by least squares on {loss} of each half of the samples ({why}{coarse}) and "
                               "tested plane by plane against the half-difference", name)
    if causal:
        if operator != "softmax" or method != "least_squares":
            raise ValueError("causal=True needs the softmax operator's least squares (RStarEstimator with "
                             "operator='softmax', or method='least_squares'): only its factored fit models the "
                             f"mask; got operator={operator!r}, method={method!r}.")
        choice = _choose_factored(value_map_known, T, d, d_v, n, budget, samples_in_memory, cal, causal=True)
        if choice.name != FACTORED_NAME:
            raise ValueError(f"causal attention is modelled by the factored least squares only, which cannot run "
                             f"here: {choice.fallback_reason}.")
        return choice
    if operator == "softmax":
        return _choose_softmax(value_map_known, T, d, d_v, n, method, budget, samples_in_memory, cal)
    raise ValueError(f"operator must be 'linear_proxy', 'linear_qk' or 'softmax', got {operator!r}.")


def _choose_token(T, d, d_v, n, budget, cal):
    notes = []
    if not moment_sums_fit(budget, T, d, d_v):
        # without the (T d)^2 sums there is no regression residual: where the samples would give it one, the test
        # changes (the coherent statistic is computed from the kept samples instead, the same statistic)
        if n is None or T * d_v * (n - T * d) >= cal.min_noise_dof:
            notes.append(f"the linear proxy's regression sums ((T d)^2 = {(T * d) ** 2} entries) exceed half the "
                         f"memory budget ({budget.describe()}): the noise level comes from the bulk instead of the "
                         "regression residual, and predict is unavailable; raise memory_budget to keep them")
        if n is not None and not budget.allows_samples(n, T, d, d_v):
            notes.append(f"the {n} samples exceed the memory budget ({budget.describe()}), so the coherent "
                         "split-half statistic, which would keep them, is not computed: only the second-moment "
                         "test counts; raise memory_budget to keep it")
    return InversionChoice("token", "the linear proxy's only inversion", "token", None, tuple(notes))


def _choose_query_key(value_map_known, T, d, d_v, n, method, budget, cal):
    if method == "exact" and not value_map_known:
        raise ValueError("method='exact' for operator='linear_qk' needs a known value_map (the least-squares "
                         "inversion solves Y_i = X_i K X_i^T X_i V for K).")
    first = "query_key_first_order"
    if method == "first_order":
        return InversionChoice(first, "asked for (method='first_order')", first)
    memory_ok = budget.allows_kernel_matrix(d)
    if value_map_known:
        preferred = "query_key_least_squares"
        if not memory_ok:
            if method == "exact":
                raise ValueError(f"the least-squares query-key inversion's d^2 x d^2 normal matrix at d={d} needs "
                                 f"{8 * d**4 / 2**30:.3g} GiB, over half the memory budget ({budget.describe()}); "
                                 "raise memory_budget or use method='first_order'.")
            return InversionChoice(first, _first_order_reason(T, d), preferred,
                                   f"its d^2 x d^2 normal matrix at d={d} exceeds half the memory budget "
                                   f"({budget.describe()})")
        if n is not None and not least_squares_sizes_fit(n, T, d, d_v, calibration=cal):
            return InversionChoice(first, _first_order_reason(T, d), preferred,
                                   f"{n} samples are too few for the least squares of K at T={T}, d={d}, d_v={d_v} "
                                   f"(a full-rank normal matrix and {cal.min_noise_dof} residual degrees of freedom)")
        return InversionChoice(preferred, "the value map is known: K by least squares on Y itself, unbiased for any "
                               "T, tested against exact draws of its noise", preferred)
    if T > d and d_v >= d:
        return InversionChoice(first, "T > d and d_v >= d: M_i = X_i^+ Y_i is exact and the first-order "
                               "statistic sees every direction of K", first)
    preferred = "query_key_cross_fit"
    why = "T <= d" if T <= d else "d_v < d"
    if not memory_ok:
        return InversionChoice(first, _first_order_reason(T, d), preferred,
                               f"its d^2 x d^2 normal matrices at d={d} exceed half the memory budget "
                               f"({budget.describe()})")
    blocker = None if n is None else cross_fit_blocker(n, T, d, d_v, budget, calibration=cal)
    if blocker is not None:
        return InversionChoice(first, _first_order_reason(T, d), preferred, blocker)
    return InversionChoice(preferred, f"V unknown and {why}: the first-order statistic is biased (T <= d) or weak "
                           "beyond d_v directions (d_v < d), so K is fitted by least squares on each half with V "
                           "fitted on the other", preferred)


def _first_order_reason(T, d):
    if T > d:
        return "M_i = X_i^+ Y_i, exact for T > d"
    return "M_i = X_i^+ Y_i, biased towards the projections X_i^+ X_i K since T <= d"


def _choose_softmax(value_map_known, T, d, d_v, n, method, budget, samples_in_memory, cal):
    first = "softmax_first_order"
    if method == "first_order":
        return InversionChoice(first, "asked for (method='first_order')", first)
    if method == "exact":
        if not (value_map_known and exact_softmax_shape_ok(T, d, d_v)):
            raise ValueError(
                "method='exact' needs a known value_map and d >= T and d_v >= T (X_i V must have full row "
                f"rank T); got value_map={'given' if value_map_known else 'None'} and (T, d, d_v)={(T, d, d_v)}.")
        if not exact_softmax_memory_fits(budget, d):
            raise ValueError(f"the exact softmax inversion's d^2 x d^2 normal matrices at d={d} need "
                             f"{2 * 8 * d**4 / 2**30:.3g} GiB, over the memory budget ({budget.describe()}); raise "
                             "memory_budget or use method='first_order'.")
        return InversionChoice("softmax_exact", "asked for (method='exact')", "softmax_exact")
    if method == "least_squares" and not budget.allows_kernel_matrix(d):
        return _choose_factored(value_map_known, T, d, d_v, n, budget, samples_in_memory, cal)
    if method == "least_squares":
        preferred = "softmax_least_squares"
        notes = ()
        fitted_n = n
        capacity = softmax_fit_capacity(T, d, d_v, value_map_known, budget, samples_in_memory, calibration=cal)
        if n is not None and n > capacity and samples_in_memory:
            # only the first samples within the budgets are kept: the least squares is fitted on them
            fitted_n = capacity
            # the budget that sets how many: the compute budget where it allows fewer than the memory budget keeps
            why = "memory budget" if capacity >= budget.max_samples(T, d, d_v) else "compute budget"
            more = ("raise memory_budget, or pass re-iterable batches to fit_batches to fit it on all of them"
                    if why == "memory budget" else "raise compute_budget to fit it on more of them")
            notes = (f"the {n} samples exceed the {why} of the least squares ({budget.describe()}), so it is "
                     f"fitted on the first {fitted_n} of them, exactly as fit on those alone would be (the "
                     f"others are not used by it); {more}",)
        blocker = None if n is None else softmax_fit_blocker(fitted_n, T, d, d_v, value_map_known, budget,
                                                             samples_in_memory, calibration=cal)
        if blocker is not None:
            if notes:
                over = (f"keeping the {n} samples exceeds the memory budget" if why == "memory budget" else
                        f"the fit on {n} samples exceeds the compute budget")
                blocker = f"{over} ({budget.describe()}), and on the first {fitted_n} within it: {blocker}"
            return InversionChoice(first, "first order in the token-centred data", preferred, blocker)
        return InversionChoice(preferred, "least squares of K on the model itself, tested against draws of its "
                               "first-order noise", preferred, None, notes)
    # auto: the paper's estimators
    if (value_map_known and exact_softmax_shape_ok(T, d, d_v)
            and exact_softmax_well_conditioned(T, d, d_v, calibration=cal)):
        if exact_softmax_memory_fits(budget, d):
            return InversionChoice("softmax_exact", "the value map is known and X_i V is well conditioned "
                                   "(T <= 0.9 min(d, d_v))", "softmax_exact")
        return InversionChoice(first, "first order in the token-centred data", "softmax_exact",
                               f"its d^2 x d^2 normal matrices at d={d} exceed the memory budget "
                               f"({budget.describe()})")
    if value_map_known:
        return InversionChoice(first, "X_i V is ill-conditioned or rank-deficient (T > 0.9 min(d, d_v)), so the "
                               "exact inversion would amplify noise: first order in the token-centred data", first)
    return InversionChoice(first, "V unknown: first order in the token-centred data (the paper's inversion)", first)


def _cut_windows_reason(lengths, where=""):
    """The reason's words for a causal fit's first stages on the windows cut to ``lengths`` tokens."""
    return (f"causal windows, so first on the windows cut to {', '.join(map(str, lengths))} tokens{where}, each fit "
            "starting the next (the outputs at the first T' positions are the head on the first T' tokens alone), "
            "where the cut windows keep enough residual degrees of freedom")


def _choose_factored(value_map_known, T, d, d_v, n, budget, samples_in_memory, cal, causal=False):
    """The least squares at a d whose ``d^2 x d^2`` information exceeds the memory budget (or with causal
    attention, which only it models): the factored fit."""
    preferred = FACTORED_NAME
    why_shape = ("causal attention (only the factored fit models the mask)" if causal else
                 f"the full-rank least squares' d^2 x d^2 information at d={d} ({8 * d**4 / 2**30:.3g} GiB) exceeds "
                 f"half the memory budget ({budget.describe()})")
    notes = ()
    fitted_n = n
    if n is not None and samples_in_memory:
        capacity = factored_capacity(T, d, d_v, value_map_known, budget, calibration=cal)
        if n > capacity > 0:
            fitted_n = capacity
            why = "memory budget" if capacity >= budget.max_samples(T, d, d_v) else "compute budget"
            notes = (f"the {n} samples exceed the {why} of the factored least squares ({budget.describe()}), so it "
                     f"is fitted on the first {fitted_n} of them, exactly as fit on those alone would be; raise "
                     f"{'memory_budget' if why == 'memory budget' else 'compute_budget'} to fit it on more",)
    blocker = None if n is None else factored_fit_blocker(fitted_n, T, d, d_v, value_map_known, budget,
                                                          samples_in_memory, calibration=cal)
    if blocker is not None:
        return InversionChoice("softmax_first_order", "first order in the token-centred data", preferred, blocker)
    cuts = sf.coarse_lengths(T, sf.causal_mask(T), calibration=cal) if causal else []
    coarse = "" if not cuts else f" ({_cut_windows_reason(cuts, ' at the first q')})"
    return InversionChoice(preferred, f"{why_shape}: K = A B^T of rank q is fitted by least squares on each half of "
                           f"the samples{coarse} and tested against the half-difference", preferred, None, notes)


#: Representative cases of the decision table: (operator, value map known, (T, d, d_v), the shape condition).
_TABLE_CASES = (
    ("linear_proxy", False, (16, 12, 12), "any"),
    ("linear_qk", True, (6, 12, 12), "any"),
    ("linear_qk", False, (6, 12, 12), "T <= d"),
    ("linear_qk", False, (24, 12, 6), "T > d, d_v < d"),
    ("linear_qk", False, (24, 12, 12), "T > d, d_v >= d"),
    ("softmax", True, (8, 12, 12), "T <= 0.9 min(d, d_v)"),
    ("softmax", True, (16, 12, 12), "T > 0.9 min(d, d_v)"),
    ("softmax", False, (16, 12, 12), "any"),
    ("softmax", True, (32, 384, 32), "8 d^4 bytes > memory_budget / 2"),
    ("softmax", False, (32, 384, 32), "8 d^4 bytes > memory_budget / 2"),
)


def decision_table(method="auto", n_samples=10_000):
    """The decisions of :func:`choose_inversion` on representative shapes, as rows (the docs' decision table).

    Each row runs :func:`choose_inversion` three times on an example shape: with ``n_samples`` samples and the
    default budget (``inversion``), with 4 samples (``with 4 samples``) and with a budget of 1 KiB and one
    multiply-add (``over the budget``). An inversion the method cannot run for a case is left out.

    Parameters
    ----------
    method : {"auto", "first_order", "exact", "least_squares"}, default="auto"
    n_samples : int, default=10000

    Returns
    -------
    list of dict
        Keys ``operator``, ``value_map``, ``shape``, ``example``, ``inversion``, ``reason``,
        ``with 4 samples``, ``over the budget``.

    Examples
    --------
    >>> rows = decision_table()
    >>> rows[2]["shape"], rows[2]["inversion"], rows[2]["with 4 samples"]
    ('T <= d', 'query_key_cross_fit', 'query_key_first_order')
    """
    tiny = CostBudget(memory_bytes=1024, multiply_adds=1)
    rows = []
    for operator, known, shape, condition in _TABLE_CASES:
        try:
            choice = choose_inversion(operator, value_map_known=known, shape=shape, n_samples=n_samples,
                                      method=method)
        except ValueError:
            continue
        outcomes = []
        for n, budget in ((4, None), (n_samples, tiny)):
            try:
                outcomes.append(choose_inversion(operator, value_map_known=known, shape=shape, n_samples=n,
                                                 method=method, budget=budget).name)
            except ValueError:
                outcomes.append("ValueError")
        rows.append({"operator": operator, "value_map": "known" if known else "unknown", "shape": condition,
                     "example": "T={}, d={}, d_v={}".format(*shape), "inversion": choice.name,
                     "reason": choice.reason, "with 4 samples": outcomes[0], "over the budget": outcomes[1]})
    return rows


def decision_table_markdown(methods=("auto", "least_squares")):
    """:func:`decision_table` for each method as a Markdown table."""
    lines = ["| method | operator | V | shape | inversion | with 4 samples | over a 1 KiB budget |",
             "|---|---|---|---|---|---|---|"]
    for method in methods:
        for row in decision_table(method):
            lines.append(f"| `{method}` | `{row['operator']}` | {row['value_map']} | {row['shape']} | "
                         f"`{row['inversion']}` | `{row['with 4 samples']}` | `{row['over the budget']}` |")
    return "\n".join(lines)
