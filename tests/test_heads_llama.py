"""Llama-family attention read by rstar.heads: rotary positions, grouped key/value heads, biases (Qwen2), sliding
windows (Mistral), scaled RoPE; the rotary truncation in planes; what is refused, and why. Small randomly
initialised models from transformers' configurations (no download)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _blocks import block_error_by_hand  # noqa: E402
from rstar import RotaryPositions, RStarEstimator  # noqa: E402
from rstar.heads import (collect_attention, eigen_attention_head_curve, estimate_heads,  # noqa: E402
                         kernel_truncation_curve, plane_truncation_curve, truncation_rank)
from rstar.inversions._numerics.rotary import (family_svd, pair_rotations, plane_strengths, rotate,  # noqa: E402
                                               rotate_adjoint)

_SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def _model(kind, **extra):
    torch.manual_seed(0)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    return model_cls(config_cls(**{**_SMALL, **extra})).eval()


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 50, size=(24, 9))


def test_rotation_is_orthogonal_and_its_adjoint_is_its_inverse():
    rng = np.random.default_rng(0)
    pos = RotaryPositions.from_frequencies([1.0, 0.1, 0.01], length=5, offset=3)
    U = rng.standard_normal((2, 5, 6))
    G = rng.standard_normal((2, 5, 6))
    R = rotate(U, pos)
    np.testing.assert_allclose(np.linalg.norm(R, axis=-1), np.linalg.norm(U, axis=-1))
    np.testing.assert_allclose(np.sum(R * G), np.sum(U * rotate_adjoint(G, pos)))
    np.testing.assert_allclose(rotate_adjoint(R, pos), U, atol=1e-12)
    # plane 0 at position t = offset + 1 turned by 4 rad: (u_0, u_3) as a complex number times e^{4i}
    z = (U[0, 1, 0] + 1j * U[0, 1, 3]) * np.exp(4j)
    np.testing.assert_allclose([R[0, 1, 0], R[0, 1, 3]], [z.real, z.imag])


def test_the_logit_family_is_every_pair_s_kernel_side_by_side():
    """family_svd's values are those of ``[sqrt(w) A R(phi_s - phi_t) B^T]`` over the kept pairs, formed explicitly,
    on both sides; a planted width is its rank whatever the frequencies (low ones included)."""
    rng = np.random.default_rng(1)
    d, P, T = 7, 3, 5
    pos = RotaryPositions.from_frequencies([1.0, 1e-2, 1e-4], T)
    mask = np.tril(np.ones((T, T), dtype=bool))
    A = rng.standard_normal((d, 2)) @ rng.standard_normal((2, 2 * P))   # rank 2 on each side
    B = rng.standard_normal((d, 2 * P))
    pairs = pair_rotations(pos, mask)
    assert pairs[0].shape == (T, P) and pairs[1].sum() == pytest.approx(1.0)   # one per offset
    blocks = []
    for t, s_ in zip(*np.nonzero(mask)):
        delta = pos.angles[s_] - pos.angles[t]
        c, s = np.cos(delta), np.sin(delta)
        R = np.block([[np.diag(c), -np.diag(s)], [np.diag(s), np.diag(c)]])
        blocks.append(A @ R @ B.T / np.sqrt(mask.sum()))
    for side, Z in (("q", np.hstack(blocks)), ("k", np.hstack([K.T for K in blocks]))):
        U, sv = family_svd([(A, B)], [1.0], pairs, side)
        np.testing.assert_allclose(sv, np.linalg.svd(Z, compute_uv=False)[:sv.size], atol=1e-10)
    assert np.sum(family_svd([(A, B)], [1.0], pairs, "q")[1] > 1e-8) == 2


def test_the_weighted_family_of_two_heads_is_formed_without_its_turned_copies():
    """family_svd's half-sum and half-difference of two heads (what the split-half statistic compares), at angles
    that are not a multiple of one another (every pair its own difference, as a model's float32 tables give),
    equal the explicit ``sum_h w_h [sqrt(w) A_h R B_h^T]`` on both sides: values and directions."""
    rng = np.random.default_rng(4)
    d, P, T = 9, 3, 6
    pos = RotaryPositions(np.outer(np.arange(T), [1.0, 0.2, 0.01]) + 1e-6 * rng.standard_normal((T, P)))
    mask = np.tril(np.ones((T, T), dtype=bool))
    pairs = pair_rotations(pos, mask)
    assert pairs[0].shape[0] == mask.sum() - T + 1   # the diagonal pairs share delta = 0
    heads = [(rng.standard_normal((d, 2 * P)), rng.standard_normal((d, 2 * P))) for _ in range(2)]
    for weights in ([0.5, 0.5], [0.5, -0.5]):
        blocks = []
        for t, s_ in zip(*np.nonzero(mask)):
            delta = pos.angles[s_] - pos.angles[t]
            c, s = np.cos(delta), np.sin(delta)
            R = np.block([[np.diag(c), -np.diag(s)], [np.diag(s), np.diag(c)]])
            blocks.append(sum(w * A @ R @ B.T for w, (A, B) in zip(weights, heads)) / np.sqrt(mask.sum()))
        for side, Z in (("q", np.hstack(blocks)), ("k", np.hstack([K.T for K in blocks]))):
            U, sv = family_svd(heads, weights, pairs, side)
            U0, s0, _ = np.linalg.svd(Z, full_matrices=False)
            np.testing.assert_allclose(sv[:d], s0, rtol=1e-10, atol=1e-12 * s0[0])
            np.testing.assert_allclose(np.abs(np.sum(U[:, :d] * U0, axis=0)), 1.0, atol=1e-8)


def test_rotary_positions_refuse_what_is_not_a_rotation():
    with pytest.raises(ValueError, match="2-D array"):
        RotaryPositions(np.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        RotaryPositions(np.array([[np.nan]]))
    cos, sin = np.ones((3, 4)), np.zeros((3, 4))
    cos[:, 0] = 0.5
    with pytest.raises(ValueError, match="rotate-half layout"):
        RotaryPositions.from_tables(cos, sin)
    pos, amplitude = RotaryPositions.from_tables(2 * np.cos(np.ones((3, 4))), 2 * np.sin(np.ones((3, 4))))
    assert amplitude == pytest.approx(2.0) and pos.n_planes == 2
    np.testing.assert_allclose(pos.angles, 1.0)


@pytest.mark.parametrize("kind, extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 4}),
                                         ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                     "original_max_position_embeddings": 16}})])
def test_llama_family_heads_are_recomputed_with_rotation_groups_and_windows(ids, kind, extra):
    layers = collect_attention(_model(kind, **extra), ids)
    assert [layer.style for layer in layers] == ["llama", "llama"]
    layer = layers[1]
    assert layer.X.shape == (24, 9, 32) and layer.Y.shape == (24, 9, 4, 8)
    assert layer.causal and layer.rotary.n_planes == 4 and layer.rotary.length == 9
    assert layer.max_abs_error < 1e-5
    # two key/value heads, each shared by two query heads: the key and value weights are the group's
    np.testing.assert_array_equal(layer.kv_groups, [0, 0, 1, 1])
    np.testing.assert_array_equal(layer.key[0], layer.key[1])
    np.testing.assert_array_equal(layer.value[2], layer.value[3])
    assert not np.allclose(layer.key[1], layer.key[2])
    assert layer.window == (4 if kind == "mistral" else None)
    head = layer.head(3)
    assert head.kv_group == 1 and head.rotary is layer.rotary
    np.testing.assert_allclose(head.output(), head.Y, atol=1e-9)
    # the singular values of its logit family (d_head of them, descending)
    sv = head.kernel_singular_values()
    assert sv.size == 8 and np.all(sv > 0) and np.all(np.diff(sv) <= 0)
    with pytest.raises(ValueError, match="rotary head"):
        head.kernel()


def test_a_rotary_head_recomputed_without_its_rotation_is_not_its_output(ids):
    """The rotation matters on these heads: dropping it changes their outputs (so the recomputation check is a
    check, and a non-rotary estimator would be fitting another class)."""
    head = collect_attention(_model("llama"), ids)[0].head(0)
    plain = head.features() @ head.factors()[0], head.features() @ head.factors()[1]
    from rstar.heads import attention_rows

    unrotated = attention_rows(plain[0] @ plain[1].transpose(0, 2, 1), mask=head.mask()) @ (
        head.features() @ head.value_map())
    assert np.max(np.abs(unrotated - head.Y)) > 10 * np.max(np.abs(head.output() - head.Y)) + 1e-6


def test_qwen2_biases_enter_the_homogeneous_coordinate(ids):
    model = _model("qwen2")
    with torch.no_grad():
        for lin in (model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj,
                    model.model.layers[0].self_attn.v_proj):
            lin.bias.normal_(0.0, 0.5)
    layer = collect_attention(model, ids, layers=[0])[0]
    assert layer.has_bias and layer.max_abs_error < 1e-5
    assert np.any(layer.query[:, -1] != 0)


def test_rotary_truncation_projects_on_the_logit_family_and_planes_are_kept_whole_in_mha2mla_s_view(ids):
    """A head whose query/key weights hold two planes (the others zeroed) has query and key projections of rank 4:
    its truncation reproduces it exactly from width 4 and not below; kept as whole planes (MHA2MLA's view), widths
    count in planes (an odd width keeps the planes below it)."""
    model = _model("llama", num_key_value_heads=4)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        # head 0's planes 1 and 3 only (rotate-half layout: columns p and p + 4 of the head's 8)
        keep = torch.zeros(8)
        keep[[1, 5, 3, 7]] = 1.0
        attn.q_proj.weight[:8] *= keep[:, None] * 3.0
        attn.k_proj.weight[:8] *= keep[:, None] * 3.0
    head = collect_attention(model, ids, layers=[0])[0].head(0)
    A, B = head.factors()
    strengths = plane_strengths(A, B)
    assert np.count_nonzero(strengths) == 2
    curve = kernel_truncation_curve(head)
    assert curve.shape == (9,)
    assert np.all(curve[4:] < 1e-12) and curve[3] > 1e-5 and curve[0] > curve[2] > curve[3]
    assert truncation_rank(head, 1e-6) == 4
    planes = plane_truncation_curve(head)
    assert planes[4] < 1e-12 and planes[2] > 1e-5 and planes[3] == planes[2] and planes[5] == planes[4]
    sv = head.kernel_singular_values()
    assert np.all(sv[4:] < 1e-12 * sv[0]) and sv[3] > 1e-3 * sv[0]


def test_a_llama_rank_pattern_names_q_proj_and_k_proj_and_a_shared_key_head_serves_its_group(ids):
    """PEFT's target modules of a Llama-family layer are q_proj and k_proj; with two query heads per key head
    (d_head 8), k_proj needs each key head's group's ranks summed, at most d_head."""
    from rstar.heads import rank_pattern

    model = _model("llama")
    layers = collect_attention(model, ids)
    plan = [dict(layer=0, head=h, rank=r) for h, r in enumerate((3, 7, 2, 1))] + [dict(layer=1, head=2, rank=5)]
    pattern = rank_pattern(plan, layers)
    name0, name1 = layers[0].name, layers[1].name
    assert pattern == {f"{name0}.q_proj": 13, f"{name0}.k_proj": 8 + 3, f"{name1}.q_proj": 5, f"{name1}.k_proj": 5}
    assert set(pattern) <= set(dict(model.named_modules()))


def test_eigen_attention_projects_a_rotary_head_s_rotated_queries_and_keys(ids):
    """Eigen Attention's per-head truncation of a rotary head, formed by hand from the module's own rotated queries
    and keys: the basis is the stacked activations' top right-singular directions on the calibration windows, the
    projection acts after the rotation, and the curve is measured on other windows against the head there."""
    model = _model("llama", num_key_value_heads=4)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():   # strong enough logits that the truncation shows
        attn.q_proj.weight *= 4.0
        attn.k_proj.weight *= 4.0
    other = np.random.default_rng(5).integers(0, 50, size=(20, 9))
    head = collect_attention(model, ids, layers=[0])[0].head(2)
    held = collect_attention(model, other, layers=[0])[0].head(2)
    spectrum, curve = eigen_attention_head_curve(head, held.X, held.Y)

    def rotated(X):
        Xt, rows = head.features(X), head._rows()
        return rotate(Xt @ head.query[rows], head.rotary), rotate(Xt @ head.key[rows], head.rotary)

    q, k = rotated(head.X)
    _, s, Wt = np.linalg.svd(np.vstack([k.reshape(-1, 8), q.reshape(-1, 8)]), full_matrices=False)
    np.testing.assert_allclose(spectrum, s / s.sum(), rtol=1e-9)
    qh, kh = rotated(held.X)
    values = head.features(held.X) @ head.value_map()
    tss = np.sum((held.Y - held.Y.reshape(-1, 8).mean(axis=0)) ** 2)
    for r in (0, 3, 8):
        P = Wt[:r].T @ Wt[:r]
        logits = (qh @ P) @ (kh @ P).transpose(0, 2, 1) / np.sqrt(8)
        logits[:, ~np.tril(np.ones((9, 9), dtype=bool))] = -np.inf
        S = np.exp(logits - logits.max(axis=-1, keepdims=True))
        Yr = (S / S.sum(axis=-1, keepdims=True)) @ values
        np.testing.assert_allclose(curve[r], np.sum((held.Y - Yr) ** 2) / tss, rtol=1e-7, atol=1e-12)
    assert curve[8] < 1e-9 < curve[3] < curve[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_rotary_head_is_cut_on_its_query_side_inside_the_model(ids, kind):
    """truncated_heads on a Llama-family layer: the planned head's q_proj rows (and bias) are projected to the plan's
    width, the shared k_proj and every other head untouched, the model computes the projected head exactly, the
    projection is the best of its width for the head's logit family on the query side (Eckart-Young), full width
    changes nothing, and the weights come back on exit."""
    from rstar.heads import rotary_query_projection, truncated_heads
    from rstar.inversions._numerics.softmax_factored import token_metric_roots

    model = _model(kind)
    attn = model.model.layers[0].self_attn
    before = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    layer = collect_attention(model, ids, layers=[0])[0]
    head = layer.head(1)
    A, B = head.factors()
    Z = head.features()
    metric = token_metric_roots(Z, keys_centred=False)     # a rotary head's metric: keys uncentred
    pairs = pair_rotations(layer.rotary, head.mask())
    P = rotary_query_projection(A, B, 3, pairs, metric)
    assert np.linalg.matrix_rank(P, tol=1e-8) == 3
    for bad in (-1, 9, 2.5, True):
        with pytest.raises(ValueError, match="rank must be a whole number in 0 ... 8"):
            rotary_query_projection(A, B, bad, pairs, metric)
    with pytest.raises(ValueError, match="finite arrays of one shape"):
        rotary_query_projection(A, B[:, :4], 3, pairs, metric)
    with pytest.raises(ValueError, match="finite arrays of one shape"):
        rotary_query_projection(np.where(A > 0, np.nan, A), B, 3, pairs, metric)
    # Eckart-Young on the query side: the family of the cut-off part holds exactly the tail of the head's values
    s = family_svd([(metric[0] @ A, metric[2] @ B)], [1.0], pairs, "q")[1]
    tail = family_svd([(metric[0] @ A, metric[2] @ B), (metric[0] @ P @ A, metric[2] @ B)], [1.0, -1.0], pairs,
                      "q")[1]
    np.testing.assert_allclose(np.sum(tail ** 2), np.sum(s[3:] ** 2), rtol=1e-8)
    plan = [dict(layer=0, head=1, rank=3), dict(layer=0, head=0, rank=8)]
    with truncated_heads(model, plan, [layer]):
        inside = collect_attention(model, ids, layers=[0])[0]
        q_rows = attn.q_proj.weight[8:16].detach().double().numpy()
        assert torch.equal(attn.k_proj.weight, before["k_proj.weight"])
        assert torch.equal(attn.q_proj.weight[16:], before["q_proj.weight"][16:])
    assert np.linalg.matrix_rank(q_rows, tol=1e-5) == 3
    assert inside.max_abs_error < 1e-4
    expected = head.output(factors=(P @ A, B))
    np.testing.assert_allclose(inside.Y[:, :, 1], expected, atol=1e-4 * np.abs(expected).max())
    np.testing.assert_allclose(inside.Y[:, :, [0, 2, 3]], layer.Y[:, :, [0, 2, 3]], atol=1e-5)   # full width: a no-op
    assert np.abs(inside.Y[:, :, 1] - layer.Y[:, :, 1]).max() > 1e-3
    assert all(torch.equal(v, before[k]) for k, v in attn.state_dict().items())
    doubled = (np.hstack([A, A]), np.hstack([B, B]))      # a rotary fit's model: its two halves' heads side by side
    with pytest.raises(ValueError, match="rotary fit's own factors"):
        with truncated_heads(model, plan, [layer], factors={(0, 1): doubled}):
            pass
    assert all(torch.equal(v, before[k]) for k, v in attn.state_dict().items())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_rotary_student_s_factors_replace_its_head_inside_the_model(ids, kind):
    """A causal rotary student trained on one head of a grouped layer (its value map held fixed) is put back in
    that head's place: the model computes the student's own predictions there, the other head of its group and the
    rest unchanged; a narrower plan cuts the student's family to that width; the projections come back on exit.
    Refused: a rotary fit's doubled factors, a cut the factors do not take, factors of another shape."""
    from rstar.heads import truncated_heads
    from rstar.inversions._numerics.rotary import truncated_rotary_head
    from rstar.inversions._numerics.softmax_factored import token_metric_roots
    from rstar.students import AttentionStudent

    model = _model(kind)
    attn = model.model.layers[0].self_attn
    if kind == "qwen2":
        with torch.no_grad():
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
                lin.bias.normal_(0.0, 0.5)
    before = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    layer = collect_attention(model, ids, layers=[0])[0]
    head = layer.head(1)            # query head 1 reads key head 0, as head 0 does
    Z = head.features()
    student = AttentionStudent(kind="softmax", causal=True, rotary=layer.rotary, rank=3, value_map=head.value_map(),
                               max_epochs=30, random_state=0).fit(Z, head.Y)
    A, B = student.query_key_factors_
    assert A.shape == (Z.shape[-1], 8)
    predicted = student.predict(Z)
    with truncated_heads(model, [dict(layer=0, head=1, rank=8)], [layer], factors={(0, 1): (A, B)}):
        inside = collect_attention(model, ids, layers=[0])[0]
    assert all(torch.equal(v, before[k]) for k, v in attn.state_dict().items())
    assert inside.max_abs_error < 1e-4
    np.testing.assert_allclose(inside.Y[:, :, 1], predicted, atol=1e-4 * np.abs(predicted).max())
    np.testing.assert_allclose(inside.Y[:, :, [0, 2, 3]], layer.Y[:, :, [0, 2, 3]], atol=1e-5)
    assert np.abs(inside.Y[:, :, 1] - layer.Y[:, :, 1]).max() > 1e-3
    # width 2 of the student's width 3: its family cut on both sides in the tokens' metric (keys uncentred)
    metric = token_metric_roots(Z, keys_centred=False)
    cut = truncated_rotary_head(metric, pair_rotations(layer.rotary, head.mask()), A, B, 2)
    with truncated_heads(model, [dict(layer=0, head=1, rank=2)], [layer], factors={(0, 1): (A, B)}):
        inside = collect_attention(model, ids, layers=[0])[0]
    want = head.output(factors=cut)
    np.testing.assert_allclose(inside.Y[:, :, 1], want, atol=1e-4 * np.abs(want).max())
    assert np.abs(want - predicted).max() > 1e-4
    plan = [dict(layer=0, head=1, rank=3)]
    for factors, metric_name, match in [
            ((np.hstack([A, A]), np.hstack([B, B])), "tokens", "rotary fit's own factors"),
            ((A, B), "activations", "cut by 'tokens' or 'weights'"),
            ((A[:, :4], B[:, :4]), "tokens", "must be two finite arrays of shape"),
            ((np.where(A > 0, np.nan, A), B), "weights", "must be two finite arrays of shape")]:
        with pytest.raises(ValueError, match=match):
            with truncated_heads(model, plan, [layer], metric=metric_name, factors={(0, 1): factors}):
                pass
    assert attn.num_key_value_groups == 2
    assert all(torch.equal(v, before[k]) for k, v in attn.state_dict().items())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_anchors_cut_a_grouped_rotary_head_on_its_key_side_and_leave_its_group_as_it_was(ids, kind):
    """truncated_heads(metric="activations" | "whitened") on a grouped rotary layer: inside the block the module
    reads one key/value head per query head (copies of its group's), the planned head computes Eigen Attention's cut
    (its key on the top directions of the layer's key activations before the rotation, all key heads stacked; the
    query whole) or SVD-LLM's (query and key maps each truncated on the tokens), the other head of its group and the
    rest are unchanged, and the module's own projections come back on exit."""
    from rstar.heads import rotary_key_basis, truncated_heads, whitened_factors

    model = _model(kind)
    attn = model.model.layers[0].self_attn
    before = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    k_proj, v_proj = attn.k_proj, attn.v_proj
    layer = collect_attention(model, ids, layers=[0])[0]
    head = layer.head(1)            # query head 1 reads key head 0, as head 0 does
    A, B = head.factors()
    Z = head.features().reshape(-1, head.features().shape[-1])
    plan = [dict(layer=0, head=1, rank=3)]
    keys = np.stack([layer.key[0], layer.key[2]])[:, head._rows()]    # the layer's two key heads
    s2, U = rotary_key_basis(keys, Z.T @ Z)
    np.testing.assert_allclose(s2, np.linalg.svd(np.vstack([Z @ k for k in keys]), compute_uv=False) ** 2,
                               rtol=1e-8, atol=1e-8 * s2[0])
    expected = {"activations": (A, B @ U[:, :3] @ U[:, :3].T), "whitened": whitened_factors(A, B, Z.T @ Z, 3)}
    for metric_name, factors in expected.items():
        with truncated_heads(model, plan, [layer], metric=metric_name):
            assert attn.num_key_value_groups == 1 and attn.k_proj.out_features == attn.q_proj.out_features
            inside = collect_attention(model, ids, layers=[0])[0]
        assert attn.k_proj is k_proj and attn.v_proj is v_proj and attn.num_key_value_groups == 2
        assert all(torch.equal(v, before[k]) for k, v in attn.state_dict().items())
        assert inside.max_abs_error < 1e-4
        want = head.output(factors=factors)
        assert np.linalg.matrix_rank(factors[0] @ factors[1].T, tol=1e-8) == 3
        np.testing.assert_allclose(inside.Y[:, :, 1], want, atol=1e-4 * np.abs(want).max())
        assert np.abs(inside.Y[:, :, 1] - layer.Y[:, :, 1]).max() > 1e-3
        np.testing.assert_allclose(inside.Y[:, :, [0, 2, 3]], layer.Y[:, :, [0, 2, 3]], atol=1e-5)
    # a layer holding some heads only: query head 3 reads key head 1, its own copy cut, head 2 beside it untouched
    part = layer.select_heads([2, 3])
    q3, k3 = layer.head(3).factors()
    with truncated_heads(model, [dict(layer=0, head=3, rank=3)], [part], metric="whitened"):
        inside = collect_attention(model, ids, layers=[0])[0]
    want = layer.head(3).output(factors=whitened_factors(q3, k3, Z.T @ Z, 3))
    np.testing.assert_allclose(inside.Y[:, :, 3], want, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(inside.Y[:, :, :3], layer.Y[:, :, :3], atol=1e-5)
    # an error inside the block, and a nested key-side cut, leave the module as it was
    with pytest.raises(RuntimeError, match="inside"):
        with truncated_heads(model, plan, [layer], metric="activations"):
            raise RuntimeError("inside")
    with pytest.raises(ValueError, match="nested key-side cuts are refused"):
        with truncated_heads(model, plan, [layer], metric="activations"):
            with truncated_heads(model, plan, [layer], metric="whitened"):
                pass
    assert attn.k_proj is k_proj and attn.v_proj is v_proj and attn.num_key_value_groups == 2
    assert all(torch.equal(v, before[k]) for k, v in attn.state_dict().items())
    del attn.num_key_value_groups   # an attention that does not say how it shares its key heads
    try:
        with pytest.raises(ValueError, match="has no num_key_value_groups"):
            with truncated_heads(model, plan, [layer], metric="whitened"):
                pass
    finally:
        attn.num_key_value_groups = 2
    assert all(torch.equal(v, before[k]) for k, v in attn.state_dict().items())
    # full width is Eigen Attention's no-op; every head of the layer cut is its grouped cut (one key per group)
    with truncated_heads(model, [dict(layer=0, head=h, rank=8) for h in range(4)], [layer], metric="activations"):
        np.testing.assert_allclose(collect_attention(model, ids, layers=[0])[0].Y, layer.Y, atol=1e-5)
    with truncated_heads(model, [dict(layer=0, head=h, rank=2) for h in range(4)], [layer], metric="activations"):
        inside = collect_attention(model, ids, layers=[0])[0]
    for h in range(4):
        q, k = layer.head(h).factors()
        want = layer.head(h).output(factors=(q, k @ U[:, :2] @ U[:, :2].T))
        np.testing.assert_allclose(inside.Y[:, :, h], want, atol=1e-4 * np.abs(want).max())


def test_eigen_attention_s_sweep_reads_a_rotary_layer_s_key_spectrum(ids):
    """eigen_attention_sweep on a Llama layer: one spectrum, the layer's key activations before the rotation; the
    error at a rank is the decoder block's, its heads cut by truncated_heads(metric="activations")."""
    from rstar.heads import eigen_attention_sweep, rotary_key_basis

    model = _model("llama", attn_implementation="eager")   # the causal mask passed to the block as a tensor
    layers = collect_attention(model, ids, layers=[0, 1])
    sweep = eigen_attention_sweep(model, layers, ids, batch_size=8)
    sweep = sweep.to_dict("records") if hasattr(sweep, "to_dict") else sweep
    layer = layers[1]
    Z = layer.X.reshape(-1, layer.X.shape[-1])
    s = np.sqrt(rotary_key_basis(np.stack([layer.key[0], layer.key[2]])[:, :-1], Z.T @ Z)[0])
    s = s / s.sum()
    steps = [r for r in sweep if r["layer"] == 1]
    assert steps[0]["threshold"] == 1.0 and steps[0]["rank"] == 8 and steps[0]["error"] == 0.0
    for r in steps[1:]:
        assert r["rank"] == int(np.sum(np.cumsum(s) < r["threshold"] - 1e-12))
    step = next(r for r in steps if 0 < r["rank"] < 8)
    plan = [dict(layer=1, head=h, rank=step["rank"]) for h in range(4)]
    np.testing.assert_allclose(step["error"], block_error_by_hand(model, model.model.layers[1], ids, plan, layers),
                               rtol=1e-4)


def test_palu_scores_a_llama_head_by_its_query_rows_and_its_group_s_key_rows(ids):
    """head_fisher_scores on a causal LM: next-token cross-entropy, each query head scored by its own q_proj rows
    and the k_proj rows of the key head its group shares."""
    from rstar.heads import head_fisher_scores

    model = _model("llama")
    layers = collect_attention(model, ids, layers=[1])
    scores = head_fisher_scores(model, layers, ids, batch_size=8)
    rows = scores.to_dict("records") if hasattr(scores, "to_dict") else scores
    assert {r["fisher_loss"] for r in rows} == {"next-token cross-entropy"}
    attn = model.model.layers[1].self_attn
    sq = [torch.zeros_like(attn.q_proj.weight), torch.zeros_like(attn.k_proj.weight)]
    for start in range(0, len(ids), 8):
        batch = torch.as_tensor(ids[start:start + 8])
        model.zero_grad()
        logits = model(batch).logits[:, :-1]
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
        sq[0] += attn.q_proj.weight.grad ** 2
        sq[1] += attn.k_proj.weight.grad ** 2
    model.zero_grad(set_to_none=True)
    q, k = [(acc / 3).sqrt() for acc in sq]
    for h, g in ((1, 0), (2, 1)):   # 4 query heads, 2 key heads: heads 0-1 read key head 0, heads 2-3 key head 1
        want = (q[8 * h:8 * (h + 1)].mean() + k[8 * g:8 * (g + 1)].mean()).item() / 2
        got = next(r["fisher"] for r in rows if r["head"] == h)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_a_rotary_head_whose_window_is_short_beside_its_width_is_fitted_on_its_log_attention():
    """head_dim 16, T = 9 <= 0.9 * 16: the attention is read back from the outputs (layer 0 repeats tokens within
    windows, whose value rows then coincide and give no entry); the reading is within the truncation rank and the
    fit's own model at full width reproduces held-out windows of the head."""
    model = _model("llama", hidden_size=64, intermediate_size=128)
    rng = np.random.default_rng(2)
    layer = collect_attention(model, rng.integers(0, 50, size=(500, 9)), layers=[0])[0]
    held = collect_attention(model, rng.integers(0, 50, size=(200, 9)), layers=[0])[0].head(1)
    table = estimate_heads([layer.select_heads([1])], tolerances=(0.05,))
    assert set(table["inversion"]) == {"softmax_rotary_log_attention"}
    assert np.all(table["rank_at_0.05"] <= table["truncation_rank_at_0.05"] + 1)
    head = layer.head(1)
    est = RStarEstimator(rotary=head.rotary, causal=True, value_map=head.value_map(), tolerance=0.05,
                         max_rank=head.d_head, random_state=0).fit(head.features(), head.Y)
    Yh = held.Y.reshape(-1, held.Y.shape[-1])
    excess = np.sum((held.Y - est.predict(held.features(), rank=head.d_head)) ** 2) / np.sum((Yh - Yh.mean(0)) ** 2)
    assert excess < 0.01


def test_rotary_layers_are_fitted_in_the_rotary_class_and_others_are_refused_with_the_reason(ids):
    layers = collect_attention(_model("llama"), np.random.default_rng(1).integers(0, 50, size=(400, 9)))
    table = estimate_heads([layers[0].select_heads([0, 2])], tolerances=(0.05,))
    assert list(table["kv_group"]) == [0, 1]
    assert set(table["inversion"]) == {"softmax_rotary_least_squares"}
    assert np.all(table["rank_at_0.05"] <= table["truncation_rank_at_0.05"] + 2)
    from rstar import MPRankEstimator

    with pytest.raises(ValueError, match="no rotary class"):
        estimate_heads(layers[:1], MPRankEstimator("softmax"), tolerances=())
    window = collect_attention(_model("mistral", sliding_window=4), ids, layers=[0])
    with pytest.raises(ValueError, match="sliding window of 4 tokens"):
        estimate_heads(window, tolerances=())


def test_query_key_normalisation_is_refused_by_name(ids):
    model = _model("llama")
    attn = model.model.layers[1].self_attn
    attn.q_norm = torch.nn.LayerNorm(8)
    with pytest.raises(ValueError, match="normalises its queries and keys"):
        collect_attention(model, ids)
    # the other layer alone is read
    assert len(collect_attention(model, ids, layers=[0])) == 1


def test_a_padded_or_shifted_window_is_refused(ids):
    """Rotary tables that differ between windows (positions other than 0 ... T-1) are refused."""
    pos = torch.arange(9)[None].repeat(4, 1)
    pos[2:] += 3
    with pytest.raises(ValueError, match="different rotary positions"):
        collect_attention(_model("llama"), ids[:4], batch_size=4, position_ids=pos)


def test_both_sides_cuts_a_rotary_head_with_its_own_query_and_key_maps(ids):
    """truncated_heads(both_sides=True): each planned rotary head cut on both sides with its own maps, exactly as
    passing those maps as ``factors``; a narrower class than the default query-side cut, so the head's output moves
    further from the whole head's; the module restored on exit; refused with a cut that has its own key side."""
    from rstar.heads import truncated_heads

    model = _model("llama")
    attn = model.model.layers[0].self_attn
    before = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    layer = collect_attention(model, ids, layers=[0])[0]
    plan = [dict(layer=0, head=1, rank=2), dict(layer=0, head=2, rank=3)]
    outputs = {}
    for name, kw in (("query side", {}), ("both sides", dict(both_sides=True)),
                     ("own factors", dict(factors={(0, h): layer.head(h).factors() for h in (1, 2)}))):
        with truncated_heads(model, plan, [layer], **kw):
            outputs[name] = collect_attention(model, ids, layers=[0])[0].Y
        assert all(torch.equal(v, before[k]) for k, v in attn.state_dict().items())
    np.testing.assert_allclose(outputs["both sides"], outputs["own factors"], atol=1e-6)
    # heads 0 and 3 untouched; the cut heads further from the whole head when both sides are cut
    np.testing.assert_allclose(outputs["both sides"][:, :, [0, 3]], layer.Y[:, :, [0, 3]], atol=1e-5)
    err = {name: np.sum((outputs[name][:, :, [1, 2]] - layer.Y[:, :, [1, 2]]) ** 2) for name in outputs}
    assert err["both sides"] > err["query side"] > 0
    with pytest.raises(ValueError, match="has its own key-side cut"):
        with truncated_heads(model, plan, [layer], metric="whitened", both_sides=True):
            pass


def test_rotary_heads_fitted_in_worker_processes_read_as_one_after_another():
    # the default estimator (torch where present) in joblib's workers: the same rotary fits, the same readings
    layers = collect_attention(_model("llama"), np.random.default_rng(1).integers(0, 50, size=(400, 9)), layers=[0])
    pick = [layers[0].select_heads([0, 2, 3])]
    one = estimate_heads(pick, tolerances=(0.05,))
    two = estimate_heads(pick, tolerances=(0.05,), n_jobs=2)
    assert list(two["head"]) == [0, 2, 3] and list(two["kv_group"]) == [0, 1, 1]
    assert set(two["inversion"]) == {"softmax_rotary_least_squares"}
    for key in ("rank", "rank_at_0.05", "truncation_rank_at_0.05", "warnings"):
        assert list(two[key]) == list(one[key]), key
    for a, b in zip(one["risk_curve"], two["risk_curve"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)


def test_heads_go_to_a_dask_cluster_under_joblibs_dask_backend():
    distributed = pytest.importorskip("distributed")
    import joblib

    layers = collect_attention(_model("llama"), np.random.default_rng(1).integers(0, 50, size=(400, 9)), layers=[0])
    pick = [layers[0].select_heads([0, 2])]
    one = estimate_heads(pick, tolerances=(0.05,))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster):
        with joblib.parallel_config(backend="dask"), distributed.get_task_stream() as stream:
            two = estimate_heads(pick, tolerances=(0.05,), n_jobs=-1)
    # the two heads' fits ran as tasks on the cluster's workers
    assert len([t for t in stream.data if "timed_fit_head" in str(t["key"])]) >= 2, stream.data
    assert list(two["head"]) == [0, 2]
    assert list(two["rank_at_0.05"]) == list(one["rank_at_0.05"])
    assert list(two["truncation_rank_at_0.05"]) == list(one["truncation_rank_at_0.05"])
