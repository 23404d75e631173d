"""Small-scale versions of the paper's experiments (CPU, seconds each): qualitative outcomes."""

import json

import numpy as np
import pytest

from rstar.paper.experiments import (CONFIGS, ExperimentResult, frontier, insufficiency_bound, markdown_table,
                               run_experiment, table1, table2, table3)

pytest.importorskip("torch")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


pytestmark = pytest.mark.usefixtures("one_torch_thread")

STUDENT = dict(lr=1e-2, init_scale=1e-2, max_epochs=1500, patience=40, max_lr_drops=3)


def _check_result(res, name):
    assert isinstance(res, ExperimentResult) and res.name == name
    text = res.to_markdown()
    assert text.startswith("| ") and "---|" in text
    json.dumps(res.to_dict())  # every number is JSON-serialisable
    fig = res.plot()
    assert fig.axes and all(ax.get_title() for ax in fig.axes)
    return text


@pytest.fixture(scope="module")
def t1():
    return table1(quick=True, n_train=500, n_test=300, ranks=[1, 2, 3, 4], student=STUDENT)


def test_table1_insufficiency_attainment_recovery(t1):
    _check_result(t1, "table1")
    sweep = {r["rank_param"]: r for r in t1.records if r["part"] == "rank_sweep"}
    floor = sweep[1]["noise_floor"]
    assert floor == pytest.approx(0.48)
    # insufficiency: excess risk at r < r*, at least the Eckart-Young bound (up to estimation noise)
    for r in (1, 2):
        assert sweep[r]["risk_ratio"] > 10
        assert sweep[r]["test_risk"] - floor > 0.9 * sweep[r]["excess_bound"]
    # attainment: within a few percent of the floor for r >= r*
    for r in (3, 4):
        assert sweep[r]["risk_ratio"] < 1.03
        assert sweep[r]["excess_bound"] == 0
    rec = [r for r in t1.records if r["part"] == "recovery"][0]
    assert rec["risk_ratio"] < 1.03
    assert rec["rank_"] == 3 and 2.9 <= rec["effective_rank_"] <= 3.1
    data = {r["estimator"]: r["rank_"] for r in t1.records if r["part"] == "data_only"}
    assert data == {"NumericalRankEstimator": 3, "MPRankEstimator": 3, "RStarEstimator": 3}
    assert "0.48" in t1.to_markdown()


def test_table2_static_transfer():
    res = table2(quick=True, n_train=300, n_test=200, student=dict(STUDENT, max_epochs=300, patience=20),
                 block_max_epochs=60)
    _check_result(res, "table2")
    att = {r["kind"]: r for r in res.records if r.get("part") == "attainment"}
    assert att["linear_proxy"]["risk_ratio"] < 1.05  # B0 attains the floor at r*
    for kind in ("linear_qk", "linear_qk_full", "softmax", "block"):  # the others do not come close
        assert att[kind]["risk_ratio"] > 10, kind
        assert att[kind]["test_r2"] < 0.2, kind
    assert {r["kind"] for r in res.records if r.get("part") == "recovery"} == {"linear_proxy", "linear_qk",
                                                                                 "softmax", "block"}


def test_table3_attention_native():
    res = table3(quick=True, seq_len=8, n_features=6, rank=2, n_train=400, n_test=200, ranks=[1, 2],
                 student=STUDENT)
    _check_result(res, "table3")
    for teacher in ("linear_qk", "softmax"):
        rows = {r["rank_param"]: r for r in res.records if r["task"] == teacher and r["estimator"] ==
                "AttentionStudent"}
        assert rows[1]["risk_ratio"] > 3, teacher  # insufficiency
        assert rows[2]["risk_ratio"] < 1.05, teacher  # attainment at r*
        assert rows[None]["rank_"] == 2, teacher  # recovery
        assert 1.9 <= rows[None]["effective_rank_"] <= 2.1, teacher
        rstar_rank = [r["rank_"] for r in res.records if r["task"] == teacher and r["estimator"] == "RStarEstimator"]
        assert rstar_rank == [2]


def test_frontier_through_cross_validate():
    res = frontier(quick=True, rank=2, sizes=[(6, 6, 300)], logit_scales=[2.0], n_splits=2, student=STUDENT)
    _check_result(res, "frontier")
    by = {}
    for r in res.records:
        by.setdefault((r["operator"], r["estimator"]), []).append(r)
    assert len(by[("linear_qk", "student")]) == 2  # one record per fold
    r_star = res.records[0]["true_rank"]
    assert r_star == 2
    # exact data-only recovery for linear QK, and the trained student agrees
    assert [r["rank_"] for r in by[("linear_qk", "RStar")]] == [r_star] * 2
    assert [r["rank_"] for r in by[("linear_qk", "student")]] == [r_star] * 2
    assert [r["rank_"] for r in by[("softmax", "student")]] == [r_star] * 2
    # softmax: the numerical rank of the inverted statistic breaks (full rank d); the trained student does not
    assert [r["rank_"] for r in by[("softmax", "numerical")]] == [6, 6]
    # d >= T: the exact inversion with known V is part of the comparison
    assert ("softmax", "softmax-exact (V known)") in by
    row = [r for r in res.summary if r["operator"] == "linear_qk"][0]
    assert row["train / data-only time"] > 1


def test_insufficiency_bound_matches_monte_carlo():
    rng = np.random.default_rng(0)
    A = np.linalg.qr(rng.standard_normal((6, 6)))[0][:, :3] @ np.diag([2.0, 1.0, 0.5]) @ \
        np.linalg.qr(rng.standard_normal((6, 6)))[0][:, :3].T
    V = rng.standard_normal((4, 3))
    U, s, Wt = np.linalg.svd(A)
    A1 = (U[:, :1] * s[:1]) @ Wt[:1]  # best rank-1 A with V = V*
    X = rng.standard_normal((20000, 6, 4))
    excess = np.mean(np.sum((np.einsum("st,ntd,dv->nsv", A - A1, X, V)) ** 2, axis=(1, 2)))
    assert excess == pytest.approx(insufficiency_bound(s, V, 1), rel=0.03)


def test_configs_and_errors():
    assert set(CONFIGS) == {"table1", "table2", "table3", "frontier"}
    assert CONFIGS["table1"]["full"]["n_features"] == 12 and CONFIGS["table1"]["full"]["seq_len"] == 16
    with pytest.raises(ValueError, match="unknown experiment"):
        run_experiment("table4")
    with pytest.raises(ValueError, match="unknown configuration keys"):
        table1(quick=True, n_trian=10)
    assert markdown_table([{"a": 1.23456, "b": None}], ["a", "b"]).splitlines()[-1] == "| 1.235 |  |"
