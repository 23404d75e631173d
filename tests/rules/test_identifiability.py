"""The identifiability gates (rstar.rules.identifiability): pure functions of facts and shape, one module."""

import ast
import pathlib
import pickle
import warnings

import numpy as np
import pytest

from rstar import OperatorMisfitWarning, RStarEstimator, UnidentifiableRankWarning
from rstar.calibration import DEFAULT_CALIBRATION
from rstar.datasets import make_attention_task
from rstar.inversions import Finding
from rstar.rules import identifiability as idf

from _reasons import assert_warned

ROOT = pathlib.Path(__file__).resolve().parents[2] / "rstar"


def _first_order_gate(centred, tokens, features, calibration=DEFAULT_CALIBRATION):
    return idf._STATISTIC_GATES["first_order_shape"](
        {"centred": centred, "tokens": tokens, "features": features}, calibration)


def test_verdict_unpacks_as_a_warning_and_carries_its_reason():
    v = idf.Verdict("single_token", UnidentifiableRankWarning, "why", (0, 4))
    category, message = v
    assert (category, message) == (UnidentifiableRankWarning, "why")
    assert v.reason == "single_token" and v.bounds == (0, 4)
    w = v.warning()
    assert isinstance(w, UnidentifiableRankWarning) and w.reason == "single_token" and w.bounds == (0, 4)
    again = pickle.loads(pickle.dumps(v))
    assert again == v and again.reason == v.reason and again.bounds == v.bounds


def _verdict_reasons(path):
    """The reasons the module gives its verdicts: the first argument of each ``Verdict(...)``, where a literal."""
    tree = ast.parse(path.read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Verdict"
            and node.args and isinstance(node.args[0], ast.Constant)}


def test_every_reason_is_listed_and_documented():
    given = _verdict_reasons(ROOT / "rules" / "identifiability.py")
    # the rules' verdicts and the fallbacks' take their reason from a variable (rule_verdict's, the finding's)
    rule_reasons = {"bulk_too_wide", "bulk_exhausted", "mostly_spikes", "energy_discounts", "numerical_outside",
                    "split_half_band", "split_half_at_cap"}
    fallbacks = {"no_output", "no_value_signal", "softmax_misfit", "not_converged", "singular_information"}
    assert given | rule_reasons | fallbacks == set(idf.REASONS)
    page = (ROOT.parent / "docs" / "rules" / "identifiability.md").read_text()
    assert [r for r in idf.REASONS if f"`{r}`" not in page] == []
    for reason in rule_reasons:
        assert f'reason == "{reason}"' in (ROOT / "rules" / "identifiability.py").read_text()


def test_covering_widens_only_the_ends_a_verdict_names():
    vs = [idf.Verdict("a", None, "", (None, 9)), idf.Verdict("b", None, "", (0, 3)), idf.Verdict("c", None, "")]
    assert idf.covering((2, 4), vs) == (0, 9)
    assert idf.covering((2, 4), vs[:1]) == (2, 9)
    assert idf.covering((2, 4), []) == (2, 4)


@pytest.mark.parametrize("centred,tokens,features,reasons", [
    (True, 31, 16, []),                                            # T - 1 > d: identified
    (True, 31, 32, ["first_order_near_square"]),                  # aspect 0.97, T - 1 <= d
    (True, 31, 100, ["first_order_too_few_tokens"]),              # d > 3 (T - 1)
    (False, 8, 33, ["first_order_qk_too_few_tokens"]),            # d > 4 T
    (False, 8, 32, []),
])
def test_first_order_shape_gates(centred, tokens, features, reasons):
    out = _first_order_gate(centred, tokens, features)
    assert [v.reason for v in out] == reasons
    assert all(v.bounds == (0, features) and v.category is UnidentifiableRankWarning for v in out)


def test_first_order_gate_reads_its_calibration():
    # d = 100 with 31 centred tokens is refused at the default aspect 3; allowed at 4
    loose = DEFAULT_CALIBRATION.replace(first_order_max_aspect=4.0)
    assert [v.reason for v in _first_order_gate(True, 31, 100)] == ["first_order_too_few_tokens"]
    assert _first_order_gate(True, 31, 100, loose) == []


