"""Write the decision table of ``rstar.inversions.choose_inversion`` into docs/decision_table.md.

    python docs/generate_decision_table.py          # rewrite the table in place
    python docs/generate_decision_table.py --check  # exit 1 if the committed table is stale

The table lies between the marker lines ``<!-- decision table: begin -->`` and ``<!-- decision table: end -->``
(added after the placeholder comment on the first run).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _marked_table  # noqa: E402

from rstar.inversions import decision_table_markdown

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decision_table.md")
BEGIN, END = "<!-- decision table: begin -->", "<!-- decision table: end -->"
PLACEHOLDER = "<!-- generated: python docs/generate_decision_table.py -->"


def render(text):
    """``text`` with the generated table between the markers."""
    return _marked_table.render(text, decision_table_markdown(), BEGIN, END, PLACEHOLDER)


def main(argv=None):
    return _marked_table.main(PAGE, "Which inversion runs", render, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
