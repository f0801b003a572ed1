"""The markdown of a notebook as one line, for the tests that pin issue 48's findings."""

from __future__ import annotations

import json
import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook(prefix: str) -> Path:
    (path,) = NOTEBOOKS.glob(f"{prefix}_*.ipynb")
    return path


def cells(prefix: str, kind: str = "markdown") -> list[str]:
    return ["".join(c["source"]) for c in json.loads(notebook(prefix).read_text())["cells"]
            if c["cell_type"] == kind]


def without_links(text: str) -> str:
    """Markdown as it reads: a link is its text (each notebook links its glossary terms)."""
    return re.sub(r"\[([^\[\]]*)\]\([^)\s]*\)", r"\1", text)


def flat(text: str) -> str:
    """One line, without links, bold marks or code marks (underscores stay: in names)."""
    return " ".join(re.sub(r"[*`]", "", without_links(text)).split())


def markdown(prefix: str) -> str:
    """A notebook's markdown cells, flattened, joined by a pilcrow (a sentence ends there)."""
    return " ¶ ".join(flat(c) for c in cells(prefix))


def sentences(text: str) -> list[str]:
    """Sentences of flattened text: a full stop, then a space and a capital (so "2.25" and
    "e.g. x" stay inside), or a cell's end."""
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(])|\s*¶\s*", text) if s]