def test_factored_fit_gates():
    base = dict(settled=True, iterations=50, fitted_rank=8, budget_ran_out=False, count=(3, 3), capped=False,
                features=64)
    gate = idf._STATISTIC_GATES["factored_fit"]
    assert gate(base, DEFAULT_CALIBRATION) == []
    unsettled = gate(dict(base, settled=False, budget_ran_out=True), DEFAULT_CALIBRATION)
    assert [v.reason for v in unsettled] == ["factored_unsettled"] and unsettled[0].bounds == (0, 8)
    assert "(the compute budget ran out)" in unsettled[0].message
    capped = gate(dict(base, capped=True, count=(7, 7)), DEFAULT_CALIBRATION)
    # the rule warns at the cap; this gate only widens
    assert [v.reason for v in capped] == ["factored_at_cap"] and capped[0].bounds == (0, 64)
    assert capped[0].category is None


def test_fallback_verdicts_carry_the_reason_as_data():
    v = idf.fallback_verdict(Finding("softmax_misfit", {"ratio": 2.5, "features": 16}), DEFAULT_CALIBRATION)
    assert v.reason == "softmax_misfit" and v.bounds == (0, 16) and "Fallback in use" in v.message
    v = idf.fallback_verdict(Finding("no_output", {}), DEFAULT_CALIBRATION)
    assert v.bounds is None and v.category is UnidentifiableRankWarning


def test_tolerance_gates():
    kw = dict(tolerance=0.05, rank=3, dim=16, inversion="x", identified=True, disagreement=None, noise_lower=2,
              noise_upper=4, calibration=DEFAULT_CALIBRATION)
    assert idf.tolerance_verdicts(**kw) == []
    assert [v.reason for v in idf.tolerance_verdicts(**dict(kw, identified=False))] == [
        "curve_against_unidentified_fit"]
    # a cross-fitted curve whose rank-3 models hold the tolerance on their own held-out risk: r*(eps) <= 3 whatever
    # the full model it subtracts, so an unidentified fit cannot have made the reading too small
    assert idf.tolerance_verdicts(**dict(kw, identified=False, held_out_reach=3)) == []
    later = idf.tolerance_verdicts(**dict(kw, identified=False, held_out_reach=5))
    assert [v.reason for v in later] == ["curve_against_unidentified_fit"] and later[0].bounds == (None, 5)
    assert "reaches 5 (the rank whose models' own held-out risk" in later[0].message
    assert idf.tolerance_verdicts(**dict(kw, identified=False, held_out_reach=None))[0].bounds == (None, 16)
    # the noise's gate keeps every rank (directions fitted to noise have read short on other windows)
    assert idf.tolerance_verdicts(**dict(kw, rank=5, held_out_reach=5))[0].bounds == (2, 16)
    fraction = DEFAULT_CALIBRATION.curve_resolution_fraction
    assert idf.tolerance_verdicts(**dict(kw, disagreement=fraction * 0.05 * 0.99)) == []
    assert [v.reason for v in idf.tolerance_verdicts(**dict(kw, disagreement=fraction * 0.05 * 1.01))] == [
        "curve_resolution"]
    # beyond the noise floor the curve does not place r*(eps): from the noise floor's lower end to every rank
    below = idf.tolerance_verdicts(**dict(kw, rank=5))
    assert [v.reason for v in below] == ["tolerance_below_noise"] and below[0].bounds == (2, 16)
    assert idf.covering((5, 6), below) == (2, 16)
    # a floor known only within more than the tolerance (held out less in sample): the curve may understate every
    # rank's excess by that much, so the reading's upper end reaches every rank (MiniLM layer 0 head 2: gap 0.08,
    # read 5 (5, 7) at 5%, its kernel truncated to 5 held out 10.9%)
    assert idf.tolerance_verdicts(**dict(kw, floor_gap=0.05 * 0.99)) == []
    gap = idf.tolerance_verdicts(**dict(kw, floor_gap=0.08))
    assert [v.reason for v in gap] == ["curve_floor_gap"] and gap[0].bounds == (None, 16)
    assert idf.covering((3, 5), gap) == (3, 16) and "0.08 of Var(Y)" in gap[0].message
    # a curve that reaches the tolerance only beyond the class's bound (dim: d, or max_rank): read at the bound,
    # every rank the class allows, and the other gates read the rank at the bound
    beyond = idf.tolerance_verdicts(**dict(kw, rank=20, noise_upper=18))
    assert [v.reason for v in beyond] == ["tolerance_beyond_class_bound"] and beyond[0].bounds == (0, 16)
    assert "only at rank 20" in beyond[0].message and "the reading is the bound, 16" in beyond[0].message
    assert [v.reason for v in idf.tolerance_verdicts(**dict(kw, rank=20))] == ["tolerance_beyond_class_bound",
                                                                              "tolerance_below_noise"]
    assert "the rank it reads (16)" in idf.tolerance_verdicts(**dict(kw, rank=20))[1].message
    assert idf.within_class(20, idf.covering((18, 22), beyond), 16) == (16, (0, 16))
    assert idf.tolerance_verdicts(**dict(kw, rank=16, noise_upper=18)) == []


