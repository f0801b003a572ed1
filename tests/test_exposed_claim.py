"""No notebook or zero_lab docstring calls measured exposed communication a lower bound (issue 48).

The projection at ideal overlap is a lower bound on a step. A measured exposed time is not a
bound either way: hidden communication is not free, so removing communication can save more
than the exposed time; and exposed time includes waiting for the slowest rank, which removing
communication does not save, so it can exceed the saving (the course's stage 3 A/B: 197.9 ms
exposed against 161.2 ms saved).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from finding_text import without_links

ROOT = Path(__file__).resolve().parent.parent
SUBJECT = r"exposed\s+(?:communication|comm|time)"
BOUND = r"(?:only\s+|just\s+|always\s+)?(?:a\s+|the\s+)?lower\s+bound"
CLAIMS = [  # exposed ... is a lower bound / exposed ..., which is a lower bound / "It is ..."
    re.compile(SUBJECT + r"[^.;:()]{0,40}?\b(?:is|are|was|remains)\s+" + BOUND, re.IGNORECASE),
    re.compile(SUBJECT + r",?\s+which\s+is\s+" + BOUND, re.IGNORECASE),
    re.compile(SUBJECT + r"[^.]*\.\s+(?:It|This)\s+is\s+" + BOUND, re.IGNORECASE),
]


def flat(text: str) -> str:
    """One line, without markdown emphasis or code marks."""
    return " ".join(re.sub(r"[*_`]", "", without_links(text)).split())


def claims(text: str) -> list[str]:
    text = flat(text)
    return [m.group(0) for pattern in CLAIMS for m in pattern.finditer(text)]


def texts() -> list[tuple[str, str]]:
    found = []
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                found.append((f"{path.name} cell {i}", "".join(cell["source"])))
    for path in sorted((ROOT / "zero_lab").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    found.append((f"{path.relative_to(ROOT)} {getattr(node, 'name', '')}", doc))
    for path in sorted((ROOT / "zero_lab").rglob("*.md")):
        found.append((str(path.relative_to(ROOT)), path.read_text()))
    return found


@pytest.mark.parametrize("claim", [
    "So exposed communication is a **lower bound** on what\ncommunication costs a step",
    "so exposed time is a lower bound on what communication costs a step",
    "exposed time is only a lower bound.",
    "Exposed communication is the time the step waited. It is a lower bound on what it costs",
    "removing it can save more than the exposed time, which is a lower bound on what",
])
def test_the_old_claims_are_caught(claim):
    assert claims(claim)


@pytest.mark.parametrize("fine", [
    "the projection at ideal overlap is a lower bound; measured exposed time includes waiting "
    "for the slowest rank, so it can exceed what removing communication saves",
    "These are lower bounds: they count only the exposed first all-gather",
])
def test_the_corrected_claims_pass(fine):
    assert not claims(fine)


def test_no_text_calls_measured_exposed_time_a_lower_bound():
    found = sorted({f"{where}: {c!r}" for where, text in texts() for c in claims(text)})
    assert not found, ("measured exposed time is no lower bound (the projection is):\n"
                       + "\n".join(found))
