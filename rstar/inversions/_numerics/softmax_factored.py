"""Least squares of softmax attention with a factored kernel ``K = A B^T`` (pure functions on arrays).

Model (theory §2, class B2), for samples ``X_i`` (T x d) and ``Y_i`` (T x d_v)::

    Y_i = softmax(X_i A B^T X_i^T / sqrt(d)) X_i V + E_i,    A, B of shape (d, q)

The full-rank least squares (:mod:`rstar.inversions._numerics.softmax_ls`) needs the ``d^2 x d^2``
information of K for its null, which is out of reach at the sizes of real
layers (d = 385: 175 GB). Here K is fitted as rank-``q`` factors, so nothing
larger than ``d x max(q, d_v)`` per token or ``d x d`` in all is ever formed:
one loss-and-gradient evaluation costs about ``4 n T d q + n T^2 (2 q + 2 d_v)``
multiply-adds (the gradient of a factor is ``sum_i X_i^T dL_i (X_i B)``, never
the ``d x d`` gradient of K). The fit starts from the top-q singular pairs of
the gradient of K at ``K = 0`` (the first-order statistic) scaled by a line
search, then runs L-BFGS on ``(A, B)``; with V unknown, on ``(A, B, V)``
together, from the least-squares V given the starting attention (the gradient
in V is ``2 sum_i X_i^T P_i^T R_i``, at about ``2 n T d d_v`` more per
evaluation).

The kernel is identified only through the logits it produces on the tokens: a
direction ``b`` on the key side with ``b^T x_j`` constant within each sequence
(a key bias, the constant feature of a biased head) moves no attention weight.
:func:`token_metric_roots` gives the metric in which the fitted kernels are
compared: the query-side token second moment and the key-side second moment of
the tokens centred within their sequence. A rotary head turns that constant by
the key's position, so there it does move attention weight (a relative-position
pattern): its key side is measured uncentred (``keys_centred=False``).
"""

from dataclasses import dataclass

import numpy as np
from scipy import linalg

from ..._backend import NUMPY
from ...calibration import DEFAULT_CALIBRATION
from .lbfgs import minimize_lbfgs
from .linalg import factored_svd, psd_power, solve_psd
from .rotary import rotate, rotate_adjoint

__all__ = [
    "FactoredSoftmaxFit",
    "causal_mask",
    "closed_prefix",
    "coarse_lengths",
    "cut_windows",
    "causal_attention_weights",
    "factored_loss_terms",
    "factored_loss",
    "factored_rss",
    "factored_sample_rss",
    "factored_sample_disagreement",
    "factored_outputs",
    "joint_loss",
    "joint_loss_terms",
    "kernel_gradient",
    "extended_start",
    "gradient_start",
    "value_map_given_kernel",
    "half_models",
    "query_key_coordinates",
    "attention_from_coordinates",
    "fit_factored_pair",
    "NumpyHalfLoss",
    "half_losses",
    "token_metric_roots",
    "token_metric_roots_of_sums",
    "token_metric_sums",
    "token_metric_roots_of_halves",
    "uncentred_key_roots",
    "token_metric_cost",
    "factored_eval_cost",
    "factored_start_cost",
]

# The iteration caps, the loss tolerance, the value map's ridge, the chunks and the line search's cost allowance are
# the ``calibration``'s (rstar.calibration: factored_max_iter, factored_max_iter_fitted_v, least_squares_loss_tol,
# value_ridge, chunk_entries, line_search_allowance); every function that reads one takes it.


