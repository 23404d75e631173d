"""The calibration object: every tuned number in one documented, validated place, read through the package."""

import ast
import dataclasses
import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest

from rstar.calibration import DEFAULT_CALIBRATION, GROUPS, Calibration

from _reasons import assert_warned

ROOT = Path(__file__).resolve().parents[1]

#: Today's values, written out: a change to a default is a change to this list (and to docs/calibration.md).
DEFAULTS = {
    # identifiability gates
    "ill_conditioned_aspect": 0.9,
    "first_order_max_aspect": 3.0,
    "first_order_qk_max_aspect": 4.0,
    "first_order_misfit": 3.0,
    "first_order_max_kurtosis": 0.03,
    "first_order_kurtosis_standard_errors": 3.0,
    "least_squares_misfit_ratio": 1.1,
    "exact_clipped_fraction": 0.25,
    # noise and null
    "min_noise_dof": 50,
    "min_sample_dof": 20,
    "default_seed": 20260,
    "default_null_draws": 1000,
    "top_down_min_bulk": 4,
    "coherent_bonferroni": 4.0,
    "residual_floor_margin": 2.0,
    "bulk_width_factor": 4.0,
    "robust_noise_quantile": 0.25,
    # levels
    "rstar_alpha": 0.003,
    "interval_factor": 10.0,
    "value_signal_alpha": 1e-3,
    # split-half test
    "split_half_margin": 1.5,
    "split_half_noise_edge": 1.25,
    # factored fit
    "factored_start_rank": 8,
    "rotary_start_logit_std": 0.1,
    "log_attention_variance_floor": 1.0,
    "coarse_window_ratio": 4,
    "coarse_window_min_length": 32,
    "first_position_samples_ratio": 1.5,
    "factored_segment_iter": 50,
    "factored_stable_rtol": 0.01,
    "factored_clear_gap": 2.0,
    "factored_clear_checks": 3,
    "factored_unsettled_segments": 4,
    "factored_fill_ratio": 0.05,
    "factored_rescale_iter": 100,
    "factored_scale_damping": 0.01,
    "factored_scaled_memory": 60,
    # optimisers
    "least_squares_loss_tol": 0.01,
    "softmax_max_iter": 4000,
    "softmax_restarts": 2,
    "cross_fit_random_starts": 8,
    "profile_ftol": 1e-10,
    "coherent_fit_tol": 1e-4,
    "coherent_max_iter": 50,
    "factored_max_iter": 400,
    "factored_max_iter_fitted_v": 600,
    "log_attention_max_iter": 1000,
    "value_ridge": 1e-10,
    # budgets
    "memory_budget": 2**29,
    "compute_budget": 2**39,
    "cost_iterations": 512,
    "line_search_allowance": 1.1,
    # memory chunks
    "chunk_entries": 2**20,
    "update_chunk_entries": 2**22,
    "value_error_chunk_entries": 2**22,
    "chunk_temporaries": 8,
    "max_cached_weights": 2**23,
    # risk curve
    "curve_resolution_fraction": 0.5,
    # model check
    "model_check_alpha": 1e-3,
    # students
    "fisher_samples": 256,
    "fisher_chunk": 64,
}


def test_defaults_are_todays_values():
    fields = [f.name for f in dataclasses.fields(Calibration)]
    assert sorted(fields) == sorted(DEFAULTS)
    for name, value in DEFAULTS.items():
        got = getattr(DEFAULT_CALIBRATION, name)
        assert got == value and type(got) is type(value), (name, got, value)
    assert Calibration() == DEFAULT_CALIBRATION


def test_every_field_says_what_it_is_who_sets_it_and_on_what():
    for f in dataclasses.fields(Calibration):
        for key in ("meaning", "set_by", "data", "group"):
            assert isinstance(f.metadata.get(key), str) and f.metadata[key].strip(), (f.name, key)
        assert f.metadata["group"] in GROUPS, f.name
        # a command, or says that none sets it
        assert f.metadata["set_by"].startswith(("python benchmarks/", "none")), f.name
        if f.metadata["set_by"].startswith("python "):
            script = f.metadata["set_by"].split()[1]
            assert (ROOT / script).exists(), (f.name, script)
    # every group is used, in the order the table lists them
    groups = [row[5] for row in DEFAULT_CALIBRATION.table()]
    assert set(groups) == set(GROUPS)
    assert sorted(groups, key=GROUPS.index) == groups


