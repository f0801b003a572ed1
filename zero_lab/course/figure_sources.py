"""Which code drew each committed figure, so a test can tell a stale one (issue 50, part 2).

The figures in figures/ are what `make figures` ran: the notebooks saved them, the runner copied
them. Each is named after the notebook that saved it ("03_step_ddp.png": notebook 03). When a
figure is copied, figures/SOURCES.json records a digest of what drew it: the notebook's code
cells and the zero_lab.course modules it imports that draw (those importing matplotlib).
tests/test_figures_fresh.py recomputes the digests: a figure whose notebook or drawing code
changed since is stale, and the test says to run `make figures`. Prose edits do not count.

A digest, not a file time: a clone gives every file the same time, and git keeps no times.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
FIGURES = ROOT / "figures"
RECORD = FIGURES / "SOURCES.json"
COURSE = ROOT / "zero_lab" / "course"
IMPORT = re.compile(r"from zero_lab\.course(?:\.(\w+))? import ([\w, ()\n]+)")


def notebook_of(figure: str) -> Path:
    """The notebook that saves `figure` (a file name such as '03_step_ddp.png')."""
    found = sorted(NOTEBOOKS.glob(f"{figure[:2]}_*.ipynb"))
    if not re.match(r"\d\d_", figure) or len(found) != 1:
        raise ValueError(f"figure must be named after its notebook ('03_step_ddp.png'); got "
                         f"{figure!r}, which names no one notebook in {NOTEBOOKS}")
    return found[0]


def code_cells(notebook: Path) -> str:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def drawing_modules(code: str) -> list[Path]:
    """The zero_lab.course modules `code` imports that draw (they import matplotlib)."""
    names = set()
    for module, imported in IMPORT.findall(code):
        names |= {module} if module else set(re.findall(r"\w+", imported))
    found = [COURSE / f"{name}.py" for name in sorted(names)]
    return [p for p in found if p.exists() and "matplotlib" in p.read_text(encoding="utf-8")]


def digest(notebook: Path) -> str:
    """sha256 of the notebook's code cells and its drawing modules' text."""
    code = code_cells(notebook)
    h = hashlib.sha256(code.encode())
    for module in drawing_modules(code):
        h.update(f"\n# {module.name}\n".encode() + module.read_bytes())
    return h.hexdigest()


def record(figures: list[Path]) -> None:
    """Add the copied `figures` to SOURCES.json beside them, with their notebooks' digests (a
    figure named after no notebook is recorded as such, and `stale` names it)."""
    for folder in {figure.parent for figure in figures}:
        path = folder / RECORD.name
        known = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        for figure in (f for f in figures if f.parent == folder):
            try:
                notebook = notebook_of(figure.name)
                known[figure.name] = {"notebook": notebook.name, "sources": digest(notebook)}
            except ValueError:
                known[figure.name] = {"notebook": None, "sources": None}
        path.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n", encoding="utf-8")


def stale(folder: Path = FIGURES) -> list[str]:
    """The figures in `folder` with no record, named after no notebook, or drawn by code that
    has changed since they were copied."""
    path = folder / RECORD.name
    known = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    found = []
    for figure in sorted(folder.glob("*.png")):
        entry = known.get(figure.name)
        if entry is None or entry["notebook"] is None:
            found.append(f"{figure.name} ({'no record' if entry is None else 'no notebook'})")
        elif entry["sources"] != digest(notebook_of(figure.name)):
            found.append(f"{figure.name} (the code of {entry['notebook']} changed)")
    return found
