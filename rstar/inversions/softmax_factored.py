"""Factored least-squares inversion of softmax attention at the sizes of real layers (d in the hundreds, T << d).

The full-rank least squares (:mod:`rstar.inversions.softmax_least_squares`)
tests its kernel against draws from the ``d^2 x d^2`` information, out of
reach at d = 385 (175 GB). Here each half of the samples (odd and even global
index, as the least squares keeps them) is fitted with a rank-q kernel
``K = A B^T`` (:func:`rstar.inversions._numerics.softmax_factored.fit_factored_pair`), V known
or fitted, and the statistic is the whitened half-sum
``M_q^{1/2} (K_1 + K_2) / 2 M_k^{1/2}`` in the token metric
(:func:`rstar.inversions._numerics.softmax_factored.token_metric_roots`), tested against the
whitened half-difference ``(K_1 - K_2) / 2`` — one draw of the half-sum's
noise, since the halves share the signal and carry independent noise of one
law (:class:`SplitHalfNull`, :func:`rstar.rules.split_half_result`).

q starts at the calibration's ``factored_start_rank`` (or above the first-order count) and
doubles, from the previous fit, while nearly all of its directions stand above
the null (r* could exceed q), or while its count has not settled after
``factored_unsettled_segments`` segments (a rank-q fit below r* has no stable
optimum), or while, given a tolerance, the halves' stopped fits disagree by
more than the risk curve can resolve it with, or predict each other's samples
worse than their own by more than it (different optima of a rank too small:
``reading_tolerance``), where d, the compute budget and a bound on r*
the model class gives (``rank_bound``: the estimators' ``max_rank``, a head's
``d_head``) allow; the statistic records the q it stopped at.
"""

import numpy as np

from .._backend import NUMPY
from ._numerics import softmax_factored as sf
from ._numerics.linalg import factored_svd
from ._numerics.rotary import rotate
from ..budgets import DEFAULT_BUDGET, largest_count
from ..calibration import DEFAULT_CALIBRATION
from ..risk import centred_sums, total_sum_of_squares
from ._statistic import Finding, SplitHalfNull, WhitenedStatistic, curve_resolution_misses, split_half_counts

__all__ = ["FACTORED_NAME", "factored_fit_blocker", "factored_capacity", "factored_statistic",
           "factored_rank_residuals", "factored_half_disagreement", "factored_output_distances",
           "factored_operator", "truncated_kernel", "first_order_count", "first_order_start_rank"]

