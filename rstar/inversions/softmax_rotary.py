"""Least-squares inversion of rotary softmax attention (Llama-family heads), plane by plane.

A rotary head (theory §2, "Rotary positions") has one plane per frequency of its rotation: plane p's part of the
logits is ``Re(x_t^T M_p x_s e^{i (phi_tp - phi_sp)})`` with the complex kernel ``M_p = alpha_p beta_p^H``
(:mod:`rstar.inversions._numerics.rotary`). Its width is counted in planes, two dimensions each, at the model's
own frequencies: the rotary r* is ``2 x`` the number of planes the risk needs (at most ``2P = d_head``).

Each half of the samples (odd and even global index, as the factored least squares keeps them) is fitted with a
full rotary head, ``A, B`` of shape (d, 2P) with the given angles
(:func:`rstar.inversions._numerics.softmax_factored.fit_factored_pair` on the rotary losses), V known or fitted,
from independent random starts (so a plane the data do not single out is not planted alike in both halves). The
statistic is plane by plane: the whitened half-sum ``M_q^{1/2} (M_p^1 + M_p^2) / 2 M_k^{1/2}`` against the
half-difference, the noise of the half-sum (:class:`SplitHalfNull`); a plane counts where its half-sum's largest
singular value stands above the largest half-difference of any plane by the split-half margin. The plane's two
real dimensions enter the spectrum as one value twice, so the rules count whole planes.

The truncation of a fitted head to width r keeps its ``floor(r / 2)`` strongest planes in the token metric (each
half's own, for the cross-fitted risk curve); the half-sum, which can hold two planes at one frequency, is
truncated by the complex SVD of each frequency's whitened kernel, the strongest pairs kept (its planes keep their
frequencies, so a kept pair at an already used frequency is a second plane there).
"""

import numpy as np

from ._numerics import softmax_factored as sf
from ._numerics.rotary import RotaryPositions, plane_kernels
from .._backend import NUMPY
from ..budgets import DEFAULT_BUDGET
from ..calibration import DEFAULT_CALIBRATION
from ..risk import centred_sums, total_sum_of_squares
from ._statistic import Finding, SplitHalfNull, WhitenedStatistic, split_half_counts
from .softmax_factored import _residual_dof, _segment_cost

__all__ = ["ROTARY_NAME", "rotary_fit_blocker", "rotary_statistic", "rotary_rank_residuals",
           "rotary_half_disagreement", "rotary_output_distances", "rotary_operator", "RotarySoftmaxOperator"]

#: The name of this inversion (``inversion_``).
ROTARY_NAME = "softmax_rotary_least_squares"


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
                f"a rotary head of width {q} at T={T}, d={d}, d_v={d_v}")
    if not budget.allows_samples(n, T, d, d_v):
        return f"keeping the {n} samples exceeds the memory budget ({budget.describe()})"
    cost = sf.factored_start_cost(n, T, d, d_v, value_map_known) + 2 * _segment_cost(n, T, d, d_v, q,
                                                                                      value_map_known, calibration)
    if not budget.allows_fit_compute(cost):
        return (f"two segments of {calibration.factored_segment_iter} iterations of the width-{q} rotary fits on "
                f"{n} samples exceed the compute budget ({budget.describe()})")
    return None


# -- the planes of a fit ---------------------------------------------------------------------------------------


def plane_groups(rotary, angle):
    """The planes in groups the window cannot tell apart: p and p' are linked where their relative turn over the
    positions, ``max_t (phi_tp - phi_tp') - min_t (phi_tp - phi_tp')``, is below ``angle`` radians (the
    calibration's ``rotary_group_angle``); groups are the linked components, each sorted, ordered by first plane."""
    phi = rotary.angles
    P = phi.shape[1]
    diff = phi[:, :, None] - phi[:, None, :]
    linked = (diff.max(axis=0) - diff.min(axis=0)) < angle
    label = -np.ones(P, dtype=int)
    groups = []
    for p in range(P):
        if label[p] >= 0:
            continue
        stack, members = [p], []
        label[p] = len(groups)
        while stack:
            a = stack.pop()
            members.append(a)
            for b in np.flatnonzero(linked[a] & (label < 0)):
                label[b] = len(groups)
                stack.append(b)
        groups.append(np.sort(np.array(members)))
    return groups


def _whitened_planes(metric, A, B):
    """Each plane's complex factors in the token metric, ``(M_q^{1/2} alpha, M_k^{1/2} beta)``, shape (d, P)."""
    alpha, beta = plane_kernels(A, B)
    return metric[0] @ alpha, metric[2] @ beta


