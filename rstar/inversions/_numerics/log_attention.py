"""Log-attention least squares: a head's logits read back from its outputs (pure functions on arrays).

With the value map V known and the value path ``Z_i = X_i V`` (T x d_v) of full row rank, a softmax head's output
``Y_i = S_i Z_i`` gives its attention back, ``S_i = Y_i Z_i^+`` (theory §4, the exact inversion), and each kept
entry gives its logit up to the row's normaliser: ``log S_its = l_its - c_it``. A model of the logits (a rotary
head's ``rotate(X_i A) rotate(X_i B)^T / sqrt(d)``) is then fitted by weighted least squares on ``log S`` with the
row constants removed by weighted centring (Frisch–Waugh), so each entry counts by how well its log is known,
not by how much it moves the output. On a real head's windows that is the difference between the output least
squares, whose small attention weights barely constrain their logits (a fit reproduces its own windows and
misses held-out ones), and a fit that generalises: SmolLM2 layer 3 head 3 (n = 250 windows of 32 tokens,
d = 577) held out 36 % of Var(Y) after 1100 iterations of the output least squares and 0.5 % after 600 of this
one on 300 other windows (a one-off diagnostic of one half's fit, not kept in ``benchmarks/``; the whole estimator
on that head is in ``benchmarks/rotary_real_heads.py --heads diagonal``).

Weights (the delta method with a floor): ``Var(S_its) = sigma^2 [(Z_i Z_i^T)^{-1}]_ss`` with ``sigma^2`` the
output noise (the part of Y outside the row space of Z, ``d_v - T`` degrees of freedom a row), so
``Var(log S) ~ Var(S) / S^2`` and an entry weighs ``1 / (1 + Var(log S) / tau^2)``: a logit known to within
``tau`` (the calibration's ``log_attention_variance_floor``, tau^2 in nats^2) counts fully, one buried in the
noise hardly at all, and a non-positive S not at all. What the noise buries is still known to be small: the rest
of each entry's weight holds the model's log-attention below ``log(S+ + 2 sd(S))`` (a one-sided, censored term),
so that no direction the known logits leave free can raise a buried logit (without it, two halves of a planted
width-4 head agreed on every known logit and disagreed by 0.8 % of Var(Y) on their outputs). Columns whose value
rows the window does not tell apart (a token repeated in one window: its rows of Z coincide) give no entry.
"""

import numpy as np

from .linalg import solve_psd
from .rotary import rotate, rotate_adjoint
from .softmax_factored import _chunks, _ridged, closed_prefix
from ...calibration import DEFAULT_CALIBRATION
from ..._backend import NUMPY

__all__ = ["first_position_value_map", "first_position_gives_value_map", "attention_from_outputs",
           "log_attention_targets", "log_attention_loss", "LogAttentionHalfLoss",
           "log_attention_half_losses"]


def first_position_gives_value_map(n_samples, d, mask, *, calibration=DEFAULT_CALIBRATION):
    """Whether :func:`first_position_value_map` reads V well enough for a start: the first query attends to itself
    alone (``mask`` keeps only ``(0, 0)`` in its first row: causal or sliding-window attention) and there are at
    least the calibration's ``first_position_samples_ratio`` times d samples to regress on."""
    if mask is None or not np.asarray(mask, dtype=bool)[0, 0] or not closed_prefix(mask, 1):
        return False
    return n_samples >= calibration.first_position_samples_ratio * d


def first_position_value_map(X, Y, *, calibration=DEFAULT_CALIBRATION):
    """The value map read from the first position of causal windows: ``y_i0 = x_i0^T V`` (its query attends to
    itself alone, whatever the logits), so V is the least squares of ``Y[:, 0]`` on ``X[:, 0]`` (ridged by the
    calibration's ``value_ridge``, relative to the mean eigenvalue, where the first tokens span fewer than d
    directions).

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)

    Returns
    -------
    V : ndarray of shape (d, d_v)
    """
    X0, Y0 = X[:, 0, :], Y[:, 0, :]
    return solve_psd(_ridged(X0.T @ X0, calibration.value_ridge), X0.T @ Y0)


