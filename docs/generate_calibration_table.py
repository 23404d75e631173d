"""Write the table of ``rstar.calibration.Calibration`` (every tuned value) into docs/calibration.md.

    python docs/generate_calibration_table.py          # rewrite the table in place
    python docs/generate_calibration_table.py --check  # exit 1 if the committed table is stale

The table lies between the marker lines ``<!-- calibration table: begin -->`` and ``<!-- calibration table: end -->``
(added after the placeholder comment on the first run), one section per group.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _marked_table  # noqa: E402

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
    return _marked_table.render(text, table_markdown(), BEGIN, END, PLACEHOLDER)


def main(argv=None):
    return _marked_table.main(PAGE, "Calibration", render, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
