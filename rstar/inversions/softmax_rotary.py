"""Least-squares inversion of rotary softmax attention (Llama-family heads).

A rotary head (theory §2, "Rotary positions") turns its projected queries and keys by position before the logits,
``logit_ts = x_t^T A R(phi_s - phi_t) B^T x_s`` with ``A = W_Q``, ``B = W_K`` (d x 2P) and ``R`` the block rotation
of its P planes (:mod:`rstar.inversions._numerics.rotary`). Its **width** here is the rank of its query and key
projections with the rotation kept at every plane: a width-r head is ``A' = P_q A``, ``B' = P_k B`` with rank-r
projections of the tokens on each side (how low-rank query/key compression of RoPE models works: Palu and
SVD-LLM reconstruct the keys before the rotation), so r* <= 2P = d_head. The logits at each pair are
``K(delta) = A R(delta) B^T``, and the width a head needs is the rank of that family on each side: the statistic is
the family side by side, ``Z_q = [sqrt(w_delta) K(delta)]`` over the pairs' angle differences (each with its share
w of the kept pairs) and ``Z_k`` likewise with ``K(delta)^T``, in the token metric, so every dimension is measured
by its effect on the logits over the window. Planes whose frequencies the window cannot tell apart (low
frequencies over a short window) need no special treatment: the family sees only their sum.

Each half of the samples (odd and even global index) is fitted with a full rotary head (A, B of shape (d, 2P), the
given angles) by :func:`rstar.inversions._numerics.softmax_factored.fit_factored_pair` on the rotary losses, V known
or fitted, from independent random starts (so a direction the data do not single out is not planted alike in both
halves). The whitened half-sum of the families is tested against their half-difference, the noise of the half-sum
(:class:`SplitHalfNull`): a dimension counts where its singular value, on the side that has more, stands above the
half-difference's largest (either side) by the split-half margin. A head truncated to width r projects its query
and key factors on the top r directions of its own family (each half's own, for the cross-fitted risk curve; the
half-sum's, for ``predict``).

Two metrics. The fits (their preconditioner and start) and the split-half test use the tokens' metric with the keys
centred within the window, as the unrotated softmax fits do. The heads cut to width r (the risk curve, ``predict``)
are cut with the keys uncentred: a key component constant within the window moves no attention weight in an
unrotated head, but the rotation turns it by the key's position (a relative-position pattern), so a cut that
weighs it at nothing drops it (on SmolLM2's layer 8 head 0 the fit's width-34 cut stood at 10 % of Var(Y) where the
head's own needs 1 %). The test does not use that metric: in the planes the window barely turns the same component
is barely identified, and with it weighed in full the halves' disagreement along it (on layer 2 head 2, 6 to 8 times the
next direction's) raised the split-half noise for every direction, and planted widths on SmolLM2's inputs went
unsettled. The count therefore does not see a direction constant within the window on both sides (a pure
position pattern); the risk curve does, and a tolerance reading beyond the count is warned with its interval.
"""

import numpy as np

from ._numerics import softmax_factored as sf
from ._numerics.log_attention import (first_position_gives_value_map, first_position_value_map,
                                      log_attention_half_losses)
from ._numerics.rotary import (RotaryPositions, family_svd, pair_rotations, projected_head, rotary_directions,
                              truncated_rotary_head)
from .._backend import NUMPY
from ..budgets import DEFAULT_BUDGET
from ..calibration import DEFAULT_CALIBRATION
from ..risk import centred_sums, total_sum_of_squares
from .softmax_exact import exact_softmax_well_conditioned
from ._statistic import Finding, SplitHalfNull, WhitenedStatistic, split_half_counts
from .softmax_factored import (_ProjectedTokens, _residual_dof, _segment_cost, _samples_for_dof, _settling_check,
                               _top_width)

__all__ = ["ROTARY_NAME", "ROTARY_LOG_NAME", "ROTARY_NAMES", "rotary_inversion_name", "coarse_stages",
           "rotary_fit_blocker", "rotary_statistic", "rotary_rank_residuals", "rotary_half_disagreement",
           "rotary_output_distances", "rotary_operator", "RotarySoftmaxOperator"]