def attention_from_outputs(X, Y, value_map, *, calibration=DEFAULT_CALIBRATION):
    """The attention that produced Y: ``S_i = Y_i Z_i^+`` with ``Z_i = X_i V``, and each entry's variance.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    Y : ndarray of shape (n, T, d_v)
    value_map : ndarray of shape (d, d_v)
        With ``d_v > T``.
    calibration : Calibration
        Its ``value_ridge`` (relative, times the largest eigenvalue of ``Z_i Z_i^T``): directions of ``Z_i Z_i^T``
        below it are not told apart.

    Returns
    -------
    S : ndarray of shape (n, T, T)
    variance : ndarray of shape (n, T, T)
        ``Var(S_its)`` under output noise of the variance left outside the rows of Z, plus the solve's rounding
        ``(eps cond(Z_i) T)^2``; ``inf`` in a column s whose row of ``Z_i`` is not told apart from the others.
    noise_variance : float
        That variance, per output entry.
    """
    n, T, _ = X.shape
    d_v = Y.shape[2]
    Z = X @ value_map
    G = Z @ Z.transpose(0, 2, 1)                     # (n, T, T)
    lam, U = np.linalg.eigh(G)
    keep = lam > calibration.value_ridge * np.maximum(lam[:, -1:], 1e-300)
    inv = np.where(keep, 1.0 / np.where(keep, lam, 1.0), 0.0)
    # S^T = G^+ Z Y^T; the leverage of column s on the dropped directions marks it as not told apart
    ZY = Z @ Y.transpose(0, 2, 1)                    # (n, T, T): Z_i Y_i^T
    S = np.einsum("nak,nk,nbk,nbt->nta", U, inv, U, ZY, optimize=True)
    residual = Y - S @ Z
    noise_variance = float(np.einsum("ntv,ntv->", residual, residual)) / max(n * T * (d_v - T), 1)
    diag_inv = np.einsum("nsk,nk->ns", U**2, inv)     # [(Z Z^T)^+]_ss
    unresolved = np.einsum("nsk,nk->ns", U**2, (~keep).astype(float)) > 1e-8
    # rounding: a least-squares solve is good to about eps cond(Z_i) times its size (Higham, Accuracy and Stability
    # of Numerical Algorithms, ch. 20); on planted heads the errors of S at true weights below 1e-25 were 3 (median)
    # to 16 (max) times eps cond(Z_i), so eps cond T (T = 8 there) bounds them
    cond = np.sqrt(lam[:, -1] / np.min(np.where(keep, lam, np.inf), axis=1))
    eps = np.finfo(G.dtype if np.issubdtype(G.dtype, np.floating) else float).eps   # the solve's own precision
    rounding = (eps * cond * T) ** 2
    per_column = noise_variance * diag_inv + rounding[:, None]
    variance = np.broadcast_to(np.where(unresolved, np.inf, per_column)[:, None, :], (n, T, T)).copy()
    return S, variance, noise_variance


