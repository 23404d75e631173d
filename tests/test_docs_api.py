"""The API reference lists what users call: no module's ``__all__`` exports a tuned numeric constant.

docs/conf.py writes the API page from each public module's ``__all__``; a module-level number (a margin, a
default, an iteration cap) there would appear as public API. The tuned values are the fields of one object,
:class:`rstar.calibration.Calibration` (``DEFAULT_CALIBRATION.split_half_margin``), documented on its own page.
"""

import ast
import importlib
import numbers
import pkgutil
from pathlib import Path

import pytest

import rstar

CONF = Path(__file__).resolve().parents[1] / "docs" / "conf.py"


def _api_modules():
    """The module names of conf.py's ``API_MODULES``, read without running conf.py (which writes docs/api.rst)."""
    for node in ast.parse(CONF.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "API_MODULES" for t in node.targets):
            return [name for name, _ in ast.literal_eval(node.value)]
    raise AssertionError("docs/conf.py has no API_MODULES")


def _all_modules():
    return ["rstar"] + sorted(m.name for m in pkgutil.walk_packages(rstar.__path__, "rstar."))


def _import(name):
    try:
        return importlib.import_module(name)
    except ImportError as err:   # an optional extra (torch, transformers ...) that is not installed
        pytest.skip(f"{name} needs an optional dependency: {err}")


def _numeric_exports(module):
    out = []
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name)
        if isinstance(value, numbers.Number) and not isinstance(value, bool):
            out.append(f"{name} = {value!r}")
    return out


def test_api_modules_are_listed():
    names = _api_modules()
    assert "rstar" in names and "rstar.rules" in names and "rstar.inversions" in names


@pytest.mark.parametrize("name", _api_modules())
def test_public_modules_export_no_numeric_constants(name):
    module = _import(name)
    assert _numeric_exports(module) == [], f"{name}.__all__ lists numeric constants (they would be documented " \
                                           "as API): remove them from __all__"


@pytest.mark.parametrize("name", _all_modules())
def test_no_module_exports_numeric_constants(name):
    # private modules too: a package that re-exports a private module's __all__ would list them again
    assert _numeric_exports(_import(name)) == []


def test_tuned_values_are_calibration_fields():
    # the constants that were importable by name (rstar.rules.SPLIT_HALF_MARGIN ...) are fields of the calibration
    import dataclasses

    from rstar.calibration import DEFAULT_CALIBRATION, Calibration

    names = ("compute_budget", "memory_budget", "default_null_draws", "default_seed", "ill_conditioned_aspect",
             "min_noise_dof", "curve_resolution_fraction", "coherent_bonferroni", "interval_factor",
             "residual_floor_margin", "split_half_margin", "split_half_noise_edge", "top_down_min_bulk",
             "chunk_entries")
    fields = {f.name for f in dataclasses.fields(Calibration)}
    assert set(names) <= fields
    assert all(isinstance(getattr(DEFAULT_CALIBRATION, name), numbers.Number) for name in names)
    # and no longer module attributes of the packages that re-exported them
    import rstar.inversions
    import rstar.rules

    for module, old in ((rstar.inversions, "DEFAULT_SEED"), (rstar.inversions, "MIN_NOISE_DOF"),
                        (rstar.rules, "SPLIT_HALF_MARGIN"), (rstar.rules, "INTERVAL_FACTOR")):
        assert not hasattr(module, old), f"{module.__name__}.{old} is still defined"
    # the calibration's own module exports the object, not its numbers
    assert "DEFAULT_CALIBRATION" in importlib.import_module("rstar.calibration").__all__
