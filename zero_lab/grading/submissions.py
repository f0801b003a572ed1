"""A folder of submissions, read for grading: students, their notebooks, each exercise's code.

    SUBMISSIONS/<student>/<notebook>.ipynb          (nbgrader's submitted/<student>/, one level)

What is graded is what the notebook's kernel holds when the exercise's check cell runs: each
of the exercise's functions as last defined in a code cell above the check cell (the stub's
cell, or a new cell the student wrote below it), with the top-level imports, `def`s and
assignments to plain names of those cells that it reads, transitively (`import numpy as np`,
a helper, a constant). All of it is taken with the AST; nothing else of any cell is taken or
run (a check cell edited, `grading.check_*` rebound, a print, `torch.x = ...`: never read),
and the one sandbox runs what is taken. Which cells are the exercise's and its check's is
known from the course's own notebook by cell id (the student copy keeps them). The grader
recomputes the exercise cell's text outside the functions' bodies from the course's notebook
rather than trusting a stamp in the submission: a cell whose text there changed, comments
aside, is "tampered", shown as a diff (stub -> submitted), and graded as any other once the
instructor accepts it (`grade --accept student/notebook/exercise`, `read_accepts`).
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import io
import json
import threading
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Found:
    """An exercise's code in one submission: the `def`s, or why there are none."""

    status: str  # "found", "missing", "tampered"
    source: str = ""  # the functions' definitions and what they use, in notebook order
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