def log_attention_targets(S, variance, mask=None, *, calibration=DEFAULT_CALIBRATION):
    """``(L, W, U, C)``: the targets and weights of :func:`log_attention_loss_terms`.

    ``L = log S`` with weight ``W = 1 / (1 + Var(log S) / tau^2)``, ``Var(log S) = Var(S) / S^2`` (tau^2 the
    calibration's ``log_attention_variance_floor``); and for what the noise buries, a bound: ``U = log(S+ + 2 sd(S))``
    with weight ``C = 1 - W`` on the model's log-attention from above (a small weight is known to be small even
    where its log is not known). All four are 0 where masked or in a column not told apart (``Var(S)`` infinite).
    """
    known = np.isfinite(variance)
    if mask is not None:
        known &= mask
    positive = known & (S > 0)
    Sp = np.where(positive, S, 1.0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        var_log = np.where(positive, variance / Sp**2, np.inf)
        W = np.where(positive, 1.0 / (1.0 + var_log / calibration.log_attention_variance_floor), 0.0)
        upper = np.maximum(S, 0.0) + 2.0 * np.sqrt(np.where(known, variance, 0.0))
        U = np.where(known & (upper > 0), np.log(np.where(upper > 0, upper, 1.0)), 0.0)
    C = np.where(known & (upper > 0), 1.0 - W, 0.0)
    return np.where(positive, np.log(Sp), 0.0), W, U, C


def log_attention_loss_terms(X, L, W, U, C, A, B, rotary=None):
    """A chunk's log-attention loss and its gradients in the factors.

    With the model's logits ``l = rotate(X A) rotate(X B)^T / sqrt(d)``, ``e = l - L`` and the row constant
    ``ebar_it`` (e's W-weighted mean over the row: the fitted log-normaliser),
    ``f = sum W (e - ebar)^2 + sum C max(0, l - ebar - U)^2``: the known logs fitted, the buried ones held below
    their bound. Rows without a known entry give nothing.
    """
    n, T, d = X.shape
    q = A.shape[1]
    c = 1.0 / np.sqrt(d)
    XA, XB = X @ A, X @ B
    if rotary is not None:
        XA, XB = rotate(XA, rotary), rotate(XB, rotary)
    G = XA @ XB.transpose(0, 2, 1) * c
    E = G - L
    mass = W.sum(axis=2, keepdims=True)
    has = mass > 0
    ebar = np.where(has, np.einsum("nts,nts->nt", W, E)[..., None] / np.where(has, mass, 1.0), 0.0)
    E = E - ebar
    H = np.where(has, np.maximum(G - ebar - U, 0.0), 0.0)
    WE, CH = W * E, C * H
    f = float(np.einsum("nts,nts->", WE, E) + np.einsum("nts,nts->", CH, H))
    # the centring projects (its adjoint leaves W E as is); the bound's row constant passes its pull to the row
    pull = np.where(has, CH.sum(axis=2, keepdims=True) / np.where(has, mass, 1.0), 0.0)
    dG = 2.0 * c * (WE + CH - W * pull)
    dA, dB = dG @ XB, dG.transpose(0, 2, 1) @ XA
    if rotary is not None:
        dA, dB = rotate_adjoint(dA, rotary), rotate_adjoint(dB, rotary)
    Xf = X.reshape(-1, d)
    return f, Xf.T @ dA.reshape(-1, q), Xf.T @ dB.reshape(-1, q)


def log_attention_loss(X, targets, A, B, *, calibration=DEFAULT_CALIBRATION, rotary=None):
    """:func:`log_attention_loss_terms` summed over all samples, chunk by chunk (bounded temporaries);
    ``targets = (L, W, U, C)`` of :func:`log_attention_targets`."""
    n, T, d = X.shape
    f, gA, gB = 0.0, np.zeros_like(A), np.zeros_like(B)
    for part in _chunks(n, T, d, calibration):
        fp, a, b = log_attention_loss_terms(X[part], *(t[part] for t in targets), A, B, rotary)
        f += fp
        gA += a
        gB += b
    return f, gA, gB


class LogAttentionHalfLoss:
    """One half's log-attention loss on numpy float64, with the factored losses' signature:
    ``loss(A, B, V, value_grad=False) -> (f, grad_A, grad_B, None)`` (V is the known one the targets were read
    with; it is not fitted). The torch back-end's :class:`rstar._torch_backend.log_attention.LogAttentionHalfLoss`
    computes the same on a device."""

    def __init__(self, X, targets, *, calibration=DEFAULT_CALIBRATION, rotary=None):
        self.X, self.targets, self.calibration, self.rotary = X, targets, calibration, rotary

    def __call__(self, A, B, V=None, value_grad=False):
        if value_grad:
            raise ValueError("the log-attention loss reads the attention with a known value map; it fits no V.")
        return (*log_attention_loss(self.X, self.targets, A, B, calibration=self.calibration,
                                    rotary=self.rotary), None)


def log_attention_half_losses(halves, value_map, mask=None, ops=NUMPY, *, calibration=DEFAULT_CALIBRATION,
                              rotary=None):
    """Each half's log-attention loss: the targets read on numpy in float64 (:func:`attention_from_outputs`, with
    ``value_map``, or each half's own where it is a tuple of two; :func:`log_attention_targets`), the loss evaluated
    on numpy (:class:`LogAttentionHalfLoss`) or on ``ops``'s device in its ``fit_dtype``
    (:class:`rstar._torch_backend.log_attention.LogAttentionHalfLoss`)."""
    maps = value_map if isinstance(value_map, tuple) else (value_map,) * len(halves)
    losses = []
    for (X, Y), V in zip(halves, maps):
        S, variance, _ = attention_from_outputs(X, Y, V, calibration=calibration)
        targets = log_attention_targets(S, variance, mask, calibration=calibration)
        losses.append(LogAttentionHalfLoss(X, targets, calibration=calibration, rotary=rotary) if ops.name == "numpy"
                      else ops.log_attention_half_loss(X, targets, calibration.chunk_entries, rotary=rotary))
    return losses
