"""Write the decision table of ``rstar.inversions.choose_inversion`` into docs/decision_table.md.

    python docs/generate_decision_table.py          # rewrite the table in place
    python docs/generate_decision_table.py --check  # exit 1 if the committed table is stale

The table lies between the marker lines ``<!-- decision table: begin -->`` and ``<!-- decision table: end -->``
(added after the placeholder comment on the first run).
"""

import argparse
import os
import sys

from rstar.inversions import decision_table_markdown

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decision_table.md")
BEGIN, END = "<!-- decision table: begin -->", "<!-- decision table: end -->"
PLACEHOLDER = "<!-- generated: python docs/generate_decision_table.py -->"


def render(text):
    """``text`` with the generated table between the markers."""
    table = f"{BEGIN}\n{decision_table_markdown()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + table + rest.split(END, 1)[1]
    if PLACEHOLDER in text:
        return text.replace(PLACEHOLDER, PLACEHOLDER + "\n\n" + table, 1)
    return text.rstrip("\n") + "\n\n" + PLACEHOLDER + "\n\n" + table + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the committed table is current")
    args = parser.parse_args(argv)
    text = open(PAGE).read() if os.path.exists(PAGE) else "# Which inversion runs\n"
    new = render(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is stale: run python docs/generate_decision_table.py", file=sys.stderr)
            return 1
        return 0
    with open(PAGE, "w") as fh:
        fh.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
