"""AttentionStudent: the trained students B0–B3 as a scikit-learn regressor."""

import copy
import time
import warnings
from numbers import Integral, Real

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_is_fitted

from .._validation import (check_int, check_positive, check_random_state, check_tokens, check_value_map,
                           check_X_Y_and_y_ndim)
from ..calibration import DEFAULT_CALIBRATION, Calibration
from ..metrics import token_r2_score
from ..budgets import CostBudget
from ..exceptions import InversionFallbackWarning
from ..inversions._numerics.rotary import RotaryPositions
from ._rank import kronecker_entry_variance, mp_corrected_rank, operator_entry_variance

__all__ = ["AttentionStudent", "KINDS"]

#: student kinds and the class names used in the paper
KINDS = {
    "linear_proxy": "B0",
    "linear_qk": "B1",
    "linear_qk_full": "B1c",
    "softmax": "B2",
    "block": "B3",
}
_LINEAR_KINDS = ("linear_proxy", "linear_qk", "linear_qk_full")


def _import_torch():
    try:
        import torch  # noqa: F401
    except ImportError as exc:  # torch missing or blocked
        raise ImportError(
            "rstar.students needs PyTorch, which is not installed. Install it with: pip install \"rstar[torch]\""
        ) from exc
    return torch


def _activation_bytes(kind, batch, T, d, d_v, dtype):
    """About the bytes a training step holds for a batch (autograd keeps each intermediate): the logits and
    attention (three T x T per sample), the token-side products (six of T x max(d, d_v)), the block's FFN (width
    4d: ten T x d more)."""
    width = max(d, d_v)
    per_sample = 3 * T * T + 6 * T * width + (10 * T * d if kind == "block" else 0)
    return batch * per_sample * (4 if dtype == "float32" else 8)


