"""The log-attention least squares of rotary heads (V known, T well below d_v): the attention read back from the
outputs, its weights, the loss's gradients, and the width it reads through RStarEstimator."""

import warnings

import numpy as np
import pytest

from rstar import RotaryPositions, RStarEstimator
from rstar.inversions import choose_inversion
from rstar.inversions._numerics import softmax_factored as sf
from rstar.calibration import DEFAULT_CALIBRATION
from rstar.inversions._numerics.log_attention import (LogAttentionHalfLoss, attention_from_outputs,
                                                      first_position_gives_value_map, first_position_value_map,
                                                      log_attention_half_losses, log_attention_loss,
                                                      log_attention_targets)
from rstar.inversions.softmax_rotary import ROTARY_LOG_NAME, ROTARY_NAME

T, D, P, DV = 8, 16, 4, 16
POS = RotaryPositions.from_frequencies(10000.0 ** -(np.arange(P) / P), T)
MASK = np.tril(np.ones((T, T), dtype=bool))


def _head(planes, seed=0, scale=1.5):
    rng = np.random.default_rng(seed)
    A, B = np.zeros((D, 2 * P)), np.zeros((D, 2 * P))
    for p in planes:
        for c in (p, p + P):
            A[:, c], B[:, c] = rng.standard_normal(D) * scale, rng.standard_normal(D) * scale
    return A, B


def _task(A, B, n=600, seed=0, noise=0.0):
    rng = np.random.default_rng(seed + 100)
    X = rng.standard_normal((n, T, D))
    V = rng.standard_normal((D, DV)) / np.sqrt(D)
    Y = sf.factored_outputs(X, X @ V, A, B, MASK, rotary=POS)
    return X, Y + noise * Y.std() * rng.standard_normal(Y.shape), V


def test_attention_is_read_back_exactly_and_a_repeated_token_gives_no_entry():
    A, B = _head((0, 2))
    X, Y, V = _task(A, B, n=20)
    X[3, 5] = X[3, 2]                                 # token 2 repeated at position 5 in sample 3
    Y = sf.factored_outputs(X, X @ V, A, B, MASK, rotary=POS)
    S, variance, sigma2 = attention_from_outputs(X, Y, V)
    truth = sf._attention(X, A, B, MASK, POS)
    keep = np.ones(20, dtype=bool)
    keep[3] = False
    np.testing.assert_allclose(S[keep], truth[keep], atol=1e-10)
    assert sigma2 < 1e-25
    # the repeated token's two columns are not told apart: no weight; every other kept entry counts fully
    L, W, U, C = log_attention_targets(S, variance, MASK)
    assert np.all(W[3][:, [2, 5]] == 0) and np.all(C[3][:, [2, 5]] == 0) and np.all(np.isinf(variance[3][:, [2, 5]]))
    outside = ~MASK[None].repeat(20, 0)
    assert np.all(W[outside] == 0) and np.all(C[outside] == 0)
    clear = keep[:, None, None] & MASK & (truth > 1e-6)
    assert np.all(W[clear] > 0.999)
    # where W is below 1 the rest holds the entry below its bound
    np.testing.assert_allclose((W + C)[keep[:, None, None] & MASK], 1.0)
    np.testing.assert_allclose(L[clear], np.log(truth[clear]), atol=1e-6)


def test_output_noise_is_estimated_and_buried_entries_fade():
    A, B = _head((0, 1, 2, 3), scale=2.5)
    X, Y, V = _task(A, B, n=400)
    rng = np.random.default_rng(7)
    sigma = 0.01
    S, variance, sigma2 = attention_from_outputs(X, Y + sigma * rng.standard_normal(Y.shape), V)
    assert sigma2 == pytest.approx(sigma**2, rel=0.05)
    truth = sf._attention(X, A, B, MASK, POS)
    _, W, U, C = log_attention_targets(S, variance, MASK)
    small, large = MASK & (truth < 1e-4), MASK & (truth > 0.2)
    assert W[small].mean() < 0.2 < 0.95 < W[large].mean()
    # the bound on a buried entry holds the truth in all but a few per cent of entries (2 standard deviations)
    assert np.mean(np.log(truth[small]) <= U[small]) > 0.95
    assert C[small].mean() > 0.8