#: The name of this inversion (``inversion_``).
FACTORED_NAME = "softmax_factored_least_squares"
def _residual_dof(n, T, d, d_v, q, value_map_known):
    """Residual degrees of freedom of one half's fit: ``n/2 T d_v - 2 d q`` (``- d d_v`` with V fitted)."""
    return (n // 2) * T * d_v - 2 * d * q - (0 if value_map_known else d * d_v)


def _samples_for_dof(T, d, d_v, q, value_map_known, min_dof):
    """The fewest samples (even) whose halves keep ``min_dof`` residual degrees of freedom each
    (:func:`_residual_dof`) for width-q factors."""
    per_half = -(-(min_dof + 2 * d * q + (0 if value_map_known else d * d_v)) // (T * d_v))
    return 2 * int(per_half)


def _segment_cost(n, T, d, d_v, q, value_map_known=True, calibration=DEFAULT_CALIBRATION):
    """Multiply-adds of one segment of L-BFGS iterations on both halves (n samples in all), and, with V fitted,
    the least-squares V each segment starts from."""
    return (calibration.factored_segment_iter * sf.factored_eval_cost(n, T, d, d_v, q, value_map_known,
                                                                     calibration=calibration)
            + (0 if value_map_known else n * T * d * (T + d)))


def _stage_cost(n, T, d, d_v, q, value_map_known, calibration=DEFAULT_CALIBRATION):
    """What a rank-q stage needs before its count can settle: its start and two segments."""
    return (sf.factored_start_cost(n, T, d, d_v, value_map_known)
            + 2 * _segment_cost(n, T, d, d_v, q, value_map_known, calibration))


def _settling_check(split_values, charge, budget, segment_cost, margin, stopping_count, rtol):
    """``(on_check, state)`` for :func:`rstar.inversions._numerics.softmax_factored.fit_factored_pair` where a fit
    only has to settle: at every check ``charge(segment_cost)`` (it adds a segment's multiply-adds to those spent
    and returns the total) and the split-half count of ``split_values(fits) -> (values, null values)``; the run
    stops once a segment leaves the count and the values it counts unchanged within ``rtol``
    (``state["outcome"] = "settled"``), or where another segment would pass the compute budget (``"budget"``)."""
    state = {}

    def on_check(current, n_iter):
        total = charge(segment_cost)
        s, sd = split_values(current)
        count = stopping_count(s, float(sd[0]) if sd[0] > 0 else 0.0, margin)
        previous, state["previous"] = state.get("previous"), (count, s)
        if previous is not None and previous[0][0] == count[0] and np.allclose(
                s[:count[0]], previous[1][:count[0]], rtol=rtol, atol=0.0):
            state["outcome"] = "settled"
            return True
        if not budget.allows_fit_compute(total + segment_cost):
            state["outcome"] = "budget"
            return True
        return False

    return on_check, state


def factored_fit_blocker(n, T, d, d_v, value_map_known=False, budget=DEFAULT_BUDGET, samples_in_memory=True, *,
                         calibration=DEFAULT_CALIBRATION):
    """Why n samples of this shape cannot be fitted by the factored least squares (None if they can): the
    samples kept in memory within the memory budget (not read in passes), the first rank's start and two
    segments of iterations within the compute budget, and the calibration's ``min_noise_dof`` residual degrees of
    freedom per half."""
    q = min(calibration.factored_start_rank, d)
    min_dof = calibration.min_noise_dof
    if not samples_in_memory:
        return "the factored least squares fits the samples in memory, and these are read in passes"
    if _residual_dof(n, T, d, d_v, q, value_map_known) < min_dof:
        return (f"{n} samples leave fewer than {min_dof} residual degrees of freedom per half for rank-{q} "
                f"factors at T={T}, d={d}, d_v={d_v} (at least "
                f"{_samples_for_dof(T, d, d_v, q, value_map_known, min_dof)} samples would)")
    if not budget.allows_samples(n, T, d, d_v):
        return f"keeping the {n} samples exceeds the memory budget ({budget.describe()})"
    if not budget.allows_fit_compute(_stage_cost(n, T, d, d_v, q, value_map_known, calibration)):
        return (f"two segments of {calibration.factored_segment_iter} iterations of the rank-{q} factored fits on "
                f"{n} samples exceed the compute budget ({budget.describe()})")
    return None


def factored_capacity(T, d, d_v, value_map_known=False, budget=DEFAULT_BUDGET, *, calibration=DEFAULT_CALIBRATION):
    """The most samples the factored least squares keeps and fits within the budgets (0 if none)."""
    def fits(n):
        return (budget.allows_samples(n, T, d, d_v)
                and budget.allows_fit_compute(_stage_cost(n, T, d, d_v, min(calibration.factored_start_rank, d),
                                                      value_map_known, calibration)))

    return largest_count(fits, budget.max_samples(T, d, d_v))


def first_order_count(gradients, metric, margin):
    """The split-half count of the halves' gradients of K at ``K = 0`` (the first-order statistic, whitened as a
    gradient, ``M_q^{-1/2} G M_k^{-1/2}``): directions of the half-sum above ``margin`` times the
    half-difference's largest."""
    _, Mq_inv, _, Mk_inv = metric
    G1, G2 = (Mq_inv @ G @ Mk_inv for G in gradients)
    s = np.linalg.svd((G1 + G2) / 2, compute_uv=False)
    sd = np.linalg.svd((G1 - G2) / 2, compute_uv=False)
    return int(np.sum(s > margin * sd[0])) if sd[0] > 0 else 0


def first_order_start_rank(count, *, calibration=DEFAULT_CALIBRATION):
    """A first rank for the factors: the smallest power of two at least ``count + 2`` (``count`` from
    :func:`first_order_count`), and at least the calibration's ``factored_start_rank``."""
    return max(calibration.factored_start_rank, 1 << int(np.ceil(np.log2(count + 2))))


def _split_half_values(halves_factors, metric):
    """The singular values of the whitened half-sum and half-difference from the halves' factors, through thin
    QR factors of the ``d x 2q`` stacks (``O(d q^2)``, not a ``d x d`` SVD at every check): each has rank at most
    2q, so the values beyond are zero; padded to d with zeros."""
    Mq, _, Mk, _ = metric
    (A1, B1), (A2, B2) = halves_factors
    d = A1.shape[0]
    left, right = Mq @ np.hstack([A1, A2]), Mk @ np.hstack([B1, B2])
    Ql, Rl = np.linalg.qr(left)
    Qr, Rr = np.linalg.qr(right)
    q = A1.shape[1]
    out = []
    for sign in (1.0, -1.0):
        core = Rl @ np.diag(np.r_[np.ones(q), sign * np.ones(q)]) @ Rr.T / 2
        s = np.linalg.svd(core, compute_uv=False)
        out.append(np.pad(s, (0, max(0, d - s.size)))[:d])
    return out


def _split_half(K1, K2, metric):
    Mq, _, Mk, _ = metric
    Ssum = Mq @ ((K1 + K2) / 2) @ Mk
    Sdiff = Mq @ ((K1 - K2) / 2) @ Mk
    U, s, Wt = np.linalg.svd(Ssum)
    sd = np.linalg.svd(Sdiff, compute_uv=False)
    return U, s, Wt.T, sd


def factored_statistic(halves, value_map, budget=DEFAULT_BUDGET, max_iter=None,
                       margin=None, start_rank=None, mask=None, *, calibration=DEFAULT_CALIBRATION,
                       stopping_count=split_half_counts, ops=NUMPY, rank_bound=None, reading_tolerance=None):
    """The split-half statistic of the factored least squares.

    Parameters
    ----------
    halves : tuple of two (X, Y)
        The samples with odd and with even global index (internal units).
    value_map : ndarray of shape (d, d_v) or None
    budget : CostBudget
    max_iter : int or None
        L-BFGS iterations of each rank's fit at most (None: the calibration's ``factored_max_iter``, or
        ``factored_max_iter_fitted_v`` with V fitted).
    margin : float or None
        The test's margin (None: the calibration's ``split_half_margin``).
    start_rank : int or None
        The first rank q (None: :func:`first_order_start_rank`, at least the calibration's ``factored_start_rank``).
    mask : ndarray of bool, shape (T, T), or None
        The logits the attention keeps (causal: :func:`rstar.inversions._numerics.softmax_factored.causal_mask`); None keeps all.
    stopping_count : callable, default=split_half_counts
        ``(singular_values, edge, margin) -> (count above the margin, count above the null)``: the split-half
        rule's count, which decides when the fit has settled, when q doubles and what it reports
        (:func:`rstar.rules.split_half.split_half_counts`; the estimators pass it).
    rank_bound : int or None
        A bound on r* the model class gives (the estimators' ``max_rank``; a head's ``d_head``): q never exceeds
        it, and a count that fills it is read there rather than doubled past (r* > q is excluded). None: d.
    reading_tolerance : float or None
        The tolerance ε the risk curve will be read at (the estimators' ``tolerance``): the fit must resolve it,
        as :func:`rstar.rules.identifiability.tolerance_verdicts` judges the curve. Where a rank-q fit has
        stopped but its halves' outputs disagree by more than the calibration's ``curve_resolution_fraction``
        times ε (:func:`factored_half_disagreement`, relative to Var(Y)), or its full models leave more than ε
        more of Var(Y) on the other half's samples than on their own (the curve's floor gap), the halves sit at
        different optima, of a rank too small for the task or of too few samples, so q doubles, where the bound
        and the budget allow, with fits started afresh (a fit extended from the halves' own stays in their
        basins); the wider fits are kept while each half's model predicts the other half's samples better (the
        cross-fitted residual sum of squares falls), and the first doubling that does not is undone. None: q
        doubles only on the count.
    ops : NumpyOps or TorchOps, default=NUMPY
        Where the L-BFGS loss evaluations run (:func:`rstar.inversions._numerics.softmax_factored.half_losses`:
        numpy float64, or torch on its device in its ``fit_dtype``); the statistic, its null and the residuals
        are computed on numpy in float64 either way.
    calibration : Calibration, default=DEFAULT_CALIBRATION
        The tuned values of the fit and its test (:mod:`rstar.calibration`: ``split_half_margin``, the
        ``factored_*`` values, ``min_noise_dof``, ...).

    Returns
    -------
    WhitenedStatistic
        ``units="logit"``: eigenvalues of ``K~ K~^T / d`` for the whitened half-sum ``K~``.
    """
    (X1, Y1), (X2, Y2) = halves
    n = X1.shape[0] + X2.shape[0]
    _, T, d = X1.shape
    d_v = Y1.shape[2]
    known = value_map is not None
    if max_iter is None:
        max_iter = calibration.factored_max_iter if known else calibration.factored_max_iter_fitted_v
    metric = sf.token_metric_roots_of_halves(halves, calibration=calibration)
    margin = calibration.split_half_margin if margin is None else float(margin)
    start_rank_min, min_dof = calibration.factored_start_rank, calibration.min_noise_dof
    spent = float(sf.token_metric_cost(n, T, d)) + sf.factored_start_cost(n, T, d, d_v, known)

    def charge(cost):
        nonlocal spent
        spent += cost
        return spent

    # the first rank: from the split-half count of the gradient of K at K = 0 (the first-order statistic), so
    # that a large r* does not climb through every doubling; at least factored_start_rank, within the budget
    grads, uniform_v = [], []
    for X, Y in halves:
        uniform_v.append(sf.value_map_given_kernel(X, Y, mask=mask, calibration=calibration) if value_map is None
                         else value_map)
        grads.append(sf.kernel_gradient(X, X @ uniform_v[-1], Y, mask=mask, calibration=calibration))
    first_count = first_order_count(grads, metric, margin)
    # the largest q the fit may take: d, or the class's bound on r*
    top = d if rank_bound is None else max(1, min(int(rank_bound), d))
    q = min(first_order_start_rank(first_count, calibration=calibration) if start_rank is None else int(start_rank),
            top)
    while q > start_rank_min and not (budget.allows_fit_compute(spent + 2 * _segment_cost(n, T, d, d_v, q, known,
                                                                                      calibration))
                                      and _residual_dof(n, T, d, d_v, q, known) >= min_dof):
        q //= 2
    q = min(max(q, start_rank_min if start_rank is None else 1), top)

    # L-BFGS and its starts in whitened token coordinates (real tokens are far from isotropic)
    pre = (metric[1], metric[0])
    losses = sf.half_losses(halves, mask, ops, calibration=calibration)
    starts = [sf.gradient_start(X, Y, G, q, V0, mask, pre, active=first_count or None, calibration=calibration,
                                loss=loss)
              for (X, Y), G, V0, loss in zip(halves, grads, uniform_v, losses)]
    # causal windows: the outputs at the first T' positions are the head applied to the first T' tokens alone, so
    # the windows cut to T' tokens are samples of the same head; fitted there first at the starting q (an L-BFGS
    # iteration costs about T / T' less on the projections and (T / T')^2 less on the logits), the full windows'
    # fit starts from their factors (and V), as the rotary fit does
    coarse = []
    for T_c in sf.coarse_lengths(T, mask, calibration=calibration):
        if min(_residual_dof(2 * X.shape[0], T_c, d, d_v, q, known) for X, _ in halves) < min_dof:
            continue
        cut, mask_c = sf.cut_windows(halves, mask, T_c)
        # the full fit's settling rule (the count and its values unchanged over a segment), or the budget
        on_cut_check, stage = _settling_check(
            lambda current: _split_half_values([(f.A, f.B) for f in current], metric), charge, budget,
            _segment_cost(n, T_c, d, d_v, q, known, calibration), margin, stopping_count,
            calibration.factored_stable_rtol)
        fits = sf.fit_factored_pair(cut, q, starts, value_map=value_map, mask=mask_c, max_iter=max_iter,
                                    precondition=pre, on_check=on_cut_check,
                                    check_every=calibration.factored_segment_iter, calibration=calibration,
                                    losses=sf.half_losses(cut, mask_c, ops, calibration=calibration))
        del cut
        coarse.append({"length": int(T_c), "rank": int(q), "iterations": int(fits[0].n_iter),
                       "outcome": stage.get("outcome") or "iterations"})
        starts = [(f.A, f.B, f.value_map) for f in fits]
        if stage.get("outcome") == "budget":
            break
    state = {"capped": False}

    def can_double():
        nxt = min(2 * q, top)
        return (nxt > q and _residual_dof(n, T, d, d_v, nxt, known) >= min_dof
                and budget.allows_fit_compute(spent + _stage_cost(n, T, d, d_v, nxt, known, calibration)))

    def on_check(current, n_iter):
        # every segment: the split-half count; stop to double q, once the count has settled, or at the budget
        nonlocal spent
        spent += _segment_cost(n, T, d, d_v, q, known, calibration)
        s, sd = _split_half_values([(f.A, f.B) for f in current], metric)
        edge = sd[0] if sd[0] > 0 else 0.0
        count = stopping_count(s, edge, margin)
        # at the class's bound a full count is read there: r* cannot exceed it (not capped, nothing to double)
        at_bound = rank_bound is not None and q >= rank_bound
        if count[1] >= q - 1 and not state["capped"] and not at_bound:
            if can_double():
                state["outcome"] = "double"
                return True
            state["capped"] = True
        previous = state.get("previous")
        state["previous"] = (count, s)
        state["count"] = count
        # with V fitted, a count that stands clear of the null (factored_clear_gap either way, nothing in between)
        # through factored_clear_checks checks has settled even while the fit still sharpens what it counts
        gap, rtol = calibration.factored_clear_gap, calibration.factored_stable_rtol
        k = count[0]
        clear = (not known and k == count[1] and (k == 0 or s[k - 1] >= gap * margin * edge)
                 and (s.size <= k or s[k] * gap <= edge))
        state["clear"] = state["clear"] + 1 if clear and previous is not None and previous[0] == count else int(clear)
        if ((previous is not None and previous[0][0] == count[0]
                and np.allclose(s[:count[0]], previous[1][:count[0]], rtol=rtol, atol=0.0))
                or state["clear"] >= calibration.factored_clear_checks):
            state["outcome"] = "settled"
            return True
        state["segments"] += 1
        # a fit that uses all q directions and still reshapes its leading one after factored_unsettled_segments
        # segments is below r*; a fit with directions to spare is waiting out a transient (V fitted on real tokens)
        moving = previous is not None and s[0] > 0 and abs(s[0] - previous[1][0]) > rtol * s[0]
        filled = s.size >= q and s[q - 1] > calibration.factored_fill_ratio * s[0]
        if state["segments"] >= calibration.factored_unsettled_segments and moving and filled and can_double():
            state["outcome"] = "double"
            return True
        if not budget.allows_fit_compute(spent + _segment_cost(n, T, d, d_v, q, known, calibration)):
            state["outcome"] = "budget"
            return True
        return False

    # the halves' disagreement at each q doubled for it, and the fits kept before the last such doubling
    agreement, kept = [], None
    while True:
        state.update(outcome=None, previous=None, count=None, segments=0, clear=0)
        fits = sf.fit_factored_pair(halves, q, starts, value_map=value_map, mask=mask, max_iter=max_iter,
                                    precondition=pre, on_check=on_check, check_every=calibration.factored_segment_iter,
                                    calibration=calibration, losses=losses)
        if (state["outcome"] != "double" and reading_tolerance is not None
                and (kept is not None or state["outcome"] != "budget")):
            # the fit has stopped: do its halves agree as closely as the readings need?
            spent += 6 * sf.factored_eval_cost(n, T, d, d_v, q, known, calibration=calibration)
            disagreement, held_out, in_sample = _halves_agreement([(f.A, f.B) for f in fits], halves, value_map,
                                                                  mask, calibration=calibration)
            agreement.append({"rank": int(q), "disagreement": float(disagreement), "held_out": float(held_out),
                              "in_sample": float(in_sample)})
            unresolved = any(curve_resolution_misses(reading_tolerance, disagreement, held_out - in_sample,
                                                     calibration))
            if kept is not None and held_out >= kept[3]:
                # the wider fit predicts the other half no better: back to the fits before it
                q, fits, state, _ = kept
                agreement[-1]["undone"] = True
            elif unresolved and state["outcome"] != "budget" and can_double():
                kept = (q, fits, dict(state), held_out)
                state["outcome"] = "double"
                # the halves sit in different basins: the wider fit starts afresh (from the gradient of K at
                # K = 0, as the first q did), since one extended from these fits stays in their basins
                q = min(2 * q, top)
                spent += sf.factored_start_cost(n, T, d, d_v, known)
                starts = [sf.gradient_start(X, Y, G, q, V0, mask, pre, active=first_count or None,
                                            calibration=calibration, loss=loss)
                          for (X, Y), G, V0, loss in zip(halves, grads, uniform_v, losses)]
                continue
        if state["outcome"] != "double":
            break
        # nearly every direction stands above the null, the count has not settled in factored_unsettled_segments
        # segments, or the halves do not resolve reading_tolerance: r* may exceed q, so double it from the fits at
        # hand, where d, the residual degrees of freedom and the compute budget (its start and two segments) allow
        q = min(2 * q, top)
        spent += sf.factored_start_cost(n, T, d, d_v, known)
        starts = [(*sf.extended_start(X, Y, f, q, mask, pre, calibration=calibration, loss=loss), f.value_map)
                  for (X, Y), f, loss in zip(halves, fits, losses)]
    iters = fits[0].n_iter
    capped = state["capped"]
    stable = state["outcome"] == "settled" or all(f.converged for f in fits)
    budget_out = state["outcome"] == "budget"
    U, s, W, sd = _split_half(fits[0].kernel, fits[1].kernel, metric)
    edge = sd[0] if sd[0] > 0 else 0.0
    count = stopping_count(s, edge, margin)
    rss = sum(f.rss for f in fits)
    dof = sum(_residual_dof(2 * X.shape[0], T, d, d_v, q, known) for X, _ in halves)
    sigma2 = rss / max(dof, 1)
    # whether the fit settled, and what ran out: facts for rstar.rules.identifiability
    findings = [Finding("factored_fit", {"settled": bool(stable), "iterations": int(iters), "fitted_rank": int(q),
                                         "budget_ran_out": bool(budget_out), "count": count, "capped": bool(capped),
                                         "features": int(d), "coarse_windows": coarse, "agreement": agreement})]
    K = (fits[0].kernel + fits[1].kernel) / 2
    V = value_map if known else (fits[0].value_map + fits[1].value_map) / 2
    lam = s**2 / d
    null = SplitHalfNull(null_eigenvalues=sd**2 / d, margin=margin, noise_variance=float(sigma2),
                         noise_dof=float(dof), fitted_rank=int(q), rank_cap=int(q if capped else d), kernel=K,
                         value_map=V, metric=metric, singular_vectors=(U, s, W),
                         half_kernels=tuple((f.A, f.B) for f in fits))
    ws = WhitenedStatistic(lam, U, metric[1], float(n * d_v), null, FACTORED_NAME, (), [], "logit",
                           findings=findings)
    return ws


def _truncation(metric, A, B, r):
    """Rank-r truncation of ``K = A B^T`` in the token metric, as factors of shape (d, r): the SVD of
    ``M_q^{1/2} A B^T M_k^{1/2}`` through thin QR factors of its two ``d x q`` sides (``O(d q^2)``, not a
    ``d x d`` SVD)."""
    Mq, Mq_inv, Mk, Mk_inv = metric
    U, s, W = factored_svd(Mq @ A, Mk @ B)
    pad = ((0, 0), (0, max(0, min(r, A.shape[0]) - s.size)))   # beyond rank q: zero directions, as a d x d SVD has
    return np.pad(Mq_inv @ (U[:, :r] * s[:r]), pad), np.pad(Mk_inv @ W[:, :r], pad)


def truncated_kernel(ws, r):
    """The rank-r truncation of the whitened half-sum mapped back: ``M_q^{-1/2} U_r S_r W_r^T M_k^{-1/2}``,
    as factors ``(A, B)`` of shape (d, r)."""
    U, s, W = ws.null.singular_vectors
    _, Mq_inv, _, Mk_inv = ws.null.metric
    return Mq_inv @ (U[:, :r] * s[:r]), Mk_inv @ W[:, :r]


class _ProjectedTokens:
    """Tokens' coordinates on a head's directions, computed once for every width r:
    ``X P_q A = (X M_q^{-1/2} U_q)[..., :r] (U_q[:, :r]^T M_q^{1/2} A)`` (and the key side likewise), so a rank-r
    (or width-r rotary) head's query and key coordinates cost ``n T r q`` multiply-adds, not ``n T d q``.

    With ``(U_q, U_k)`` the singular vectors of ``M_q^{1/2} A B^T M_k^{1/2}`` this is the kernel's rank-r
    truncation in the token metric (:func:`_truncation`: ``U_r U_r^T`` on either side keeps the same r
    directions); with a rotary head's family directions, its width-r cut
    (:func:`rstar.inversions._numerics.rotary.projected_head` is the same head as factors)."""

    def __init__(self, X, metric, directions, r_max):
        Mq, Mq_inv, Mk, Mk_inv = metric
        Uq, Uk = (U[:, :max(0, int(r_max))] for U in directions)
        self.metric, self.Uq, self.Uk = metric, Uq, Uk
        self.XUq, self.XUk = X @ (Mq_inv @ Uq), X @ (Mk_inv @ Uk)
        self.d = X.shape[2]

    def sample_rss(self, A, B, r, Z, Y, mask, rotary, calibration):
        """Each sample's residual sum of squares of the head ``(A, B)`` cut to rank (width) r, r at most
        ``r_max``, shape (n,): :func:`rstar.inversions._numerics.softmax_factored.factored_sample_rss` of the cut
        head (``rotary`` None: no rotation)."""
        Mq, _, Mk, _ = self.metric
        r = max(0, int(r))
        Cq, Ck = self.Uq[:, :r].T @ (Mq @ A), self.Uk[:, :r].T @ (Mk @ B)
        if rotary is None:
            # no rotation between the sides: the logits need only the r x r core, on r coordinates a side
            Cq, Ck = Cq @ Ck.T, None
        n, T, _ = self.XUq.shape
        out = np.empty(n)
        for part in sf._chunks(n, T, self.d, calibration):
            if rotary is None:
                XA, XB = self.XUq[part, :, :r] @ Cq, self.XUk[part, :, :r]
            else:
                XA, XB = rotate(self.XUq[part, :, :r] @ Cq, rotary), rotate(self.XUk[part, :, :r] @ Ck, rotary)
            R = sf.attention_from_coordinates(XA, XB, mask, self.d) @ Z[part] - Y[part]
            out[part] = np.einsum("ntv,ntv->n", R, R)
        return out


def _top_width(ranks, full):
    """The largest of ``ranks`` (None: ``full``), at most ``full``: the directions the projected tokens need."""
    return max([full if r is None else min(int(r), full) for r in ranks] + [0])


def factored_rank_residuals(ws, halves, value_map, ranks, mask=None, per_sample=False, *,
                            calibration=DEFAULT_CALIBRATION):
    """Cross-fitted residual sums of squares of the rank-r models for r in ``ranks`` (None: the fitted kernels
    themselves): each half's kernel, truncated to rank r in the token metric (V known, or refitted on that
    half given the truncation's attention), is measured on the *other* half, and the two sums are added.

    Out of sample, so a rank read off the curve does not take the fit's optimism for accuracy (in sample, a
    real head's rank at 5% read 17 where the held-out excess was 5.04%); each model is fitted on half the
    samples, so the curve errs towards larger ranks.

    Parameters
    ----------
    ws : WhitenedStatistic
        From :func:`factored_statistic`.
    halves : tuple of two (X, Y)
        The samples the halves were fitted on, in the same order.
    value_map : ndarray or None
    ranks : list of int or None
    per_sample : bool, default=False
        Each sample's residual sum of squares (an array of shape (n,) per rank: the second half's samples under
        the first half's model, then the first half's under the second's) instead of their total.
    """
    metric = ws.null.metric
    known = value_map is not None
    # with V known, the other half's value path and its tokens on each half's singular directions: once for every r
    paths = [Xo @ value_map if known else None for Xo, _ in halves[::-1]]
    projected = [None, None]
    if known:
        Mq, _, Mk, _ = metric
        q = ws.null.half_kernels[0][0].shape[1]
        projected = [_ProjectedTokens(Xo, metric, factored_svd(Mq @ A_h, Mk @ B_h)[::2], _top_width(ranks, q))
                     for (A_h, B_h), (Xo, _) in zip(ws.null.half_kernels, halves[::-1])]
    out = []
    for r in ranks:
        parts = []
        for (A_h, B_h), (Xf, Yf), (Xo, Yo), proj, Zo in zip(ws.null.half_kernels, halves, halves[::-1], projected,
                                                             paths):
            if known and r is not None:
                parts.append(proj.sample_rss(A_h, B_h, r, Zo, Yo, mask, None, calibration))
                continue
            A, B = (A_h, B_h) if r is None else _truncation(metric, A_h, B_h, r)
            if not known:
                Zo = Xo @ sf.value_map_given_kernel(Xf, Yf, A, B, mask, calibration=calibration)
            parts.append(sf.factored_sample_rss(Xo, Zo, Yo, A, B, mask, calibration=calibration))
        out.append(np.concatenate(parts) if per_sample else float(sum(np.sum(p) for p in parts)))
    return out


def factored_half_disagreement(ws, halves, value_map, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """How far the two halves' full fits disagree: ``sum_i ||f_1(X_i) - f_2(X_i)||^2 / (4 TSS)`` over every sample
    (both halves), TSS the total sum of squares of Y about each half's mean.

    To first order in the fits' errors (independent, of one law) this is the excess risk of a half's model over
    the half-sum's, relative to Var(Y): the resolution of the cross-fitted curve (:func:`factored_rank_residuals`),
    measured on half models. On settled MiniLM heads it was 1e-6 to 1e-5; on layer 3 head 8, which settled at q = 8
    with a count of 3, 0.026 — and the rank the curve read at 1% (8) held out 1.46% over the half-sum model.
    V unknown: each half's V given its kernel, as the curve refits it.
    """
    return _halves_agreement(ws.null.half_kernels, halves, value_map, mask, calibration=calibration)[0]


def _halves_agreement(half_kernels, halves, value_map, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """``(disagreement, held_out, in_sample)`` of the halves' factors ``((A_1, B_1), (A_2, B_2))``, each relative
    to the total sum of squares: :func:`factored_half_disagreement`, the cross-fitted residual sum of squares
    (each half's model on the other half's samples: the floor the cross-fitted curve subtracts) and the same
    models' on their own halves."""
    models = sf.half_models(half_kernels, halves, value_map, mask, calibration=calibration)
    dis, held_out, in_sample, tss = 0.0, 0.0, 0.0, 0.0
    (A1, B1, V1), (A2, B2, V2) = models
    for (X, Y), own, other in zip(halves, models, models[::-1]):
        dis += float(np.sum(sf.factored_sample_disagreement(X, (X @ V1, A1, B1), (X @ V2, A2, B2), mask,
                                                            calibration=calibration)))
        held_out += sf.factored_rss(X, X @ other[2], Y, other[0], other[1], mask, calibration=calibration)
        in_sample += sf.factored_rss(X, X @ own[2], Y, own[0], own[1], mask, calibration=calibration)
        tss += total_sum_of_squares(centred_sums(X, Y))
    return (dis / (4.0 * tss), held_out / tss, in_sample / tss) if tss > 0 else (0.0, 0.0, 0.0)


def factored_output_distances(ws, samples, value_map, ranks, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """Each sample's squared distance between the outputs of the half-sum's rank-r truncation and of its full
    kernel, ``||P_i(K_r) X_i V_r - P_i(K) X_i V||^2``, for r in ``ranks``: the models ``predict`` uses (V known, or
    refitted on ``samples`` given each kernel's attention, as :func:`factored_operator`), on ``samples``.

    The cross-fitted curve (:func:`factored_rank_residuals`) measures the halves' own truncations, whose excess
    can fall well short of the half-sum's: where the halves fitted different directions (a fit below r*, or
    unsettled), the half-sum has up to 2q of them and its truncation at q loses what a half's does not (MiniLM's
    layer 1 head 1, q = 16: the half curve is 0 at rank 16, the half-sum's rank-16 model held out 22% above its
    full one). Where the full model reproduces Y, as on a noise-free head, this distance is its excess; with
    noise it overstates it (the full model's fitted noise counts as lost). It involves no Y, so it is measured
    on the samples fitted without their optimism.

    Parameters
    ----------
    samples : tuple (X, Y), or a sequence of them
        The samples, or their parts (the halves), read part by part (no joined copy); V is refitted on all.

    Returns
    -------
    list of ndarray of shape (n,)
        The parts' samples in order.
    """
    parts = sf.sample_parts(samples)
    top = len(ws.null.singular_vectors[1])
    A, B, V = _truncated_model(ws, parts, value_map, top, mask, calibration)
    # V refitted at each rank: the truncated factors are needed for it (small: d x r each)
    models = None if value_map is not None else [_truncated_model(ws, parts, value_map, min(top, r), mask,
                                                                  calibration) for r in ranks]
    U, _, W = ws.null.singular_vectors

    def measure(X):
        Z = X @ V
        # each rank's model measured against the full model's outputs (computed once a part)
        full = sf.factored_outputs(X, Z, A, B, mask, calibration=calibration)
        if models is not None:
            return [sf.factored_sample_rss(X, X @ Vr, full, Ar, Br, mask, calibration=calibration)
                    for Ar, Br, Vr in models]
        # V known: the truncations on the tokens projected on the half-sum's directions
        proj = _ProjectedTokens(X, ws.null.metric, (U, W), _top_width(ranks, top))
        return [proj.sample_rss(A, B, min(int(r), top), Z, full, mask, None, calibration) for r in ranks]

    return sf.over_parts(parts, measure)


def _truncated_model(ws, samples, value_map, rank, mask=None, calibration=DEFAULT_CALIBRATION):
    """``(A, B, V)`` of the rank-``rank`` truncation, V known or re-fitted on ``samples`` (a pair ``(X, Y)`` or
    its parts) given its attention."""
    A, B = truncated_kernel(ws, rank)
    V = value_map if value_map is not None else sf.value_map_of_parts(samples, A, B, mask, calibration=calibration)
    return A, B, V


def factored_operator(ws, samples, value_map, rank, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """``(K, V)`` of the rank-``rank`` truncation, V known or re-fitted on ``samples`` (a pair ``(X, Y)`` or its
    parts; for ``predict``)."""
    A, B, V = _truncated_model(ws, samples, value_map, rank, mask, calibration)
    return A @ B.T, V