def without_comments(source: str) -> str:
    """`source` with every comment cut out (comment lines become blank): a comment above a
    `def` or after its signature is the learner's to write, as a body is."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    lines = source.splitlines()
    for tok in reversed(tokens):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col].rstrip()
    return "\n".join(lines) + "\n"


def outside_text(source: str, names: tuple[str, ...]) -> str | None:
    """The cell's text with the named functions' bodies cut out (each becomes `    ...`; the
    `def` lines, docstrings, decorators and everything else kept) and no comments; None when
    the cell does not parse or lacks one of the functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = _functions(tree, names)
    if set(found) != set(names):
        return None
    lines = without_comments(source).splitlines()
    cut: dict[int, str] = {}
    for node in found.values():
        first = node.body[0]
        start = first.lineno - 1  # back over blank lines to the signature's last line
        while start > node.lineno - 1 and not lines[start - 1].strip():
            start -= 1
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            start = first.end_lineno  # keep the docstring: the exercise's statement
        end = node.end_lineno  # on over comments still indented inside the function
        indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
        while end < len(lines) and (not lines[end].strip() or
                                    len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        cut.update({i: "" for i in range(start, end)})
        if start < end:
            cut[start] = " " * (indent + 4) + "..."
    kept = [cut.get(i, line).rstrip() for i, line in enumerate(lines)]
    return "\n".join(line for line in kept if line.strip()) + "\n"


def outside_bodies(source: str, names: tuple[str, ...]) -> str | None:
    """`outside_text` as a digest (what a student copy's exercise cell must keep)."""
    text = outside_text(source, names)
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def tamper_diff(stub: str, source: str, names: tuple[str, ...]) -> str:
    """A unified diff of the exercise cell's text outside the bodies: the stub's (the course
    cell's, the same outside its bodies), the student's (comments left out: they do not
    count)."""
    before = (outside_text(stub, names) or stub).splitlines(keepends=True)
    after = (outside_text(source, names) or without_comments(source)).splitlines(keepends=True)
    return "".join(difflib.unified_diff(before, after, "stub", "submitted", n=1)).rstrip()


# The batch grader grades exercises in threads, and CPython 3.11's ast module counts recursion
# once per interpreter: two threads converting ASTs at once can fail with "SystemError: AST
# constructor recursion depth mismatch" (it graded a correct reference `crash` in a CI run).
# Reading a submission takes milliseconds; one thread at a time costs nothing.
_AST_LOCK = threading.Lock()


def exercise_code(submission: dict, course: dict, names: tuple[str, ...], check: str = "",
                  accepted: bool = False) -> Found:
    """`_exercise_code`, one thread at a time (`_AST_LOCK`)."""
    with _AST_LOCK:
        return _exercise_code(submission, course, names, check, accepted)


def _exercise_code(submission: dict, course: dict, names: tuple[str, ...], check: str = "",
                   accepted: bool = False) -> Found:
    """The functions `names` of a submitted notebook, as its kernel holds them when the check
    cell runs: each one's last definition in a code cell above the check cell (the course
    notebook's cell id, else the first cell calling `check`), with the top-level imports,
    `def`s and assignments of earlier cells that they use, transitively (`carried`). The
    exercise cell (the course's cell id) edited outside the bodies is "tampered", with the
    diff, unless `accepted`; comments never count."""
    course_cells = code_cells(course)
    at = next((i for i, (_, src) in enumerate(course_cells)
               if outside_bodies(src, names) is not None), None)
    if at is None:
        raise ValueError(f"the course notebook has no cell defining {', '.join(names)}")
    cell_id, course_source = course_cells[at]
    check_id = next((cid for cid, src in course_cells[at + 1:] if check and f"{check}(" in src),
                    None)
    cells = code_cells(submission)
    trees = [_parse(src) for _, src in cells]
    defining = [i for i, tree in enumerate(trees) if tree and _functions(tree, names)]
    ends = [i for i, (cid, src) in enumerate(cells) if check_id and cid == check_id] or [
        i for i, (_, src) in enumerate(cells)
        if check and f"{check}(" in src and i > (defining or [-1])[0]]
    end = ends[0] if ends else len(cells)
    own = [i for i, (cid, _) in enumerate(cells) if cid is not None and cid == cell_id]
    own = own or defining[:1]  # no ids kept: the first cell defining them is the stub's
    if own and own[0] < end and not accepted:
        source = cells[own[0]][1]
        got = outside_bodies(source, names)
        if got is not None and got != outside_bodies(course_source, names):
            diff = tamper_diff(course_source, source, names)  # bodies cut: the stub's text
            return Found("tampered", detail="the exercise cell was edited outside the "
                         "function's body (only the body is yours to write):\n" + diff)
    found = carried(cells[:end], trees[:end], names)
    broken = [i for i in own if trees[i] is None]
    if found is None and broken:  # its functions then fail to be defined, with the error
        return Found("found", source=cells[broken[0]][1], detail="SyntaxError")
    if found is None:
        return Found("missing", detail=f"no cell above the check defines {', '.join(names)} "
                                       f"(cell {cell_id})")
    return Found("found", source=found)


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _bound(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds, if it is one that is carried: an import, a
    `def` or `class`, an assignment to plain names."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
    names: set[str] = set()
    for target in targets:
        for part in ast.walk(target):
            if isinstance(part, ast.Name):
                names.add(part.id)
            elif not isinstance(part, (ast.Tuple, ast.List, ast.Store, ast.Starred)):
                return set()  # x.y = ..., x[0] = ...: changes something, binds nothing
    return names


def _used(node: ast.AST) -> set[str]:
    """The free names a statement reads (a function's own arguments and locals left out)."""
    loads, local = set(), set()
    for part in ast.walk(node):
        if isinstance(part, ast.Name):
            (loads if isinstance(part.ctx, ast.Load) else local).add(part.id)
        elif isinstance(part, ast.arg):  # any function's or lambda's arguments
            local.add(part.arg)
    return loads - local


def carried(cells: list[tuple[str | None, str]], trees: list, names: tuple[str, ...]
            ) -> str | None:
    """The source to define `names` as these cells leave them: each name's last top-level
    binding, and those of the names they read, transitively, in notebook order; None when
    one of `names` has no `def`. Nothing else of any cell (a call, a print, an
    `x.y = ...`) is taken."""
    last: dict[str, tuple[int, int, ast.stmt]] = {}
    for c, tree in enumerate(trees):
        for s, node in enumerate(tree.body if tree else []):
            for name in _bound(node):
                last[name] = (c, s, node)
    if not all(isinstance(last.get(n, (0, 0, None))[2], ast.FunctionDef) for n in names):
        return None
    chosen: dict[tuple[int, int], ast.stmt] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in last or last[name][:2] in chosen:
            continue
        c, s, node = last[name]
        chosen[(c, s)] = node
        todo += sorted(_used(node))
    return "\n\n".join(ast.get_source_segment(cells[c][1], chosen[(c, s)])
                       for c, s in sorted(chosen)) + "\n"


def accept_key(student: str, exercise) -> str:
    """How `--accept` names one student's exercise: student/notebook/check."""
    return f"{student}/{exercise.notebook.removesuffix('.ipynb')}/{exercise.check}"


def read_accepts(keys: Iterable[str], files: Iterable[Path]) -> set[tuple[str, str, str]]:
    """(student, notebook, exercise) of each `--accept` key and each line of each
    `--accept-file` (blank lines and # comments skipped). The notebook may keep its .ipynb;
    the exercise is its check (check_owned_range) or its function (owned_range)."""
    lines = [*keys]
    for path in files:
        lines += [line.split("#")[0] for line in Path(path).read_text().splitlines()]
    out = set()
    for line in filter(None, (line.strip() for line in lines)):
        parts = line.split("/")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"--accept {line!r}: expected student/notebook/exercise, e.g. "
                             "ann/03_zero1/check_owned_range")
        out.add((parts[0], parts[1].removesuffix(".ipynb"), parts[2]))
    return out


def accepted_for(accepted: set, student: str, exercise) -> bool:
    """Whether `accepted` (read_accepts) names this student's exercise."""
    notebook = exercise.notebook.removesuffix(".ipynb")
    return any((student, notebook, name) in accepted
               for name in (exercise.check, *exercise.functions))


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
