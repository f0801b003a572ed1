"""Student copies: every notebook with its solutions replaced by stubs and outputs cleared.

One notebook cell holds a function the learner completes; the reference solution sits
between `### BEGIN SOLUTION` and `### END SOLUTION` (both on their own lines, inside the
function), nbgrader's markers. `python -m zero_lab.grading student --out build/student` (what
`make student` runs) copies every notebooks/*.ipynb with each fenced solution replaced by a
stub that raises NotImplementedError, at the indentation of the `### BEGIN SOLUTION` line,
and with all outputs cleared. Notebooks are read and written as plain JSON (nbformat v4), so
the generator needs nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from zero_lab.launch.paths import NOTEBOOKS, STUDENT

BEGIN_MARK = "### BEGIN SOLUTION"
END_MARK = "### END SOLUTION"
STUB_LINES = (
    "# YOUR CODE HERE",
    'raise NotImplementedError("exercise: replace this line with your solution")',
)


def stub_solutions(source: str, where: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION region of `source` with a NotImplementedError stub.

    The stub takes the indentation of the `### BEGIN SOLUTION` line, so a region inside a
    function body stays a valid function body. Unbalanced markers raise ValueError.
    """
    out: list[str] = []
    inside = False
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith(BEGIN_MARK):
            if inside:
                raise ValueError(f"{where}: nested {BEGIN_MARK!r}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(f"{indent}{stub}\n" for stub in STUB_LINES)
        elif stripped.startswith(END_MARK):
            if not inside:
                raise ValueError(f"{where}: {END_MARK!r} without {BEGIN_MARK!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN_MARK!r} without {END_MARK!r}")
    return "".join(out)


def student_notebook(nb: dict, where: str = "notebook") -> tuple[dict, int]:
    """Return (student copy of a notebook dict, number of solutions stubbed); outputs cleared."""
    nb = json.loads(json.dumps(nb))  # deep copy; notebooks are plain JSON
    n_stubbed = 0
    for index, cell in enumerate(nb.get("cells", [])):
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        if cell.get("cell_type") == "code":
            if BEGIN_MARK in text:
                n_stubbed += text.count(BEGIN_MARK)
                text = stub_solutions(text, f"{where} cell {index}")
            cell["outputs"] = []
            cell["execution_count"] = None
            for key in ("execution", "papermill"):  # run metadata papermill/jupyter add
                cell.get("metadata", {}).pop(key, None)
        cell["source"] = text.splitlines(keepends=True)
    nb.get("metadata", {}).pop("papermill", None)
    return nb, n_stubbed


def write_student_copies(notebooks_dir: Path, out_dir: Path) -> dict[str, int]:
    """Write a student copy of every notebook in `notebooks_dir` to `out_dir`.

    Returns {notebook file name: number of solutions stubbed}.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for path in sorted(notebooks_dir.glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        student, n = student_notebook(nb, path.name)
        text = json.dumps(student, indent=1, ensure_ascii=False) + "\n"
        (out_dir / path.name).write_text(text, encoding="utf-8")
        written[path.name] = n
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """`student [--notebooks DIR] [--out DIR]`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m zero_lab.grading student",
                                     description="write student copies of the notebooks")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS)
    parser.add_argument("--out", type=Path, default=STUDENT)
    args = parser.parse_args(argv)
    written = write_student_copies(args.notebooks, args.out)
    for name, n in written.items():
        print(f"{args.out / name}: {n} solution(s) replaced by stubs")
    if not written:
        print(f"no notebooks found in {args.notebooks}", file=sys.stderr)
        return 1
    return 0
