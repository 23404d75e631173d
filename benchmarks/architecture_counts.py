"""Counts of where rstar decides a rank, read from the source: the evidence of the "one place" refactor.

For a checkout of rstar (default: this one), counted with Python's ``ast`` (no import):

- module-level numeric constants (UPPERCASE names bound to a number or a power of numbers), and those
  exported in an ``__all__``;
- modules that name ``UnidentifiableRankWarning`` / ``OperatorMisfitWarning`` (outside ``exceptions.py``, the
  package's ``__init__`` and the paper's experiments, which only filter them) or set ``rank_bounds``;
- the lines of the class ``_RankEstimator`` and its number of methods;
- function-level imports of the package's own modules (``from .x import ...`` inside a function), outside the
  command line (``cli.py``, which imports lazily for start-up time) and the optional torch extra (students).

Usage::

    python benchmarks/architecture_counts.py                     # this checkout
    python benchmarks/architecture_counts.py /path/to/other/checkout
"""

import ast
import sys
from pathlib import Path

LAZY_OK = ("cli.py", "paper/cli.py", "_backend.py", "students/", "heads/_collect.py", "heads/_text.py")
#: lazy imports of the optional torch extra (the students) are not circles
OPTIONAL = ("students",)
FILTER_ONLY = ("exceptions.py", "__init__.py", "paper/experiments.py", "experiments.py")


def _is_number(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return True
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    return False


def counts(root):
    pkg = Path(root) / "rstar"
    constants, exported, deciders, lazy = [], [], [], []
    estimator_lines = estimator_methods = None
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        tree = ast.parse(path.read_text())
        names_all = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                try:
                    names_all = set(ast.literal_eval(node.value))
                except ValueError:
                    pass
        for node in tree.body:
            if isinstance(node, ast.Assign) and _is_number(node.value):
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id.lstrip("_").isupper():
                        constants.append(f"{rel}:{t.id}")
                        if t.id in names_all:
                            exported.append(f"{rel}:{t.id}")
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        if not rel.endswith(FILTER_ONLY) and names & {"UnidentifiableRankWarning", "OperatorMisfitWarning",
                                                       "rank_bounds"}:
            deciders.append(rel)
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(fn):
                if (isinstance(node, ast.ImportFrom) and node.level > 0 and not rel.startswith(LAZY_OK)
                        and (node.module or "").split(".")[0] not in OPTIONAL):
                    lazy.append(f"{rel}:{node.lineno} from {'.' * node.level}{node.module or ''}")
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "_RankEstimator":
                estimator_lines = node.end_lineno - node.lineno + 1
                estimator_methods = sum(isinstance(b, ast.FunctionDef) for b in node.body)
    return dict(constants=constants, exported=exported, deciders=deciders, lazy=sorted(set(lazy)),
                estimator_lines=estimator_lines, estimator_methods=estimator_methods)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    root = argv[0] if argv else Path(__file__).resolve().parents[1]
    c = counts(root)
    print(f"checkout: {root}")
    print(f"module-level numeric constants: {len(c['constants'])} (in __all__: {len(c['exported'])})")
    for name in c["constants"]:
        print(f"    {name}")
    print(f"modules that raise UnidentifiableRankWarning / OperatorMisfitWarning or set rank_bounds: "
          f"{len(c['deciders'])}: {', '.join(c['deciders'])}")
    print(f"_RankEstimator: {c['estimator_lines']} lines, {c['estimator_methods']} methods")
    print(f"function-level imports of the package's own modules (outside the CLI and torch back-ends): "
          f"{len(c['lazy'])}")
    for line in c["lazy"]:
        print(f"    {line}")


if __name__ == "__main__":
    main()