class AttentionStudent(RegressorMixin, BaseEstimator):
    """A trained attention student (classes B0–B3), fitted by full- or large-batch Adam.

    Learns ``Y ≈ f_theta(X)`` for token arrays ``X`` of shape ``(n, T, d)`` and
    targets ``Y`` of shape ``(n, T, d_v)`` by minimising the mean squared
    error, then measures the learned operator: its rank above the
    finite-sample noise level (``rank_``) and its effective rank
    (``effective_rank_``), theory §6.

    Parameters
    ----------
    kind : {"linear_qk", "linear_proxy", "linear_qk_full", "softmax", "block"}, default="linear_qk"
        The student class:

        - ``"linear_proxy"`` (B0): ``Y = A X V`` with ``A = P Q^T`` (T x T).
          A is tied to token positions, so ``predict`` needs the T seen in ``fit``.
        - ``"linear_qk"`` (B1): ``Y = (X W_Q)(X W_K)^T X V / c``, ``c = sqrt(T d)``
          fixed at fit time (the normaliser of
          :func:`rstar.datasets.make_attention_task`).
        - ``"linear_qk_full"`` (B1c): B1 with an unconstrained d x d kernel K
          (the control; ``rank`` must be None).
        - ``"softmax"`` (B2): ``Y = softmax(X W_Q W_K^T X^T / sqrt(d)) X V``.
        - ``"block"`` (B3): B2 followed by residual, LayerNorm, a GELU FFN of
          width 4d, residual, LayerNorm and a linear read-out to d_v.
    rank : int or None, default=None
        Inner dimension r of ``P Q^T`` / ``W_Q W_K^T`` (1 <= r <= T for B0,
        1 <= r <= d otherwise). None is over-parameterised: full width
        (T or d) with the small initialisation ``init_scale``.
    max_epochs : int, default=3000
        Maximum number of passes over the data.
    lr : float, default=1e-2
        Adam learning rate.
    init_scale : float, default=1e-2
        Standard deviation of the entries of the operator's factors
        (P, Q, W_Q, W_K or K) at initialisation; the value map and the other
        weights use ``1/sqrt(fan_in)``.
    batch_size : int or None, default=None
        Mini-batch size; None is full-batch gradient descent.
    device : str, default="auto"
        ``"auto"`` uses CUDA when it is available, else the CPU.
    random_state : int, RandomState instance or None, default=None
        Seeds the initialisation and the batch order. With a fixed seed, CPU
        runs are deterministic (bit-for-bit on the same machine and torch).
    verbose : int, default=0
        > 0 shows a tqdm progress bar with the current loss.
    tol : float, default=1e-4
        Relative improvement of the training loss that resets the plateau counter.
    patience : int, default=100
        Epochs without such an improvement that make a plateau. On a plateau the
        learning rate is halved; after ``max_lr_drops`` halvings the next
        plateau stops training (early stopping).
    max_lr_drops : int, default=3
    weight_decay : float, default=0.0
        Adam's L2 penalty (0 keeps the implicit bias of small initialisation alone).
    alpha : float, default=0.01
        False-alarm level of the noise threshold used for ``rank_``.
    dtype : {"float32", "float64"}, default="float32"
        Precision of training.
    calibration : Calibration or None, default=None
        The tuned values the rank measurement reads (the samples of the operator's Fisher information and its
        chunks: ``fisher_samples``, ``fisher_chunk``; :mod:`rstar.calibration`). None: ``DEFAULT_CALIBRATION``.
    memory_budget : int or None, default=None
        Bytes the student may hold at once beyond its data. Given, a training batch whose activations would take
        more than half of it is refused before training with a one-line error (lower ``batch_size``); None: the
        calibration's ``memory_budget`` (512 MiB) for the Fisher information only, and training that runs out of
        memory stops with that one-line error. With ``fisher="auto"`` the operator's Fisher information is
        computed exactly where its ``m x m`` matrix (m = d^2 entries, T^2 for B0) fits in half of it, else by its
        nearest Kronecker factors.
    fisher : {"auto", "exact", "kronecker"}, default="auto"
        How the operator's Fisher information is computed (see Notes). ``"exact"`` beyond the memory budget is
        refused; ``"kronecker"`` needs a query-key student (not B0). A rotary student takes ``"auto"`` only: its
        noise level is the split-half test's.
    value_map : array-like of shape (d, d_v) or None, default=None
        A known value map ``V``, held fixed while the rest trains (as :class:`rstar.RStarEstimator`'s
        ``value_map``): the student then learns only its operator, on the same task the estimator's V-known fit
        reads. None learns V with the rest. Not for ``"block"`` (its value map is d x d inside the block).
    causal : bool, default=False
        ``"softmax"`` and ``"block"``: each token attends to itself and the tokens before it (a decoder head, as
        :class:`rstar.RStarEstimator`'s ``causal``).
    rotary : rstar.RotaryPositions or None, default=None
        ``"softmax"`` only: a rotary head at these positions (one angle per plane and token of the T in ``fit``;
        ``collect_attention`` reads a model's), ``logit_ts = rot_t(x_t A) . rot_s(x_s B) / sqrt(d)`` with A, B of
        d x 2P (``2P = rotary.width``). ``rank`` is then the head's width (``A = L G_q``, ``B = R G_k`` through
        an r-dimensional space; 1 <= r <= min(d, 2P)) and ``rank_`` is read by the split-half test (see Notes).
    validation_fraction : float in (0, 0.5) or None, default=None
        Early stopping on held-out samples: this share of the samples (drawn with ``random_state``) is not trained
        on; the plateau rule (``tol``, ``patience``, ``max_lr_drops``) reads their risk instead of the training
        risk, and the weights of the epoch with the lowest held-out risk are kept. None trains on every sample to
        the training risk's plateau — which on noise-free targets (a real head's outputs) can fit directions other
        windows do not share.

    Attributes
    ----------
    rank_ : int
        MP-corrected rank of the learned operator: the number of its singular
        values above ``noise_threshold_`` (see Notes).
    effective_rank_ : float
        R_eff (entropy, eq. 1) for the linear kinds, R̃_eff (energy, eq. 2)
        for ``"softmax"`` and ``"block"``, computed on the singular values
        above ``noise_threshold_`` only.
    raw_effective_rank_ : float
        The same measure on all singular values (no correction).
    kernel_ : ndarray of shape (T, T) for B0, (d, d) otherwise
        The learned operator ``A = P Q^T`` or ``K = W_Q W_K^T``.
    kernel_singular_values_ : ndarray
        Its singular values, descending.
    noise_threshold_ : float
        The finite-sample noise level tau of the operator's singular values.
    kernel_entry_variance_ : float
        Average per-entry variance s^2 of the operator's estimation error (nan for a rotary student: its noise
        level is the split-half test's).
    fisher_method_ : {"exact", "kronecker", "split_half"}
        How the operator's noise level was computed (see Notes); ``"kronecker"`` chosen by ``"auto"`` is
        warned; ``"split_half"`` for rotary students.
    query_key_factors_ : tuple of two ndarrays of shape (d, k), softmax kinds only
        ``(A, B)`` with the logits ``x_t A (x_s B)^T / sqrt(d)`` (turned by the positions for a rotary student):
        what a model's head would take in place of its own query and key maps (k = r, d or 2P).
    noise_variance_ : float
        Per-entry residual variance of the training targets.
    history_ : list of float
        Training risk (mean per-sample ``||Y - Y_hat||_F^2``) at each epoch.
    validation_history_ : list of float, with ``validation_fraction`` only
        The held-out samples' risk at each epoch.
    validation_samples_ : ndarray of int, with ``validation_fraction`` only
        The indices of the held-out samples.
    train_risk_ : float
        Final training risk, comparable with the noise floor ``sigma^2 T d_v``.
    n_iter_ : int
        Number of epochs run.
    n_features_in_ : int
        d.
    seq_len_ : int
        T seen in ``fit``.
    n_outputs_ : int
        d_v.
    device_ : str
        The device trained on.
    fit_time_ : float
        Seconds spent in training (excluding the rank computation).

    Notes
    -----
    ``rank_``: near the optimum the learned operator is the population
    operator plus a Gaussian error with covariance ``sigma^2 F^{-1}``,
    ``F = J^T J`` the Fisher information of the operator's entries (the other
    weights held at their fitted values). Replacing it by the isotropic matrix
    of equal total variance, pure noise reaches at most the Tracy–Widom
    corrected Marchenko–Pastur edge ``~ s (sqrt(p) + sqrt(q))`` with
    probability ``1 - alpha``; only singular values above it count. ``F`` is
    computed with forward-mode autodiff on at most 256 training samples (the
    calibration's ``fisher_samples``) and rescaled to n. See :func:`rstar.students.mp_corrected_rank`.

    At real sizes (d = 384: ``F`` has d^4 = 2e10 entries) ``F`` is not formed: the kernel enters the query-key
    students only through the logits, and token t's output only through row t of them, so each row of the Jacobian
    is a rank-one matrix ``x_t u^T`` (``u = sum_s (d y / d S_ts) x_s`` times the logit scale, from one forward-mode
    pass per key position), and ``F = sum (x x^T) (x) (u u^T)``. Its nearest Kronecker product ``A (x) B`` in the
    Frobenius norm (alternating least squares on the two factors, each a sum over the same rows; Van Loan and
    Pitsianis 1993) gives ``tr(F^{-1}) ~ tr(A^{-1}) tr(B^{-1})`` (:func:`rstar.students.kronecker_entry_variance`),
    in ``O(d^2)`` memory; ``fisher_method_`` says which was used. Where both can run they were compared in
    ``tests/test_students.py``.

    A rotary student's logits are not linear in one d x d kernel (offset delta has its own, ``A R(delta) B^T``),
    and its width is the rank of that family (:mod:`rstar.inversions.softmax_rotary`). Its ``rank_`` is the
    split-half test rstar's rotary fit reads: two more students, trained the same way from the same initial
    weights on the samples of odd and of even index, and the family of their mean against the family of their
    half-difference (in the tokens' metric, over the window's offsets); ``rank_`` counts the directions of the
    first above the calibration's ``split_half_margin`` times the largest of the second (``noise_threshold_``),
    ``kernel_singular_values_`` are the first's. It costs two more trainings on half the samples each.

    Examples
    --------
    >>> from rstar.datasets import make_attention_task
    >>> from rstar.students import AttentionStudent
    >>> X, Y = make_attention_task(200, kind="linear_qk", seq_len=8, n_features=6,
    ...                            rank=2, random_state=0)
    >>> student = AttentionStudent(kind="linear_qk", random_state=0)  # over-parameterised
    >>> student.fit(X, Y).rank_
    2
    >>> round(student.effective_rank_, 2)
    2.0
    >>> student.predict(X).shape
    (200, 8, 6)
    """

    _parameter_constraints = {
        "kind": [StrOptions(set(KINDS))],
        "rank": [Interval(Integral, 1, None, closed="left"), None],
        "max_epochs": [Interval(Integral, 1, None, closed="left")],
        "lr": [Interval(Real, 0, None, closed="neither")],
        "init_scale": [Interval(Real, 0, None, closed="neither")],
        "batch_size": [Interval(Integral, 1, None, closed="left"), None],
        "device": "no_validation",   # resolved by rstar._torch_backend.resolve_torch_device (imports torch)
        "random_state": ["random_state"],
        "verbose": [Interval(Integral, 0, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left")],
        "patience": [Interval(Integral, 1, None, closed="left")],
        "max_lr_drops": [Interval(Integral, 0, None, closed="left")],
        "weight_decay": [Interval(Real, 0, None, closed="left")],
        "alpha": [Interval(Real, 0, 1, closed="neither")],
        "dtype": [StrOptions({"float32", "float64"})],
        "calibration": [Calibration, None],
        "memory_budget": [Interval(Integral, 1, None, closed="left"), None],
        "fisher": [StrOptions({"auto", "exact", "kronecker"})],
        "value_map": ["array-like", None],
        "causal": ["boolean"],
        "rotary": [RotaryPositions, None],
        "validation_fraction": [Interval(Real, 0, 0.5, closed="neither"), None],
    }

    def __init__(self, kind="linear_qk", rank=None, max_epochs=3000, lr=1e-2, init_scale=1e-2, batch_size=None,
                 device="auto", random_state=None, verbose=0, tol=1e-4, patience=100, max_lr_drops=3,
                 weight_decay=0.0, alpha=0.01, dtype="float32", calibration=None, memory_budget=None,
                 fisher="auto", value_map=None, causal=False, rotary=None, validation_fraction=None):
        self.kind = kind
        self.rank = rank
        self.max_epochs = max_epochs
        self.lr = lr
        self.init_scale = init_scale
        self.batch_size = batch_size
        self.device = device
        self.random_state = random_state
        self.verbose = verbose
        self.tol = tol
        self.patience = patience
        self.max_lr_drops = max_lr_drops
        self.weight_decay = weight_decay
        self.alpha = alpha
        self.dtype = dtype
        self.calibration = calibration
        self.memory_budget = memory_budget
        self.fisher = fisher
        self.value_map = value_map
        self.causal = causal
        self.rotary = rotary
        self.validation_fraction = validation_fraction

    # ------------------------------------------------------------------ checks
    def _check_params(self, T, d):
        """The single parameters by ``_parameter_constraints`` (scikit-learn's), then what they leave: bools (which
        its Integral and Real intervals accept) and the parameters' combinations with each other and with the data's
        shape."""
        self._validate_params()
        rank = check_int(self.rank, "rank", 1, allow_none=True)
        if self.kind == "linear_qk_full" and rank is not None:
            raise ValueError("kind='linear_qk_full' (B1c) has an unconstrained d x d kernel: rank must be None, "
                             f"got {self.rank!r}. Use kind='linear_qk' for a rank-constrained kernel.")
        limit, what = (T, "T (A is T x T)") if self.kind == "linear_proxy" else (d, "d (K is d x d)")
        if self.causal and self.kind not in ("softmax", "block"):
            raise ValueError(f"causal=True masks a softmax's logits: kind must be 'softmax' or 'block', got "
                             f"{self.kind!r}.")
        if self.rotary is not None:
            if self.kind != "softmax":
                raise ValueError(f"rotary positions are a softmax head's: kind must be 'softmax' with rotary, got "
                                 f"{self.kind!r}.")
            if self.rotary.length != T:
                raise ValueError(f"rotary has {self.rotary.length} positions, but X has T = {T} tokens.")
            if self.fisher != "auto":
                raise ValueError(f"fisher={self.fisher!r}: a rotary student's logits are not linear in one d x d "
                                 "kernel, so its rank is read by the split-half test; use fisher='auto'.")
            limit, what = min(d, self.rotary.width), f"min(d, rotary.width) = min({d}, {self.rotary.width})"
        if rank is not None and rank > limit:
            raise ValueError(f"rank must be <= {what} = {limit} for kind={self.kind!r}, got {rank}.")
        check_int(self.max_epochs, "max_epochs", 1)
        check_positive(self.lr, "lr", allow_none=False)
        check_positive(self.init_scale, "init_scale", allow_none=False)
        check_int(self.batch_size, "batch_size", 1, allow_none=True)
        check_int(self.verbose, "verbose", 0)
        check_positive(self.tol, "tol", allow_none=False, strict=False)
        check_int(self.patience, "patience", 1)
        check_int(self.max_lr_drops, "max_lr_drops", 0)
        check_positive(self.weight_decay, "weight_decay", allow_none=False, strict=False)
        check_positive(self.alpha, "alpha", allow_none=False, upper=1.0)
        check_int(self.memory_budget, "memory_budget", 1, allow_none=True)
        if self.fisher == "kronecker" and self.kind == "linear_proxy":
            raise ValueError("fisher='kronecker' needs a query-key student: the linear_proxy (B0) operator does "
                             "not enter through logits; use fisher='exact' or 'auto'.")
        return rank

    # --------------------------------------------------------------- fitting
    def fit(self, X, Y):
        """Train the student on ``(X, Y)`` and measure its learned operator.

        Parameters
        ----------
        X : array-like of shape (n_samples, T, d) or (n_samples, d)
        Y : array-like of shape (n_samples, T, d_v) or (n_samples, d_v)

        Returns
        -------
        self
        """
        X, Y, y_ndim = check_X_Y_and_y_ndim(X, Y)
        n, T, d = X.shape
        d_v = Y.shape[2]
        rank = self._check_params(T, d)
        value_map = check_value_map(self.value_map, d, d_v)
        if value_map is not None and self.kind == "block":
            raise ValueError("value_map fixes the value map of a linear_proxy, linear_qk, linear_qk_full or softmax "
                             "student; a block student's is d x d inside the block: use value_map=None.")
        budget = self._budget()
        batch = n if self.batch_size is None else min(int(self.batch_size), n)
        activations = _activation_bytes(self.kind, batch, T, d, d_v, self.dtype)
        if self.memory_budget is not None and not budget.allows_array(activations // 8):
            raise ValueError(f"a training batch of {batch} samples (T = {T}, d = {d}) needs about "
                             f"{activations / 2**20:.0f} MiB of activations, over half the memory budget "
                             f"({budget.memory_bytes / 2**20:.0f} MiB): lower batch_size or raise memory_budget.")
        torch = _import_torch()
        from .._torch_backend import resolve_torch_device
        from ._modules import build_module

        device = resolve_torch_device(self.device)
        dtype = getattr(torch, self.dtype)
        seed = int(check_random_state(self.random_state).randint(np.iinfo(np.int32).max))
        gen = torch.Generator().manual_seed(seed)

        self._module_args_ = dict(kind=self.kind, seq_len=T, n_features=d, value_dim=d_v, rank=rank,
                                  causal=bool(self.causal), rotary=self.rotary)
        self._fixed_value_map = value_map is not None
        module = build_module(**self._module_args_, init_scale=self.init_scale, generator=gen, value_map=value_map)
        module = module.to(device=device, dtype=dtype)
        Xt = torch.as_tensor(X, dtype=dtype, device=device)
        Yt = torch.as_tensor(Y, dtype=dtype, device=device)

        for stale in ("validation_history_", "validation_samples_", "query_key_factors_"):   # a refit's leftovers
            self.__dict__.pop(stale, None)
        validation = self._validation_samples(n, seed)
        if self.rotary is not None:
            self._validation_samples(n // 2, seed)   # the split-half students' halves must hold some out too
        t0 = time.perf_counter()
        try:
            trained = self._train(module, Xt, Yt, gen, torch, validation)
            if validation is None:
                self.history_ = trained
            else:
                self.history_, self.validation_history_ = trained
                self.validation_samples_ = validation
        except (RuntimeError, MemoryError) as error:
            if not isinstance(error, MemoryError) and "memory" not in str(error).lower():
                raise
            raise ValueError(f"training ran out of memory on {device} with batches of {batch} samples (T = {T}, "
                             f"d = {d}: about {activations / 2**20:.0f} MiB of activations): lower batch_size.") \
                from None
        self.fit_time_ = time.perf_counter() - t0
        self.n_iter_ = len(self.history_)

        module.eval()
        with torch.no_grad():
            sse = sum(float(((module(xb) - yb) ** 2).sum()) for xb, yb, _ in self._batches(Xt, Yt, 4096))
        self.train_risk_ = sse / n
        self.noise_variance_ = sse / (n * T * d_v)
        self.module_ = module
        self.n_features_in_, self.seq_len_, self.n_outputs_ = d, T, d_v
        self._y_ndim = y_ndim
        self.device_ = str(device)

        with torch.no_grad():
            self.kernel_ = module.operator().detach().cpu().double().numpy()
            if self.kind in ("softmax", "block"):
                self.query_key_factors_ = tuple(f.detach().cpu().double().numpy() for f in module.query_key_factors())
        if self.rotary is not None:
            self._split_half_rank(X, Y, value_map, seed, device, dtype, torch)
            return self
        size = T if self.kind == "linear_proxy" else d
        exact_fits = budget.allows_kernel_matrix(size)
        if self.fisher == "exact" and not exact_fits:
            raise ValueError(f"fisher='exact': the {size}^2 x {size}^2 Fisher information exceeds half the memory "
                             f"budget ({budget.memory_bytes / 2**20:.0f} MiB): raise memory_budget or use "
                             "fisher='auto'.")
        if self.fisher == "exact" or (self.fisher == "auto" and exact_fits):
            fisher = self._operator_fisher(module, Xt, gen, torch)
            self.kernel_entry_variance_ = operator_entry_variance(fisher, self.noise_variance_)
            self.fisher_method_ = "exact"
        elif self.kind == "linear_proxy":
            raise ValueError(f"the linear_proxy student's Fisher information ({T}^2 x {T}^2 entries) exceeds half "
                             f"the memory budget ({budget.memory_bytes / 2**20:.0f} MiB): raise memory_budget "
                             "or use shorter sequences.")
        else:
            query_factor, key_factor = self._kronecker_fisher(module, Xt, gen, torch, budget)
            self.kernel_entry_variance_ = kronecker_entry_variance(query_factor, key_factor, self.noise_variance_)
            self.fisher_method_ = "kronecker"
        if self.fisher == "auto" and self.fisher_method_ == "kronecker":
            warnings.warn(f"the {d}^2 x {d}^2 Fisher information of the student's kernel exceeds half the memory "
                          f"budget ({budget.memory_bytes / 2**20:.0f} MiB), so its noise level comes from the "
                          "nearest Kronecker product of that information (fisher_method_ = 'kronecker'), which "
                          "under-estimated the exact per-entry variance by 2-34% where both ran (d = 6 to 48), so "
                          "rank_ may count too many; raise memory_budget for the exact one.",
                          InversionFallbackWarning, stacklevel=2)
        measure = "entropy" if self.kind in _LINEAR_KINDS else "energy"
        spec = mp_corrected_rank(self.kernel_, self.kernel_entry_variance_, alpha=self.alpha, measure=measure)
        self.rank_ = spec.rank
        self.effective_rank_ = spec.effective_rank
        self.raw_effective_rank_ = spec.raw_effective_rank
        self.noise_threshold_ = spec.threshold
        self.kernel_singular_values_ = spec.singular_values
        return self

    def _calibration(self):
        return DEFAULT_CALIBRATION if self.calibration is None else self.calibration

    def _validation_samples(self, n, seed):
        """The sorted indices of the ``validation_fraction`` of n samples held out (drawn with ``seed``), or None
        without early stopping; refused where that holds out none or leaves fewer than two to train on."""
        if self.validation_fraction is None:
            return None
        n_held = int(round(float(self.validation_fraction) * n))
        if not 1 <= n_held <= n - 2:
            raise ValueError(f"validation_fraction={self.validation_fraction!r} of {n} samples holds out {n_held}: "
                             "at least one sample must be held out and two trained on.")
        return np.sort(check_random_state(seed).permutation(n)[:n_held])

    def _split_half_rank(self, X, Y, value_map, seed, device, dtype, torch):
        """A rotary student's rank (see Notes): two students trained from the fit's initial weights on the samples
        of odd and even index, the split-half count of their logit families."""
        from ..inversions._numerics.rotary import pair_rotations
        from ..inversions._numerics.softmax_factored import causal_mask, token_metric_roots_of_halves
        from ..inversions._statistic import split_half_counts
        from ..inversions.softmax_rotary import family_split_half
        from ..spectral import energy_effective_rank_from_singular_values
        from ._modules import build_module

        halves = [(X[0::2], Y[0::2]), (X[1::2], Y[1::2])]
        factors = []
        for Xh, Yh in halves:
            gen = torch.Generator().manual_seed(seed)
            half = build_module(**self._module_args_, init_scale=self.init_scale, generator=gen, value_map=value_map)
            half = half.to(device=device, dtype=dtype)
            # each half stops as the fit does: on its own held-out share
            self._train(half, torch.as_tensor(Xh, dtype=dtype, device=device),
                        torch.as_tensor(Yh, dtype=dtype, device=device), gen, torch,
                        self._validation_samples(Xh.shape[0], seed))
            with torch.no_grad():
                factors.append(tuple(f.detach().cpu().double().numpy() for f in half.query_key_factors()))
        T = X.shape[1]
        metric = token_metric_roots_of_halves(halves, calibration=self._calibration())
        pairs = pair_rotations(self.rotary, causal_mask(T) if self.causal else None)
        width = factors[0][0].shape[1]
        s, sd, _, _ = family_split_half(metric, factors, pairs, width)
        margin = self._calibration().split_half_margin
        self.noise_threshold_ = float(margin * sd[0])
        self.rank_ = split_half_counts(s, float(sd[0]), margin)[0]
        self.kernel_singular_values_ = s
        self.kernel_entry_variance_ = float("nan")
        self.fisher_method_ = "split_half"
        self.effective_rank_ = float(energy_effective_rank_from_singular_values(s[:self.rank_]))
        self.raw_effective_rank_ = float(energy_effective_rank_from_singular_values(s))

    def _budget(self):
        memory = self._calibration().memory_budget if self.memory_budget is None else int(self.memory_budget)
        return CostBudget(memory_bytes=memory)

    def _fisher_samples(self, module, Xt, gen, torch):
        """At most the calibration's ``fisher_samples`` training samples (drawn with ``gen``), and a frozen copy of
        the module: what the operator's Fisher information is measured on."""
        n = Xt.shape[0]
        sel = torch.randperm(n, generator=gen)[:min(n, self._calibration().fisher_samples)].to(Xt.device)
        return Xt[sel], copy.deepcopy(module).requires_grad_(False)

    def _kronecker_fisher(self, module, Xt, gen, torch, budget):
        """The nearest Kronecker factors ``(A, B)`` (d x d each) of the kernel's Fisher information, rescaled to all n
        samples: with ``F = sum_rows (x x^T) (x) (u u^T)`` (see Notes), ``A = sum (u^T B u) x x^T / ||B||^2`` and
        ``B = sum (x^T A x) u u^T / ||A||^2`` alternated from ``B = I`` until their product's norm changes by less
        than 1e-6 (at most 20 rounds). The rows' ``u = c X^T g`` (``g = dy / dS_t.``, T entries) are never formed:
        ``u^T B u = c^2 g^T (X B X^T) g`` and ``sum u u^T = c^2 X^T (sum g g^T) X`` keep every product at
        ``O(T d^2)`` a sample. The row Jacobians are recomputed each round, in chunks within the memory budget."""
        n, T, d = Xt.shape
        Xs, module = self._fisher_samples(module, Xt, gen, torch)
        m = Xs.shape[0]
        Xs, module = Xs.double(), module.double()
        d_v = module(Xs[:1]).shape[-1]
        per_sample = T * (d_v * T * (T + 1) + 4 * d + 4 * T)   # the jvps' columns, their stack, the products
        chunk = max(1, min(m, budget.memory_bytes // 2 // (8 * per_sample)))
        K0 = module.operator()
        scale = float(module.logit_scale)

        def row_jacobians():
            for start in range(0, m, chunk):
                xb = Xs[start:start + chunk]
                S0 = module.logits(xb, K0)
                columns = []
                for s in range(T):
                    tangent = torch.zeros_like(S0)
                    tangent[..., s] = 1.0
                    columns.append(torch.func.jvp(lambda S, xb=xb: module.forward_with_logits(xb, S),
                                                  (S0,), (tangent,))[1])
                yield xb, torch.stack(columns, dim=-1) * scale              # (c, T, d_v, T): c dy_t / dS_ts

        A = torch.eye(d, dtype=torch.float64, device=Xt.device)
        B = torch.eye(d, dtype=torch.float64, device=Xt.device)
        previous = None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
            for _ in range(20):
                new_A = torch.zeros_like(A)
                for xb, G in row_jacobians():
                    P = xb @ B @ xb.transpose(-1, -2)                          # X B X^T
                    weight = torch.einsum("ntvs,nsu,ntvu->nt", G, P, G)       # sum_v u^T B u, per token
                    new_A += torch.einsum("ntd,nt,nte->de", xb, weight, xb)
                A = new_A / torch.sum(B * B)
                new_B = torch.zeros_like(B)
                for xb, G in row_jacobians():
                    weight = torch.einsum("ntd,de,nte->nt", xb, A, xb)       # x^T A x, per token
                    M = torch.einsum("nt,ntvs,ntvu->nsu", weight, G, G)
                    new_B += torch.einsum("nsd,nsu,nue->de", xb, M, xb)
                B = new_B / torch.sum(A * A)
                current = float(torch.linalg.norm(A) * torch.linalg.norm(B))
                if previous is not None and abs(current - previous) <= 1e-6 * current:
                    break
                previous = current
        return A.cpu().numpy() * (n / m), B.cpu().numpy()

    @staticmethod
    def _batches(Xt, Yt, size, order=None, Zt=None):
        """Consecutive batches ``(X, Y, Z)`` of ``size`` samples, in ``order`` (a permutation) when given (Z None
        where ``Zt`` is)."""
        for start in range(0, Xt.shape[0], size):
            sel = slice(start, start + size) if order is None else order[start:start + size]
            yield Xt[sel], Yt[sel], None if Zt is None else Zt[sel]

    def _train(self, module, Xt, Yt, gen, torch, validation=None):
        """Adam to the plateau rule's stop; with ``validation`` (indices of held-out samples) the rule reads their
        risk, the best epoch's weights are kept, and ``(history, validation_history)`` is returned."""
        Zt = None
        if getattr(self, "_fixed_value_map", False):
            # a value map held fixed: X V is the same at every epoch, computed once (a third of a rotary student's
            # epoch at SmolLM2's size went to it)
            with torch.no_grad():
                Zt = torch.cat([xb @ module.V for xb, _, _ in self._batches(Xt, Yt, 4096)])
        held = None
        if validation is not None:
            keep = np.ones(Xt.shape[0], dtype=bool)
            keep[validation] = False
            pick = torch.as_tensor(np.flatnonzero(keep), device=Xt.device)
            out = torch.as_tensor(np.asarray(validation), device=Xt.device)
            held = (Xt[out], Yt[out], None if Zt is None else Zt[out])
            Xt, Yt, Zt = Xt[pick], Yt[pick], None if Zt is None else Zt[pick]
        n = Xt.shape[0]
        per_sample = Yt.shape[1] * Yt.shape[2]  # mean over entries -> per-sample sum
        batch = n if self.batch_size is None else min(int(self.batch_size), n)
        lr = float(self.lr)
        opt = torch.optim.Adam(module.parameters(), lr=lr, weight_decay=float(self.weight_decay))
        history, held_history, best, since_best, drops = [], [], np.inf, 0, 0
        lowest, best_state = np.inf, None   # the lowest held-out risk and its epoch's weights
        bar = None
        if self.verbose:
            from tqdm.auto import tqdm
            bar = tqdm(total=int(self.max_epochs), desc=f"{KINDS[self.kind]} r={self.rank}", leave=False)
        module.train()
        try:
            for _ in range(int(self.max_epochs)):
                order = None if batch >= n else torch.randperm(n, generator=gen).to(Xt.device)
                total = 0.0
                for xb, yb, zb in self._batches(Xt, Yt, batch, order, Zt):
                    opt.zero_grad(set_to_none=True)
                    loss = torch.mean((module(xb, zb) - yb) ** 2)
                    loss.backward()
                    opt.step()
                    total += float(loss.detach()) * xb.shape[0]
                risk = total / n * per_sample
                if not np.isfinite(risk):
                    raise FloatingPointError(
                        f"training diverged (loss {risk}) at epoch {len(history) + 1}; lower lr (now {self.lr!r}).")
                history.append(risk)
                watched = risk
                if held is not None:
                    with torch.no_grad():
                        watched = sum(float(((module(xb, zb) - yb) ** 2).sum()) for xb, yb, zb
                                      in self._batches(*held[:2], 4096, None, held[2])) / held[0].shape[0]
                    held_history.append(watched)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(risk=f"{risk:.4g}", lr=f"{lr:.2g}")
                if held is not None and watched < lowest:
                    lowest, best_state = watched, {k: v.detach().clone() for k, v in module.state_dict().items()}
                if watched < best * (1 - self.tol):
                    best, since_best = watched, 0
                else:
                    since_best += 1
                if since_best >= self.patience:
                    if drops >= self.max_lr_drops:
                        break
                    drops, since_best, lr = drops + 1, 0, lr / 2
                    for group in opt.param_groups:
                        group["lr"] = lr
        finally:
            if bar is not None:
                bar.close()
        if held is None:
            return history
        if best_state is not None:
            module.load_state_dict(best_state)
        return history, held_history

    def _operator_fisher(self, module, Xt, gen, torch):
        """``J^T J`` of the predictions w.r.t. the operator's entries, rescaled to all n samples."""
        n = Xt.shape[0]
        Xs, module = self._fisher_samples(module, Xt, gen, torch)
        m, chunk = Xs.shape[0], self._calibration().fisher_chunk
        K0 = module.operator()
        F = torch.zeros(K0.numel(), K0.numel(), dtype=Xt.dtype, device=Xt.device)
        with warnings.catch_warnings():
            # torch's forward-AD decompositions call the deprecated torch.jit.script on first use
            warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
            for start in range(0, m, chunk):
                xb = Xs[start:start + chunk]
                J = torch.func.jacfwd(lambda K, xb=xb: module.forward_with_operator(xb, K))(K0)
                J = J.reshape(-1, K0.numel())
                F += J.T @ J
        return F.double().cpu().numpy() * (n / m)

    # ------------------------------------------------------------ prediction
    def predict(self, X):
        """Predict the targets of token arrays.

        Parameters
        ----------
        X : array-like of shape (n_samples, T, d) or (n_samples, d)
            T must equal the fitted ``seq_len_`` for ``kind="linear_proxy"``.

        Returns
        -------
        Y_pred : ndarray of shape (n_samples, T, d_v)
            (``(n_samples, d_v)``, or ``(n_samples,)``, for 2-D X where fit was given a 2-D or 1-D Y: one token
            a sample).
        """
        check_is_fitted(self, "module_")
        if not hasattr(X, "ndim"):
            X = np.asarray(X)
        two_d = X.ndim == 2
        X = check_tokens(X, "X")
        if X.shape[2] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[2]} features, but AttentionStudent is expecting {self.n_features_in_} "
                             f"features as input (per token: X must have shape (n_samples, T, "
                             f"{self.n_features_in_})).")
        if self.rotary is not None and X.shape[1] != self.seq_len_:
            raise ValueError(f"X has T = {X.shape[1]} tokens, but the rotary student turns its {self.seq_len_} "
                             f"positions' tokens: X must have shape (n_samples, {self.seq_len_}, "
                             f"{self.n_features_in_}).")
        if self.kind == "linear_proxy" and X.shape[1] != self.seq_len_:
            raise ValueError(f"X has T = {X.shape[1]} tokens, but the linear_proxy student mixes tokens with a "
                             f"fixed {self.seq_len_} x {self.seq_len_} matrix A: X must have shape "
                             f"(n_samples, {self.seq_len_}, {self.n_features_in_}).")
        torch = _import_torch()
        from .._torch_backend import resolve_torch_device
        device = resolve_torch_device(self.device)
        module = self.module_
        first = next(module.parameters())
        if first.device != device:
            module = module.to(device)
        Xt = torch.as_tensor(X, dtype=first.dtype, device=device)
        module.eval()
        with torch.no_grad():
            out = [module(Xt[s:s + 4096]).double().cpu().numpy() for s in range(0, X.shape[0], 4096)]
        Y = np.concatenate(out, axis=0)
        if two_d and getattr(self, "_y_ndim", 3) in (1, 2):   # as the Y given to fit (a 1-D Y had one output)
            return Y[:, 0, 0] if self._y_ndim == 1 else Y[:, 0]
        return Y

    def score(self, X, y, sample_weight=None):
        """Token-wise R²: sklearn's ``r2_score`` on Y reshaped to ``(n·T, d_v)``.

        Parameters
        ----------
        X : array-like of shape (n_samples, T, d) or (n_samples, d)
        y : array-like of shape (n_samples, T, d_v) or (n_samples, d_v)
            The targets Y (named ``y`` as scikit-learn passes it by keyword).
        sample_weight : None
            Not supported; must be None.

        Returns
        -------
        float
            See :func:`rstar.metrics.token_r2_score`.
        """
        if sample_weight is not None:
            raise ValueError("sample_weight is not supported by the token-wise R² score.")
        X, Y, _ = check_X_Y_and_y_ndim(X, y)
        pred = self.predict(X)   # 3-D here: X was read as (n, T, d)
        if pred.shape[2] != Y.shape[2]:
            raise ValueError(f"Y has d_v = {Y.shape[2]} outputs, but this student predicts {pred.shape[2]}.")
        return token_r2_score(Y, pred)

    # ---------------------------------------------------------------- pickle
    def __getstate__(self):
        state = dict(super().__getstate__())  # a copy: object.__getstate__ returns the live __dict__
        module = state.pop("module_", None)
        if module is not None:
            # CPU numpy arrays: loads on a machine without CUDA
            state["_module_state_"] = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
            state["_module_dtype_"] = str(next(module.parameters()).dtype).replace("torch.", "")
        return state

    def __setstate__(self, state):
        module_state = state.pop("_module_state_", None)
        dtype = state.pop("_module_dtype_", "float32")
        super().__setstate__(state)
        if module_state is not None:
            torch = _import_torch()
            from ._modules import build_module
            args = self._module_args_
            # a fixed value map is a buffer of the state: a placeholder of its shape, then loaded
            placeholder = (np.zeros((args["n_features"], args["value_dim"]))
                           if getattr(self, "_fixed_value_map", False) else None)
            module = build_module(**args, init_scale=1.0, generator=torch.Generator().manual_seed(0),
                                  value_map=placeholder)
            module = module.to(getattr(torch, dtype))
            module.load_state_dict({k: torch.as_tensor(v) for k, v in module_state.items()})
            self.module_ = module

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        tags.target_tags.single_output = False
        tags.non_deterministic = self.random_state is None
        # one token a sample (2-D X): attention of a single token degenerates (softmax of one logit is 1)
        tags.regressor_tags.poor_score = self.kind != "linear_proxy"
        return tags