def _chunks(n, T, d, calibration):
    """Samples per chunk of a loss evaluation: the calibration's ``chunk_entries`` bound the ``chunk T^2`` (or
    ``chunk T d``) temporaries."""
    step = max(1, calibration.chunk_entries // max(T * T, T * d))
    return [slice(s, s + step) for s in range(0, n, step)]


def causal_mask(T):
    """The logits a causal (decoder) head keeps: token t attends to tokens ``s <= t`` (lower triangle)."""
    return np.tril(np.ones((T, T), dtype=bool))


def closed_prefix(mask, length):
    """Whether windows under ``mask`` cut to their first ``length`` tokens are samples of the same head: no position
    before ``length`` attends to a token at ``length`` or later (``mask[:length, length:]`` all False: causal, or
    causal sliding windows; None, bidirectional: no)."""
    return mask is not None and not np.asarray(mask, dtype=bool)[:length, length:].any()


def coarse_lengths(T, mask, *, calibration=DEFAULT_CALIBRATION):
    """The shorter window lengths a causal fit is run at first, shortest first: ``T // r, T // r^2, ...`` (r the
    calibration's ``coarse_window_ratio``) while at least its ``coarse_window_min_length``.

    A length T' qualifies only where no position before T' attends to a token at T' or later (``mask[:T', T':]``
    all False: causal, or causal sliding windows), so that the outputs at the first T' positions are the head
    applied to the first T' tokens alone: the cut windows are samples of the same head. None (bidirectional)
    gives none.

    Examples
    --------
    >>> coarse_lengths(512, causal_mask(512))
    [32, 128]
    >>> coarse_lengths(128, None)
    []
    """
    if mask is None:
        return []
    ratio, shortest = calibration.coarse_window_ratio, calibration.coarse_window_min_length
    out, length = [], int(T) // ratio
    while length >= shortest:
        if closed_prefix(mask, length):
            out.append(length)
        length //= ratio
    return sorted(out)


def cut_windows(halves, mask, length):
    """``(cut halves, cut mask)``: each half's windows and outputs cut to their first ``length`` tokens (contiguous
    copies) and the mask's top-left ``length x length`` block — samples of the same head where ``length`` is one of
    :func:`coarse_lengths` (the halves and mask themselves, not copies, at their full length)."""
    if length >= halves[0][0].shape[1]:
        return halves, mask
    cut = tuple((np.ascontiguousarray(X[:, :length]), np.ascontiguousarray(Y[:, :length])) for X, Y in halves)
    return cut, np.asarray(mask, dtype=bool)[:length, :length]


def causal_attention_weights(X, K):
    """Row-wise causal ``softmax(X_i K X_i^T / sqrt(d))`` (row t over keys ``s <= t``), shape (n, T, T)."""
    T, d = X.shape[1], X.shape[2]
    return NUMPY.softmax_rows(_masked((X @ (K / np.sqrt(d))) @ X.transpose(0, 2, 1), causal_mask(T)))


def _masked(L, mask):
    if mask is not None:
        L = np.where(mask, L, -np.inf)
    return L


def factored_loss_terms(X, Z, Y, A, B, mask=None, *, rotary=None):
    """A chunk's residual sum of squares and its gradients in the factors.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Z : ndarray of shape (n, T, d_v)
        The value path ``X_i V``.
    Y : ndarray of shape (n, T, d_v)
    A, B : ndarray of shape (d, q)
    mask : ndarray of bool, shape (T, T), or None
        Which logits are kept (e.g. causal: ``j <= i``); None keeps all.
    rotary : RotaryPositions or None
        A rotary head's positions (:mod:`rstar.inversions._numerics.rotary`): the logits are
        ``rotate(X_i A) rotate(X_i B)^T / sqrt(d)``, q the rotation's width ``2P``.

    Returns
    -------
    f : float
        ``sum_i ||Y_i - softmax(X_i A B^T X_i^T / sqrt(d)) Z_i||^2``.
    grad_A, grad_B : ndarray of shape (d, q)
    """
    f, gA, gB, _, _ = _loss_core(X, Z, Y, A, B, mask, rotary)
    return f, gA, gB


def _loss_core(X, Z, Y, A, B, mask, rotary=None):
    """``(f, grad_A, grad_B, P, R)`` of a chunk: the loss, its factor gradients, the attention and residual."""
    n, T, d = X.shape
    q = A.shape[1]
    c = 1.0 / np.sqrt(d)
    XA = X @ A
    XB = X @ B
    if rotary is not None:
        XA, XB = rotate(XA, rotary), rotate(XB, rotary)
    P = NUMPY.softmax_rows(_masked(XA @ XB.transpose(0, 2, 1) * c, mask))
    R = P @ Z - Y
    f = float(np.einsum("ntv,ntv->", R, R))
    dP = 2.0 * (R @ Z.transpose(0, 2, 1))
    dL = (dP - np.einsum("nts,nts->nt", dP, P)[..., None]) * P * c
    Xf = X.reshape(-1, d)
    dA, dB = dL @ XB, dL.transpose(0, 2, 1) @ XA
    if rotary is not None:
        dA, dB = rotate_adjoint(dA, rotary), rotate_adjoint(dB, rotary)
    gA = Xf.T @ dA.reshape(-1, q)
    gB = Xf.T @ dB.reshape(-1, q)
    return f, gA, gB, P, R


def joint_loss_terms(X, Y, A, B, V, mask=None, *, rotary=None):
    """A chunk's residual sum of squares and its gradients in the factors and in V (value path ``X_i V``).

    ``grad_V = 2 sum_i X_i^T P_i^T R_i``, through ``T x d_v`` products (``P_i X_i`` is never formed).

    Returns
    -------
    f, grad_A, grad_B, grad_V
    """
    d = X.shape[2]
    f, gA, gB, P, R = _loss_core(X, X @ V, Y, A, B, mask, rotary)
    gV = 2.0 * (X.reshape(-1, d).T @ (P.transpose(0, 2, 1) @ R).reshape(-1, V.shape[1]))
    return f, gA, gB, gV


def joint_loss(X, Y, A, B, V, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """:func:`joint_loss_terms` summed over all samples, chunk by chunk."""
    n, T, d = X.shape
    f, gA, gB, gV = 0.0, np.zeros_like(A), np.zeros_like(B), np.zeros_like(V)
    for part in _chunks(n, T, d, calibration):
        fp, a, b, v = joint_loss_terms(X[part], Y[part], A, B, V, mask, rotary=rotary)
        f += fp
        gA += a
        gB += b
        gV += v
    return f, gA, gB, gV


def factored_loss(X, Z, Y, A, B, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """:func:`factored_loss_terms` summed over all samples, chunk by chunk (bounded temporaries)."""
    n, T, d = X.shape
    f, gA, gB = 0.0, np.zeros_like(A), np.zeros_like(B)
    for part in _chunks(n, T, d, calibration):
        fp, a, b = factored_loss_terms(X[part], Z[part], Y[part], A, B, mask, rotary=rotary)
        f += fp
        gA += a
        gB += b
    return f, gA, gB


class NumpyHalfLoss:
    """One half's factored loss on numpy float64: ``loss(A, B, V, value_grad=False) -> (f, grad_A, grad_B, grad_V)``
    (grad_V None unless ``value_grad``); :func:`joint_loss` with V's gradient, else :func:`factored_loss` on the
    value path ``X V``, kept while V is unchanged. The torch back-end's
    :class:`rstar._torch_backend.factored.FactoredHalfLoss` computes the same on a device."""

    def __init__(self, X, Y, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
        self.X, self.Y, self.mask, self.calibration, self.rotary = X, Y, mask, calibration, rotary
        self._path = (None, None)

    def __call__(self, A, B, V, value_grad=False):
        if value_grad:
            return joint_loss(self.X, self.Y, A, B, V, self.mask, calibration=self.calibration, rotary=self.rotary)
        key, Z = self._path
        if key is None or key.shape != V.shape or not np.array_equal(key, V):
            Z = self.X @ V
            self._path = (np.array(V, dtype=float), Z)
        return (*factored_loss(self.X, Z, self.Y, A, B, self.mask, calibration=self.calibration, rotary=self.rotary),
                None)


def half_losses(halves, mask=None, ops=NUMPY, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """Each half's loss-and-gradient function (:class:`NumpyHalfLoss`, or its torch twin on ``ops``'s device, whose
    per-sample work runs in ``ops.fit_dtype``: :class:`rstar._torch_backend.factored.FactoredHalfLoss`)."""
    if ops.name == "numpy":
        return [NumpyHalfLoss(X, Y, mask, calibration=calibration, rotary=rotary) for X, Y in halves]
    return [ops.factored_half_loss(X, Y, mask, calibration.chunk_entries, rotary=rotary) for X, Y in halves]


def factored_rss(X, Z, Y, A, B, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """Residual sum of squares of ``Y_i ~ softmax(X_i A B^T X_i^T / sqrt(d)) Z_i`` (no gradient; q may be 0)."""
    return float(np.sum(factored_sample_rss(X, Z, Y, A, B, mask, calibration=calibration, rotary=rotary)))


def factored_sample_rss(X, Z, Y, A, B, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """Each sample's residual sum of squares under :func:`factored_rss`'s model, shape (n,)."""
    n, T, d = X.shape
    out = np.empty(n)
    for part in _chunks(n, T, d, calibration):
        R = _attention(X[part], A, B, mask, rotary) @ Z[part] - Y[part]
        out[part] = np.einsum("ntv,ntv->n", R, R)
    return out


def factored_outputs(X, Z, A, B, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """The model's outputs ``P_i(K) Z_i`` for ``K = A B^T``, shape (n, T, d_v) (in chunks, as the losses)."""
    n, T, d = X.shape
    out = np.empty(Z.shape)
    for part in _chunks(n, T, d, calibration):
        out[part] = _attention(X[part], A, B, mask, rotary) @ Z[part]
    return out


def factored_sample_disagreement(X, model, other, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """Each sample's squared distance between two models' outputs, ``||P_i(K) Z_i - P_i(K') Z'_i||^2``.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    model, other : tuple ``(Z, A, B)``
        A model's value path ``Z = X V`` of shape (n, T, d_v) and its kernel factors ``K = A B^T``.

    Returns
    -------
    ndarray of shape (n,)
    """
    n, T, d = X.shape
    out = np.empty(n)
    (Z, A, B), (Z2, A2, B2) = model, other
    for part in _chunks(n, T, d, calibration):
        D = (_attention(X[part], A, B, mask, rotary) @ Z[part]
             - _attention(X[part], A2, B2, mask, rotary) @ Z2[part])
        out[part] = np.einsum("ntv,ntv->n", D, D)
    return out


def query_key_coordinates(X, A, B, rotary=None):
    """``(X A, X B)``, rotated to each token's position where ``rotary`` is given: the logits are their inner
    products over ``sqrt(d)``."""
    XA, XB = X @ A, X @ B
    if rotary is not None:
        XA, XB = rotate(XA, rotary), rotate(XB, rotary)
    return XA, XB


def attention_from_coordinates(XA, XB, mask=None, d=None):
    """Row-wise ``softmax(XA XB^T / sqrt(d) + mask)`` (d None: no scaling, the caller folded it into ``XA``)."""
    logits = XA @ XB.transpose(0, 2, 1)
    return NUMPY.softmax_rows(_masked(logits if d is None else logits / np.sqrt(d), mask))


def _attention(X, A, B, mask=None, rotary=None):
    return attention_from_coordinates(*query_key_coordinates(X, A, B, rotary), mask, X.shape[2])


def half_models(half_kernels, halves, value_map=None, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """Each half's model ``(A, B, V)``: its fitted factors, and V known or fitted on that half given its attention
    (:func:`value_map_given_kernel`)."""
    return tuple((A, B, value_map if value_map is not None
                  else value_map_given_kernel(X, Y, A, B, mask, calibration=calibration, rotary=rotary))
                 for (A, B), (X, Y) in zip(half_kernels, halves))


def value_normal_equations(X, Y, A=None, B=None, mask=None, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """``(sum_i W_i^T W_i, sum_i W_i^T Y_i)`` with ``W_i = P_i X_i``, ``P_i`` the attention of ``K = A B^T``
    (uniform if A is None): the normal equations of the value map given the kernel. Costs about
    ``n T d (T + d)`` multiply-adds."""
    n, T, d = X.shape
    d_v = Y.shape[2]
    gram, cross = np.zeros((d, d)), np.zeros((d, d_v))
    for part in _chunks(n, T, d, calibration):
        Xp = X[part]
        if A is None:
            P = NUMPY.softmax_rows(_masked(np.zeros((Xp.shape[0], T, T)), mask))
        else:
            P = _attention(Xp, A, B, mask, rotary)
        W = (P @ Xp).reshape(-1, d)
        gram += W.T @ W
        cross += W.T @ Y[part].reshape(-1, d_v)
    return gram, cross


def _ridged(gram, ridge):
    d = gram.shape[0]
    return gram + ridge * max(float(np.trace(gram)) / d, np.finfo(float).tiny) * np.eye(d)


def value_map_given_kernel(X, Y, A=None, B=None, mask=None, ridge=None, *, calibration=DEFAULT_CALIBRATION,
                           rotary=None):
    """Least-squares V of ``Y_i ~ P_i X_i V`` given the attention ``P_i`` of ``K = A B^T`` (uniform if A is None).

    Costs about ``n T d (T + d)`` multiply-adds (:func:`value_normal_equations`); a relative ``ridge`` (None: the
    calibration's ``value_ridge``) keeps the ``d x d`` normal matrix invertible where the tokens span fewer than d
    directions.
    """
    return value_map_of_parts((X, Y), A, B, mask, ridge, calibration=calibration, rotary=rotary)


def sample_parts(samples):
    """``samples`` as a list of ``(X, Y)`` parts: one pair ``(X, Y)`` (arrays), or a sequence of such pairs (the
    halves a fit keeps), read part by part so that no joined copy of them is made."""
    return [samples] if isinstance(samples[0], np.ndarray) else list(samples)


def over_parts(parts, measure):
    """``measure(X)`` (one per-sample array for each of several models) on each part's tokens, each model's arrays
    concatenated over the parts in their order: every sample's values, the parts not joined."""
    return [np.concatenate(column) for column in zip(*(measure(X) for X, _ in parts))]


def value_map_of_parts(parts, A=None, B=None, mask=None, ridge=None, *, calibration=DEFAULT_CALIBRATION,
                       rotary=None):
    """:func:`value_map_given_kernel` on the samples of every ``(X, Y)`` part together (:func:`sample_parts`):
    the normal equations summed part by part, the parts not joined."""
    ridge = calibration.value_ridge if ridge is None else ridge
    sums = [value_normal_equations(X, Y, A, B, mask, calibration=calibration, rotary=rotary)
            for X, Y in sample_parts(parts)]
    return solve_psd(_ridged(sum(g for g, _ in sums), ridge), sum(c for _, c in sums))


def factored_eval_cost(n, T, d, d_v, rank, value_map_known=True, *, calibration=DEFAULT_CALIBRATION):
    """Multiply-adds of one loss-and-gradient evaluation on n samples (the line search's extra evaluations
    included): ``1.1 (4 n T d q + 2 n T^2 (q + d_v))``, plus ``2 n T d d_v + n T^2 d_v`` with V fitted (1.1 the
    calibration's ``line_search_allowance``)."""
    extra = 0 if value_map_known else 2 * n * T * d * d_v + n * T * T * d_v
    return calibration.line_search_allowance * (4 * n * T * d * rank + 2 * n * T * T * (rank + d_v) + extra)


def factored_start_cost(n, T, d, d_v, value_map_known=True):
    """Multiply-adds of a fit's start (the ``d x d`` gradient, ``n T d^2``) and, with V fitted, of the
    least-squares V given its attention (``n T d (T + d)``)."""
    return float(n * T * d * d + (0 if value_map_known else n * T * d * (T + d)))


@dataclass
class FactoredSoftmaxFit:
    """One half's fit (:func:`fit_factored_pair`).

    Attributes
    ----------
    A, B : ndarray of shape (d, q)
        The factors: ``K = A B^T``.
    value_map : ndarray of shape (d, d_v)
        V (the one given, or fitted).
    rss : float
        Residual sum of squares.
    n_iter : int
        L-BFGS iterations, all rounds.
    converged : bool
        Whether the last round stopped on the loss tolerance rather than the iteration limit.
    """

    A: np.ndarray
    B: np.ndarray
    value_map: np.ndarray
    rss: float
    n_iter: int
    converged: bool

    @property
    def kernel(self):
        return self.A @ self.B.T


def kernel_gradient(X, Z, Y, A=None, B=None, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """Gradient of the residual sum of squares in K at ``K = A B^T`` (``K = 0`` if A is None), ``d x d``.

    ``sum_i X_i^T dL_i X_i / sqrt(d)`` with ``dL_i`` the logit gradient; at ``K = 0`` it is the first-order
    statistic of the kernel. Costs about ``n T d^2`` multiply-adds.
    """
    n, T, d = X.shape
    G = np.zeros((d, d))
    for part in _chunks(n, T, d, calibration):
        Xp, Zp, Yp = X[part], Z[part], Y[part]
        if A is None:
            P = NUMPY.softmax_rows(_masked(np.zeros((Xp.shape[0], T, T)), mask))
        else:
            P = _attention(Xp, A, B, mask)
        R = P @ Zp - Yp
        dP = 2.0 * (R @ Zp.transpose(0, 2, 1))
        dL = (dP - np.einsum("nts,nts->nt", dP, P)[..., None]) * P
        G += Xp.reshape(-1, d).T @ (dL @ Xp).reshape(-1, d)
    return G / np.sqrt(d)


def _line_start(X, Y, V, A0, B0, G, k, mask, precondition=None, active=None, calibration=DEFAULT_CALIBRATION,
                loss=None):
    """``(A0, B0)`` extended by the top-``k`` singular pairs of ``-G`` at the scale that lowers the loss most.

    With ``precondition = (P, P_inv)`` the pairs are those of the whitened gradient ``-P G P``, mapped back
    (``K = P U S W^T P``). Only the first ``active`` new pairs (all if None) start at that scale; the others
    start 100 times weaker in their logits, so that directions the gradient does not single out are grown by
    the fit rather than planted in both halves alike. ``loss`` is the half's :func:`half_losses` function (None:
    :class:`NumpyHalfLoss`).
    """
    loss = NumpyHalfLoss(X, Y, mask, calibration=calibration) if loss is None else loss
    P = None if precondition is None else precondition[0]
    U, s, Wt = linalg.svd(-G if P is None else -(P @ G @ P), full_matrices=False, check_finite=False)
    U, s, W = U[:, :k], s[:k], Wt[:k].T
    if P is not None:
        U, W = P @ U, P @ W
    if not s.size or not s[0] > 0:
        pad = np.zeros((X.shape[2], k))
        return np.hstack([A0, pad]), np.hstack([B0, pad])
    weight = np.ones(k)
    if active is not None and active < k:
        weight[max(int(active), 0):] = 0.1
    d = X.shape[2]
    Xs = X[: min(X.shape[0], 256)]
    logits = (Xs @ (U * s)) @ (Xs @ W).transpose(0, 2, 1) / np.sqrt(d)
    # a scale at which the new directions' logits are of order one, then the best of a geometric grid
    t0 = 1.0 / max(float(np.std(logits)), np.finfo(float).tiny)
    best = (np.inf, 0.0)
    for t in t0 * 2.0 ** np.arange(-6, 5):
        root = np.sqrt(t * s) * weight
        f = loss(np.hstack([A0, U * root]), np.hstack([B0, W * root]), V)[0]
        best = min(best, (f, t))
    root = np.sqrt(best[1] * s) * weight
    return np.hstack([A0, U * root]), np.hstack([B0, W * root])


def gradient_start(X, Y, G, rank, value_map=None, mask=None, precondition=None, active=None, *,
                   calibration=DEFAULT_CALIBRATION, loss=None):
    """Starting factors of rank ``rank`` from a given gradient of K at ``K = 0`` (:func:`kernel_gradient`),
    V known or the uniform-attention least squares, scaled by a line search (see :func:`_line_start` for
    ``precondition``, ``active`` and ``loss``)."""
    V = value_map_given_kernel(X, Y, mask=mask, calibration=calibration) if value_map is None else value_map
    empty = np.zeros((X.shape[2], 0))
    return _line_start(X, Y, V, empty, empty, G, rank, mask, precondition, active, calibration, loss)


def extended_start(X, Y, fit, rank, mask=None, precondition=None, *, calibration=DEFAULT_CALIBRATION, loss=None):
    """Starting factors of rank ``rank`` from a smaller fit: its factors and the top singular pairs of the
    gradient of K at its kernel (the directions it leaves most to gain on), scaled by a line search."""
    Z = X @ fit.value_map
    k = rank - fit.A.shape[1]
    if k <= 0:
        return fit.A[:, :rank], fit.B[:, :rank]
    G = kernel_gradient(X, Z, Y, fit.A, fit.B, mask, calibration=calibration)
    return _line_start(X, Y, fit.value_map, fit.A, fit.B, G, k, mask, precondition, calibration=calibration,
                       loss=loss)


def balanced_factor_scales(At, Bt, damping):
    """The factors ``(At, Bt)`` (d x q, whitened) of one kernel re-factored in balance, and their column scales.

    With ``At Bt^T = U S W^T`` (:func:`rstar.inversions._numerics.linalg.factored_svd`: ``O(d q^2)``), the
    balanced factors are ``U S^{1/2}`` and ``W S^{1/2}`` (the same kernel, ``At^T At = Bt^T Bt = S``), and the
    scale of column j is ``(s_j + damping s_1)^{-1/2}``: L-BFGS run on ``At / scale`` (and ``Bt / scale``) takes
    gradient steps preconditioned by ``(Bt^T Bt + damping s_1 I)^{-1}`` on the query side and
    ``(At^T At + ...)^{-1}`` on the key side, the scaled gradient descent of low-rank factorisations (Tong, Ma &
    Chi, "Accelerating ill-conditioned low-rank matrix estimation via scaled gradient descent", JMLR 22, 2021; the
    damping, which keeps the columns the kernel does not use moving, as in Zhang, Fattahi & Zhang's PrecGD,
    NeurIPS 2021), so that the kernel's weak directions are fitted at the pace of its strong ones. Returns
    ``(At, Bt, scale)``; a zero kernel is returned as given with unit scales.
    """
    U, s, W = factored_svd(At, Bt)
    if not s.size or not s[0] > 0:
        return At, Bt, np.ones(At.shape[1])
    root = np.sqrt(s)
    return U * root, W * root, 1.0 / np.sqrt(s + damping * s[0])


def _minimize(fun, blocks, precondition, max_iter, tol, n_obs, on_check=None, check_every=None,
              block_precondition=None, factor_pairs=(), rescale_every=None, damping=0.0, memory=20,
              preconditioned_fun=None):
    """L-BFGS (:func:`rstar.inversions._numerics.lbfgs.minimize_lbfgs`) on the blocks (each ``d x k``) in preconditioned
    coordinates ``block = P (block~ * scale)``.

    ``precondition = (P, P_inv)`` (symmetric ``d x d``, e.g. ``M^{-1/2}`` and ``M^{1/2}`` of the token second
    moment, so that anisotropic tokens do not make the loss badly conditioned) or None. ``fun`` maps the blocks
    to ``(f, [gradients])``. ``on_check(blocks, n_iter)`` is called every ``check_every`` iterations and stops
    the run by returning True. ``block_precondition`` (a list, one entry per block, or None) gives a block its
    own ``(P, P_inv)`` in place of ``precondition`` where the entry is not None.

    ``factor_pairs`` lists the ``(i, j)`` blocks that are the query and key factors of one kernel ``A B^T``: every
    ``rescale_every`` iterations (and at the start) they are re-factored in balance in their whitened coordinates
    and given the column scales of :func:`balanced_factor_scales` (``damping``), and L-BFGS restarts from there
    (the kernel, and so the loss, unchanged; its curvature memory cleared: the coordinates changed). ``memory``:
    the curvature pairs L-BFGS keeps. ``preconditioned_fun`` (with one common ``precondition``): ``fun`` of the
    blocks in the preconditioned coordinates ``block~ * scale``, with its gradients in them — the loss applies P
    itself (to its tokens, once), and L-BFGS's evaluations make no ``P`` product here. Returns ``(blocks, f,
    n_iter, converged)``; converged means stopped on the loss tolerance or with no step left to take (not the
    iteration limit, not ``on_check``).
    """
    d = blocks[0].shape[0]
    edges = np.cumsum([0] + [b.shape[1] for b in blocks])
    # one (P, P_inv) per block: the common one, or the block's own where block_precondition gives it
    pre = [precondition if (block_precondition is None or block_precondition[k] is None) else block_precondition[k]
           for k in range(len(blocks))]
    common = all(p is pre[0] for p in pre)

    def apply(M, which):
        # P (which=0) or P_inv (which=1) of each block, on the blocks side by side as one d x K matrix
        if common:
            return M if pre[0] is None else pre[0][which] @ M
        return np.hstack([M[:, edges[k]:edges[k + 1]] if p is None else p[which] @ M[:, edges[k]:edges[k + 1]]
                          for k, p in enumerate(pre)])

    scale = np.ones(edges[-1])   # each column's scale (1 outside the factor pairs)

    def unpack(theta):
        M = apply(theta.reshape(d, edges[-1]) * scale, 0)
        return [np.ascontiguousarray(M[:, edges[k]:edges[k + 1]]) for k in range(len(blocks))]

    if preconditioned_fun is not None and not (common and pre[0] is not None):
        raise ValueError("preconditioned_fun takes the blocks in one common precondition's coordinates; "
                         "give that precondition (and no block_precondition of its own to any block).")

    def wrapped(theta):
        if preconditioned_fun is not None:
            M = theta.reshape(d, edges[-1]) * scale
            f, grads = preconditioned_fun([M[:, edges[k]:edges[k + 1]] for k in range(len(blocks))])
            return f, (np.hstack(grads) * scale).ravel()
        f, grads = fun(unpack(theta))
        return f, (apply(np.hstack(grads), 0) * scale).ravel()   # P symmetric: d f / d b~ = P^T d f / d b

    def rebalance(current):
        # the whitened factors of each kernel in balance, and their columns' scales
        white = apply(np.hstack(current), 1)
        scale[:] = 1.0
        for i, j in factor_pairs:
            qi, qj = slice(edges[i], edges[i + 1]), slice(edges[j], edges[j + 1])
            white[:, qi], white[:, qj], s = balanced_factor_scales(white[:, qi], white[:, qj], damping)
            scale[qi], scale[qj] = s, s
        return (white / scale).ravel()

    theta = rebalance(blocks) if factor_pairs else apply(np.hstack(blocks), 1).ravel()
    f0 = wrapped(theta)[0]
    # stop once an iteration gains less than tol times the loss per observation (f <= f0 throughout)
    ftol = tol / n_obs * max(f0, 1e-300) / max(f0, 1.0)
    chunk = int(max_iter) if not factor_pairs or not rescale_every else int(rescale_every)
    done, f, status = 0, f0, "max_iter"
    while done < int(max_iter):
        def callback(x, nit, offset=done):
            total = offset + nit
            return on_check is not None and total % check_every == 0 and bool(on_check(unpack(x), total))

        theta, f, nit, status = minimize_lbfgs(wrapped, theta, min(chunk, int(max_iter) - done), ftol,
                                               memory=memory, callback=callback)
        done += nit
        if status != "max_iter" or done >= int(max_iter):
            break
        theta = rebalance(unpack(theta))
    return unpack(theta), float(f), done, status in ("converged", "line_search")


def fit_factored_pair(halves, rank, starts, value_map=None, mask=None, max_iter=None,
                      tol=None, precondition=None, on_check=None, check_every=50,
                      value_precondition=True, *, calibration=DEFAULT_CALIBRATION, losses=None, rotary=None):
    """Both halves' fits as one L-BFGS run on their summed (separable) loss, so that its curvature memory
    survives the checks made along the way.

    Parameters
    ----------
    halves : tuple of two (X, Y)
    rank : int
    starts : tuple of two (A, B) or (A, B, V)
        Each half's start (with V fitted, its starting value; else the least squares given the start).
    value_map : ndarray of shape (d, d_v), tuple of two of them, or None
        Known V (one for both halves, or each half's own); None fits it with the factors (L-BFGS on both).
    mask : ndarray of bool, shape (T, T), or None
        Logits kept (causal attention: :func:`causal_mask`); None keeps all.
    max_iter : int or None, default=None
        L-BFGS iterations in all (None: the calibration's ``factored_max_iter``).
    tol : float or None, default=None
        Stop when an iteration gains less than ``tol`` times the loss per observation (None: the calibration's
        ``least_squares_loss_tol``).
    precondition : tuple (P, P_inv) or None
        L-BFGS runs on ``P^{-1} A, P^{-1} B`` (and ``P^{-1} V``): with ``P = M^{-1/2}`` of the tokens' second
        moment the loss sees whitened tokens, so anisotropic (real) tokens do not slow it down.
    on_check : callable or None
        ``on_check(fits, n_iter)`` with the two current :class:`FactoredSoftmaxFit` (their ``rss`` not yet
        computed: nan), every ``check_every`` iterations; True stops the run.
    check_every : int, default=50
    value_precondition : bool, default=True
        With V fitted, L-BFGS runs on ``G^{1/2} V`` with ``G = sum_i (P_i X_i)^T (P_i X_i) / (n T)`` the value
        map's normal matrix at the start (each half its own), rather than in the token metric: attention averages
        the tokens, so ``G`` is far more anisotropic than the tokens' second moment (the within-sequence
        variation shrinks, the sequence mean stays), and a V fitted in the token metric lags the kernel. At
        T = 128 on MiniLM's tokens (d = 384, planted rank 3) the fit in the token metric carried a fourth direction shared by both halves at
        0.8-3 times the split-half noise for 350 iterations (n = 2000; 1.3-1.7 for 500 at n = 1260); in this
        metric it stood at 0.07-0.14 from the first check.
    calibration : Calibration, default=DEFAULT_CALIBRATION
        Its ``factored_max_iter``, ``least_squares_loss_tol``, ``value_ridge`` and ``chunk_entries``
        (:mod:`rstar.calibration`).
    losses : list of two callables or None
        Each half's loss-and-gradient function (:func:`half_losses`: numpy, or torch on a device); None: numpy.
    rotary : RotaryPositions or None
        Rotary heads (:mod:`rstar.inversions._numerics.rotary`): the factors' columns are its planes (``rank`` its
        width ``2P``); ``losses`` must have been made with the same.

    Returns
    -------
    (fit_1, fit_2) : tuple of FactoredSoftmaxFit
    """
    max_iter = calibration.factored_max_iter if max_iter is None else max_iter
    tol = calibration.least_squares_loss_tol if tol is None else tol
    fitted_v = value_map is None
    known_maps = (None, None) if fitted_v else value_map if isinstance(value_map, tuple) else (value_map,) * 2
    blocks, own = [], []
    for (X, Y), start in zip(halves, starts):
        A, B = np.asarray(start[0], dtype=float), np.asarray(start[1], dtype=float)
        blocks += [A, B]
        own += [None, None]
        if fitted_v:
            # V's normal equations at the start: its least squares where the start has no V, and its metric
            if value_precondition or len(start) < 3:
                gram, cross = value_normal_equations(X, Y, A, B, mask, calibration=calibration, rotary=rotary)
                gram = _ridged(gram, calibration.value_ridge)
            blocks.append(np.asarray(start[2], dtype=float) if len(start) == 3 else solve_psd(gram, cross))
            if value_precondition:
                G = gram / (X.shape[0] * X.shape[1])
                own.append((psd_power(G, -0.5), psd_power(G, 0.5)))
            else:
                own.append(None)
    per = 3 if fitted_v else 2

    def split(bl):
        return bl[:per], bl[per:]

    # the value path of a known V is computed once by each half's loss (not at every evaluation)
    losses = half_losses(halves, mask, calibration=calibration, rotary=rotary) if losses is None else losses
    paths = [None if fitted_v else X @ V for (X, _), V in zip(halves, known_maps)]

    def fun(bl, **basis):
        f, grads = 0.0, []
        for loss, part, V in zip(losses, split(bl), known_maps):
            fp, gA, gB, gV = loss(part[0], part[1], part[2] if fitted_v else V, value_grad=fitted_v, **basis)
            grads += [gA, gB, gV] if fitted_v else [gA, gB]
            f += fp
        return f, grads

    # V known and losses that take the factors in preconditioned coordinates (torch's): P is applied to their
    # tokens once, not to the factors and gradients at every evaluation
    folded = None
    if (precondition is not None and not fitted_v
            and all(getattr(loss, "takes_basis", False) for loss in losses)):
        def folded(bl):
            return fun(bl, basis=precondition[0])

    def as_fits(bl, rss=(np.nan, np.nan), nit=0, converged=False):
        out = []
        for part, r, V in zip(split(bl), rss, known_maps):
            V = part[2] if fitted_v else V
            out.append(FactoredSoftmaxFit(part[0], part[1], V, float(r), nit, converged))
        return tuple(out)

    check = None if on_check is None else (lambda bl, nit: on_check(as_fits(bl, nit=nit), nit))
    n_obs = sum(Y.size for _, Y in halves)
    # an unrotated head's kernel A B^T is unchanged by A G, B G^{-T}: its factors are kept in balance and scaled
    # (balanced_factor_scales); a rotary head's columns are its planes, which only plane-wise rotations keep
    pairs = () if rotary is not None or not calibration.factored_rescale_iter else ((0, 1), (per, per + 1))
    bl, _, nit, converged = _minimize(fun, blocks, precondition, max_iter, tol, n_obs, check, check_every,
                                      block_precondition=own if fitted_v else None, factor_pairs=pairs,
                                      rescale_every=calibration.factored_rescale_iter,
                                      damping=calibration.factored_scale_damping,
                                      memory=calibration.factored_scaled_memory if pairs else 20,
                                      preconditioned_fun=folded)
    rss = [factored_rss(X, X @ part[2] if fitted_v else Z, Y, part[0], part[1], mask, calibration=calibration,
                        rotary=rotary)
           for (X, Y), Z, part in zip(halves, paths, split(bl))]
    return as_fits(bl, rss, nit, converged)


def token_metric_cost(n, T, d):
    """Multiply-adds of :func:`token_metric_roots`: two ``d x d`` Grams and two eigen-decompositions."""
    return float(2 * n * T * d * d + 20 * d**3)


def token_metric_sums(X, Y=None, calibration=DEFAULT_CALIBRATION, *, keys_centred=True):
    """A chunk's shares of the token metrics: ``(sum_i X_i^T X_i, sum_i (P X_i)^T P X_i, tokens)``, P the centring
    within each sequence (``Y`` unused: a :meth:`rstar.streaming.Samples.map_sum` function); with
    ``keys_centred=False`` the centred sum is not formed (``None`` in its place)."""
    n, T, d = X.shape
    Mq, Mk = np.zeros((d, d)), np.zeros((d, d)) if keys_centred else None
    for part in _chunks(n, T, d, calibration):
        Xp = X[part].reshape(-1, d)
        Mq += Xp.T @ Xp
        if keys_centred:
            Xc = (X[part] - X[part].mean(axis=1, keepdims=True)).reshape(-1, d)
            Mk += Xc.T @ Xc
    return Mq, Mk, n * T


def token_metric_roots_of_sums(sums, ridge=1e-12):
    """:func:`token_metric_roots` from the summed :func:`token_metric_sums` (a key side of ``None``: the
    query side's roots in its place, :func:`uncentred_key_roots`)."""
    Mq, Mk, count = sums
    out = []
    for M in (Mq / count,) if Mk is None else (Mq / count, Mk / count):
        out += [psd_power(M, 0.5, rcond=ridge), psd_power(M, -0.5, rcond=ridge)]
    return tuple(out) if Mk is not None else tuple(out) * 2


def token_metric_roots_of_halves(halves, ridge=1e-12, *, calibration=DEFAULT_CALIBRATION):
    """:func:`token_metric_roots` of the samples of both halves ``((X1, Y1), (X2, Y2))`` together, summed half by
    half (without joining them: a copy of every sample)."""
    sums = [token_metric_sums(X, calibration=calibration) for X, _ in halves]
    return token_metric_roots_of_sums(tuple(a + b for a, b in zip(*sums)), ridge)


def token_metric_roots(X, ridge=1e-12, *, calibration=DEFAULT_CALIBRATION, keys_centred=True):
    """Square roots and pseudo-inverse square roots of the query- and key-side token metrics.

    ``M_q = sum_i X_i^T X_i / (n T)`` (the tokens) and
    ``M_k = sum_i (X_i - 1 xbar_i^T)^T (X_i - 1 xbar_i^T) / (n T)`` (the tokens centred within their sequence:
    what moves attention weights). The kernel's action on the data is ``M_q^{1/2} K M_k^{1/2}``.
    ``keys_centred=False`` gives ``M_k = M_q``: a rotary head's metric, where a key component constant within the
    sequence is turned by the key's position and so moves attention weights (measured centred, it would weigh
    nothing, and a head projected in that metric would lose it — its positional pattern).

    Returns
    -------
    (Mq_half, Mq_inv_half, Mk_half, Mk_inv_half) : tuple of ndarray of shape (d, d)
    """
    return token_metric_roots_of_sums(token_metric_sums(X, calibration=calibration, keys_centred=keys_centred), ridge)


def uncentred_key_roots(roots):
    """The token metric's roots with the key side's replaced by the query side's (``M_k = M_q``, the keys
    uncentred: a rotary head's cuts)."""
    return (roots[0], roots[1], roots[0], roots[1])
