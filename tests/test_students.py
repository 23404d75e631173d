"""Trained students (rstar.students): API contract, determinism, pickling, rank measurement."""

import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.metrics import r2_score

import rstar
from rstar.datasets import make_attention_task, make_linear_proxy
from rstar.students import (AttentionStudent, kronecker_entry_variance, mp_corrected_rank, operator_entry_variance,
                            operator_noise_threshold)


pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = ["linear_proxy", "linear_qk", "linear_qk_full", "softmax", "block"]
FAST = dict(max_epochs=30, patience=10)


def _env_with_package():
    """Environment for a subprocess that imports this checkout of rstar, installed or not."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(rstar.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def small_qk():
    return make_attention_task(300, kind="linear_qk", seq_len=8, n_features=6, rank=2, random_state=1,
                               return_teacher=True)


# ------------------------------------------------------------------ numpy-only rank helpers
def test_noise_threshold_tends_to_mp_edge():
    # sqrt(q * TW quantile) -> s (sqrt p + sqrt q) for large matrices
    tau = operator_noise_threshold((400, 400), 0.25, alpha=0.5)
    assert tau == pytest.approx(0.5 * (20 + 20), rel=0.01)
    assert operator_noise_threshold((12, 12), 1.0, alpha=0.01) > operator_noise_threshold((12, 12), 1.0, alpha=0.1)
    assert operator_noise_threshold((3, 5), 0.0) == 0.0


def test_noise_threshold_false_alarm_rate():
    # Gaussian p x q noise exceeds the 1 - alpha threshold about alpha of the time
    rng = np.random.default_rng(0)
    tau = operator_noise_threshold((12, 12), 1.0, alpha=0.1)
    tops = np.array([np.linalg.norm(rng.standard_normal((12, 12)), 2) for _ in range(2000)])
    assert 0.05 < np.mean(tops > tau) < 0.15


def test_mp_corrected_rank_counts_only_spikes():
    rng = np.random.default_rng(0)
    s2 = 1e-4
    K = np.diag([1.0, 0.5, 0.2] + [0.0] * 9) + np.sqrt(s2) * rng.standard_normal((12, 12))
    out = mp_corrected_rank(K, s2)
    assert out.rank == 3
    assert out.raw_effective_rank > out.effective_rank  # noise singular values inflate the raw measure
    assert mp_corrected_rank(np.sqrt(s2) * rng.standard_normal((12, 12)), s2).rank == 0
    assert mp_corrected_rank(np.zeros((4, 4)), 1e-3).effective_rank == 0.0
    with pytest.raises(ValueError, match="measure"):
        mp_corrected_rank(K, s2, measure="bogus")


def test_entry_variance():
    assert operator_entry_variance(4.0 * np.eye(9), 2.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="square"):
        operator_entry_variance(np.ones((2, 3)), 1.0)
    with pytest.raises(ValueError, match="noise_variance"):
        operator_entry_variance(np.eye(2), -1.0)


# ------------------------------------------------------------------ students
@pytest.mark.parametrize("kind", KINDS)
def test_fit_predict_shapes(torch, kind):
    X, Y = make_attention_task(40, kind="softmax", seq_len=5, n_features=4, value_dim=3, rank=2, random_state=0)
    st = AttentionStudent(kind=kind, random_state=0, **FAST).fit(X, Y)
    assert st.predict(X).shape == (40, 5, 3)
    side = 5 if kind == "linear_proxy" else 4
    assert st.kernel_.shape == (side, side)
    assert len(st.history_) == st.n_iter_ <= 30
    assert st.n_features_in_ == 4 and st.seq_len_ == 5 and st.n_outputs_ == 3
    assert 0 <= st.rank_ <= side
    assert np.isfinite(st.effective_rank_) and np.isfinite(st.train_risk_)
    assert st.device_ == "cpu"


def test_two_dimensional_input_is_one_token(torch):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((50, 3))
    Y = X @ rng.standard_normal((3, 2))
    st = AttentionStudent(kind="linear_proxy", random_state=0, **FAST).fit(X, Y)
    assert st.predict(X).shape == (50, 2)                    # as Y was given: one token a sample
    assert st.predict(X[:, None]).shape == (50, 1, 2)
    assert st.seq_len_ == 1


def test_score_is_tokenwise_r2(torch, small_qk):
    X, Y, _ = small_qk
    st = AttentionStudent(kind="linear_qk", random_state=0, **FAST).fit(X, Y)
    pred = st.predict(X)
    assert st.score(X, Y) == pytest.approx(r2_score(Y.reshape(-1, 6), pred.reshape(-1, 6)), rel=1e-12)
    # train_risk_ is the per-sample squared Frobenius error
    assert st.train_risk_ == pytest.approx(np.mean(np.sum((Y - pred) ** 2, axis=(1, 2))), rel=1e-4)


def test_deterministic_with_random_state(torch, small_qk):
    X, Y, _ = small_qk
    a = AttentionStudent(kind="softmax", random_state=3, **FAST).fit(X, Y)
    b = AttentionStudent(kind="softmax", random_state=3, **FAST).fit(X, Y)
    c = AttentionStudent(kind="softmax", random_state=4, **FAST).fit(X, Y)
    assert a.history_ == b.history_
    np.testing.assert_array_equal(a.predict(X), b.predict(X))
    np.testing.assert_array_equal(a.kernel_, b.kernel_)
    assert not np.array_equal(a.kernel_, c.kernel_)
    # mini-batches are drawn from the same seeded generator
    d = AttentionStudent(kind="linear_qk", batch_size=64, random_state=5, **FAST).fit(X, Y)
    e = AttentionStudent(kind="linear_qk", batch_size=64, random_state=5, **FAST).fit(X, Y)
    np.testing.assert_array_equal(d.predict(X), e.predict(X))


def test_pickle_roundtrip_is_cpu_numpy(torch, small_qk):
    X, Y, _ = small_qk
    st = AttentionStudent(kind="block", rank=2, random_state=0, **FAST).fit(X, Y)
    state = st.__getstate__()
    assert "module_" not in state
    assert all(isinstance(v, np.ndarray) for v in state["_module_state_"].values())
    loaded = pickle.loads(pickle.dumps(st))
    np.testing.assert_array_equal(loaded.predict(X), st.predict(X))
    assert loaded.rank_ == st.rank_ and loaded.get_params() == st.get_params()
    np.testing.assert_array_equal(loaded.kernel_, st.kernel_)


def test_clone_and_params(torch):
    st = AttentionStudent(kind="softmax", rank=2, lr=0.05, random_state=7)
    cl = clone(st)
    assert cl.get_params() == st.get_params()
    assert not hasattr(cl, "rank_")
    with pytest.raises(NotFittedError):
        cl.predict(np.zeros((2, 3, 4)))


@pytest.mark.parametrize("params, match", [
    (dict(kind="mlp"), "'kind' parameter of AttentionStudent must be a str among"),
    (dict(rank=0), "'rank' parameter of AttentionStudent must be an int in the range \\[1, inf\\) or None"),
    (dict(rank=2.5), "'rank' parameter"),
    (dict(rank=7), "rank must be <= d"),
    (dict(kind="linear_proxy", rank=9), "rank must be <= T"),
    (dict(kind="linear_qk_full", rank=2), "rank must be None"),
    (dict(lr=0), "'lr' parameter"),
    (dict(init_scale=-1.0), "'init_scale' parameter"),
    (dict(max_epochs=0), "'max_epochs' parameter"),
    (dict(batch_size=0), "'batch_size' parameter"),
    (dict(alpha=1.5), "'alpha' parameter"),
    (dict(dtype="float16"), "'dtype' parameter"),
    (dict(device="tpu"), "device must be"),
    (dict(fisher="fast"), "'fisher' parameter .* among \\{.*'exact'"),
    (dict(kind="linear_proxy", fisher="kronecker"), "fisher='kronecker' needs a query-key student"),
    (dict(memory_budget=0), "'memory_budget' parameter"),
    (dict(rank=True), "rank must be None or an integer"),   # a bool passes the constraints as an int
    (dict(max_epochs=float("inf")), "'max_epochs' parameter"),
    (dict(tol=float("nan")), "'tol' parameter"),
    (dict(causal="yes"), "'causal' parameter of AttentionStudent must be an instance of 'bool'"),
    (dict(rotary=np.zeros((8, 2))), "'rotary' parameter of AttentionStudent must be an instance of"),
    (dict(validation_fraction=0.5), "'validation_fraction' parameter .* range \\(0(\\.0)?, 0\\.5\\)"),
    (dict(calibration={"fisher_samples": 8}), "'calibration' parameter"),
    (dict(value_map=np.ones((6, 5))), "value_map must have shape \\(d, d_v\\) = \\(6, 6\\)"),
    (dict(value_map=np.full((6, 6), np.nan)), "value_map contains NaN"),
    (dict(kind="block", value_map=np.eye(6)), "a block student's is d x d inside the block"),
    (dict(memory_budget=2**12), "a training batch of 20 samples .* lower batch_size or raise memory_budget"),
    (dict(fisher="exact", memory_budget=2**14, batch_size=1), "fisher='exact': the 6\\^2 x 6\\^2 Fisher"),
])
def test_bad_params(torch, small_qk, params, match):
    X, Y, _ = small_qk
    with pytest.raises(ValueError, match=match):
        AttentionStudent(**params).fit(X[:20], Y[:20])


def test_cuda_requested_without_cuda(torch, small_qk):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    X, Y, _ = small_qk
    with pytest.raises(ValueError, match="CUDA is not available"):
        AttentionStudent(device="cuda").fit(X[:20], Y[:20])


def test_bad_data(torch, small_qk):
    X, Y, _ = small_qk
    st = AttentionStudent(**FAST)
    with pytest.raises(ValueError, match="X must have shape"):
        st.fit(X[0, 0], Y)
    with pytest.raises(ValueError, match="different numbers of samples"):
        st.fit(X, Y[:10])
    with pytest.raises(ValueError, match="tokens"):
        st.fit(X, Y[:, :4])
    bad = X.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        st.fit(bad, Y)
    st.fit(X[:30], Y[:30])
    with pytest.raises(ValueError, match=r"X has \d features, but AttentionStudent is expecting"):
        st.predict(X[:, :, :4])
    proxy = AttentionStudent(kind="linear_proxy", **FAST).fit(X[:30], Y[:30])
    with pytest.raises(ValueError, match="fixed 8 x 8 matrix"):
        proxy.predict(X[:, :5])
    # attention students accept another sequence length
    assert st.predict(X[:, :5]).shape == (300, 5, 6)


def test_verbose_progress_bar(torch, small_qk, capsys):
    X, Y, _ = small_qk
    AttentionStudent(verbose=1, max_epochs=5, random_state=0).fit(X[:20], Y[:20])
    assert "B1" in capsys.readouterr().err


def test_early_stopping_on_plateau(torch, small_qk):
    X, Y, _ = small_qk
    st = AttentionStudent(kind="linear_qk", rank=2, max_epochs=5000, patience=20, max_lr_drops=1,
                          random_state=0).fit(X, Y)
    assert st.n_iter_ < 5000
    # the last `patience` epochs did not improve on the best by the relative tolerance
    h = np.asarray(st.history_)
    assert h[-20:].min() >= h[:-20].min() * (1 - st.tol) - 1e-12


def test_insufficiency_attainment_recovery_linear_qk(torch, small_qk):
    X, Y, teacher = small_qk
    floor = teacher.noise_floor
    risks = {}
    for r in (1, 2, None):
        st = AttentionStudent(kind="linear_qk", rank=r, random_state=0).fit(X, Y)
        risks[r] = st.train_risk_
        if r is None:
            assert st.rank_ == 2
            assert 1.95 <= st.effective_rank_ <= 2.05
            assert st.raw_effective_rank_ >= st.effective_rank_
    assert risks[1] > 10 * floor  # insufficiency
    assert risks[2] < 1.02 * floor  # attainment (training risk is slightly below the floor)
    assert risks[None] < 1.02 * floor


def test_softmax_recovery_energy_rank(torch):
    X, Y, teacher = make_attention_task(400, kind="softmax", seq_len=8, n_features=6, rank=2, random_state=2,
                                        return_teacher=True)
    st = AttentionStudent(kind="softmax", random_state=0).fit(X, Y)
    assert st.rank_ == 2
    assert 1.9 <= st.effective_rank_ <= 2.05
    assert st.train_risk_ < 1.03 * teacher.noise_floor


def test_known_value_map_is_held_fixed(torch):
    # the student learns only its kernel, on the task RStarEstimator(value_map=V) reads: V stays the given one
    # (a buffer, not trained), the kernel is still recovered, and it predicts with that V after a pickle
    X, Y, teacher = make_attention_task(400, kind="softmax", seq_len=8, n_features=6, rank=2, random_state=2,
                                        return_teacher=True)
    V = teacher.value_map
    st = AttentionStudent(kind="softmax", rank=2, value_map=V, random_state=0).fit(X, Y)
    np.testing.assert_array_equal(st.module_.V.detach().double().numpy(), V.astype(np.float32))
    assert "V" not in dict(st.module_.named_parameters())
    assert st.rank_ == 2 and st.train_risk_ < 1.05 * teacher.noise_floor
    K = st.kernel_
    assert np.linalg.norm(K - teacher.kernel) < 0.1 * np.linalg.norm(teacher.kernel)
    loaded = pickle.loads(pickle.dumps(st))
    np.testing.assert_array_equal(loaded.predict(X), st.predict(X))
    # the other weights start from the same draws as with V learned
    from rstar.students._modules import build_module

    args = dict(seq_len=8, n_features=6, value_dim=6, rank=2, init_scale=0.01)
    free = build_module("softmax", **args, generator=torch.Generator().manual_seed(3))
    fixed = build_module("softmax", **args, generator=torch.Generator().manual_seed(3), value_map=V)
    for name in ("L", "R"):
        torch.testing.assert_close(getattr(free, name), getattr(fixed, name))


def test_linear_proxy_rank_sweep(torch):
    X, Y, teacher = make_linear_proxy(300, seq_len=8, n_features=5, rank=2, random_state=0, return_teacher=True)
    low = AttentionStudent(kind="linear_proxy", rank=1, random_state=0).fit(X, Y)
    ok = AttentionStudent(kind="linear_proxy", rank=None, random_state=0).fit(X, Y)
    assert low.train_risk_ > 5 * teacher.noise_floor
    assert ok.train_risk_ < 1.02 * teacher.noise_floor
    assert ok.rank_ == 2


def test_import_without_torch(tmp_path):
    code = textwrap.dedent("""
        import sys

        class BlockTorch:  # behave as if torch were not installed
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("No module named 'torch'")

        sys.meta_path.insert(0, BlockTorch())
        import rstar, rstar.students, rstar.paper.experiments, rstar.cli
        assert "torch" not in sys.modules
        from rstar.students import AttentionStudent
        import numpy as np
        st = AttentionStudent(kind="softmax", rank=2)
        assert st.get_params()["rank"] == 2
        try:
            st.fit(np.zeros((5, 3, 2)), np.zeros((5, 3, 2)))
        except ImportError as exc:
            assert 'pip install "rstar[torch]"' in str(exc), exc
            print("OK")
        else:
            raise AssertionError("fit without torch did not raise")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=_env_with_package())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"


