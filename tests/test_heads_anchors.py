"""The anchors' allocations and truncations (Eigen Attention, SVD-LLM, Palu, EVA) against their definitions."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _blocks import block_error_by_hand  # noqa: E402
from rstar.heads import (activation_basis_factors, activation_singular_values, collect_attention,  # noqa: E402
                         eigen_attention_head_curve, eigen_attention_head_rank, eigen_attention_plan,
                         eigen_attention_sweep, eva_plan, fisher_share_plan, head_fisher_scores, truncated_heads,
                         uniform_plan, weight_energy_plan, whitened_factors)


def _records(t):
    return t.to_dict("records") if hasattr(t, "to_dict") else t


@pytest.fixture(scope="module")
def bert():
    config = transformers.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, initializer_range=0.5, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = np.random.default_rng(0).integers(0, 60, size=(60, 10))
    return model, ids, collect_attention(model, ids)


def test_activation_basis_keeps_the_top_directions_of_the_stacked_activations():
    rng = np.random.default_rng(0)
    q, k, Z = rng.standard_normal((6, 4)), rng.standard_normal((6, 4)), rng.standard_normal((50, 6))
    stacked = np.vstack([Z @ k, Z @ q])
    s = np.linalg.svd(stacked, compute_uv=False)
    np.testing.assert_allclose(activation_singular_values(q, k, Z.T @ Z), s / s.sum(), rtol=1e-10)
    for r in range(5):
        q2, k2 = activation_basis_factors(q, k, Z.T @ Z, r)
        # the stacked activations of the truncated head are the best rank-r approximation of the full ones
        kept = np.vstack([Z @ k2, Z @ q2])
        np.testing.assert_allclose(np.linalg.norm(stacked - kept) ** 2, np.sum(s[r:] ** 2), rtol=1e-9, atol=1e-9)
        assert np.linalg.matrix_rank(q2 @ k2.T, tol=1e-9) == r
    np.testing.assert_allclose(activation_basis_factors(q, k, Z.T @ Z, 4)[0], q, atol=1e-12)


def test_whitened_truncation_is_the_best_rank_r_map_on_the_tokens_and_keeps_what_they_miss():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    Z = rng.standard_normal((50, 6))
    Z[:, 5] = 0.0   # a feature the tokens never use: the maps' row for it is kept as it is
    for r in range(5):
        q2, k2 = whitened_factors(q, k, Z.T @ Z, r)
        for W, W2 in ((q, q2), (k, k2)):
            s = np.linalg.svd(Z @ W, compute_uv=False)
            np.testing.assert_allclose(np.linalg.norm(Z @ (W - W2)) ** 2, np.sum(s[r:] ** 2), rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(W2[5], W[5], atol=1e-12)
        assert np.linalg.matrix_rank(Z @ q2 @ k2.T @ Z.T, tol=1e-8) <= r


def test_uniform_and_weight_energy_plans(bert):
    _, _, layers = bert
    plan = _records(uniform_plan(layers, 13))
    assert [p["rank"] for p in plan] == [4, 3, 3, 3] and {p["d_head"] for p in plan} == {8}
    assert sum(p["rank"] for p in _records(uniform_plan(layers, 100))) == 32   # capped at d_head
    energy = _records(weight_energy_plan(layers, 10))
    assert sum(p["rank"] for p in energy) <= 10
    # the energy split keeps at least as much of the kernels' summed energy as the uniform one at equal width
    def lost(plan):
        total = 0.0
        for p in plan:
            s = layers[p["layer"]].head(p["head"]).kernel_singular_values() ** 2
            total += s[p["rank"]:].sum() / s.sum()
        return total
    assert lost(energy) <= lost(_records(uniform_plan(layers, 10))) + 1e-12
    with pytest.raises(ValueError, match="budget must be a whole number"):
        uniform_plan(layers, 2.5)


def test_eva_ranks_the_layers_components_together(bert):
    _, _, layers = bert
    rng = np.random.default_rng(2)
    # layer 0's tokens in one strong direction, layer 1's spread evenly: layer 0's first component wins the budget
    X0 = rng.standard_normal(layers[0].X.shape) * 0.01
    X0[..., 0] += 10 * rng.standard_normal(X0.shape[:-1])
    X1 = rng.standard_normal(layers[1].X.shape)
    skewed = [dataclasses.replace(layers[0], X=X0), dataclasses.replace(layers[1], X=X1)]
    plan = _records(eva_plan(skewed, 4, rho=2.0))
    # caps: round(2 * 4 / 2) = 4 a layer; layer 0 ratio ~1 then ~1e-6, layer 1 ratios ~1/16 each
    assert [p["rank"] for p in plan] == [1, 0, 2, 1]
    assert sum(p["rank"] for p in _records(eva_plan(layers, 9))) == 9
    # the cap rho * budget / layers: with rho = 1 each layer takes at most half
    assert sum(p["rank"] for p in _records(eva_plan(skewed, 4, rho=1.0)) if p["layer"] == 1) == 2
    with pytest.raises(ValueError, match="rho must be >= 1"):
        eva_plan(layers, 4, rho=0.5)


def test_fisher_share_plan_is_proportional_capped_and_spends_the_budget():
    rows = [dict(layer=0, head=h, d_head=8, fisher=f) for h, f in enumerate([1.0, 1.0, 2.0])]
    assert [p["rank"] for p in _records(fisher_share_plan(rows, 4))] == [1, 1, 2]
    rows = [dict(layer=0, head=h, d_head=8, fisher=f) for h, f in enumerate([1.0, 0.0, 0.0])]
    assert [p["rank"] for p in _records(fisher_share_plan(rows, 10))] == [8, 1, 1]
    rows = [dict(layer=0, head=h, d_head=8, fisher=f) for h, f in enumerate([3.0, 2.0, 1.0])]
    # shares 3.5, 2.33, 1.17 -> 3, 2, 1 and the one left to the largest fraction
    assert [p["rank"] for p in _records(fisher_share_plan(rows, 7))] == [4, 2, 1]
    with pytest.raises(ValueError, match="finite and >= 0"):
        fisher_share_plan([dict(layer=0, head=0, d_head=8, fisher=np.nan)], 2)
    with pytest.raises(ValueError, match="no 'fisher' column"):
        fisher_share_plan([dict(layer=0, head=0, d_head=8)], 2)


def test_head_fisher_scores_are_the_rms_gradients_of_each_head_s_query_and_key_rows(bert):
    model, ids, layers = bert

    def loss(out, batch):
        return out.last_hidden_state.pow(2).sum()

    scores = _records(head_fisher_scores(model, layers, ids, loss=loss, batch_size=20))
    # by hand: three batches, the gradients' root mean square per weight, averaged over the head's rows
    module = model.encoder.layer[1].attention.self
    sq = [torch.zeros_like(module.query.weight, dtype=torch.float64) for _ in range(2)]
    for s in range(0, 60, 20):
        model.zero_grad()
        loss(model(torch.as_tensor(ids[s:s + 20])), None).backward()
        for acc, p in zip(sq, (module.query.weight, module.key.weight)):
            acc += p.grad.double() ** 2
    model.zero_grad()
    q, k = [(acc / 3).sqrt()[8:16].mean().item() for acc in sq]
    got = next(p["fisher"] for p in scores if p["layer"] == 1 and p["head"] == 1)
    np.testing.assert_allclose(got, (q + k) / 2, rtol=1e-6)
    assert {p["fisher_loss"] for p in scores} == {"given"}
    assert all(p.grad is None for p in model.parameters())
    # the default (a Gaussian likelihood on the last hidden state) is seeded; a head whose values are zero
    # cannot move the output through its queries and keys: its score is zero
    a = _records(head_fisher_scores(model, layers, ids, batch_size=30, random_state=3))
    b = _records(head_fisher_scores(model, layers, ids, batch_size=30, random_state=3))
    assert [p["fisher"] for p in a] == [p["fisher"] for p in b] and all(p["fisher"] > 0 for p in a)
    assert {p["fisher_loss"] for p in a} == {"unit Gaussian likelihood on the last hidden state"}
    with torch.no_grad():
        saved = module.value.weight[:8].clone()
        module.value.weight[:8] = 0.0
    try:
        zeroed = _records(head_fisher_scores(model, layers, ids, batch_size=30))
    finally:
        with torch.no_grad():
            module.value.weight[:8] = saved
    assert next(p["fisher"] for p in zeroed if p["layer"] == 1 and p["head"] == 0) == 0.0
    assert next(p["fisher"] for p in zeroed if p["layer"] == 1 and p["head"] == 1) > 0


def test_eigen_attention_sweep_and_plans(bert):
    model, ids, layers = bert
    sweep = _records(eigen_attention_sweep(model, layers, ids, batch_size=30))
    for index in (0, 1):
        steps = [r for r in sweep if r["layer"] == index]
        assert steps[0]["threshold"] == 1.0 and steps[0]["rank"] == 8 and steps[0]["error"] == 0.0
        ranks = [r["rank"] for r in steps]
        assert ranks == sorted(ranks, reverse=True) and ranks[-1] < 8
        # each head's rank: its normalised singular values' running sum below the threshold; the layer's the largest
        rows = slice(None)
        gram = np.concatenate([layers[index].X.reshape(-1, 16), np.ones((600, 1))], axis=1)
        gram = gram.T @ gram
        spectra = [activation_singular_values(layers[index].query[h][rows], layers[index].key[h][rows], gram)
                   for h in range(2)]
        for r in steps[1:]:
            assert r["rank"] == max(int(np.sum(np.cumsum(s) < r["threshold"] - 1e-12)) for s in spectra)
    # one error by hand: the block's output with layer 1's heads truncated at the rank, against the full output
    step = next(r for r in sweep if r["layer"] == 1 and 0 < r["rank"] < 8)
    plan = [dict(layer=1, head=h, rank=step["rank"]) for h in range(2)]
    np.testing.assert_allclose(step["error"], block_error_by_hand(model, model.encoder.layer[1], ids, plan, layers),
                               rtol=1e-4)
    # plans: a tiny error budget keeps every direction; each layer keeps the last threshold under the budget
    assert all(p["rank"] == 8 for p in _records(eigen_attention_plan(sweep, layers, error_budget=1e-12)))
    e = step["error"]
    plan = _records(eigen_attention_plan(sweep, layers, error_budget=e))
    steps1 = [r for r in sweep if r["layer"] == 1]
    first_over = next(i for i, r in enumerate(steps1) if r["error"] >= e)
    assert {p["rank"] for p in plan if p["layer"] == 1} == {steps1[first_over - 1]["rank"]}
    for W in (0, 9, 20, 32):
        plan = _records(eigen_attention_plan(sweep, layers, budget=W))
        width = sum(p["rank"] for p in plan)
        smallest = sum(2 * min(r["rank"] for r in sweep if r["layer"] == i) for i in (0, 1))
        assert width <= max(W, smallest)
        assert all(len({p["rank"] for p in plan if p["layer"] == i}) == 1 for i in (0, 1))
    with pytest.raises(ValueError, match="exactly one of error_budget"):
        eigen_attention_plan(sweep, layers)
    with pytest.raises(ValueError, match="descending"):
        eigen_attention_sweep(model, layers, ids, thresholds=[0.5, 0.9])


def test_eigen_attention_per_head_is_its_truncation_and_its_threshold_search(bert):
    """Without rotation the per-head curve is the head with activation_basis_factors' maps at each rank; the search
    lowers the threshold until the excess first exceeds the tolerance and keeps the rank before (not the smallest
    rank below the tolerance)."""
    _, _, layers = bert
    head = layers[1].head(1)
    spectrum, curve = eigen_attention_head_curve(head)
    gram = np.einsum("ntp,ntq->pq", head.features(), head.features())
    rows = head._rows()   # the maps' rows on the features (the bias row only where the layer has biases)
    np.testing.assert_allclose(spectrum, activation_singular_values(head.query[rows], head.key[rows], gram),
                               rtol=1e-8)
    tss = np.sum((head.Y - head.Y.reshape(-1, head.d_head).mean(axis=0)) ** 2)
    for r in range(head.d_head + 1):
        q, k = head.query.copy(), head.key.copy()
        q[rows], k[rows] = activation_basis_factors(head.query[rows], head.key[rows], gram, r)
        Yr = dataclasses.replace(head, query=q, key=k).output()
        np.testing.assert_allclose(curve[r], np.sum((head.Y - Yr) ** 2) / tss, rtol=1e-7, atol=1e-12)
    # four equal directions: thresholds 1.0 -> rank 4, 0.98 ... 0.76 -> 3, 0.74 ... 0.52 -> 2, 0.5 ... 0.3 -> 1
    flat = np.full(4, 0.25)
    falling = [0.5, 0.2, 0.04, 0.005, 0.0]
    assert eigen_attention_head_rank(flat, falling, 0.01) == 3
    assert eigen_attention_head_rank(flat, falling, 0.05) == 2
    assert eigen_attention_head_rank(flat, falling, 0.6) == 1   # the thresholds stop at 0.3: never rank 0
    assert eigen_attention_head_rank(flat, [0.0, 0.2, 0.0, 0.5, 0.0], 0.1) == 4   # stops at the first excess
    with pytest.raises(ValueError, match="d_head \\+ 1 = 5 entries"):
        eigen_attention_head_rank(flat, falling[:4], 0.01)
    with pytest.raises(ValueError, match="tolerance must be"):
        eigen_attention_head_rank(flat, falling, float("nan"))


def test_the_anchors_truncations_inside_the_model(bert):
    model, ids, layers = bert
    gram = np.concatenate([layers[1].X.reshape(-1, 16), np.ones((600, 1))], axis=1)
    gram = gram.T @ gram
    plan = [dict(layer=1, head=0, rank=3)]
    for metric, trunc in (("activations", activation_basis_factors), ("whitened", whitened_factors)):
        with truncated_heads(model, plan, layers, metric=metric):
            inside = collect_attention(model, ids, layers=[1])[0]
        q, k = trunc(layers[1].query[0], layers[1].key[0], gram, 3)
        np.testing.assert_allclose(inside.query[0] @ inside.key[0].T, q @ k.T, atol=1e-5)
        np.testing.assert_allclose(inside.query[1], layers[1].query[1], atol=1e-6)


def test_the_anchors_and_factors_errors_are_one_line(bert):
    model, ids, layers = bert
    with pytest.raises(ValueError, match="windows must be token ids of shape"):
        head_fisher_scores(model, layers, ids[0])
    with pytest.raises(ValueError, match="holds no sequences"):
        head_fisher_scores(model, layers, ids[:0])
    with pytest.raises(ValueError, match="budget must be >= 0"):
        eva_plan(layers, -1)
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        head_fisher_scores(model, layers, ids, batch_size=0)
    with pytest.raises(ValueError, match="error_budget must be > 0"):
        eigen_attention_plan([dict(layer=i, threshold=1.0, rank=8, error=0.0) for i in (0, 1)], layers,
                             error_budget=0)
    with pytest.raises(ValueError, match="no rows for layer 1"):
        eigen_attention_plan([dict(layer=0, threshold=1.0, rank=8, error=0.0)], layers, budget=4)
    plan = [dict(layer=1, head=0, rank=2)]
    for bad in [(np.zeros((17, 2)), np.zeros((17, 3))), (np.zeros((5, 2)), np.zeros((5, 2))),
                (np.zeros((17, 9)), np.zeros((17, 9)))]:
        with pytest.raises(ValueError, match="factors must be two arrays of shape \\(17, r\\)"), truncated_heads(
                model, plan, layers, factors={(1, 0): bad}):
            pass


def test_query_key_factors_of_an_operator_without_one_is_a_one_line_error():
    from rstar import MPRankEstimator
    from rstar.datasets import make_linear_proxy

    X, Y = make_linear_proxy(300, seq_len=6, n_features=5, rank=2, random_state=0)
    est = MPRankEstimator("linear_proxy").fit(X, Y)
    with pytest.raises(ValueError, match="has no query–key map"):
        est.query_key_factors()
