"""A folder of submissions, read for grading: students, their notebooks, each exercise's code.

    SUBMISSIONS/<student>/<notebook>.ipynb          (nbgrader's submitted/<student>/, one level)

An exercise's code is taken from its cell with the AST: the `def`s it names, nothing else of
the cell, and never any other cell (the check cells, an earlier cell that rebinds
`grading.check_*`, a cell that switches tracebacks off: none of them is read). Which cell is
the exercise's is known from the course's own notebook: the student copy keeps each cell's
id, and its text outside the functions' bodies is what `make student` wrote. The grader
recomputes that text from the course's notebooks rather than trusting a stamp in the
submission (which the submission could edit as easily as the cell): a cell whose text
outside the bodies changed is "tampered", one that is gone is "missing".
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Found:
    """An exercise's code in one submission: the `def`s, or why there are none."""

    status: str  # "found", "missing", "tampered"
    source: str = ""  # the functions' definitions, in the order the exercise names them
    detail: str = ""


def code_cells(nb: dict) -> list[tuple[str | None, str]]:
    """(cell id, source) of every code cell."""
    out = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            source = cell.get("source", "")
            out.append((cell.get("id"), "".join(source) if isinstance(source, list) else source))
    return out


def _functions(tree: ast.Module, names: tuple[str, ...]) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name in names}


def outside_bodies(source: str, names: tuple[str, ...]) -> str | None:
    """The cell's text with the named functions' bodies cut out (their `def` lines, decorators
    and everything else kept), as a digest; None when the cell does not parse or lacks one."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = _functions(tree, names)
    if set(found) != set(names):
        return None
    lines = source.splitlines()
    cut = set()
    for node in found.values():
        first = node.body[0]
        start = first.lineno - 1  # back over comments to the signature's last line
        while start > node.lineno - 1 and _comment_or_blank(lines[start - 1]):
            start -= 1
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            start = first.end_lineno  # keep the docstring: the exercise's statement
        end = node.end_lineno  # on over comments still indented inside the function
        indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
        while end < len(lines) and (not lines[end].strip() or
                                    len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        cut.update(range(start, end))
    kept = [line.rstrip() for i, line in enumerate(lines) if i not in cut]
    text = "\n".join(line for line in kept if line.strip())
    return hashlib.sha256(text.encode()).hexdigest()


def _comment_or_blank(line: str) -> bool:
    return not line.strip() or line.lstrip().startswith("#")


def definitions(source: str, names: tuple[str, ...]) -> str:
    """The named functions' source (each `def` to its end; decorators left out)."""
    tree = ast.parse(source)
    found = _functions(tree, names)
    return "\n\n".join(ast.get_source_segment(source, found[name]) for name in names) + "\n"


def exercise_code(submission: dict, course: dict, names: tuple[str, ...]) -> Found:
    """Find the functions `names` in a submitted notebook, by the course notebook's cell."""
    course_cell = next(((cid, src) for cid, src in code_cells(course)
                        if outside_bodies(src, names) is not None), None)
    if course_cell is None:
        raise ValueError(f"the course notebook has no cell defining {', '.join(names)}")
    cell_id, course_source = course_cell
    want = outside_bodies(course_source, names)
    cells = code_cells(submission)
    by_id = [src for cid, src in cells if cid is not None and cid == cell_id]
    candidates = by_id or [src for _, src in cells if _defines(src, names)]
    if not candidates:
        return Found("missing", detail=f"no cell defines {', '.join(names)} (cell {cell_id})")
    source = candidates[-1]
    try:
        ast.parse(source)
    except SyntaxError as exc:
        return Found("found", source=source, detail=f"SyntaxError: {exc.msg} (line {exc.lineno})")
    got = outside_bodies(source, names)
    if got is None:
        return Found("missing", detail=f"the exercise cell no longer defines {', '.join(names)}")
    if got != want:
        return Found("tampered", source=definitions(source, names),
                     detail="the exercise cell was edited outside the function's body "
                            "(only the body is yours to write)")
    return Found("found", source=definitions(source, names))


def _defines(source: str, names: tuple[str, ...]) -> bool:
    try:
        return set(_functions(ast.parse(source), names)) == set(names)
    except SyntaxError:
        return False


def students(folder: Path) -> dict[str, dict[str, dict]]:
    """{student: {notebook file name: notebook}} from SUBMISSIONS/<student>/*.ipynb; a file that
    is not a notebook is recorded as None (its exercises are graded "missing")."""
    if not folder.is_dir():
        raise FileNotFoundError(f"SUBMISSIONS: {folder} is not a folder")
    out: dict[str, dict[str, dict]] = {}
    for student in sorted(p for p in folder.iterdir() if p.is_dir()):
        books = {}
        for path in sorted(student.glob("*.ipynb")):
            try:
                books[path.name] = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                books[path.name] = None
        out[student.name] = books
    if not out:
        raise FileNotFoundError(f"SUBMISSIONS: {folder} has no student folders "
                                "(expected SUBMISSIONS/<student>/<notebook>.ipynb)")
    return out