def _group_svd(lefts, rights, weights):
    """Thin SVD of ``sum_h w_h L_h R_h^H`` through QR factors of the stacked sides: ``(U, s, W)``."""
    Ql, Rl = np.linalg.qr(np.hstack(lefts))
    Qr, Rr = np.linalg.qr(np.hstack(rights))
    k = [L.shape[1] for L in lefts]
    core = Rl @ np.diag(np.repeat(np.asarray(weights, dtype=complex), k)) @ np.conj(Rr.T)
    u, s, wh = np.linalg.svd(core)
    return Ql @ u, s, Qr @ np.conj(wh.T)


def _group_pairs(metric, halves_factors, groups, sign):
    """Per group of planes, the thin SVD of its whitened summed kernel ``(M^1 + sign M^2) / 2`` (complex rank at most
    twice the group's size; the class allows the group's size): a list of ``(U, s, W)``, s descending."""
    (a1, b1), (a2, b2) = (_whitened_planes(metric, A, B) for A, B in halves_factors)
    return [_group_svd([a1[:, g], a2[:, g]], [b1[:, g], b2[:, g]], [0.5, 0.5 * sign]) for g in groups]


def plane_split_half(metric, halves_factors, groups):
    """``(s, sd, U)``: the values the class counts, a group's ``len(group)`` largest singular values of its whitened
    half-sum, all groups together (shape (P,), not sorted); the half-difference's likewise; and the half-sum's
    left vector of each value (complex, (P, d))."""
    s, sd, vecs = [], [], []
    for g, (U, sv, _), (_, dv, _) in zip(groups, _group_pairs(metric, halves_factors, groups, 1.0),
                                         _group_pairs(metric, halves_factors, groups, -1.0)):
        k = len(g)
        s.append(np.pad(sv[:k], (0, k - min(k, sv.size))))
        sd.append(np.pad(dv[:k], (0, k - min(k, dv.size))))
        vecs.append(np.pad(U[:, :k], ((0, 0), (0, k - min(k, U.shape[1])))).T)
    return np.concatenate(s), np.concatenate(sd), np.concatenate(vecs)


def _spectrum(values):
    """The planes' values as a spectrum of real dimensions: each twice, descending."""
    return np.sort(np.repeat(np.asarray(values, dtype=float), 2))[::-1]