def test_the_merged_constants_are_said_to_be_one_idea():
    meanings = {f.name: f.metadata["meaning"] for f in dataclasses.fields(Calibration)}
    assert "SOFTMAX_MISFIT" in meanings["least_squares_misfit_ratio"]
    assert "CROSS_FIT_MISFIT" in meanings["least_squares_misfit_ratio"]
    assert "SOFTMAX_LOSS_TOL" in meanings["least_squares_loss_tol"]
    assert "FACTORED_LOSS_TOL" in meanings["least_squares_loss_tol"]
    assert "CHUNK_ENTRIES" in meanings["chunk_entries"]


def test_table_rows():
    rows = DEFAULT_CALIBRATION.table()
    assert len(rows) == len(DEFAULTS)
    name, value, meaning, set_by, data, group = rows[0]
    assert (name, value) == ("ill_conditioned_aspect", 0.9) and group == "identifiability gates"
    other = DEFAULT_CALIBRATION.replace(split_half_margin=2.0).table()
    assert dict((r[0], r[1]) for r in other)["split_half_margin"] == 2.0


def test_replace_copies_and_the_object_is_frozen_and_pickles():
    cal = DEFAULT_CALIBRATION.replace(split_half_margin=2.0, min_noise_dof=80)
    assert (cal.split_half_margin, cal.min_noise_dof) == (2.0, 80)
    assert DEFAULT_CALIBRATION.split_half_margin == 1.5 and cal != DEFAULT_CALIBRATION
    with pytest.raises(dataclasses.FrozenInstanceError):
        cal.split_half_margin = 3.0
    assert pickle.loads(pickle.dumps(cal)) == cal and hash(cal) == hash(pickle.loads(pickle.dumps(cal)))
    with pytest.raises(TypeError):
        DEFAULT_CALIBRATION.replace(no_such_field=1)


@pytest.mark.parametrize("name, value, match", [
    ("split_half_margin", 0, "split_half_margin must be a finite number > 0, got 0"),
    ("split_half_margin", -1.5, "split_half_margin must be a finite number > 0"),
    ("first_order_max_aspect", float("inf"), "first_order_max_aspect must be a finite number > 0"),
    ("rstar_alpha", 1.0, "rstar_alpha must be a number in \\(0, 1\\)"),
    ("model_check_alpha", 0.0, "model_check_alpha must be a number in \\(0, 1\\)"),
    ("value_signal_alpha", float("nan"), "value_signal_alpha must be a number in \\(0, 1\\)"),
    ("ill_conditioned_aspect", 1.5, "ill_conditioned_aspect must be a number in \\(0, 1\\]"),
    ("factored_fill_ratio", 1.0, "factored_fill_ratio must be a number in \\[0, 1\\)"),
    ("min_noise_dof", 50.5, "min_noise_dof must be an integer >= 1, got 50.5"),
    ("min_noise_dof", 0, "min_noise_dof must be an integer >= 1"),
    ("softmax_restarts", -1, "softmax_restarts must be an integer >= 0"),
    ("default_null_draws", True, "default_null_draws must be an integer >= 1, got True"),
    ("residual_floor_margin", 0.5, "residual_floor_margin must be a finite number >= 1"),
    ("interval_factor", "10", "interval_factor must be a finite number >= 1, got '10'"),
    ("first_order_max_kurtosis", -0.01, "first_order_max_kurtosis must be a finite number >= 0"),
])
def test_validation_names_the_field_in_one_line(name, value, match):
    with pytest.raises(ValueError, match=match) as info:
        DEFAULT_CALIBRATION.replace(**{name: value})
    assert "\n" not in str(info.value) and str(info.value).startswith(f"Calibration.{name} ")
    with pytest.raises(ValueError, match=match):
        Calibration(**{name: value})


