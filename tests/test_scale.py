"""Scale: fitting over batches in passes, dask arrays (a LocalCluster included), shards merged, the torch back-end."""

import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

from rstar import MPRankEstimator, RStarEstimator
from rstar.datasets import make_attention_task, make_linear_proxy
from rstar.exceptions import InversionFallbackWarning, UnidentifiableRankWarning
from rstar.streaming import ArraySamples, BatchSamples

from _reasons import assert_warned

# 1 MiB: far below what keeping 1000 samples of T = 32, d = 16 takes (8 MiB), far above every sum
SMALL_BUDGET = 2**20


@pytest.fixture(scope="module")
def softmax_task():
    return make_attention_task(1000, seq_len=32, n_features=16, rank=3, noise=0.1, random_state=0)


def _batches(X, Y, size=250):
    return lambda: ((X[i:i + size], Y[i:i + size]) for i in range(0, X.shape[0], size))


def _same_fit(a, b, rtol=1e-9):
    assert a.rank_ == b.rank_ and a.inversion_ == b.inversion_ and a.rank_interval_ == b.rank_interval_
    np.testing.assert_allclose(a.spectrum_, b.spectrum_, rtol=rtol, atol=rtol * a.spectrum_[0])
    assert a.threshold_ == pytest.approx(b.threshold_, rel=1e-6)
    assert a.n_samples_seen_ == b.n_samples_seen_


def test_fit_batches_within_budget_equals_partial_fit(softmax_task):
    X, Y = softmax_task
    ref = RStarEstimator()
    for i in range(0, 1000, 250):
        ref.partial_fit(X[i:i + 250], Y[i:i + 250])
    est = RStarEstimator().fit_batches(_batches(X, Y))
    _same_fit(est, ref, rtol=1e-12)
    assert est.rank_ == 3 and est.inversion_ == "softmax_least_squares"


def test_fit_batches_over_budget_reads_passes_instead_of_falling_back(softmax_task):
    X, Y = softmax_task
    ref = RStarEstimator().fit(X, Y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InversionFallbackWarning)
        est = RStarEstimator(memory_budget=SMALL_BUDGET).fit_batches(_batches(X, Y))
    # the same least squares, read in passes: equal to round-off (the attention weights are recomputed)
    _same_fit(est, ref, rtol=1e-8)
    assert est.inversion_ == "softmax_least_squares"
    np.testing.assert_allclose(est.predict(X[:50]), ref.predict(X[:50]), rtol=1e-6, atol=1e-8)
    # partial_fit under the same budget keeps the first 128 samples only, fits the least squares on them, and says so
    stream = RStarEstimator(memory_budget=SMALL_BUDGET)
    for i in range(0, 1000, 250):
        stream.partial_fit(X[i:i + 250], Y[i:i + 250])
    assert stream.n_samples_seen_ == 1000 and "rank_" not in vars(stream)   # computed when first read
    with pytest.warns(InversionFallbackWarning, match="fitted on the first 128"):
        assert stream.rank_ >= 0
    alone = RStarEstimator().fit(X[:128], Y[:128])
    assert stream.inversion_ == "softmax_least_squares" and stream.rank_ == alone.rank_
    np.testing.assert_allclose(stream.spectrum_, alone.spectrum_, rtol=1e-8, atol=1e-10 * alone.spectrum_[0])


def test_a_fit_read_in_passes_keeps_no_samples_and_pickles(softmax_task):
    X, Y = softmax_task
    sizes = []
    for n in (500, 1000):
        est = RStarEstimator(memory_budget=SMALL_BUDGET, predict_sums=False).fit_batches(_batches(X[:n], Y[:n]))
        sizes.append(len(pickle.dumps(est)))
    # flat in n: sums, null draws and the whitened statistic, never the samples (8 MiB at n = 1000)
    assert sizes[1] < 1.05 * sizes[0] and sizes[1] < 4 * 2**20
    again = pickle.loads(pickle.dumps(est))
    assert again.rank_ == est.rank_ and again.statistic_.inversion == "softmax_least_squares"
    with pytest.raises(ValueError, match="read its samples in passes"):
        est.partial_fit(X[:10], Y[:10])
    with pytest.raises(ValueError, match="in passes"):
        est.merge(RStarEstimator().fit(X[:200], Y[:200]))