def test_log_attention_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5, T, D))
    targets = (rng.standard_normal((5, T, T)), rng.uniform(size=(5, T, T)) * MASK,
               rng.standard_normal((5, T, T)) - 1.0, rng.uniform(size=(5, T, T)) * MASK)
    A, B = rng.standard_normal((D, 2 * P)) * 0.3, rng.standard_normal((D, 2 * P)) * 0.3
    f, gA, gB = log_attention_loss(X, targets, A, B, rotary=POS)
    eps = 1e-6
    for which, grad in ((0, gA), (1, gB)):
        for i, j in ((3, 5), (0, 0), (15, 7)):
            E = np.zeros_like(A)
            E[i, j] = eps
            plus = [A + E, B] if which == 0 else [A, B + E]
            minus = [A - E, B] if which == 0 else [A, B - E]
            numeric = (log_attention_loss(X, targets, *plus, rotary=POS)[0]
                       - log_attention_loss(X, targets, *minus, rotary=POS)[0]) / (2 * eps)
            assert numeric == pytest.approx(grad[i, j], rel=1e-5, abs=1e-8)
    # the row constants are free: adding one to a row of L and U changes nothing
    shift = rng.standard_normal((5, T, 1))
    moved = (targets[0] + shift, targets[1], targets[2] + shift, targets[3])
    assert log_attention_loss(X, moved, A, B, rotary=POS)[0] == pytest.approx(f, rel=1e-10)
    # the true head has zero loss on its own log-attention
    A0, B0 = _head((1,))
    S = sf._attention(X, A0, B0, MASK, POS)
    assert log_attention_loss(X, log_attention_targets(S, np.zeros_like(S), MASK), A0, B0, rotary=POS)[0] < 1e-18
    with pytest.raises(ValueError, match="fits no V"):
        LogAttentionHalfLoss(X, targets, rotary=POS)(A, B, np.eye(D), value_grad=True)


def _random_targets(n, seed=0):
    """Targets with every term at work: weights in (0, 1), bounds the model crosses, a row with no known entry
    (sample 0, row 3) and a row whose entries are all buried (sample 1, row 4: W = 0, C > 0)."""
    rng = np.random.default_rng(seed)
    L = rng.standard_normal((n, T, T))
    W = rng.uniform(size=(n, T, T)) * MASK
    U = rng.standard_normal((n, T, T)) - 1.0
    C = rng.uniform(size=(n, T, T)) * MASK
    W[0, 3], C[0, 3], W[1, 4] = 0.0, 0.0, 0.0
    return L, W, U, C


def test_torch_log_attention_loss_agrees_with_numpy():
    torch = pytest.importorskip("torch")
    from rstar._torch_backend.log_attention import LogAttentionHalfLoss as TorchLoss

    rng = np.random.default_rng(1)
    X = rng.standard_normal((11, T, D))
    targets = _random_targets(11)
    A, B = rng.standard_normal((D, 2 * P)) * 0.5, rng.standard_normal((D, 2 * P)) * 0.5
    f, gA, gB = log_attention_loss(X, targets, A, B, rotary=POS)
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        # chunks of 3 (float64) or 6 (float32) samples: the sums over chunks are checked too
        loss = TorchLoss(X, targets, torch.device("cpu"), dtype, chunk_entries=3 * T * D, rotary=POS)
        assert len(loss.parts) > 1
        ft, tA, tB, tV = loss(A, B, np.eye(D))
        assert tV is None and ft == pytest.approx(f, rel=rtol)
        np.testing.assert_allclose(tA, gA, rtol=rtol, atol=rtol * np.abs(gA).max())
        np.testing.assert_allclose(tB, gB, rtol=rtol, atol=rtol * np.abs(gB).max())
    with pytest.raises(ValueError, match="fits no V"):
        loss(A, B, np.eye(D), value_grad=True)
    # the factors in a basis P: the loss of P A, P B, its gradients P^T times
    Pm = rng.standard_normal((D, D))
    ft, tA, tB, _ = loss(A, B, np.eye(D), basis=Pm)
    f, gA, gB = log_attention_loss(X, targets, Pm @ A, Pm @ B, rotary=POS)
    assert ft == pytest.approx(f, rel=1e-4)
    np.testing.assert_allclose(tA, Pm.T @ gA, rtol=1e-4, atol=1e-4 * np.abs(Pm.T @ gA).max())
    np.testing.assert_allclose(tB, Pm.T @ gB, rtol=1e-4, atol=1e-4 * np.abs(Pm.T @ gB).max())