def test_zero_is_allowed_where_it_means_none():
    cal = DEFAULT_CALIBRATION.replace(factored_stable_rtol=0.0, factored_fill_ratio=0.0, softmax_restarts=0,
                                      cross_fit_random_starts=0, max_cached_weights=0, value_ridge=0.0)
    assert cal.softmax_restarts == 0
    assert DEFAULT_CALIBRATION.replace(default_seed=np.int64(7)).default_seed == 7   # numpy integers are integers


# -- a different calibration changes the answers it should -------------------------------------------------------


def test_min_noise_dof_decides_which_inversion_runs():
    from rstar.inversions import choose_inversion

    # 300 samples at T = 6, d = 12: 300 * 6 * 12 - 144 = 21456 residual degrees of freedom
    shape = dict(value_map_known=True, shape=(6, 12, 12), n_samples=300)
    assert choose_inversion("linear_qk", **shape).name == "query_key_least_squares"
    strict = DEFAULT_CALIBRATION.replace(min_noise_dof=30000)
    choice = choose_inversion("linear_qk", calibration=strict, **shape)
    assert choice.name == "query_key_first_order" and choice.is_fallback
    assert "30000 residual degrees of freedom" in choice.fallback_reason
    # and the inversion made with it falls back the same way once it has the samples
    from rstar.datasets import make_attention_task
    from rstar.inversions import make_inversion

    X, Y, t = make_attention_task(300, kind="linear_qk", seq_len=6, n_features=12, rank=3, noise=0.1,
                                  random_state=0, return_teacher=True)
    runs = []
    for cal in (None, strict):
        inv = make_inversion("linear_qk", t.value_map, shape=(6, 12, 12), calibration=cal)
        assert inv.calibration is (DEFAULT_CALIBRATION if cal is None else strict)
        stats = inv.new_stats(6, 12, 12)
        inv.update(stats, X, Y)
        runs.append(inv.whiten(stats).inversion)
    assert runs == ["query_key_least_squares", "query_key_first_order"]


def _split_half_statistic(signal, p=20):
    from rstar.inversions import SplitHalfNull, WhitenedStatistic
    from rstar.inversions.softmax_factored import FACTORED_NAME

    lam = np.concatenate([signal, np.full(p - len(signal), 0.5)])
    null = SplitHalfNull(null_eigenvalues=np.linspace(1, 0.1, p), fitted_rank=8, rank_cap=20)
    return WhitenedStatistic(lam, np.eye(p), np.eye(p), 1000.0, null, FACTORED_NAME, (), [], "logit")


def test_split_half_noise_edge_decides_the_interval():
    from rstar.rules import MarchenkoPasturRule

    # 1.7 (eigenvalue) lies above 1.25^2 = 1.5625 times the null's largest and below the margin's 1.5^2 = 2.25
    ws = _split_half_statistic([100.0, 9.0, 1.7])
    assert ws.null.margin == DEFAULT_CALIBRATION.split_half_margin
    res = MarchenkoPasturRule()(ws)
    assert res.rank == 2 and res.rank_interval == (2, 8)
    assert_warned(res.warnings, "split_half_band", bounds=(None, 8))
    wider = MarchenkoPasturRule(calibration=DEFAULT_CALIBRATION.replace(split_half_noise_edge=1.4))(ws)
    assert wider.rank == 2 and wider.rank_interval == (2, 2) and not wider.warnings


def test_interval_factor_decides_the_levels_of_rank_interval():
    from rstar.rules import MarchenkoPasturRule, interval_levels, sequential_spike_test

    assert interval_levels(0.01) == (0.001, 0.1)
    one = DEFAULT_CALIBRATION.replace(interval_factor=1.0)
    assert interval_levels(0.01, calibration=one) == (0.01, 0.01)
    rng = np.random.default_rng(0)
    W = rng.standard_normal((30, 3000))
    W[:2] *= 3.0
    W[2] *= 1.09                               # a third direction near the detection edge
    lam = np.linalg.eigvalsh(W @ W.T / 3000)[::-1]
    wide = sequential_spike_test(lam, 3000)
    tight = sequential_spike_test(lam, 3000, calibration=one)
    assert tight.rank == wide.rank and tight.rank_interval == (tight.rank, tight.rank)
    assert wide.rank_interval != tight.rank_interval
    from rstar.inversions import WhitenedStatistic, WishartNull

    ws = WhitenedStatistic(lam, np.eye(30), np.eye(30), 3000.0, WishartNull(1.0, 0.0))
    assert MarchenkoPasturRule(calibration=one)(ws).rank_interval == tight.rank_interval