#: The name of this inversion (``inversion_``), fitted on the outputs.
ROTARY_NAME = "softmax_rotary_least_squares"
#: The same fitted on the log-attention read back from the outputs (V known, T well below d_v).
ROTARY_LOG_NAME = "softmax_rotary_log_attention"
ROTARY_NAMES = (ROTARY_NAME, ROTARY_LOG_NAME)


def rotary_inversion_name(T, d, d_v, value_map_known, *, calibration=DEFAULT_CALIBRATION):
    """``(name, reason)``: the log-attention fit where V is known and ``X_i V`` is well conditioned
    (``T <= ill_conditioned_aspect * min(d, d_v)``, as the exact inversion asks), else the output least squares."""
    if not value_map_known:
        return ROTARY_NAME, "the value map is not known: it is fitted with the head on the outputs"
    if not exact_softmax_well_conditioned(T, d, d_v, calibration=calibration):
        return ROTARY_NAME, (f"T={T} tokens is more than {calibration.ill_conditioned_aspect} x min(d, d_v)="
                             f"{min(d, d_v)}, so X_i V does not give the attention back")
    return ROTARY_LOG_NAME, (f"the value map is known and T={T} <= {calibration.ill_conditioned_aspect} x "
                             f"min(d, d_v): the attention is read back as S_i = Y_i (X_i V)^+ and the head fitted "
                             "on log S, every logit counted by how well it is known, then refined on the outputs")