def test_estimator_gates_on_the_samples():
    from rstar.inversions import WhitenedStatistic, WishartNull

    ws = WhitenedStatistic(np.ones(8), np.eye(8), np.eye(8), 5.0, WishartNull(), "token")
    few = idf.estimator_verdicts(ws, 10, 4, "linear_proxy", identified=True)
    assert [v.reason for v in few] == ["too_few_noise_columns"] and few[0].bounds == (0, 8)
    # an inversion that already did not identify r* says so itself: the samples' gate is not added
    assert idf.estimator_verdicts(ws, 10, 4, "linear_proxy", identified=False) == []
    one = idf.estimator_verdicts(WhitenedStatistic(np.ones(8), np.eye(8), np.eye(8), 100.0, WishartNull(), "x"),
                                 100, 1, "softmax", identified=True)
    assert [v.reason for v in one] == ["single_token"]


def test_the_fit_records_its_verdicts_and_warns_with_their_reason():
    X, Y = make_attention_task(400, seq_len=8, n_features=6, rank=2, random_state=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = RStarEstimator().fit(X[:, :1], Y[:, :1])   # one token per sample
    assert "single_token" in [v.reason for v in est.verdicts_]
    assert est.rank_interval_ == (0, 6)
    assert_warned(caught, "single_token", bounds=(0, 6), category=UnidentifiableRankWarning)
    clean = RStarEstimator().fit(X, Y)
    assert clean.verdicts_ == [] and clean.rank_ == 2


def test_swapped_arrays_give_an_operator_misfit_verdict():
    X, Y = make_attention_task(1500, seq_len=16, n_features=8, rank=2, random_state=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = RStarEstimator().fit(Y, X)
    reasons = [v.reason for v in est.verdicts_]
    assert "softmax_misfit" in reasons or "operator_misfit" in reasons
    assert est.rank_interval_ == (0, 8)
    assert all(v.category is None or issubclass(v.category, (UnidentifiableRankWarning, OperatorMisfitWarning))
               for v in est.verdicts_)


def _warning_sites(path):
    """Places in a module that build an UnidentifiableRankWarning / OperatorMisfitWarning or an interval bound."""
    tree = ast.parse(path.read_text())
    names = {"UnidentifiableRankWarning", "OperatorMisfitWarning", "rank_bounds"}
    return [node.lineno for node in ast.walk(tree)
            if (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute)
                                                                     and node.attr in names)]


def test_only_the_identifiability_module_decides():
    # the package's modules other than rstar/rules/identifiability.py neither raise UnidentifiableRankWarning /
    # OperatorMisfitWarning nor set rank bounds (the exceptions module defines them, the package exports them,
    # and the paper's experiments count them)
    allowed = {"exceptions.py", "__init__.py", "rules/identifiability.py", "paper/experiments.py"}
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed:
            continue
        sites = _warning_sites(path)
        if sites:
            offenders[rel] = sites
    assert offenders == {}


def test_the_architecture_counts():
    # benchmarks/architecture_counts.py: the evidence of issue 35, kept
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "architecture_counts", ROOT.parent / "benchmarks" / "architecture_counts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.counts(ROOT.parent)
    assert c["deciders"] == ["rules/identifiability.py"]
    assert c["exported"] == [] and c["lazy"] == []
    assert c["estimator_lines"] < 300
    # the facts left at module level (a quadrature's node count, the bytes of a float), no tuned value
    assert sorted(c["constants"]) == ["budgets.py:_FLOAT_BYTES", "marchenko_pastur.py:_N_NOISE_NODES"]
