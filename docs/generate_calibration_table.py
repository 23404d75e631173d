"""Write the table of ``rstar.calibration.Calibration`` (every tuned value) into docs/calibration.md.

    python docs/generate_calibration_table.py          # rewrite the table in place
    python docs/generate_calibration_table.py --check  # exit 1 if the committed table is stale

The table lies between the marker lines ``<!-- calibration table: begin -->`` and ``<!-- calibration table: end -->``
(added after the placeholder comment on the first run), one section per group.
"""

import argparse
import os
import sys

from rstar.calibration import DEFAULT_CALIBRATION, GROUPS

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.md")
BEGIN, END = "<!-- calibration table: begin -->", "<!-- calibration table: end -->"
PLACEHOLDER = "<!-- generated: python docs/generate_calibration_table.py -->"


def _value(v):
    """A default as it is written in Python: powers of two as ``2**k``."""
    if isinstance(v, int) and v >= 2**10 and v & (v - 1) == 0:
        return f"2**{v.bit_length() - 1}"
    return repr(v)


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_markdown(calibration=DEFAULT_CALIBRATION):
    """The fields of ``calibration`` as one Markdown table per group (:meth:`Calibration.table`'s rows)."""
    rows = calibration.table()
    out = []
    for group in GROUPS:
        members = [r for r in rows if r[5] == group]
        if not members:
            continue
        out += [f"### {group[0].upper()}{group[1:]}", "", "| name | default | meaning | set by | data |",
                "|---|---|---|---|---|"]
        for name, value, meaning, set_by, data, _ in members:
            command = f"`{set_by}`" if set_by.startswith("python ") else _cell(set_by)
            out.append(f"| `{name}` | `{_value(value)}` | {_cell(meaning)} | {command} | {_cell(data)} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def render(text):
    """``text`` with the generated table between the markers."""
    table = f"{BEGIN}\n{table_markdown()}\n{END}"
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
    text = open(PAGE).read() if os.path.exists(PAGE) else "# Calibration\n"
    new = render(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is stale: run python docs/generate_calibration_table.py", file=sys.stderr)
            return 1
        return 0
    with open(PAGE, "w") as fh:
        fh.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