@pytest.mark.filterwarnings("ignore:the known value_map is not used")
def test_an_estimator_reads_its_calibration():
    from rstar import InversionFallbackWarning, RStarEstimator
    from rstar.datasets import make_attention_task

    X, Y, t = make_attention_task(300, kind="linear_qk", seq_len=6, n_features=12, rank=3, noise=0.1,
                                  random_state=0, return_teacher=True)
    default = RStarEstimator("linear_qk", value_map=t.value_map).fit(X, Y)
    assert default.inversion_ == "query_key_least_squares"
    strict = DEFAULT_CALIBRATION.replace(min_noise_dof=30000)
    with pytest.warns(InversionFallbackWarning, match="30000 residual degrees of freedom"):
        est = RStarEstimator("linear_qk", value_map=t.value_map, calibration=strict).fit(X, Y)
    assert est.inversion_ == "query_key_first_order"


# -- no tuned number is left at module level --------------------------------------------------------------------

#: Module-level numbers that are facts, not calibration (see rstar.calibration's docstring), with why.
FACTS = {
    ("rstar/marchenko_pastur.py", "MEDIAN_EFFICIENCY"): "2 / pi, the asymptotic efficiency of the median",
    ("rstar/marchenko_pastur.py", "_N_NOISE_NODES"): "quadrature nodes of the noise-variance integral",
    ("rstar/budgets.py", "_FLOAT_BYTES"): "bytes of a float64",
    ("rstar/heads/__init__.py", "DEFAULT_TOLERANCES"): "the tolerances estimate_heads reports by default (a "
                                                       "user-facing choice, like alpha = 0.01)",
}


def _numeric(node):
    """Whether an expression is a number (or a tuple of numbers) written out, or a calibration field aliased."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, complex)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right) or (
            (_numeric(node.left) or _constant_name(node.left)) and (_numeric(node.right) or _constant_name(node.right)))
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    if isinstance(node, ast.Attribute):
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id in ("DEFAULT_CALIBRATION", "_DC")
    return False


def _constant_name(node):
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("np", "math")


def _module_constants(path):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
            for name in names:
                if isinstance(name, ast.Name) and name.id.lstrip("_").isupper() and _numeric(node.value):
                    yield name.id


def test_no_module_level_tuned_numbers():
    found = []
    for path in sorted((ROOT / "rstar").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name in _module_constants(path):
            if (rel, name) not in FACTS:
                found.append(f"{rel}: {name}")
    assert found == [], "module-level tuned numbers (make them fields of rstar.calibration.Calibration): " + \
        ", ".join(found)


def test_the_scan_sees_numbers_and_aliases():
    src = ("A = 3\n_B = 2**20\nC = 2.0 / np.pi\nD = (0.01, 0.05)\nE = DEFAULT_CALIBRATION.split_half_margin\n"
           "F = -1e-3\nNAMES = ('a', 'b')\nlower = 3\nG = CostBudget()\n")
    tree = ast.parse(src)
    names = [n.targets[0].id for n in tree.body if _numeric(n.value) and n.targets[0].id.lstrip("_").isupper()]
    assert names == ["A", "_B", "C", "D", "E", "F"]


# -- the documentation page ---------------------------------------------------------------------------------------


def _generator():
    path = ROOT / "docs" / "generate_calibration_table.py"
    spec = importlib.util.spec_from_file_location("generate_calibration_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_calibration_table_is_current():
    """docs/calibration.md holds the table generated from Calibration.table() (docs/generate_calibration_table.py)."""
    module = _generator()
    text = Path(module.PAGE).read_text()
    assert module.BEGIN in text and module.render(text) == text
    for name, value, *_ in DEFAULT_CALIBRATION.table():
        assert f"`{name}`" in text, name


def test_the_page_is_in_the_docs():
    assert "calibration" in (ROOT / "docs" / "index.md").read_text().split()
    assert '("rstar.calibration"' in (ROOT / "docs" / "conf.py").read_text()
