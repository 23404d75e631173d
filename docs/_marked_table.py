"""A generated table kept between two marker lines of a docs page (the decision table, the calibration table)."""

import argparse
import os
import sys


def render(text, table, begin, end, placeholder):
    """``text`` with ``table`` between the ``begin`` and ``end`` markers (added after ``placeholder`` on the
    first run, or at the end of the page)."""
    block = f"{begin}\n{table}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    if placeholder in text:
        return text.replace(placeholder, placeholder + "\n\n" + block, 1)
    return text.rstrip("\n") + "\n\n" + placeholder + "\n\n" + block + "\n"


def main(page, title, render_page, description, argv=None):
    """Rewrite ``page`` with ``render_page(text)``, or with ``--check`` exit 1 where the committed page is stale."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="only check that the committed table is current")
    args = parser.parse_args(argv)
    text = open(page).read() if os.path.exists(page) else f"# {title}\n"
    new = render_page(text)
    if args.check:
        if new != text:
            print(f"{page} is stale: run python docs/{os.path.basename(sys.argv[0])}", file=sys.stderr)
            return 1
        return 0
    with open(page, "w") as fh:
        fh.write(new)
    return 0
