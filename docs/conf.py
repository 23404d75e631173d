"""Sphinx configuration of the rstar documentation site.

Build (warnings are errors)::

    python -m sphinx -W -b html docs docs/_build/html

The gallery (``examples/plot_*.py``) is executed at build time by sphinx-gallery.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("MPLBACKEND", "Agg")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import rstar  # noqa: E402

project = "rstar"
author = "the rstar developers"
copyright = "2026, the rstar developers"
release = version = rstar.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build", "auto_examples/*.ipynb", "auto_examples/*.py", "auto_examples/*.zip",
                    "auto_examples/*.md5", "auto_examples/*.json", "**.ipynb_checkpoints"]
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True, "inherited-members": False,
                           # scikit-learn's metadata-routing setters: their docstrings link into sklearn's own docs
                           "exclude-members": "set_fit_request,set_partial_fit_request,set_score_request,"
                                              "set_predict_request"}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks = set()
# intersphinx needs the network; none is reachable on CI, so cross-project links stay plain text
intersphinx_mapping = {}

html_theme = "pydata_sphinx_theme"
html_title = f"rstar {release}"
html_theme_options = {"navigation_with_keys": False, "show_toc_level": 2}
html_static_path = []

sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"quickstart\.py",
    "backreferences_dir": "generated/backreferences",
    "doc_module": ("rstar",),
    "reference_url": {"rstar": None},
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "min_reported_time": 5,
}

# the estimators report fallbacks and unidentifiable ranks as warnings: in the gallery they are part of the output
warnings.filterwarnings("default", module="rstar")

#: The API reference: every name in each public module's ``__all__``, documented where it is defined for users
#: (the estimators and warnings at the top level; ``rstar.estimators`` and ``rstar.exceptions`` only re-export).
API_MODULES = [
    ("rstar", "Data-only estimators and warnings"),
    ("rstar.inversions", "Inversions, the statistic contract and the choice of inversion"),
    ("rstar.rules", "Rank rules"),
    ("rstar.rules.identifiability", "Identifiability: when r* is not identified"),
    ("rstar.budgets", "Cost budgets"),
    ("rstar.calibration", "Calibration: every tuned value"),
    ("rstar.streaming", "Samples read in passes (batches, dask arrays)"),
    ("rstar.risk", "Risk against rank (the tolerance rank r*(ε))"),
    ("rstar.model_check", "Model checks of the operator's class"),
    ("rstar.model_selection", "Choosing the rank of a rank sweep"),
    ("rstar.heads", "Real transformer heads (torch models)"),
    ("rstar.baselines", "Published baselines"),
    ("rstar.datasets", "Task generators"),
    ("rstar.metrics", "Metrics and scorers"),
    ("rstar.spectral", "Spectral measures"),
    ("rstar.marchenko_pastur", "Marchenko–Pastur and Tracy–Widom"),
    ("rstar.students", "Trained students (torch)"),
    ("rstar.paper.experiments", "The paper's experiments"),
    ("rstar.cli", "Command line"),
]


def write_api_page(app=None):
    """Write docs/api.rst from the modules' ``__all__`` (so every public name has a page, and no stale one)."""
    import importlib

    lines = ["API reference", "=============", "",
             "Every public name, from each module's ``__all__``. The estimators and warnings are documented at the",
             "top level (``rstar.estimators`` and ``rstar.exceptions`` re-export them).", ""]
    for name, title in API_MODULES:
        module = importlib.import_module(name)
        names = [n for n in module.__all__ if not n.startswith("__")]
        lines += [title, "-" * len(title), "", f".. automodule:: {name}", "   :no-members:", "",
                  f".. currentmodule:: {name}", "", ".. autosummary::", "   :toctree: generated", ""]
        lines += [f"   {n}" for n in names] + [""]
    text = "\n".join(lines)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api.rst")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as fh:
            fh.write(text)


write_api_page()