def _model_of_pairs(metric, rotary, groups, group_svds, r):
    """A rotary head of width r from per-group SVDs: the ``floor(r / 2)`` strongest complex pairs overall, a group's
    j-th kept pair as a plane at the group's j-th frequency; ``(A, B, rotary)`` (one zero plane where r < 2)."""
    _, Mq_inv, _, Mk_inv = metric
    d = Mq_inv.shape[0]
    entries = [(-float(s[j]), gi, j) for gi, (g, (_, s, _)) in enumerate(zip(groups, group_svds))
               for j in range(min(len(g), s.size))]
    entries.sort()
    kept = entries[:max(0, int(r) // 2)]
    if not kept:
        return np.zeros((d, 2)), np.zeros((d, 2)), RotaryPositions(rotary.angles[:, :1])
    alpha, beta, planes = [], [], []
    for neg, gi, j in kept:
        U, s, W = group_svds[gi]
        root = np.sqrt(s[j])
        alpha.append(U[:, j] * root)
        beta.append(W[:, j] * root)
        planes.append(groups[gi][j])
    alpha, beta = Mq_inv @ np.stack(alpha, axis=1), Mk_inv @ np.stack(beta, axis=1)
    A = np.hstack([alpha.real, alpha.imag])
    B = np.hstack([beta.real, beta.imag])
    return A, B, RotaryPositions(rotary.angles[:, planes])


def _plane_truncation(metric, rotary, groups, A, B, r):
    """One half's fitted head truncated to width r inside the class: each group's summed kernel by its complex SVD,
    the strongest ``floor(r / 2)`` pairs kept (:func:`_model_of_pairs`)."""
    a, b = _whitened_planes(metric, A, B)
    svds = [_group_svd([a[:, g]], [b[:, g]], [1.0]) for g in groups]
    return _model_of_pairs(metric, rotary, groups, svds, r)


def _half_sum_model(ws, r):
    """The half-sum truncated to width r: ``(A, B, rotary)`` (:func:`_model_of_pairs` on its groups' SVDs)."""
    null = ws.null
    return _model_of_pairs(null.metric, null.rotary, null.plane_groups, null.singular_vectors, r)


# -- the statistic ---------------------------------------------------------------------------------------------


def _random_start(rng, metric, q, scale):
    """Factors ``M_q^{-1/2} G scale / sqrt(d)`` and ``M_k^{-1/2} G' scale / sqrt(d)`` with Gaussian G, G'."""
    d = metric[0].shape[0]
    return (metric[1] @ rng.standard_normal((d, q)) * (scale / np.sqrt(d)),
            metric[3] @ rng.standard_normal((d, q)) * (scale / np.sqrt(d)))


def rotary_statistic(halves, value_map, rotary, budget=DEFAULT_BUDGET, max_iter=None, margin=None, mask=None, *,
                     calibration=DEFAULT_CALIBRATION, stopping_count=split_half_counts, ops=NUMPY, seed=0):
    """The plane-by-plane split-half statistic of the rotary least squares.

    Parameters
    ----------
    halves : tuple of two (X, Y)
        The samples with odd and with even global index (internal units).
    value_map : ndarray of shape (d, d_v) or None
    rotary : RotaryPositions
        The angles of the head's planes at the windows' positions (T of them).
    budget : CostBudget
    max_iter : int or None
        L-BFGS iterations at most (None: the calibration's ``factored_max_iter``, or
        ``factored_max_iter_fitted_v`` with V fitted).
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
        ``units="logit"``: ``2P`` eigenvalues (each plane's ``s_p^2 / d`` twice) and the split-half null.
    """
    (X1, Y1), (X2, Y2) = halves
    n = X1.shape[0] + X2.shape[0]
    _, T, d = X1.shape
    d_v = Y1.shape[2]
    known = value_map is not None
    q = rotary.width
    if max_iter is None:
        max_iter = calibration.factored_max_iter if known else calibration.factored_max_iter_fitted_v
    metric = sf.token_metric_roots(np.concatenate([X1, X2]), calibration=calibration)
    margin = calibration.split_half_margin if margin is None else float(margin)
    spent = float(sf.token_metric_cost(n, T, d)) + sf.factored_start_cost(n, T, d, d_v, known)
    pre = (metric[1], metric[0])
    groups = plane_groups(rotary, calibration.rotary_group_angle)
    losses = sf.half_losses(halves, mask, ops, calibration=calibration, rotary=rotary)
    rng = np.random.default_rng(seed)
    starts = []
    for (X, Y), loss in zip(halves, losses):
        V0 = sf.value_map_given_kernel(X, Y, mask=mask, calibration=calibration) if value_map is None else value_map
        # logits of order one tenth: the fit grows the planes the data hold (a saddle at zero has no gradient)
        A0, B0 = _random_start(rng, metric, q, 1.0)
        Xs = X[: min(X.shape[0], 256)]
        std = float(np.std(Xs @ A0 @ (Xs @ B0).transpose(0, 2, 1) / np.sqrt(d))) or 1.0
        t = np.sqrt(0.1 / std)
        starts.append((A0 * t, B0 * t, V0))
    state = {}

    def on_check(current, n_iter):
        nonlocal spent
        spent += _segment_cost(n, T, d, d_v, q, known, calibration)
        s, sd, _ = plane_split_half(metric, [(f.A, f.B) for f in current], groups)
        lam, edge = _spectrum(s), float(np.max(sd))
        count = stopping_count(lam, edge, margin)
        previous = state.get("previous")
        state["previous"] = (count, lam)
        rtol = calibration.factored_stable_rtol
        if previous is not None and previous[0][0] == count[0] and np.allclose(
                lam[:count[0]], previous[1][:count[0]], rtol=rtol, atol=0.0):
            state["outcome"] = "settled"
            return True
        if not budget.allows_fit_compute(spent + _segment_cost(n, T, d, d_v, q, known, calibration)):
            state["outcome"] = "budget"
            return True
        return False

    fits = sf.fit_factored_pair(halves, q, starts, value_map=value_map, mask=mask, max_iter=max_iter,
                                precondition=pre, on_check=on_check, check_every=calibration.factored_segment_iter,
                                calibration=calibration, losses=losses, rotary=rotary)
    stable = state.get("outcome") == "settled" or all(f.converged for f in fits)
    halves_factors = tuple((f.A, f.B) for f in fits)
    s, sd, U1 = plane_split_half(metric, halves_factors, groups)
    order = np.argsort(-s, kind="stable")
    lam = _spectrum(s) ** 2 / d
    count = stopping_count(_spectrum(s), float(np.max(sd)), margin)
    # the statistic's directions: each plane's leading whitened query vector as two real columns, strongest first
    vecs = np.concatenate([np.stack([U1[p].real, U1[p].imag], axis=1) for p in order], axis=1)
    rss = sum(f.rss for f in fits)
    dof = sum(_residual_dof(2 * X.shape[0], T, d, d_v, q, known) for X, _ in halves)
    sigma2 = rss / max(dof, 1)
    findings = [Finding("factored_fit", {"settled": bool(stable), "iterations": int(fits[0].n_iter),
                                         "fitted_rank": int(q), "budget_ran_out": state.get("outcome") == "budget",
                                         "count": count, "capped": False, "features": int(d)})]
    V = value_map if known else (fits[0].value_map + fits[1].value_map) / 2
    null = SplitHalfNull(null_eigenvalues=_spectrum(sd) ** 2 / d, margin=margin, noise_variance=float(sigma2),
                         noise_dof=float(dof), fitted_rank=int(q), rank_cap=int(max(d, q + 1)), kernel=None,
                         value_map=V, metric=metric, singular_vectors=_group_pairs(metric, halves_factors, groups, 1.0),
                         half_kernels=halves_factors, rotary=rotary, plane_groups=groups)
    return WhitenedStatistic(lam, vecs, metric[1], float(n * d_v), null, ROTARY_NAME, (), [], "logit",
                             findings=findings)


# -- the risk curve, its resolution and the operator -----------------------------------------------------------


def rotary_rank_residuals(ws, halves, value_map, ranks, mask=None, per_sample=False, *,
                          calibration=DEFAULT_CALIBRATION):
    """Cross-fitted residual sums of squares of each half's head truncated to width r (its strongest
    ``floor(r / 2)`` planes, groups of planes the window cannot tell apart by their summed kernel's SVD; r None:
    the full head), V known or refitted on that half, measured on the other half
    (:func:`rstar.inversions.softmax_factored.factored_rank_residuals`, plane by plane)."""
    null = ws.null
    out = []
    for r in ranks:
        parts = []
        for (A_h, B_h), (Xf, Yf), (Xo, Yo) in zip(null.half_kernels, halves, halves[::-1]):
            A, B, rot = ((A_h, B_h, null.rotary) if r is None
                         else _plane_truncation(null.metric, null.rotary, null.plane_groups, A_h, B_h, r))
            V = (value_map if value_map is not None
                 else sf.value_map_given_kernel(Xf, Yf, A, B, mask, calibration=calibration, rotary=rot))
            parts.append(sf.factored_sample_rss(Xo, Xo @ V, Yo, A, B, mask, calibration=calibration, rotary=rot))
        out.append(np.concatenate(parts) if per_sample else float(sum(np.sum(p) for p in parts)))
    return out


def rotary_half_disagreement(ws, halves, value_map, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """How far the two halves' full rotary fits disagree, relative to Var(Y)
    (:func:`rstar.inversions.softmax_factored.factored_half_disagreement`'s measure)."""
    rotary = ws.null.rotary
    models = []
    for (A, B), (X, Y) in zip(ws.null.half_kernels, halves):
        models.append((A, B, value_map if value_map is not None
                       else sf.value_map_given_kernel(X, Y, A, B, mask, calibration=calibration, rotary=rotary)))
    dis, tss = 0.0, 0.0
    (A1, B1, V1), (A2, B2, V2) = models
    for X, Y in halves:
        dis += float(np.sum(sf.factored_sample_disagreement(X, (X @ V1, A1, B1), (X @ V2, A2, B2), mask,
                                                            calibration=calibration, rotary=rotary)))
        tss += total_sum_of_squares(centred_sums(X, Y))
    return dis / (4.0 * tss) if tss > 0 else 0.0


def _truncated_model(ws, samples, value_map, r, mask, calibration):
    X, Y = samples
    A, B, rot = _half_sum_model(ws, r)
    V = (value_map if value_map is not None
         else sf.value_map_given_kernel(X, Y, A, B, mask, calibration=calibration, rotary=rot))
    return A, B, V, rot


def rotary_output_distances(ws, samples, value_map, ranks, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """Each sample's squared distance between the outputs of the half-sum truncated to width r and of the whole
    half-sum (:func:`rstar.inversions.softmax_factored.factored_output_distances`, plane by plane)."""
    X = samples[0]
    top = 2 * ws.null.rotary.n_planes
    A, B, V, rot = _truncated_model(ws, samples, value_map, top, mask, calibration)
    full = sf.factored_outputs(X, X @ V, A, B, mask, calibration=calibration, rotary=rot)
    out = []
    for r in ranks:
        A, B, V, rot = _truncated_model(ws, samples, value_map, min(int(r), top), mask, calibration)
        out.append(sf.factored_sample_rss(X, X @ V, full, A, B, mask, calibration=calibration, rotary=rot))
    return out


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