# ------------------------------------------------------------------ the Fisher information at real sizes
def test_kronecker_entry_variance_is_exact_on_kronecker_products():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((4, 3))
    A = A @ A.T                                  # rank 3 of 4: one direction left out, as the pseudo-inverse does
    B = rng.standard_normal((5, 5))
    B = B @ B.T + np.eye(5)
    assert kronecker_entry_variance(A, B, 0.3) == pytest.approx(operator_entry_variance(np.kron(A, B), 0.3))
    assert kronecker_entry_variance(np.zeros((2, 2)), B, 0.0) == 0.0
    with pytest.raises(ValueError, match="query_factor must be a square matrix"):
        kronecker_entry_variance(np.zeros((2, 3)), B, 0.3)


@pytest.mark.parametrize("kind, data_kind, tolerance", [
    ("softmax", "softmax", 0.1), ("linear_qk", "linear_qk", 0.1), ("block", "softmax", 0.2)])
def test_kronecker_fisher_agrees_with_the_exact_one(torch, kind, data_kind, tolerance):
    """Where both run, the nearest Kronecker factors of the operator's Fisher information give the exact per-entry
    variance within 10% (B1, B2; 20% for the block: measured 5%, 2%, 14%) and the same rank."""
    X, Y = make_attention_task(400, kind=data_kind, seq_len=8, n_features=6, rank=2, random_state=0)
    exact = AttentionStudent(kind=kind, random_state=0, max_epochs=800).fit(X, Y)
    kron = AttentionStudent(kind=kind, random_state=0, max_epochs=800, fisher="kronecker").fit(X, Y)
    assert (exact.fisher_method_, kron.fisher_method_) == ("exact", "kronecker")
    assert kron.kernel_entry_variance_ == pytest.approx(exact.kernel_entry_variance_, rel=tolerance)
    assert kron.rank_ == exact.rank_ == (2 if kind != "block" else exact.rank_)
    np.testing.assert_array_equal(kron.kernel_, exact.kernel_)   # the same training: only the measurement differs