def test_the_half_losses_are_made_on_the_back_end_asked_for():
    torch = pytest.importorskip("torch")
    from rstar._backend import NUMPY, resolve_backend

    A, B = _head((0, 2))
    X, Y, V = _task(A, B, n=40)
    halves = ((X[::2], Y[::2]), (X[1::2], Y[1::2]))
    ref = log_attention_half_losses(halves, V, MASK, NUMPY, rotary=POS)
    dev = log_attention_half_losses(halves, V, MASK, resolve_backend(torch.device("cpu")), rotary=POS)
    assert type(ref[0]).__module__ != type(dev[0]).__module__
    A1, B1 = 0.9 * A, 1.1 * B
    for r, t in zip(ref, dev):
        np.testing.assert_allclose(t(A1, B1, V)[0], r(A1, B1, V)[0], rtol=1e-4)


def test_the_choice_reads_the_attention_back_only_where_it_can():
    shape = (T, D, DV)
    known = choose_inversion("softmax", shape=shape, n_samples=600, method="least_squares", rotary=POS,
                             value_map_known=True)
    assert known.name == ROTARY_LOG_NAME and "log-attention" in known.reason
    unknown = choose_inversion("softmax", shape=shape, n_samples=600, method="least_squares", rotary=POS,
                               value_map_known=False)
    assert unknown.name == ROTARY_NAME and "value map is not known" in unknown.reason
    # T above 0.9 d_v: X_i V does not give the attention back
    wide = RotaryPositions.from_frequencies(10000.0 ** -(np.arange(P) / P), 15)
    narrow = choose_inversion("softmax", shape=(15, D, DV), n_samples=600, method="least_squares", rotary=wide,
                              value_map_known=True)
    assert narrow.name == ROTARY_NAME and "does not give the attention back" in narrow.reason


@pytest.mark.parametrize("planes, width, noise", [((0, 3), 4, 0.0), ((3,), 2, 0.0), ((0, 1), 4, 0.05),
                                                  ((), 0, 0.05)])
def test_planted_widths_are_read_on_the_log_attention(planes, width, noise):
    """Noise-free and noisy planted heads: the fit runs on the log-attention, the width is exact and the risk
    curve reaches the floor there."""
    A, B = _head(planes)
    X, Y, V = _task(A, B, noise=noise)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est = RStarEstimator(rotary=POS, causal=True, value_map=V, tolerance=0.01, random_state=0).fit(X, Y)
    assert est.inversion_ == ROTARY_LOG_NAME
    assert (est.rank_, est.rank_interval_) == (width, (width, width))
    if width:
        assert est.risk_curve_[width] < 0.01 < est.risk_curve_[width - 1]