def test_fit_batches_accepts_a_list_and_checks_its_batches():
    X, Y = make_linear_proxy(400, rank=3, random_state=0)
    est = MPRankEstimator().fit_batches([(X[:200], Y[:200]), (X[200:], Y[200:])])
    ref = MPRankEstimator().fit(X, Y)
    assert est.rank_ == ref.rank_ == 3
    np.testing.assert_allclose(est.spectrum_, ref.spectrum_, rtol=1e-10)
    with pytest.raises(TypeError, match="one-shot iterator"):
        MPRankEstimator().fit_batches(iter([(X, Y)]))
    with pytest.raises(ValueError, match="no \\(X, Y\\) batch"):
        MPRankEstimator().fit_batches([])
    with pytest.raises(ValueError, match="batch 1 must be an \\(X, Y\\) pair"):
        MPRankEstimator().fit_batches([(X, Y), X])
    with pytest.raises(ValueError, match="tokens"):
        MPRankEstimator().fit_batches([(X, Y), (X[:, :8], Y[:, :8])])
    with pytest.raises(ValueError, match="NaN|infinity"):
        MPRankEstimator().fit_batches([(X, Y), (np.full_like(X, np.nan), Y)])


def test_shards_merged_equal_one_fit():
    X, Y = make_linear_proxy(900, rank=3, random_state=1)
    est = MPRankEstimator().partial_fit(X[:300], Y[:300])
    shards = [est.new_shard().partial_fit(X[a:a + 300], Y[a:a + 300]) for a in (300, 600)]
    est.merge(*shards)
    ref = MPRankEstimator().partial_fit(X[:300], Y[:300]).partial_fit(X[300:600], Y[300:600])
    ref.partial_fit(X[600:], Y[600:])
    _same_fit(est, ref, rtol=1e-10)
    # shards in other units (fitted apart from scratch) are refused rather than summed wrongly
    other = MPRankEstimator().fit(X[300:] * 3, Y[300:])
    with pytest.raises(ValueError, match="other units"):
        MPRankEstimator().fit(X[:300], Y[:300]).merge(other)


# -- dask --------------------------------------------------------------------------------------------------

dask_array = pytest.importorskip("dask.array")


@pytest.mark.parametrize("case", ["linear_proxy", "linear_qk_cross_fit", "softmax_kept", "softmax_passes"])
def test_dask_fit_equals_the_in_memory_fit(case):
    import dask

    if case == "linear_proxy":
        X, Y = make_linear_proxy(600, rank=3, random_state=0)
        make = lambda: MPRankEstimator()  # noqa: E731
    elif case == "linear_qk_cross_fit":
        X, Y = make_attention_task(400, kind="linear_qk", seq_len=6, n_features=8, rank=2, random_state=0)
        make = lambda: RStarEstimator(operator="linear_qk")  # noqa: E731
    else:
        X, Y = make_attention_task(600, seq_len=16, n_features=8, rank=2, noise=0.1, random_state=0)
        budget = SMALL_BUDGET // 8 if case == "softmax_passes" else RStarEstimator().memory_budget
        make = lambda: RStarEstimator(memory_budget=budget)  # noqa: E731
    # the first chunk sets the units, as in the dask fit
    ref = make().fit_batches(_batches(X, Y, 200))
    Xd = dask_array.from_array(X, chunks=(200, -1, -1))
    Yd = dask_array.from_array(Y, chunks=(200, -1, -1))
    with dask.config.set(scheduler="sync"):
        est = make().fit(Xd, Yd)
    _same_fit(est, ref, rtol=1e-8)
    if case == "linear_qk_cross_fit":
        assert est.inversion_ == "query_key_cross_fit"
    if case.startswith("softmax"):
        assert est.inversion_ == "softmax_least_squares"