def coarse_stages(T, d, d_v, value_map_known, mask, n_half=None, *, calibration=DEFAULT_CALIBRATION):
    """The stages a rotary fit of T tokens on its outputs starts with, shortest first, each with the loss it is
    fitted on: ``[(T', "log_attention" or "outputs"), ...]``.

    The cut windows are :func:`rstar.inversions._numerics.softmax_factored.coarse_lengths` (causal windows only);
    a window of T' tokens is fitted on its log-attention where ``X_i V`` gives the attention back
    (``T' <= ill_conditioned_aspect x min(d, d_v)``) and V is known, or, with V fitted, readable from the first
    position (:func:`rstar.inversions._numerics.log_attention.first_position_gives_value_map` with ``n_half``
    samples a half; None: not), else on its outputs. With V fitted the full windows themselves are such a stage
    where they are short enough (then fitted on their outputs with V). Empty where the full windows are fitted on
    the log-attention themselves (V known).

    Examples
    --------
    >>> from rstar.inversions._numerics.softmax_factored import causal_mask
    >>> coarse_stages(512, 576, 64, True, causal_mask(512))
    [(32, 'log_attention'), (128, 'outputs')]
    >>> coarse_stages(128, 576, 64, False, causal_mask(128))
    [(32, 'outputs')]
    >>> coarse_stages(128, 576, 64, False, causal_mask(128), n_half=1000)
    [(32, 'log_attention')]
    >>> coarse_stages(32, 576, 64, False, causal_mask(32), n_half=1000)
    [(32, 'log_attention')]
    >>> coarse_stages(32, 576, 32, True, causal_mask(32))
    [(28, 'log_attention')]
    """
    if rotary_inversion_name(T, d, d_v, value_map_known, calibration=calibration)[0] == ROTARY_LOG_NAME:
        return []
    value_map_read = value_map_known or (n_half is not None and first_position_gives_value_map(
        n_half, d, mask, calibration=calibration))

    def loss(T_c):
        return ("log_attention" if value_map_read and exact_softmax_well_conditioned(T_c, d, d_v,
                                                                                      calibration=calibration)
                else "outputs")

    stages = [(T_c, loss(T_c)) for T_c in sf.coarse_lengths(T, mask, calibration=calibration)]
    if loss(T) == "log_attention":
        return stages + [(T, "log_attention")]
    # no cut on the log-attention (windows too short for cuts, or cuts too long for it): the longest window it
    # reads, where no shorter than the first cut would be (T / coarse_window_ratio)
    T_log = int(np.floor(calibration.ill_conditioned_aspect * min(d, d_v)))
    if (value_map_read and all(loss_c == "outputs" for _, loss_c in stages)
            and T // calibration.coarse_window_ratio <= T_log < T and sf.closed_prefix(mask, T_log)):
        stages = [(T_log, "log_attention")] + [(T_c, loss_c) for T_c, loss_c in stages if T_c > T_log]
    return stages


def rotary_fit_blocker(n, T, d, d_v, rotary, value_map_known=False, budget=DEFAULT_BUDGET, samples_in_memory=True,
                       *, calibration=DEFAULT_CALIBRATION):
    """Why n samples cannot be fitted by the rotary least squares (None if they can): the positions must be the
    windows' (T of them), the samples kept in memory, two segments of iterations at the full width within the
    compute budget, and the calibration's ``min_noise_dof`` residual degrees of freedom per half."""
    if rotary.length != T:
        return (f"the rotary positions cover {rotary.length} positions and the windows have T={T} tokens: give the "
                "angles of the windows' own positions")
    q = rotary.width
    if not samples_in_memory:
        return "the rotary least squares fits the samples in memory, and these are read in passes"
    if _residual_dof(n, T, d, d_v, q, value_map_known) < calibration.min_noise_dof:
        return (f"{n} samples leave fewer than {calibration.min_noise_dof} residual degrees of freedom per half for "
                f"a rotary head of width {q} at T={T}, d={d}, d_v={d_v} (at least "
                f"{_samples_for_dof(T, d, d_v, q, value_map_known, calibration.min_noise_dof)} samples would)")
    if not budget.allows_samples(n, T, d, d_v):
        return f"keeping the {n} samples exceeds the memory budget ({budget.describe()})"
    cost = sf.factored_start_cost(n, T, d, d_v, value_map_known) + 2 * _segment_cost(n, T, d, d_v, q,
                                                                                      value_map_known, calibration)
    if not budget.allows_fit_compute(cost):
        return (f"two segments of {calibration.factored_segment_iter} iterations of the width-{q} rotary fits on "
                f"{n} samples exceed the compute budget ({budget.describe()})")
    return None


# -- the logit family of a fit ---------------------------------------------------------------------------------


def _family_svd(metric, heads, weights, pairs, side):
    """:func:`family_svd` of heads given as raw factors, in the token metric."""
    return family_svd([(metric[0] @ A, metric[2] @ B) for A, B in heads], weights, pairs, side)


def family_split_half(metric, halves_factors, pairs, width):
    """``(s, sd, U_q, U_k)``: the half-sum's singular values on the side with more at each rank (the first
    ``width``), the half-difference's likewise, and the half-sum's directions on each side."""
    out = {}
    for side in ("q", "k"):
        U, sv = _family_svd(metric, halves_factors, [0.5, 0.5], pairs, side)
        _, dv = _family_svd(metric, halves_factors, [0.5, -0.5], pairs, side)
        out[side] = (U, np.pad(sv, (0, max(0, width - sv.size)))[:width],
                     np.pad(dv, (0, max(0, width - dv.size)))[:width])
    s = np.maximum(out["q"][1], out["k"][1])
    sd = np.maximum(out["q"][2], out["k"][2])
    return s, sd, out["q"][0], out["k"][0]


def _stacked(halves_factors, rotary):
    """The half-sum as one rotary head with every plane twice (each half's, scaled by 1/sqrt(2)):
    ``(A, B, rotary)``."""
    (A1, B1), (A2, B2) = halves_factors
    P = A1.shape[1] // 2

    def stack(F1, F2):
        return np.hstack([F1[:, :P], F2[:, :P], F1[:, P:], F2[:, P:]]) / np.sqrt(2.0)

    return stack(A1, A2), stack(B1, B2), RotaryPositions(np.hstack([rotary.angles, rotary.angles]))


def _half_sum_model(ws, r):
    """The half-sum truncated to width r: ``(A, B, rotary)``, its stacked factors projected on the top r
    directions of the half-sum's family."""
    null = ws.null
    A, B, rot = _stacked(null.half_kernels, null.rotary)
    Uq, Uk = null.singular_vectors
    A, B = projected_head(null.metric, A, B, Uq, Uk, r)
    return A, B, rot


# -- the statistic ---------------------------------------------------------------------------------------------


def _random_start(rng, metric, q, scale):
    """Factors ``M_q^{-1/2} G scale / sqrt(d)`` and ``M_k^{-1/2} G' scale / sqrt(d)`` with Gaussian G, G'."""
    d = metric[0].shape[0]
    return (metric[1] @ rng.standard_normal((d, q)) * (scale / np.sqrt(d)),
            metric[3] @ rng.standard_normal((d, q)) * (scale / np.sqrt(d)))


def rotary_statistic(halves, value_map, rotary, budget=DEFAULT_BUDGET, max_iter=None, margin=None, mask=None, *,
                     calibration=DEFAULT_CALIBRATION, stopping_count=split_half_counts, ops=NUMPY, seed=0):
    """The split-half statistic of the rotary least squares: the halves' logit families, half-sum against
    half-difference.

    Each half is fitted on the log-attention read back from its outputs where :func:`rotary_inversion_name` says
    so (V known, T well below d_v; :mod:`rstar.inversions._numerics.log_attention`) and then refined on the
    outputs from there, else on the outputs from a random start; the statistic is named after the path that ran.

    Parameters
    ----------
    halves : tuple of two (X, Y)
        The samples with odd and with even global index (internal units).
    value_map : ndarray of shape (d, d_v) or None
    rotary : RotaryPositions
        The angles of the head's planes at the windows' positions (T of them).
    budget : CostBudget
    max_iter : int or None
        L-BFGS iterations at most (None: the calibration's ``log_attention_max_iter`` for the log-attention fit,
        else ``factored_max_iter``, or ``factored_max_iter_fitted_v`` with V fitted).
    margin : float or None
        The test's margin (None: the calibration's ``split_half_margin``).
    mask : ndarray of bool, shape (T, T), or None
        The logits kept (causal); None keeps all.
    stopping_count : callable, default=split_half_counts
        The split-half rule's count, which decides when the fit has settled.
    ops : NumpyOps or TorchOps, default=NUMPY
        Where the loss evaluations run.
    seed : int
        Seeds the halves' random starts.

    Returns
    -------
    WhitenedStatistic
        ``units="logit"``: ``2P`` eigenvalues (``s^2 / d`` of the family's singular values, the side with more at each
        rank) and the split-half null.
    """
    (X1, Y1), (X2, Y2) = halves
    n = X1.shape[0] + X2.shape[0]
    _, T, d = X1.shape
    d_v = Y1.shape[2]
    known = value_map is not None
    q = rotary.width
    name, _ = rotary_inversion_name(T, d, d_v, known, calibration=calibration)
    given_max_iter = max_iter
    if max_iter is None:
        max_iter = (calibration.log_attention_max_iter if name == ROTARY_LOG_NAME else
                    calibration.factored_max_iter if known else calibration.factored_max_iter_fitted_v)
    # the fit and its split-half test in the tokens' metric with the keys centred within the window; the heads cut
    # to width r (the risk curve, predict) with the keys uncentred (see the module's notes)
    metric = sf.token_metric_roots_of_halves(halves, calibration=calibration)
    cut_metric = sf.uncentred_key_roots(metric)
    margin = calibration.split_half_margin if margin is None else float(margin)
    spent = float(sf.token_metric_cost(n, T, d)) + sf.factored_start_cost(n, T, d, d_v, known)
    pre = (metric[1], metric[0])
    pairs = pair_rotations(rotary, mask)
    rng = np.random.default_rng(seed)
    starts = []
    for X, Y in halves:
        V0 = sf.value_map_given_kernel(X, Y, mask=mask, calibration=calibration) if value_map is None else value_map
        # small logits: the fit grows the directions the data hold (a saddle at zero has no gradient)
        A0, B0 = _random_start(rng, metric, q, 1.0)
        Xs = X[: min(X.shape[0], 256)]
        std = float(np.std(Xs @ A0 @ (Xs @ B0).transpose(0, 2, 1) / np.sqrt(d))) or 1.0
        t = np.sqrt(calibration.rotary_start_logit_std / std)
        starts.append((A0 * t, B0 * t, V0))

    def charge(cost):
        nonlocal spent
        spent += cost
        return spent

    def check(pairs_level, T_level):
        # every segment: the split-half count of the family over the level's pairs; stop once it has settled, or
        # at the budget (the segment's cost at the level's window length)
        return _settling_check(lambda current: family_split_half(metric, [(f.A, f.B) for f in current],
                                                                 pairs_level, q)[:2],
                               charge, budget, _segment_cost(n, T_level, d, d_v, q, known, calibration), margin,
                               stopping_count, calibration.factored_stable_rtol)

    # causal windows: the outputs at the first T' positions are the head applied to the first T' tokens alone, so
    # the windows cut to T' tokens are samples of the same head; fitted there first (each L-BFGS iteration
    # (T / T')^2 times cheaper on the logits), the full windows' fit starts from their factors (and V). A cut short
    # enough for the log-attention (V known, T' well below d_v) is fitted on it, as a head of T' tokens would be: on
    # real heads the output least squares from a random start settles on fits that miss held-out windows
    coarse = []
    if name != ROTARY_LOG_NAME:
        stages = coarse_stages(T, d, d_v, known, mask, min(X1.shape[0], X2.shape[0]), calibration=calibration)
        # with V fitted, the log-attention is read with each half's value map from its first position (y_0 = x_0 V)
        read_with = (value_map if known or all(loss_c == "outputs" for _, loss_c in stages) else
                     tuple(first_position_value_map(X, Y, calibration=calibration) for X, Y in halves))
        for T_c, loss_c in stages:
            if min(_residual_dof(2 * X.shape[0], T_c, d, d_v, q, known) for X, _ in halves) < calibration.min_noise_dof:
                continue
            cut, mask_c = sf.cut_windows(halves, mask, T_c)
            rot_c = RotaryPositions(rotary.angles[:T_c])
            on_check, state = check(pair_rotations(rot_c, mask_c), T_c)
            if loss_c == "log_attention":
                losses_c = log_attention_half_losses(cut, read_with, mask_c, ops, calibration=calibration,
                                                     rotary=rot_c)
                iters_c = calibration.log_attention_max_iter if given_max_iter is None else max_iter
            else:
                losses_c = sf.half_losses(cut, mask_c, ops, calibration=calibration, rotary=rot_c)
                iters_c = max_iter
            fits = sf.fit_factored_pair(cut, q, starts, value_map=read_with if loss_c == "log_attention" else value_map,
                                        mask=mask_c, max_iter=iters_c, precondition=pre, on_check=on_check,
                                        check_every=calibration.factored_segment_iter, calibration=calibration,
                                        losses=losses_c, rotary=rot_c)
            del cut, losses_c
            coarse.append({"length": int(T_c), "loss": loss_c, "iterations": int(fits[0].n_iter),
                           "outcome": state.get("outcome") or "iterations"})
            # V fitted after the log-attention: the next fit starts from V's least squares given these factors
            starts = [(f.A, f.B) if loss_c == "log_attention" and not known else (f.A, f.B, f.value_map)
                      for f in fits]
            if state.get("outcome") == "budget":
                break
    # the full windows' losses made after the coarse ones are gone (each holds its samples on the device)
    if name == ROTARY_LOG_NAME:
        # the targets and weights read once on numpy; the loss evaluated where the output loss would be
        losses = log_attention_half_losses(halves, value_map, mask, ops, calibration=calibration, rotary=rotary)
    else:
        losses = sf.half_losses(halves, mask, ops, calibration=calibration, rotary=rotary)
    on_check, state = check(pairs, T)
    fits = sf.fit_factored_pair(halves, q, starts, value_map=value_map, mask=mask, max_iter=max_iter,
                                precondition=pre, on_check=on_check, check_every=calibration.factored_segment_iter,
                                calibration=calibration, losses=losses, rotary=rotary)
    first_iterations = int(fits[0].n_iter)
    if name == ROTARY_LOG_NAME and state.get("outcome") != "budget":
        # refined on the outputs from there: the log-attention fit finds the basin (the output least squares from a
        # random start settles on fits that reproduce their own windows and miss others), the output least squares
        # is the estimator under output noise (log S of noisy outputs is biased: on a planted width-4 head with 5 %
        # noise the log-attention fit alone failed the model check at n = 2000, refined it read 4 (4, 4))
        on_check, state = check(pairs, T)
        fits = sf.fit_factored_pair(halves, q, [(f.A, f.B) for f in fits], value_map=value_map, mask=mask,
                                    max_iter=calibration.factored_max_iter, precondition=pre, on_check=on_check,
                                    check_every=calibration.factored_segment_iter, calibration=calibration,
                                    losses=sf.half_losses(halves, mask, ops, calibration=calibration, rotary=rotary),
                                    rotary=rotary)
    stable = state.get("outcome") == "settled" or all(f.converged for f in fits)
    halves_factors = tuple((f.A, f.B) for f in fits)
    s, sd, Uq, Uk = family_split_half(metric, halves_factors, pairs, q)
    # predict's directions: the half-sum's family in the metric of the cuts
    _, _, Uq_cut, Uk_cut = family_split_half(cut_metric, halves_factors, pairs, q)
    lam = s**2 / d
    count = stopping_count(s, float(sd[0]), margin)
    rss = sum(f.rss for f in fits)
    dof = sum(_residual_dof(2 * X.shape[0], T, d, d_v, q, known) for X, _ in halves)
    sigma2 = rss / max(dof, 1)
    iterations = ({"log_attention_iterations": first_iterations, "log_attention_backend": ops.name}
                  if name == ROTARY_LOG_NAME else {"coarse_windows": coarse})
    findings = [Finding("factored_fit", {**iterations, "settled": bool(stable), "iterations": int(fits[0].n_iter),
                                         "fitted_rank": int(q), "budget_ran_out": state.get("outcome") == "budget",
                                         "count": count, "capped": False, "features": int(d)})]
    V = value_map if known else (fits[0].value_map + fits[1].value_map) / 2
    null = SplitHalfNull(null_eigenvalues=sd**2 / d, margin=margin, noise_variance=float(sigma2),
                         noise_dof=float(dof), fitted_rank=int(q), rank_cap=int(max(d, q + 1)), kernel=None,
                         value_map=V, metric=cut_metric, singular_vectors=(Uq_cut, Uk_cut),
                         half_kernels=halves_factors, rotary=rotary)
    return WhitenedStatistic(lam, Uq[:, :q], metric[1], float(n * d_v), null, name, (), [], "logit",
                             findings=findings)


# -- the risk curve, its resolution and the operator -----------------------------------------------------------


def rotary_rank_residuals(ws, halves, value_map, ranks, mask=None, per_sample=False, *,
                          calibration=DEFAULT_CALIBRATION):
    """Cross-fitted residual sums of squares of each half's head truncated to width r (its factors projected on
    the top r directions of its own logit family on each side; r None: the full head), V known or refitted on that
    half, measured on the other half
    (:func:`rstar.inversions.softmax_factored.factored_rank_residuals` for rotary heads)."""
    null = ws.null
    rot = null.rotary
    pairs = pair_rotations(rot, mask)
    directions = [rotary_directions(null.metric, pairs, A_h, B_h) for A_h, B_h in null.half_kernels]
    known = value_map is not None
    # with V known, the other half's value path and its tokens on each half's directions: once for every r
    paths = [Xo @ value_map if known else None for Xo, _ in halves[::-1]]
    projected = ([_ProjectedTokens(Xo, null.metric, dirs, _top_width(ranks, rot.width))
                  for (Xo, _), dirs in zip(halves[::-1], directions)] if known else [None, None])
    out = []
    for r in ranks:
        parts = []
        for (A_h, B_h), (Xf, Yf), (Xo, Yo), dirs, proj, Zo in zip(null.half_kernels, halves, halves[::-1],
                                                                   directions, projected, paths):
            if known and r is not None:
                parts.append(proj.sample_rss(A_h, B_h, min(int(r), rot.width), Zo, Yo, mask, rot, calibration))
                continue
            # the full head, or V refitted on this half for the cut factors
            A, B = (A_h, B_h) if r is None else truncated_rotary_head(null.metric, pairs, A_h, B_h, r, dirs)
            if not known:
                Zo = Xo @ sf.value_map_given_kernel(Xf, Yf, A, B, mask, calibration=calibration, rotary=rot)
            parts.append(sf.factored_sample_rss(Xo, Zo, Yo, A, B, mask, calibration=calibration, rotary=rot))
        out.append(np.concatenate(parts) if per_sample else float(sum(np.sum(p) for p in parts)))
    return out


def rotary_half_disagreement(ws, halves, value_map, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """How far the two halves' full rotary fits disagree, relative to Var(Y)
    (:func:`rstar.inversions.softmax_factored.factored_half_disagreement`'s measure)."""
    rotary = ws.null.rotary
    models = sf.half_models(ws.null.half_kernels, halves, value_map, mask, calibration=calibration, rotary=rotary)
    dis, tss = 0.0, 0.0
    (A1, B1, V1), (A2, B2, V2) = models
    for X, Y in halves:
        dis += float(np.sum(sf.factored_sample_disagreement(X, (X @ V1, A1, B1), (X @ V2, A2, B2), mask,
                                                            calibration=calibration, rotary=rotary)))
        tss += total_sum_of_squares(centred_sums(X, Y))
    return dis / (4.0 * tss) if tss > 0 else 0.0


def _truncated_model(ws, samples, value_map, r, mask, calibration):
    A, B, rot = _half_sum_model(ws, r)
    V = (value_map if value_map is not None
         else sf.value_map_of_parts(samples, A, B, mask, calibration=calibration, rotary=rot))
    return A, B, V, rot


def rotary_output_distances(ws, samples, value_map, ranks, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """Each sample's squared distance between the outputs of the half-sum truncated to width r and of the whole
    half-sum (:func:`rstar.inversions.softmax_factored.factored_output_distances`, plane by plane; ``samples``
    a pair ``(X, Y)`` or its parts, read part by part)."""
    parts = sf.sample_parts(samples)
    top = ws.null.rotary.width
    A, B, V, rot = _truncated_model(ws, parts, value_map, top, mask, calibration)
    # V refitted at each width: the cut factors are needed for it
    models = None if value_map is not None else [_truncated_model(ws, parts, value_map, min(int(r), top), mask,
                                                                  calibration) for r in ranks]
    if models is None:
        # V known: the whole half-sum's value path serves every width; the widths cut it on projected tokens
        As, Bs, rots = _stacked(ws.null.half_kernels, ws.null.rotary)

    def measure(X):
        Z = X @ V
        full = sf.factored_outputs(X, Z, A, B, mask, calibration=calibration, rotary=rot)
        if models is not None:
            return [sf.factored_sample_rss(X, X @ Vr, full, Ar, Br, mask, calibration=calibration, rotary=rr)
                    for Ar, Br, Vr, rr in models]
        proj = _ProjectedTokens(X, ws.null.metric, ws.null.singular_vectors, _top_width(ranks, top))
        return [proj.sample_rss(As, Bs, min(int(r), top), Z, full, mask, rots, calibration) for r in ranks]

    return sf.over_parts(parts, measure)


class RotarySoftmaxOperator:
    """``Y = softmax(rotate(X A) rotate(X B)^T / sqrt(d) + mask) X V`` at the fitted positions (``predict``)."""

    def __init__(self, A, B, V, rotary, mask=None):
        self.A, self.B, self.V, self.rotary, self.mask = A, B, V, rotary, mask

    @property
    def K(self):
        """The kernel at offset zero, ``A B^T`` (the rotary head has no single kernel; reported for inspection)."""
        return self.A @ self.B.T

    def predict(self, X):
        if X.shape[1] != self.rotary.length:
            raise ValueError(f"X has T={X.shape[1]} tokens, but the rotary operator was fitted at the "
                             f"{self.rotary.length} positions of its windows.")
        return sf.factored_outputs(X, X @ self.V, self.A, self.B, self.mask, rotary=self.rotary)


def rotary_operator(ws, samples, value_map, rank, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """The half-sum truncated to width ``rank`` (V known or refitted on ``samples``), for ``predict``."""
    A, B, V, rot = _truncated_model(ws, samples, value_map, rank, mask, calibration)
    return RotarySoftmaxOperator(A, B, V, rot, mask)