def test_student_beyond_the_exact_fisher_is_measured_in_bounded_memory(torch):
    """``fisher="auto"`` past the memory budget: the Kronecker factors (d x d), said by a warning and recorded;
    at d = 128 the exact information would take 2 GiB, over the default budget, and is never formed."""
    from rstar import InversionFallbackWarning

    X, Y = make_attention_task(300, seq_len=16, n_features=128, value_dim=16, rank=4, random_state=0)
    with pytest.warns(InversionFallbackWarning, match="nearest Kronecker product"):
        student = AttentionStudent(kind="softmax", rank=4, random_state=0, max_epochs=40).fit(X, Y)
    assert student.fisher_method_ == "kronecker"
    assert np.isfinite(student.kernel_entry_variance_) and 1 <= student.rank_ <= 4
    small = make_attention_task(200, seq_len=8, n_features=6, rank=2, random_state=0)
    with pytest.warns(InversionFallbackWarning, match="raise memory_budget for the exact one"):
        tight = AttentionStudent(kind="softmax", random_state=0, max_epochs=20, batch_size=4,
                                 memory_budget=20000).fit(*small)
    assert tight.fisher_method_ == "kronecker"


def test_training_out_of_memory_is_a_one_line_error(torch, small_qk, monkeypatch):
    X, Y, _ = small_qk

    def exhausted(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(AttentionStudent, "_train", exhausted)
    with pytest.raises(ValueError, match="training ran out of memory on cpu with batches of 300 samples .* lower "
                                         "batch_size"):
        AttentionStudent(device="cpu").fit(X, Y)


@pytest.mark.parametrize("kind, rank", [("linear_qk", 3), ("linear_qk", None), ("linear_qk_full", None),
                                        ("softmax", 3), ("softmax", None), ("block", 3), ("block", None)])
def test_query_key_students_run_on_factored_logits(kind, rank):
    """The query-key students' forward pass forms the logits from the factors, (X L)(X R)^T, never the d x d
    kernel: the same outputs and gradients as through the kernel."""
    torch = pytest.importorskip("torch")
    from rstar.students._modules import build_module

    module = build_module(kind, seq_len=6, n_features=9, value_dim=4, rank=rank, init_scale=0.3,
                          generator=torch.Generator().manual_seed(0))
    X = torch.randn(5, 6, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = module(X)
    ref = module.forward_with_operator(X, module.operator())
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), list(module.parameters()), allow_unused=True)
    ref_grads = torch.autograd.grad(ref.sum(), list(module.parameters()), allow_unused=True)
    for g, h in zip(grads, ref_grads):
        torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ causal and rotary students
