"""Link each glossary term where a notebook first uses it (issue 48, part 3).

A learner who meets "bucket" for the first time clicks it and lands on its entry in
zero_lab/practice/glossary.md. Each entry there opens with an anchor (`<a id="bucket"></a>`);
the course's first use of each term in its prose, notebooks taken in order, links to it, once
in the course (every notebook's header links the whole glossary). Once: an address read
aloud is words the learner's budget counts (tests/test_learner_budget.py).

What counts as a use: the term as a whole word (a plural "buckets" too), case-blind unless
the term has capitals (NCCL, TP, DCP), outside headings, code, and existing links. Symbols
(Ψ, K, N, α, β) are left unlinked: they sit inside formulas.

    python -m zero_lab.course.glossary_links            rewrite the notebooks
    python -m zero_lab.course.glossary_links --check    exit 1 if a notebook is not so linked

tests/test_cheat_sheet.py holds every notebook to `--check`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "zero_lab" / "practice" / "glossary.md"
NOTEBOOKS = ROOT / "notebooks"
TARGET = "../zero_lab/practice/glossary.md"  # from notebooks/
ENTRY = re.compile(r'^- <a id="([\w-]+)"></a>(.*?):\s', re.MULTILINE)
UNLINKED = {"Ψ", "K", "N_d", "N", "α", "β", "alpha-beta"}
# Spans a link must not go into: fenced and inline code, links and images, HTML, headings.
PROTECTED = re.compile(r"```.*?```|`[^`\n]*`|!?\[[^\]\n]*\]\([^)\n]*\)|<[^>\n]+>|^#.*$",
                       re.DOTALL | re.MULTILINE)


def entries(glossary: str | None = None) -> dict[str, str]:
    """term -> its entry's anchor, longest terms first (so 'float8 all-gather' is linked
    before 'all-gather' can take its words)."""
    text = GLOSSARY.read_text(encoding="utf-8") if glossary is None else glossary
    found = {}
    for anchor, head in ENTRY.findall(text):
        for term in re.findall(r"\*\*(.+?)\*\*", head):
            if term not in UNLINKED:
                found[term] = anchor
    return dict(sorted(found.items(), key=lambda item: -len(item[0])))


def pattern(term: str) -> re.Pattern:
    flags = 0 if any(c.isupper() for c in term) else re.IGNORECASE
    return re.compile(rf"(?<![\w-]){re.escape(term)}(?:s|es)?(?![\w-])", flags)


def _free(text: str, start: int, end: int, taken: list[tuple[int, int]]) -> bool:
    return all(end <= a or start >= b for a, b in taken)


def link_cells(cells: list[str], terms: dict[str, str]) -> list[str]:
    """The markdown cells with each term's first free use linked, unless one is already."""
    cells = list(cells)
    for term, anchor in terms.items():
        target = f"{TARGET}#{anchor}"
        if any(f"]({target})" in cell and pattern(term).search(_link_texts(cell, target))
               for cell in cells):
            continue  # this notebook already links the term
        for i, cell in enumerate(cells):
            taken = [m.span() for m in PROTECTED.finditer(cell)]
            use = next((m for m in pattern(term).finditer(cell)
                        if _free(cell, *m.span(), taken)), None)
            if use:
                cells[i] = f"{cell[:use.start()]}[{use.group(0)}]({target}){cell[use.end():]}"
                break
    return cells


def _link_texts(cell: str, target: str) -> str:
    return " ".join(re.findall(rf"\[([^\[\]]*)\]\({re.escape(target)}\)", cell))


def unlinked(cell: str) -> str:
    """`cell` with its links to glossary entries turned back into their text."""
    return re.sub(rf"\[([^\[\]]*)\]\({re.escape(TARGET)}#[\w-]+\)", r"\1", cell)


def link_notebook(path: Path, terms: dict[str, str]) -> tuple[dict, bool, set[str]]:
    """The notebook with `terms` linked where it first uses them (and no other term linked),
    whether anything changed, and the terms it linked."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    markdown = [c for c in nb["cells"] if c["cell_type"] == "markdown"]
    before = ["".join(c["source"]) for c in markdown]
    after = link_cells([unlinked(c) for c in before], terms)
    for cell, text in zip(markdown, after, strict=True):
        cell["source"] = text.splitlines(keepends=True)
    linked = {t for t, a in terms.items()
              if any(pattern(t).search(_link_texts(c, f"{TARGET}#{a}")) for c in after)}
    return nb, after != before, linked


def link_course(write: bool) -> list[str]:
    """Link each term where the course first uses it, notebooks in order; the notebooks that
    were not so linked (rewritten when `write`)."""
    terms, changed = entries(), []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        nb, differs, linked = link_notebook(path, terms)
        terms = {t: a for t, a in terms.items() if t not in linked}
        if differs:
            changed.append(path.name)
            if write:
                path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n",
                                encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a notebook lacks a term's link")
    args = parser.parse_args(argv)
    changed = link_course(write=not args.check)
    if changed and args.check:
        print("these notebooks do not link the glossary's terms where the course first uses "
              "them: " + ", ".join(changed) + "; run python -m zero_lab.course.glossary_links",
              file=sys.stderr)
        return 1
    for name in changed:
        print(f"linked the glossary's terms in {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
