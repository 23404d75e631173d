"""benchmarks/recovery.py: sharing one statistic across the rstar estimators (``fit_from``) gives the same rows,
and the benchmark leaves rstar unpatched."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
recovery = pytest.importorskip("recovery")
alpha_calibration = pytest.importorskip("alpha_calibration")


def _small_tasks():
    tasks = recovery.make_grid("quick", 0)
    picked = {}
    for t in tasks:
        if t["n"] * t["T"] * t["d"] ** 2 <= 5e5:
            picked.setdefault((t["family"], t["T"] <= t["d"]), t)
    return list(picked.values())


def test_shared_inversion_gives_the_same_rows():
    tasks = _small_tasks()
    # every family, with T <= d and T > d (e.g. the cross-fitted query-key inversion and the first-order one)
    assert len(tasks) == 2 * len(recovery.FAMILIES)
    n_shared = 0
    for task in tasks:
        full = recovery.run_task(task, True, False)
        shared = recovery.run_task(task, True, True)
        assert [r["estimator"] for r in full] == [r["estimator"] for r in shared]
        for a, b in zip(full, shared):
            assert (a["r_hat"], a["warnings"], a["error"], a["inversion"]) == (b["r_hat"], b["warnings"], b["error"],
                                                                               b["inversion"]), (task, a, b)
        assert not any(r["shared"] for r in full)
        n_shared += sum(r["shared"] for r in shared)
    # every rstar estimator after RStarEstimator takes its statistic
    assert n_shared >= 3 * len(tasks)


def test_a_different_inversion_is_not_shared():
    from rstar import RStarEstimator
    from rstar.datasets import make_attention_task

    X, Y = make_attention_task(120, kind="linear_qk", seq_len=10, n_features=6, rank=1, random_state=0)
    ref = RStarEstimator("linear_qk").fit(X, Y)
    other = RStarEstimator("softmax")
    assert not recovery._fit_from_any(other, [ref])
    assert not hasattr(other, "rank_")
    same = RStarEstimator("linear_qk")
    assert recovery._fit_from_any(same, [ref])
    assert same.rank_ == ref.rank_


def test_the_benchmark_does_not_patch_rstar():
    import rstar.inversions as inversions

    before = {name: dict(vars(cls)) for name, cls in vars(inversions).items() if isinstance(cls, type)}
    recovery.run_task(_small_tasks()[0], True, True)
    after = {name: dict(vars(cls)) for name, cls in vars(inversions).items() if isinstance(cls, type)}
    assert before == after


def test_rerun_of_some_families_keeps_the_others_rows(tmp_path):
    common = ["--quick", "--seed", "3", "--tasks-per-family", "1", "--detection-per-point", "0", "--n-jobs", "1",
              "--no-figures"]
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    assert recovery.main(common + ["--families", "linear_proxy", "linear_qk_known_v", "--out", first]) == 0
    assert recovery.main(common + ["--families", "linear_qk_known_v", "--rows-from", first, "--out", second]) == 0
    a = {(r["task_id"], r["estimator"]): r for r in recovery._read_csv(str(tmp_path / "first" / "results.csv"))}
    b = {(r["task_id"], r["estimator"]): r for r in recovery._read_csv(str(tmp_path / "second" / "results.csv"))}
    assert a.keys() == b.keys() and {r["family"] for r in b.values()} == {"linear_proxy", "linear_qk_known_v"}
    # the rerun family is fitted again (same task, same ranks), the other is copied
    assert all(a[k]["r_hat"] == b[k]["r_hat"] for k in a)
    assert all(a[k]["seconds"] == b[k]["seconds"] for k in a if b[k]["family"] == "linear_proxy")
    assert "rows of the families not run (1 tasks)" in (tmp_path / "second" / "summary.md").read_text()
    # the recorded p-values recount to r_hat at the run's level (alpha_calibration checks it and stops otherwise)
    table = alpha_calibration.main([second, "--alphas", "0.002", "0.01", "0.05"])
    assert [row["alpha"] for row in table] == [0.002, 0.01, 0.05]
    rstar_rows = [r for r in b.values() if r["estimator"] == "RStar"]
    assert table[1]["aggregate"] == pytest.approx(recovery._rate(rstar_rows))
    with pytest.raises(SystemExit, match="seed 3"):
        recovery.main(["--quick", "--seed", "4", "--tasks-per-family", "1", "--detection-per-point", "0",
                       "--families", "linear_proxy", "--rows-from", first, "--out", str(tmp_path / "third")])


def test_rank_is_the_count_of_p_values_below_alpha():
    """The premise of benchmarks/alpha_calibration.py: RStar's rank at any level is read off the p-values
    recorded at the default level, on every family and on both sides of T = d."""
    from rstar import RStarEstimator

    for task in _small_tasks():
        rows = recovery.run_task(task, False, True)
        row = next(r for r in rows if r["estimator"] == "RStar")
        p = alpha_calibration.parse_p_values(row["p_values"])
        assert p and alpha_calibration.count_below(p, 0.01) == row["r_hat"]
        X, Y, teacher, _ = recovery.generate(task)
        V = teacher.value_map if recovery.FAMILIES[task["family"]][2] else None
        for level in (0.002, 0.05):
            est = RStarEstimator(operator=recovery.FAMILIES[task["family"]][1], value_map=V, alpha=level)
            assert est.fit(X, Y).rank_ == alpha_calibration.count_below(p, level), (task, level)


def test_count_below_is_sequential():
    assert alpha_calibration.count_below([0.0, 0.001, 0.2, 0.0], 0.01) == 2
    assert alpha_calibration.count_below([0.0, 0.001], 0.001) == 1
    assert alpha_calibration.count_below([], 0.01) == 0


def test_a_long_benchmark_continues_where_it_stopped(tmp_path, capsys):
    """The long benchmarks' journal (compress.py, rotary_real_heads.py): a step done is read back, not recomputed; a
    run resumed with other options, or started over an earlier one without --resume, is a one-line refusal."""
    runs = pytest.importorskip("_runs")
    path, record, calls = tmp_path / "compress.partial.jsonl", dict(n_eval=40, seed=1), []

    def work(v):
        calls.append(v)
        return dict(value=v)

    first = runs.Journal(path, record, False, 3)
    assert first.step("a", lambda: work(1)) == dict(value=1)
    assert first.step("a", lambda: work(2)) == dict(value=1) and calls == [1]
    assert "[1/3]" in capsys.readouterr().out
    again = runs.Journal(path, record, True, 3)
    assert again.step("a", lambda: work(3)) == dict(value=1) and calls == [1]
    assert again.step("b", lambda: work(4)) == dict(value=4) and calls == [1, 4]
    assert len(runs.Journal(path, record, True, 3).done) == 2
    with pytest.raises(SystemExit, match="other options"):
        runs.Journal(path, dict(n_eval=41, seed=1), True, 3)
    with pytest.raises(SystemExit, match="--resume"):
        runs.Journal(path, record, False, 3)


def test_the_time_left_counts_slow_steps_at_their_own_pace(tmp_path, monkeypatch):
    """A run of quick measurements and a few slow student steps: once a student is timed, the students left are
    estimated at its pace and the other steps at theirs, not every step at the mean of all."""
    runs = pytest.importorskip("_runs")
    # the journal's start, then each step's start, end and progress line
    clock = iter([0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 102.0, 102.0, 200.0])
    monkeypatch.setattr(runs.time, "perf_counter", lambda: next(clock))
    journal = runs.Journal(tmp_path / "run.partial.jsonl", dict(seed=0), False, 10, kinds=dict(student=4))
    assert journal.time_left() == 0.0
    journal.step("evaluate|a", lambda: 1)
    assert journal.time_left() == pytest.approx(9 * 1.0)   # no student timed yet: every step at the pace seen
    journal.step("evaluate|b", lambda: 2)
    journal.step("student|0.01|0,0", lambda: 3)
    # 3 students left at 100 s, 4 other steps at 1 s (a single mean would have said 7 x 34 s)
    assert journal.time_left() == pytest.approx(3 * 100.0 + 4 * 1.0)
    plain = runs.Journal(tmp_path / "plain.partial.jsonl", dict(seed=0), False, 4)
    plain.timed, plain.done = {None: [1.0, 3.0]}, {"a": 1, "b": 2}
    assert plain.time_left() == pytest.approx(2 * 2.0)


def test_the_resident_peak_sees_what_a_block_held_and_let_go():
    """The planted benchmarks' memory column: an array of 200 MiB held for a few samples and freed inside the block
    reads about 200 MiB above the level on entry, whoever allocated it (numpy here, torch alike)."""
    runs = pytest.importorskip("_runs")
    if runs.resident_bytes() is None:
        pytest.skip("this system does not report resident memory")
    import time

    with runs.PeakResidentMemory(every=0.01) as memory:
        block = np.ones(200 * 2**20 // 8)
        time.sleep(0.1)
        del block
    assert 180 <= memory.peak_mib <= 260
    with runs.PeakResidentMemory(every=0.01) as idle:
        time.sleep(0.05)
    assert idle.peak_mib < 20


def test_the_planted_benchmark_runs_the_value_maps_it_is_asked_for():
    """``--value-maps both`` ran only the fitted value map (its help named "both", the code read a comma list)."""
    import argparse

    planted = pytest.importorskip("rotary_planted")
    parser = argparse.ArgumentParser()
    assert planted.value_map_fits(parser, "both") == [True, False]
    assert planted.value_map_fits(parser, "known,fitted") == [True, False]
    assert planted.value_map_fits(parser, "fitted") == [False]
    with pytest.raises(SystemExit):
        planted.value_map_fits(parser, "bath")


@pytest.mark.parametrize("rotated", [True, False])
def test_planted_heads_have_their_width_and_logit_scale(rotated):
    """rotary_planted.py's heads: width r (the kernel's rank, the rotation kept where there is one) and logits of
    the asked standard deviation over the windows; ``--positions none`` plants them without rotation."""
    planted = pytest.importorskip("rotary_planted")
    from rstar.inversions._numerics.rotary import RotaryPositions, rotate

    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 6, 16))
    rotary = RotaryPositions.from_frequencies(10000.0 ** -(np.arange(4) / 4), length=6) if rotated else None
    A, B, V = planted.planted_head(X, rotary, 3, 5, np.random.default_rng(1), logit_std=1.5)
    assert A.shape == B.shape == (16, 8 if rotated else 3) and V.shape == (16, 5)
    assert np.linalg.matrix_rank(A) == np.linalg.matrix_rank(B) == 3
    XA, XB = (rotate(X @ A, rotary), rotate(X @ B, rotary)) if rotated else (X @ A, X @ B)
    assert np.std(XA @ XB.transpose(0, 2, 1) / 4.0) == pytest.approx(1.5, rel=1e-9)


def test_a_head_projected_on_all_its_token_directions_is_the_head():
    """token_subspace.py: the excess of a head whose factors are projected on the top k token directions is 0 at
    k = d and grows as directions are dropped (a small torch attention layer, read as rstar.heads reads one)."""
    torch = pytest.importorskip("torch")
    subspace = pytest.importorskip("token_subspace")
    from rstar.heads import collect_attention

    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.attn = torch.nn.Embedding(50, 8), torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, ids):
            x = self.emb(ids)
            return self.attn(x, x, x)[0]

    ids = np.random.default_rng(0).integers(0, 50, size=(200, 10))
    head = collect_attention(Block(), ids)[0].head(0)
    w, U = subspace.top_directions(head.features())
    assert np.all(np.diff(w) <= 1e-12)
    excess = subspace.projected_excess(head, U, [1, 4, U.shape[1]])
    assert excess[2] < 1e-20 and excess[0] > excess[1] > 1e-3


def test_the_fit_s_own_model_is_predicted_with_the_floor_moved_in_sample():
    """compress.py's predicted-against-realised rows: a head's own fitted model is predicted by the curve's point
    estimate with its floor moved from the full half models held out to the same models in sample (the curve plus
    the gap), counted for any rank-r model where every head has the floors; a row without them predicts nothing
    more."""
    runs = pytest.importorskip("_runs")
    rows = [dict(layer=0, head=0, risk_curve_point=[0.5, 0.02, 0.004], risk_curve_se=[0.01, 0.001, 0.001],
                 risk_curve_floor=0.0065, risk_curve_floor_in_sample=0.0005),
            dict(layer=0, head=1, risk_curve_point=[0.4, 0.01], risk_curve_se=[0.01, 0.001])]
    # rank_plan's rows: the fit's own model predicted by the curve plus the floors' gap (none without the floors)
    plan = [dict(layer=0, head=0, rank=2, predicted_excess=0.005, predicted_excess_fitted_model=0.005 + 0.006),
            dict(layer=0, head=1, rank=5, predicted_excess=0.01, predicted_excess_fitted_model=float("nan"))]
    real = {"0,0": dict(alone=0.0097, alone_se=0.0005, inside=0.01, inside_se=0.0005, floor=0.0),
            "0,1": dict(alone=0.01, alone_se=0.0005, inside=0.01, inside_se=0.0005, floor=0.0)}
    own = runs.predicted_against_realised(plan, rows, real, 0.01, "fit's model")
    assert own[0]["predicted_own_model"] == pytest.approx(0.004 + 0.0065 - 0.0005)
    # past the curve's end its last value; no floors, no prediction for the fit's own model
    assert own[1]["predicted_point"] == 0.01 and own[1]["predicted_own_model"] is None
    # the first head is 2 se away from its curve's point (0.0057 > 2 * hypot(0.0005, 0.001)) but within 2 of
    # the prediction for its own model (0.0003); both heads must carry it for the column to be counted
    assert runs.within_point(own[:1]) == 0 and runs.within_point(own[:1], "predicted_own_model") == 1
    line = runs.predicted_rows(own[:1], [0.01], ("fit's model",))[0]
    assert line.endswith("| 1 · 0.010 | — |") and line.count("|") == runs.PREDICTED_HEADER[0].count("|")
    assert runs.predicted_rows(own, [0.01], ("fit's model",))[0].endswith("| — | — |")
    # with the fits' own variability in the curve's error (the halves' difference: 0.003 at rank 2) the point is
    # within 2 se too (0.0057 <= 2 * hypot(0.0005, 0.003)); counted where every head carries it
    fitted_rows = [dict(rows[0], risk_curve_fit_se=[0.02, 0.002, 0.003]),
                   dict(rows[1], risk_curve_fit_se=[0.01, 0.001])]
    with_fit = runs.predicted_against_realised(plan, fitted_rows, real, 0.01, "fit's model")
    assert with_fit[0]["predicted_fit_se"] == 0.003 and runs.within_point(with_fit[:1], se="predicted_fit_se") == 1
    # the prediction for the fit's own model moves the curve by the floor, so it carries the floor's error with the
    # models' own variability too: without risk_curve_floor_fit_se it is not counted
    assert with_fit[0]["predicted_own_model_fit_se"] is None
    assert runs.predicted_rows(with_fit[:1], [0.01], ("fit's model",))[0].endswith("| 1 · 0.010 | 1 · — |")
    assert runs.predicted_rows(with_fit, [0.01], ("fit's model",))[0].endswith("| — | 2 · — |")
    # with it (0.001 here) the two errors add: 0.003 + 0.001 at rank 2
    floored = [dict(fitted_rows[0], risk_curve_floor_fit_se=0.001), fitted_rows[1]]
    with_floor = runs.predicted_against_realised(plan, floored, real, 0.01, "fit's model")
    assert with_floor[0]["predicted_own_model_fit_se"] == pytest.approx(0.004)
    assert runs.predicted_rows(with_floor[:1], [0.01], ("fit's model",))[0].endswith("| 1 · 0.010 | 1 · 1 |")
    # a head 0.0075 off its own model's prediction: beyond 2 se with the curve's variability alone
    # (2 * hypot(0.0005, 0.003) = 0.0061), within it once the floor's is added (2 * hypot(0.0005, 0.004) = 0.0081)
    far = {**real, "0,0": dict(real["0,0"], alone=0.010 + 0.0075)}
    off = runs.predicted_against_realised(plan, floored, far, 0.01, "fit's model")[:1]
    assert runs.within_point(off, "predicted_own_model", "predicted_fit_se") == 0
    assert runs.within_point(off, "predicted_own_model", "predicted_own_model_fit_se") == 1
    kernel = runs.predicted_rows(runs.predicted_against_realised(plan, rows, real, 0.01, "head's kernel")[:1],
                                 [0.01], ("head's kernel",))[0]
    # a truncated kernel (rotary heads cut on both sides) is set against the same prediction where the row has the
    # floors: the curve, fitted on half the windows, carries estimation error the kernel's truncation does not
    assert kernel.endswith("| 0 | 1 · 0.010 | — |")
    # a negative gap (the in-sample side above the held-out one) moves nothing, as in rank_plan
    from rstar.heads import rank_plan

    swapped = [dict(rows[0], d_head=2, risk_curve=[0.5, 0.02, 0.005], risk_curve_floor=0.0005,
                    risk_curve_floor_in_sample=0.0065)]
    planned = rank_plan(swapped, tolerance=0.01)
    planned = planned.to_dict("records") if hasattr(planned, "to_dict") else planned
    assert runs.predicted_against_realised(planned, swapped, real, 0.01, "fit's model")[0][
        "predicted_own_model"] == pytest.approx(0.004)
    # a plan's own prediction read where asked (the fitted-model plan's)
    fitted_plan = [dict(plan[0], predicted_excess_fitted_model=0.011)]
    assert runs.predicted_against_realised(fitted_plan, rows, real, 0.01, "fit's model at its width",
                                           "predicted_excess_fitted_model")[0]["predicted"] == 0.011


def test_the_all_heads_summary_says_where_readings_fall_against_the_truncation_rank():
    """rotary_real_heads.py's summary: per tolerance, the readings' gaps to the truncation rank, and of the heads not
    sufficient-and-within, those one above and those equal to it but short of eps on the held-out windows."""
    rotary = pytest.importorskip("rotary_real_heads")

    def row(ranks, truncation, held):
        return dict(ranks=ranks, truncation=truncation, held_out_excess=held, held_out_truncation_excess=held,
                    intervals=[[0, 64], [0, 64]], warnings=[], seconds=1.0)

    rows = [row([4, 2], [5, 2], [0.02, 0.04]),    # one below, short of 1% held out: not both
            row([5, 2], [5, 2], [0.009, 0.04]),   # on the truncation rank and sufficient: both
            row([6, 3], [5, 2], [0.008, 0.03]),   # one above: not both
            row([5, 2], [5, 2], [0.011, 0.06])]   # on it, short of eps held out: not both
    text = rotary.summary(rows)
    assert ("ε = 0.01: r*(ε) − truncation rank -1: 1, 0: 2, +1: 1; widths summed 20 against 20; of the 3 not "
            "both, 1 one above and 1 equal to it, short of ε held out.") in text
    assert ("ε = 0.05: r*(ε) − truncation rank 0: 3, +1: 1; widths summed 9 against 8; of the 2 not both, 1 one "
            "above and 1 equal to it, short of ε held out.") in text


def test_refits_are_set_against_each_other_by_either_error():
    """curve_fit_error.py: every pair of fits, at the ranks where the first fit's curve lies in [low, high],
    agrees where the curves differ by at most twice their errors combined."""
    cfe = pytest.importorskip("curve_fit_error")
    fits = [dict(risk_curve=[0.5, 0.05, 0.001], risk_curve_se=[0.01, 0.001, 0.0001],
                 risk_curve_fit_se=[0.01, 0.004, 0.0001]),
            dict(risk_curve=[0.5, 0.06, 0.001], risk_curve_se=[0.01, 0.001, 0.0001],
                 risk_curve_fit_se=[0.01, 0.004, 0.0001])]
    agree = cfe.pair_agreement(fits, 0.005, 0.1)
    # rank 1 alone: 0.01 apart is 7 sampling errors but under two fit errors (2 * hypot(0.004, 0.004) = 0.0113)
    assert agree["ranks"] == [1]
    assert agree["risk_curve_se"]["within"] == 0 and agree["risk_curve_fit_se"]["within"] == 1
    assert agree["risk_curve_se"]["ratio"] == pytest.approx(np.std([0.05, 0.06], ddof=1) / 0.001)
    table = cfe.summary([dict(layer=3, head=1, fits=fits)], 0.005, 0.1)
    assert "| 3 | 1 | 1–1 | 0 / 1 · 7.07 | 1 / 1 · 1.77 |" in table
    assert table.endswith("| 0 / 1 (0%) | 1 / 1 (100%) |")