def _rotary_task(width, n=400, seed=1):
    from rstar import RotaryPositions

    rot = RotaryPositions.from_frequencies(np.array([1.0, 0.3, 0.05]), 8)
    X, Y, teacher = make_attention_task(n, seq_len=8, n_features=6, rank=width, causal=True, rotary=rot,
                                        random_state=seed, return_teacher=True, noise=0.05)
    return rot, X, Y, teacher


@pytest.mark.parametrize("width", [0, 2])
def test_a_rotary_student_reads_a_planted_width_by_its_split_half_test(torch, width):
    """An over-parameterised causal rotary student on a planted rotary head of width 0 or 2 (d = 6, three planes at
    1, 0.3 and 0.05 rad a position, 400 windows of 8 tokens, 5% noise, V known): the split-half count of its
    halves' logit families reads the width, the (2P) singular values beyond it stay below the threshold."""
    rot, X, Y, teacher = _rotary_task(width)
    st = AttentionStudent(kind="softmax", causal=True, rotary=rot, value_map=teacher.value_map, random_state=0,
                          max_epochs=2000, lr=3e-2).fit(X, Y)
    assert st.fisher_method_ == "split_half" and np.isnan(st.kernel_entry_variance_)
    assert st.rank_ == width
    s = st.kernel_singular_values_
    assert s.shape == (6,) and np.all(s[width:] < st.noise_threshold_)
    assert np.all(s[:width] > 20 * st.noise_threshold_)
    assert st.score(X, Y) > 0.98
    assert st.effective_rank_ == pytest.approx(width, abs=0.2)