@pytest.mark.parametrize("planes, width, noise", [((0, 3), 4, 0.0), ((0, 1), 4, 0.05)])
def test_planted_widths_on_torch_read_what_numpy_reads(planes, width, noise):
    """The log-attention phase runs on the estimator's device in float32 and reads the numpy fit's width."""
    torch = pytest.importorskip("torch")
    A, B = _head(planes)
    X, Y, V = _task(A, B, noise=noise)
    kw = dict(rotary=POS, causal=True, value_map=V, tolerance=0.01, random_state=0)
    ref = RStarEstimator(**kw).fit(X, Y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est = RStarEstimator(device=torch.device("cpu"), **kw).fit(X, Y)
    assert est.inversion_ == ref.inversion_ == ROTARY_LOG_NAME
    fit = [f.values for f in est._whitened[1].findings if f.kind == "factored_fit"][0]
    assert fit["log_attention_backend"] == "torch" and fit["log_attention_iterations"] > 0
    assert (est.rank_, est.rank_interval_) == (ref.rank_, ref.rank_interval_) == (width, (width, width))
    np.testing.assert_allclose(est.spectrum_[:width], ref.spectrum_[:width], rtol=0.02)


def test_the_first_position_gives_the_value_map_of_a_causal_head():
    """A causal head's first query attends to itself alone: ``y_0 = x_0 V`` whatever the logits, so the least
    squares of the first outputs on the first tokens is V (exactly without noise, to the regression's error with
    it); not where the first query sees later tokens, nor with too few samples."""
    A, B = _head((0, 2))
    X, Y, V = _task(A, B, n=200)
    np.testing.assert_allclose(first_position_value_map(X, Y), V, atol=1e-8)
    Xn, Yn, Vn = _task(A, B, n=2000, noise=0.05)
    V_hat = first_position_value_map(Xn, Yn)
    noise_rms = 0.05 * Y.std()
    # out of sample: x V_hat off by about sqrt(d / (n - d)) times the noise, far less than the outputs' size
    assert np.sqrt(np.mean((Xn[:, 1:] @ (V_hat - Vn)) ** 2)) < 3 * noise_rms * np.sqrt(D / (2000 - D))
    assert first_position_gives_value_map(24, D, MASK) and not first_position_gives_value_map(23, D, MASK)
    assert not first_position_gives_value_map(1000, D, None)
    assert not first_position_gives_value_map(1000, D, MASK | np.eye(T, k=1, dtype=bool))


def test_each_half_reads_its_attention_with_its_own_value_map():
    """Per-half value maps in the log-attention losses and in the pair's fit: each half's own, the same as two fits
    made one half at a time."""
    A, B = _head((0, 2))
    X, Y, V = _task(A, B, n=40)
    halves = ((X[::2], Y[::2]), (X[1::2], Y[1::2]))
    V2 = V + 0.01 * np.random.default_rng(1).standard_normal(V.shape)
    losses = log_attention_half_losses(halves, (V, V2), MASK, rotary=POS)
    alone = [log_attention_half_losses(halves[i:i + 1], W, MASK, rotary=POS)[0] for i, W in enumerate((V, V2))]
    A1, B1 = 0.9 * A, 1.1 * B
    for pair, own in zip(losses, alone):
        np.testing.assert_allclose(pair(A1, B1)[0], own(A1, B1)[0])
    fits = sf.fit_factored_pair(halves, 2 * P, [(A1, B1), (A1, B1)], value_map=(V, V2), mask=MASK, max_iter=5,
                                losses=losses, rotary=POS)
    assert fits[0].value_map is V and fits[1].value_map is V2


def test_with_v_fitted_the_log_attention_is_read_with_the_first_positions_value_map():
    """V fitted, windows short enough for the log-attention and 300 samples a half (at least 1.5 d): each half's V
    is read from its first position, the fit starts on the log-attention and ends on the outputs with V fitted,
    and reads the planted width; with too few samples a half the fit runs on the outputs alone and says why not."""
    A, B = _head((0, 1))
    X, Y, _ = _task(A, B, noise=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est = RStarEstimator(rotary=POS, causal=True, tolerance=0.01, random_state=0).fit(X, Y)
    assert est.inversion_ == ROTARY_NAME
    fit = [f.values for f in est._whitened[1].findings if f.kind == "factored_fit"][0]
    assert [(stage["length"], stage["loss"]) for stage in fit["coarse_windows"]] == [(T, "log_attention")]
    assert "V from the first position" in est.inversion_reason_
    assert (est.noise_floor_rank_, est.noise_floor_interval_) == (4, (4, 4))
    few = DEFAULT_CALIBRATION.replace(first_position_samples_ratio=20.0)      # 300 < 20 x 16
    plain = RStarEstimator(rotary=POS, causal=True, tolerance=0.01, random_state=0, calibration=few).fit(X, Y)
    assert [f.values for f in plain._whitened[1].findings if f.kind == "factored_fit"][0]["coarse_windows"] == []
    assert "first position" not in plain.inversion_reason_
