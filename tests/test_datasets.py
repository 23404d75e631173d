import numpy as np
import pytest

from rstar.datasets import make_attention_task, make_linear_proxy, sample_tokens, softmax_attention


def test_linear_proxy_teacher():
    X, Y, t = make_linear_proxy(300, seq_len=10, n_features=6, value_dim=4, rank=2, noise=0.1, random_state=0,
                                return_teacher=True)
    assert X.shape == (300, 10, 6) and Y.shape == (300, 10, 4)
    assert t.rank == 2 and np.linalg.matrix_rank(t.operator) == 2
    assert t.value_map.shape == (6, 4)
    assert t.noise_floor == pytest.approx(0.1**2 * 10 * 4)
    resid = Y - np.einsum("st,ntd,dv->nsv", t.operator, X, t.value_map)
    assert resid.std() == pytest.approx(0.1, rel=0.05)
    np.testing.assert_allclose(t.singular_values, [1.0, 1.0])


def test_paper_noise_floor():
    _, _, t = make_linear_proxy(10, return_teacher=True, random_state=0)
    assert t.noise_floor == pytest.approx(0.48)


def test_reproducible_and_seed_dependent():
    a = make_attention_task(20, seq_len=6, n_features=4, rank=2, random_state=7)
    b = make_attention_task(20, seq_len=6, n_features=4, rank=2, random_state=7)
    c = make_attention_task(20, seq_len=6, n_features=4, rank=2, random_state=8)
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.allclose(a[1], c[1])


@pytest.mark.parametrize("kind", ["softmax", "linear_qk"])
def test_attention_teacher(kind):
    X, Y, t = make_attention_task(200, kind=kind, seq_len=12, n_features=8, value_dim=5, rank=3, noise=0.0,
                                  logit_scale=1.5, random_state=0, return_teacher=True)
    assert np.linalg.matrix_rank(t.kernel) == 3
    # ||K||_F = logit_scale * sqrt(d): logits have std logit_scale for Gaussian tokens
    assert np.linalg.norm(t.kernel) == pytest.approx(1.5 * np.sqrt(8))
    if kind == "softmax":
        np.testing.assert_allclose(Y, softmax_attention(X, t.kernel, t.value_map))
        logits = np.einsum("nta,ab,nsb->nts", X, t.kernel, X) / np.sqrt(8)
        assert logits.std() == pytest.approx(1.5, rel=0.1)
    else:
        c = t.normalizer
        clean = np.einsum("nta,ab,nsb,nsc,cv->ntv", X, t.kernel, X, X, t.value_map) / c
        np.testing.assert_allclose(Y, clean)


def test_token_distributions():
    rng = 0
    g = sample_tokens(4000, 2, 3, distribution="gaussian", random_state=rng)
    t = sample_tokens(4000, 2, 3, distribution="student_t", df=4.0, random_state=rng)
    c = sample_tokens(4000, 2, 3, distribution="correlated", feature_correlation=0.8, random_state=rng)
    assert g.var() == pytest.approx(1.0, rel=0.05)
    assert t.var() == pytest.approx(1.0, rel=0.2)
    # heavy tails: excess kurtosis well above the Gaussian's 0
    z = t.ravel()
    assert np.mean(z**4) / np.mean(z**2) ** 2 > 4.0
    flat = c.reshape(-1, 3)
    assert np.corrcoef(flat.T)[0, 1] == pytest.approx(0.8, abs=0.03)
    assert np.corrcoef(flat.T)[0, 2] == pytest.approx(0.64, abs=0.03)


def test_rank_zero_is_pure_noise():
    X, Y, t = make_linear_proxy(50, rank=0, noise=0.2, random_state=0, return_teacher=True)
    assert np.all(t.operator == 0)
    assert Y.std() == pytest.approx(0.2, rel=0.1)


def test_decay_and_explicit_spectrum():
    _, _, t = make_linear_proxy(5, rank=3, decay=0.5, random_state=0, return_teacher=True)
    s = t.singular_values
    assert s[1] / s[0] == pytest.approx(0.5) and s[2] / s[1] == pytest.approx(0.5)
    _, _, t = make_attention_task(5, rank=2, singular_values=[3.0, 1.0], random_state=0, return_teacher=True)
    np.testing.assert_allclose(np.linalg.svd(t.kernel, compute_uv=False)[:2], [3.0, 1.0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_samples": 0}, "n_samples"),
        ({"rank": 20}, "rank"),
        ({"rank": -1}, "rank"),
        ({"noise": -0.1}, "noise"),
        ({"token_distribution": "uniform"}, "token_distribution"),
        ({"token_distribution": "student_t", "df": 2.0}, "df"),
        ({"singular_values": [1.0]}, "singular_values"),
        ({"decay": 0.0}, "decay"),
    ],
)
def test_bad_generator_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_linear_proxy(**{"n_samples": 10, **kwargs})


def test_bad_attention_kind():
    with pytest.raises(ValueError, match="kind"):
        make_attention_task(10, kind="block")


def test_causal_and_rotary_attention_tasks():
    """``causal`` masks later tokens (the first token reads only its own value); ``rotary`` makes a rotary head
    whose offset-zero kernel is K* (its factors of rank r*), the plain head when every angle is zero."""
    from rstar import RotaryPositions

    kw = dict(seq_len=8, n_features=6, rank=2, noise=0.0, random_state=0)
    X, Y, t = make_attention_task(50, return_teacher=True, **kw)
    Xc, Yc, tc = make_attention_task(50, causal=True, return_teacher=True, **kw)
    np.testing.assert_allclose(Yc[:, 0], Xc[:, 0] @ tc.value_map, atol=1e-12)
    assert tc.causal and not t.causal and np.abs(Yc[:, 1:] - Y[:, 1:]).max() > 1e-3
    positions = RotaryPositions.from_frequencies(np.array([1.0, 0.1, 0.01]), 8)
    _, Yr, tr = make_attention_task(50, rotary=positions, return_teacher=True, **kw)
    np.testing.assert_allclose(tr.query_factors @ tr.key_factors.T, tr.kernel, atol=1e-12)
    assert np.linalg.matrix_rank(tr.query_factors) == 2 and tr.query_factors.shape == (6, 6)
    assert np.abs(Yr - Y).max() > 1e-3
    still = RotaryPositions.from_frequencies(np.zeros(3), 8)
    np.testing.assert_allclose(make_attention_task(50, rotary=still, **kw)[1], Y, atol=1e-12)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(causal=True, kind="linear_qk"), ValueError, "kind must be 'softmax'"),
    (dict(rotary="x"), TypeError, "rotary must be a RotaryPositions"),
    (dict(rotary=8), TypeError, "rotary must be a RotaryPositions"),
    (dict(rank=7), ValueError, "rank must be <= rotary.width=6"),
    (dict(seq_len=9), ValueError, "rotary has 8 positions, but seq_len=9"),
])
def test_bad_causal_and_rotary_arguments(kwargs, error, match):
    from rstar import RotaryPositions

    positions = RotaryPositions.from_frequencies(np.array([1.0, 0.1, 0.01]), 8)
    kw = dict(seq_len=8, n_features=8, rank=2, rotary=positions)
    if "rank" in kwargs or "seq_len" in kwargs:
        kw.update(kwargs)
    else:
        kw = dict(seq_len=8, n_features=8, rank=2, **kwargs)
    with pytest.raises(error, match=match):
        make_attention_task(20, **kw)