def test_a_rotary_student_is_the_rotary_head_of_its_factors(torch):
    """A rank-2 causal rotary student predicts the rotary head of its query_key_factors_ (rstar's convention:
    rot(x A) rot(x B)^T / sqrt(d), the causal mask), of rank 2 on each side; it pickles, clones with its positions,
    and refuses windows of another length."""
    from rstar.inversions._numerics.softmax_factored import causal_mask, factored_outputs

    rot, X, Y, teacher = _rotary_task(4, n=60)
    st = AttentionStudent(kind="softmax", causal=True, rotary=rot, rank=2, value_map=teacher.value_map,
                          random_state=0, **FAST).fit(X, Y)
    A, B = st.query_key_factors_
    assert A.shape == B.shape == (6, 6)
    assert np.linalg.matrix_rank(A, tol=1e-6) == 2 and np.linalg.matrix_rank(B, tol=1e-6) == 2
    want = factored_outputs(X, X @ teacher.value_map, A, B, causal_mask(8), rotary=rot)
    np.testing.assert_allclose(st.predict(X), want, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(st.kernel_, A @ B.T, atol=1e-6 * np.abs(A @ B.T).max())   # float32 products
    again = pickle.loads(pickle.dumps(st))
    np.testing.assert_array_equal(again.predict(X), st.predict(X))
    np.testing.assert_array_equal(clone(st).get_params()["rotary"].angles, rot.angles)
    with pytest.raises(ValueError, match="rotary student turns its 8 positions"):
        st.predict(X[:, :5])


@pytest.mark.parametrize("kind", ["softmax", "block"])
def test_a_causal_student_does_not_look_ahead(torch, kind):
    """causal=True: a token's output depends on it and the tokens before it only; the Fisher path (through the
    masked logits) still gives a finite noise level."""
    X, Y = make_attention_task(60, seq_len=6, n_features=4, rank=2, causal=True, random_state=0)
    st = AttentionStudent(kind=kind, causal=True, random_state=0, **FAST).fit(X, Y)
    later = X.copy()
    later[:, 3:] += 1.0
    before, after = st.predict(X), st.predict(later)
    np.testing.assert_array_equal(before[:, :3], after[:, :3])
    assert np.abs(before[:, 3:] - after[:, 3:]).max() > 1e-3
    assert np.isfinite(st.kernel_entry_variance_) and st.fisher_method_ == "exact"
    bidirectional = AttentionStudent(kind=kind, random_state=0, **FAST).fit(X, Y)
    assert np.abs(bidirectional.predict(X)[:, :3] - bidirectional.predict(later)[:, :3]).max() > 1e-3


def test_causal_and_rotary_students_refuse_what_they_cannot_be(torch):
    rot, X, Y, _ = _rotary_task(2, n=20)
    cases = [
        (dict(kind="linear_qk", causal=True), ValueError, "causal=True masks a softmax's logits"),
        (dict(causal=1), TypeError, "'causal' parameter of AttentionStudent must be an instance of 'bool'"),
        (dict(kind="linear_qk", rotary=rot), ValueError, "kind must be 'softmax' with rotary"),
        (dict(kind="softmax", rotary="rope"), TypeError, "'rotary' parameter .* instance of 'rstar.*RotaryPositions'"),
        (dict(kind="softmax", rotary=rot, fisher="exact"), ValueError, "split-half test; use fisher='auto'"),
        (dict(kind="softmax", rotary=rot, rank=7), ValueError, r"rank must be <= min\(d, rotary.width\)"),
    ]
    for params, error, match in cases:
        with pytest.raises(error, match=match):
            AttentionStudent(**params, **FAST).fit(X, Y)
    # 5% of 20 windows holds out one, but each half-student's 10 would hold out none: refused before any training
    with pytest.raises(ValueError, match="validation_fraction=0.05 of 10 samples holds out 0"):
        AttentionStudent(kind="softmax", rotary=rot, validation_fraction=0.05, **FAST).fit(X, Y)
    with pytest.raises(ValueError, match="rotary has 8 positions, but X has T = 5"):
        AttentionStudent(kind="softmax", rotary=rot, **FAST).fit(X[:, :5], Y[:, :5])


def test_early_stopping_keeps_the_epoch_with_the_lowest_held_out_risk(torch):
    """validation_fraction: that share of the samples is held out, the plateau rule reads their risk, and the weights
    kept are those of the epoch where it was lowest (here an over-parameterised student on 60 noisy samples, whose
    held-out risk rises again before the plateau stops it)."""
    X, Y = make_attention_task(80, seq_len=6, n_features=8, rank=2, noise=0.3, random_state=0)
    st = AttentionStudent(kind="softmax", validation_fraction=0.25, max_epochs=600, patience=20, lr=3e-2,
                          random_state=0).fit(X, Y)
    held = st.validation_samples_
    assert held.size == 20 and np.unique(held).size == 20
    assert len(st.validation_history_) == len(st.history_) == st.n_iter_
    assert min(st.validation_history_) < st.validation_history_[-1]
    kept = np.sum((Y[held] - st.predict(X[held])) ** 2) / held.size
    assert kept == pytest.approx(min(st.validation_history_), rel=1e-4)
    assert not hasattr(AttentionStudent(kind="softmax", **FAST).fit(X, Y), "validation_history_")
    refit = st.set_params(validation_fraction=None, kind="linear_qk", **FAST).fit(X, Y)   # no leftovers of a refit
    assert not hasattr(refit, "validation_samples_") and not hasattr(refit, "query_key_factors_")
    with pytest.raises(ValueError, match=r"'validation_fraction' parameter of AttentionStudent must be a float in "
                                         r"the range \(0(\.0)?, 0\.5\)"):
        AttentionStudent(validation_fraction=0.5, **FAST).fit(X, Y)
    with pytest.raises(ValueError, match="holds out 0: at least one sample"):
        AttentionStudent(validation_fraction=0.001, **FAST).fit(X, Y)
