"""The API reference lists what users call: no module's ``__all__`` exports a tuned numeric constant.

docs/conf.py writes the API page from each public module's ``__all__``; a module-level number (a margin, a
default, an iteration cap) there would appear as public API. Such constants stay importable by name
(``from rstar.rules import SPLIT_HALF_MARGIN``), outside ``__all__``.
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


def test_constants_stay_importable_by_name():
    from rstar.budgets import DEFAULT_COMPUTE_BUDGET, DEFAULT_MEMORY_BUDGET
    from rstar.inversions import DEFAULT_NULL_DRAWS, DEFAULT_SEED, ILL_CONDITIONED_ASPECT, MIN_NOISE_DOF
    from rstar.risk import CURVE_RESOLUTION_FRACTION
    from rstar.rules import (COHERENT_BONFERRONI, INTERVAL_FACTOR, RESIDUAL_FLOOR_MARGIN, SPLIT_HALF_MARGIN,
                             SPLIT_HALF_NOISE_EDGE, TOP_DOWN_MIN_BULK)
    from rstar.streaming import CHUNK_ENTRIES

    values = (DEFAULT_COMPUTE_BUDGET, DEFAULT_MEMORY_BUDGET, DEFAULT_NULL_DRAWS, DEFAULT_SEED, ILL_CONDITIONED_ASPECT,
              MIN_NOISE_DOF, CURVE_RESOLUTION_FRACTION, COHERENT_BONFERRONI, INTERVAL_FACTOR, RESIDUAL_FLOOR_MARGIN,
              SPLIT_HALF_MARGIN, SPLIT_HALF_NOISE_EDGE, TOP_DOWN_MIN_BULK, CHUNK_ENTRIES)
    assert all(isinstance(v, numbers.Number) for v in values)