def test_dask_fit_on_a_local_cluster():
    distributed = pytest.importorskip("distributed")
    X, Y = make_attention_task(600, seq_len=16, n_features=8, rank=2, noise=0.1, random_state=3)
    ref = RStarEstimator(memory_budget=SMALL_BUDGET // 8).fit_batches(_batches(X, Y, 150))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster):
        Xd = dask_array.from_array(X, chunks=(150, -1, -1))
        Yd = dask_array.from_array(Y, chunks=(150, -1, -1))
        est = RStarEstimator(memory_budget=SMALL_BUDGET // 8).fit(Xd, Yd)
    _same_fit(est, ref, rtol=1e-8)
    assert est.rank_ == 2


def test_dask_input_errors():
    X, Y = make_linear_proxy(100, random_state=0)
    with pytest.raises(ValueError, match="different numbers of samples"):
        MPRankEstimator().fit(dask_array.from_array(X), dask_array.from_array(Y[:50]))
    bad = X.copy()
    bad[70] = np.inf
    with pytest.raises(ValueError, match="infinity|NaN"):
        MPRankEstimator().fit(dask_array.from_array(bad, chunks=(50, -1, -1)), dask_array.from_array(Y))
    with pytest.raises(ValueError, match="dimension"):
        MPRankEstimator().fit(dask_array.ones((4, 3, 2, 2)), dask_array.from_array(Y))


def test_dask_ml_incremental_on_2d_data():
    """dask-ml's Incremental feeds partial_fit chunk by chunk; its block keys assume a 2-D X (n, d) and a 1-D y
    (dask_ml/_partial.py), read by rstar as T = 1, one output: ordinary regression."""
    wrappers = pytest.importorskip("dask_ml.wrappers")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((600, 6))
    Y = X @ rng.standard_normal(6) + 0.1 * rng.standard_normal(600)
    Xd = dask_array.from_array(X, chunks=(200, -1))
    Yd = dask_array.from_array(Y, chunks=200)
    inc = wrappers.Incremental(MPRankEstimator(), shuffle_blocks=False).fit(Xd, Yd)
    ref = MPRankEstimator()
    for i in range(0, 600, 200):
        ref.partial_fit(X[i:i + 200], Y[i:i + 200])
    _same_fit(inc.estimator_, ref, rtol=1e-12)


# -- device ------------------------------------------------------------------------------------------------


def test_torch_backend_agrees_with_numpy(softmax_task):
    torch = pytest.importorskip("torch")
    X, Y = softmax_task
    ref = RStarEstimator().fit(X, Y)
    est = RStarEstimator(device=torch.device("cpu")).fit(X, Y)
    _same_fit(est, ref, rtol=1e-6)
    np.testing.assert_allclose(est.predict(X[:20]), ref.predict(X[:20]), rtol=1e-5, atol=1e-7)
    # the passes over batches on torch too
    passes = RStarEstimator(memory_budget=SMALL_BUDGET, device=torch.device("cpu")).fit_batches(_batches(X, Y))
    _same_fit(passes, ref, rtol=1e-6)


def test_torch_chunk_terms_agree_with_numpy():
    torch = pytest.importorskip("torch")
    from rstar.inversions._numerics import softmax_ls as sls
    from rstar._backend import resolve_backend

    X, Y, t = make_attention_task(60, seq_len=7, n_features=5, value_dim=3, rank=2, random_state=2,
                                  return_teacher=True)
    ops = resolve_backend(torch.device("cpu"))
    K = t.kernel + 0.1
    for value_map in (None, t.value_map):
        f0, g0 = sls.SoftmaxLeastSquaresLoss(X, Y, value_map)(K.ravel())
        f1, g1 = sls.SoftmaxLeastSquaresLoss(X, Y, value_map, ops=ops)(K.ravel())
        assert f1 == pytest.approx(f0, rel=1e-12)
        np.testing.assert_allclose(g1, g0, rtol=1e-10, atol=1e-12)
    V = t.value_map
    for fitted in (False, True):
        F0 = sls.softmax_kernel_information_matrix(X, K, V, fitted)
        F1 = sls.softmax_kernel_information_matrix(X, K, V, fitted, ops=ops)
        np.testing.assert_allclose(F1, F0, rtol=1e-10, atol=1e-12 * np.abs(F0).max())


def test_device_is_validated_in_fit():
    X, Y = make_linear_proxy(100, random_state=0)
    with pytest.raises(ValueError, match="device"):
        MPRankEstimator(device="not-a-device").fit(X, Y)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            MPRankEstimator(device="cuda").fit(X, Y)
    assert MPRankEstimator(device="auto").fit(X, Y).rank_ == MPRankEstimator().fit(X, Y).rank_


def test_a_gpu_device_the_inversion_does_not_use_is_reported(monkeypatch):
    torch = pytest.importorskip("torch")
    import types

    import rstar.estimators as estimators

    # a CUDA device without CUDA: resolve to a stand-in whose device is "cuda" (nothing runs on it here)
    monkeypatch.setattr(estimators, "check_device", lambda device: "torch")
    monkeypatch.setattr(estimators, "resolve_backend", lambda device: types.SimpleNamespace(device=torch.device("cuda")))
    X, Y = make_linear_proxy(200, random_state=0)
    with pytest.warns(UserWarning, match="device='cuda' is used only by the least-squares softmax fit; the token "
                      "inversion ran on numpy"):
        MPRankEstimator(device="cuda").fit(X, Y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        MPRankEstimator().fit(X, Y)   # device="cpu": nothing to say


def test_import_stays_light():
    code = ("import sys, rstar; from rstar import RStarEstimator; "
            "print(sorted(m for m in ('torch', 'dask', 'distributed', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sources_sum_in_chunk_order():
    X = np.arange(60, dtype=float).reshape(5, 4, 3)
    Y = np.ones((5, 4, 2))
    whole = ArraySamples(X, Y).map_sum(lambda x, y: float(np.sum(x)), 4)
    source = BatchSamples([(X[:2], Y[:2]), (X[2:], Y[2:])]).set_shape(5, (4, 3, 2)).with_scales(2.0, 1.0)
    assert source.map_sum(lambda x, y: float(np.sum(x)), 4) == whole / 2
    odd, even = source.halves()
    assert [x.shape[0] for x, _ in odd] == [1, 1] and [x.shape[0] for x, _ in even] == [1, 2]
    np.testing.assert_array_equal(odd[1][0], X[3:4] / 2)


def test_partial_fit_computes_the_fitted_attributes_when_first_read():
    X, Y = make_linear_proxy(600, rank=3, random_state=4)
    est = MPRankEstimator()
    for i in range(0, 600, 200):
        est.partial_fit(X[i:i + 200], Y[i:i + 200])
        assert est.n_samples_seen_ == i + 200 and "rank_" not in vars(est)
    again = pickle.loads(pickle.dumps(est))             # pending: computed after unpickling too
    ref = MPRankEstimator().fit(X, Y)
    assert hasattr(est, "rank_") and est.rank_ == again.rank_ == ref.rank_ == 3
    np.testing.assert_allclose(est.spectrum_, ref.spectrum_, rtol=1e-10)
    est.partial_fit(X[:50], Y[:50])                     # a new batch: stale attributes are gone
    assert "spectrum_" not in vars(est) and est.n_samples_seen_ == 650 and est.predict(X[:2]).shape == (2, 16, 12)
    with pytest.raises(AttributeError):
        est.not_an_attribute_
    # errors about the batch or the parameters are still raised by partial_fit itself
    with pytest.raises(ValueError, match="rank must be <="):
        MPRankEstimator(rank=17).partial_fit(X, Y)
    with pytest.raises(ValueError, match="tokens"):
        est.partial_fit(X[:10, :8], Y[:10, :8])


# -- real sizes: honest answers and bounded temporaries -------------------------------------------------------


@pytest.mark.parametrize("operator", ["softmax", "linear_qk", "linear_proxy"])
def test_fewer_noise_columns_than_dimensions_is_warned(operator):
    # 6 samples x d_v = 2 columns for a 48- (features) or 64-dimensional (tokens) statistic: every eigenvalue
    # would read as signal (d = 768, T = 512, n = 30 read 480 of pure noise, unwarned)
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((6, 64, 48)), rng.standard_normal((6, 64, 2))
    with pytest.warns(UnidentifiableRankWarning) as caught:
        est = MPRankEstimator(operator).fit(X, Y)
    dim = 64 if operator == "linear_proxy" else 48
    assert_warned(caught, "too_few_noise_columns", bounds=(0, dim), category=UnidentifiableRankWarning)
    assert est.rank_interval_ == (0, dim)


def test_update_temporaries_are_bounded_by_the_d_by_d_grams():
    import tracemalloc

    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((300, 4, 512)), rng.standard_normal((300, 4, 4))
    tracemalloc.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MPRankEstimator("linear_qk", predict_sums=False).fit(X, Y)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # 300 per-sample 512 x 512 Grams at once would be 600 MiB
    assert peak < 250 * 2**20


@pytest.mark.parametrize("centred, T, d", [(True, 12, 5), (True, 4, 9), (False, 12, 5), (False, 6, 7)])
def test_first_order_sums_equal_their_per_sample_definitions(centred, T, d):
    # the sums are formed as single matrix products over a chunk; they must be the per-sample sums
    # C = sum w_i M_i M_i^T, N = sum w_i (X_i^T X_i)^+, N_coherent = sum w_i^2 (X_i^T X_i)^+, s1 = sum w_i tr(.)
    from rstar.inversions import QueryKeyInversion

    rng = np.random.default_rng(3)
    n, d_v = 40, 3
    X, Y = rng.standard_normal((n, T, d)), rng.standard_normal((n, T, d_v))
    X[2] = 0.0                      # an empty sample
    X[3, :, 1] = X[3, :, 0]         # a rank-deficient one
    inv = QueryKeyInversion(centred=centred)
    stats = inv.new_stats(T, d, d_v)
    inv.update(stats, X, Y)
    Xc = X - X.mean(axis=1, keepdims=True) if centred else X
    Yc = Y - Y.mean(axis=1, keepdims=True) if centred else Y
    C, N, N2, s1 = np.zeros((d, d)), np.zeros((d, d)), np.zeros((d, d)), 0.0
    weights = []
    for i in range(n):
        s = np.linalg.svd(Xc[i], compute_uv=False)
        kept = s[s > 1e-10 * s[0]] if s[0] > 0 else s[:0]
        G_pinv = np.linalg.pinv(Xc[i].T @ Xc[i], rcond=1e-15) if kept.size else np.zeros((d, d))
        M = np.linalg.pinv(Xc[i], rcond=1e-10) @ Yc[i]
        weights.append((kept.min() ** 2 if kept.size else 0.0, M, G_pinv))
    # (these shapes do not reweight the samples by their residual power: the weights are the smallest squared
    # singular values)
    assert stats["w1"] == pytest.approx(sum(w for w, _, _ in weights), rel=1e-12)
    for w, M, G_pinv in weights:
        C += w * M @ M.T
        N += w * G_pinv
        N2 += w**2 * G_pinv
        s1 += w * np.trace(G_pinv)
    np.testing.assert_allclose(stats["C"], C, rtol=1e-9, atol=1e-12 * np.abs(C).max())
    np.testing.assert_allclose(stats["N"], N, rtol=1e-9, atol=1e-12 * np.abs(N).max())
    assert stats["s1"] == pytest.approx(s1, rel=1e-9)
    if stats.get("N_coherent") is not None:
        np.testing.assert_allclose(stats["N_coherent"], N2, rtol=1e-9, atol=1e-12 * np.abs(N2).max())


def test_dask_chunk_work_never_copies_a_whole_chunk():
    """Each dask chunk is added to the sums, and read in passes, a bounded step at a time, rescaled step by step:
    a 20 MiB chunk (X and Y) costs its work a few MiB of traced memory, not rescaled copies of the chunk (a 781 MiB
    lazily generated array fitted with memory_budget=2**26 on two threads peaked at 420 MiB with them; 347 MiB
    without, where a plain dask reduction over the same arrays peaked at 285 MiB)."""
    import tracemalloc

    from rstar.streaming import _block_statistic, _dask_block_sum, _sums_of_squares

    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((5000, 32, 8)), rng.standard_normal((5000, 32, 8))
    est = RStarEstimator(memory_budget=2**22).fit(X[:200], Y[:200])
    inv = est._inv
    tracemalloc.start()
    [stats] = _block_statistic(inv, X, Y, 2.0, 3.0, 0, entries=2**16)
    peak_sums = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    tracemalloc.start()
    sx, sy = _dask_block_sum(X, Y, _sums_of_squares, 32 * 16, 2.0, 3.0, (), 2**16)
    peak_pass = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert stats["n"] == 5000
    assert sx == pytest.approx(np.sum(X**2) / 4) and sy == pytest.approx(np.sum(Y**2) / 9)
    chunk = X.nbytes + Y.nbytes   # 20 MiB
    assert peak_sums < chunk / 4 and peak_pass < chunk / 10, (peak_sums / 2**20, peak_pass / 2**20)


def test_a_dask_fit_keeps_samples_within_the_budget_its_workers_chunks_leave():
    """Over both budgets, a dask fit keeps a prefix of its samples and then reads every chunk again (its noise
    and model-check sums) beside it: the prefix gets the memory budget less the workers' chunk temporaries, and
    the choice's warning names the count kept. (Keeping the whole budget put the 781 MiB benchmark up to 82 MiB over
    a plain dask reduction with memory_budget=64 MiB; `python benchmarks/speed.py --dask-memory`.)"""
    import dask

    from rstar.calibration import DEFAULT_CALIBRATION as cal

    X, Y = make_attention_task(600, seq_len=16, n_features=8, rank=2, noise=0.1, random_state=0)
    Xd = dask_array.from_array(X, chunks=(200, -1, -1))
    Yd = dask_array.from_array(Y, chunks=(200, -1, -1))
    make = lambda: RStarEstimator(memory_budget=2**20, compute_budget=1e9)  # noqa: E731
    with dask.config.set(scheduler="threads", num_workers=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = make().fit(Xd, Yd)
    # two workers, each a step of budget / (8 * 2 * 2) entries split in chunk_temporaries chunks: half the budget
    chunk = 2**20 // (8 * 2 * 2) // cal.chunk_temporaries
    kept = (2**20 - 8 * 2 * cal.chunk_temporaries * chunk) // (8 * 16 * (8 + 8))
    assert kept == 256 and est._stats["n_kept"] == kept   # the compute budget alone would keep 476
    assert any(f"fitted on the first {kept} of them" in str(w.message) and "512 KiB of it for the dask workers"
               in str(w.message) for w in caught), [str(w.message) for w in caught]
    alone = make().fit(X[:kept], Y[:kept])
    assert est.rank_ == alone.rank_ == 2 and est.inversion_ == alone.inversion_ == "softmax_least_squares"
    np.testing.assert_allclose(est.spectrum_, alone.spectrum_, rtol=1e-8, atol=1e-10 * alone.spectrum_[0])
    # partial_fit reads no passes: batches added after it have the whole budget again
    assert est._budget.reserved_bytes > 0
    est.partial_fit(X[:50], Y[:50])
    assert est._budget.reserved_bytes == 0 and est._budget.max_samples(16, 8, 8) == 512


def test_kept_samples_are_joined_once_and_shared():
    """A fit reads its kept halves several times: the batches are joined on the first read and later reads share
    the joined arrays (each read had been a copy of every sample)."""
    from rstar.streaming import kept_half

    rng = np.random.default_rng(0)
    parts = [(rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 1))),
             (rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 3, 1)))]
    stats = {"samples_odd": list(parts)}
    X, Y = kept_half(stats, "samples_odd")
    np.testing.assert_array_equal(X, np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(Y, np.concatenate([p[1] for p in parts]))
    assert len(stats["samples_odd"]) == 1 and kept_half(stats, "samples_odd")[0] is X


def test_the_token_metric_of_two_halves_is_that_of_their_samples():
    from rstar.inversions._numerics import softmax_factored as sf

    rng = np.random.default_rng(1)
    X1, X2 = rng.standard_normal((30, 5, 6)), rng.standard_normal((20, 5, 6)) + 0.3
    halves = ((X1, None), (X2, None))
    for a, b in zip(sf.token_metric_roots_of_halves(halves), sf.token_metric_roots(np.concatenate([X1, X2]))):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_arrays_read_in_internal_units_equal_their_scaled_copy():
    """The curve's samples are read in internal units chunk by chunk (no scaled copy held): every read equals the
    same read of the scaled arrays, and so do the two halves read in place against their join."""
    from rstar.streaming import ArrayPartsSamples

    rng = np.random.default_rng(2)
    X, Y = rng.standard_normal((40, 3, 5)), rng.standard_normal((40, 3, 2))
    lazy = ArraySamples(X, Y, chunk_entries=30).with_scales(2.0, 4.0)
    eager = ArraySamples(X / 2.0, Y / 4.0, chunk_entries=30)
    for a, b in zip(lazy.chunks(3), eager.chunks(3)):
        np.testing.assert_allclose(a[0], b[0])
        np.testing.assert_allclose(a[1], b[1])
    np.testing.assert_allclose(lazy.mean_squares(), eager.mean_squares())
    np.testing.assert_allclose(lazy.y_sum_of_squares(), eager.y_sum_of_squares())
    np.testing.assert_allclose(lazy.rescaled(3.0, 5.0).X, X / 6.0)
    assert lazy.X is X   # nothing copied
    parts = ArrayPartsSamples([(X[:15], Y[:15]), (X[15:], Y[15:])], chunk_entries=30)
    whole = ArraySamples(X, Y, chunk_entries=30)
    np.testing.assert_allclose(parts.map_sum(lambda a, b: (a.sum(), (b**2).sum()), 3),
                               whole.map_sum(lambda a, b: (a.sum(), (b**2).sum()), 3))
    np.testing.assert_allclose(parts.y_sum_of_squares(), whole.y_sum_of_squares())
    np.testing.assert_allclose(parts.mean_squares(), whole.mean_squares())
    assert parts.in_memory and whole.in_memory and parts.n_samples == 40
