"""What `make run` refuses before any kernel starts, each refusal in the learner's words.

Two checks, both before the first notebook runs, both exit status 2:

- `preflight`: what every notebook would refuse or die of: a parameter of the wrong type,
  more ranks than the cores or the memory hold, a device this machine lacks;
- `check_notebooks`: what each notebook's own check would refuse (its fewest ranks, the
  batches nproc must divide). Those rules are written in one place, each notebook's check
  cell, the cell after its parameters (course/parameters.py); the runner runs that cell itself,
  without a kernel, rather than restate them. Before this, NPROC=1 ran notebooks 00 and 01
  for a minute before notebook 02 refused it.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import warnings
from pathlib import Path


def preflight(parameters: dict) -> None:
    """Refuse, before any kernel starts, what every notebook would refuse or die of: a
    parameter of the wrong type, more ranks than the cores or the memory hold (each rank at
    least `capacity.RANK_BASE_BYTES`; the notebooks check their own larger needs), a device
    this machine lacks. Exit status 2, one line; too many ranks for the cores but allowed is
    said in one line too."""
    from zero_lab.course.parameters import check_parameters

    nproc, backend, device = (parameters.get(k, d) for k, d in
                              (("nproc", 2), ("backend", "auto"), ("device", "auto")))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            check_parameters(nproc, backend, device)
        except (TypeError, ValueError) as err:
            print(f"make run: refused before starting any notebook: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    for warning in said:
        print(f"make run: {warning.message}", file=sys.stderr)


def check_cell(notebook: Path) -> tuple[str, str] | None:
    """A notebook's parameters cell and the cell after it, where that one checks them with
    `check_parameters` (the course's convention, course/parameters.py): the one place the
    notebook's rules are written (its fewest ranks, what nproc must divide). None without."""
    cells = [c for c in json.loads(notebook.read_text(encoding="utf-8"))["cells"]
             if c["cell_type"] == "code"]
    for i, cell in enumerate(cells[:-1]):
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            source, check = ("".join(c["source"]) for c in (cell, cells[i + 1]))
            return (source, check) if "check_parameters(" in check else None
    return None


def notebook_refusals(notebooks: list[Path], parameters: dict) -> dict[str, str]:
    """What each notebook's own check says of `parameters`, without starting its kernel:
    {notebook name: "TooFewRanks: parameter nproc=1: ..."} for those that refuse (the
    error's class, as a failing cell shows it, then its message). Its parameters cell runs, then
    `parameters` over it (as papermill injects them), then its check cell."""
    refusals = {}
    for notebook in notebooks:
        cells = check_cell(notebook)
        if cells is None:
            continue
        names: dict = {}  # the cells' variables, as the kernel's would be
        try:
            # The notebook's own code, which its kernel would run first anyway; quiet: a
            # check cell prints its warnings, and the kernel will print them again.
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(compile(cells[0], f"{notebook.name}, parameters cell", "exec"), names)
                names.update(parameters)
                exec(compile(cells[1], f"{notebook.name}, check cell", "exec"), names)
        except (TypeError, ValueError) as refusal:  # what check_parameters raises
            refusals[notebook.name] = f"{type(refusal).__name__}: {refusal}"
    return refusals


def check_notebooks(notebooks: list[Path], parameters: dict) -> None:
    """Refuse, before the first notebook runs, parameters any of `notebooks` would refuse:
    each refusal by notebook, then the NPROC values every notebook accepts (exit status 2).
    (Without this, NPROC=1 ran two notebooks for a minute before notebook 02 refused it.)"""
    refusals = notebook_refusals(notebooks, parameters)
    if not refusals:
        return
    nproc = parameters.get("nproc", 2)
    tried = range(1, max(8, 2 * nproc) + 1)
    fits = [n for n in tried if not notebook_refusals(notebooks, {**parameters, "nproc": n})]
    if fits:
        use = (f"Use NPROC={_or(fits)} ({'each passes' if len(fits) > 1 else 'it passes'} "
               "every notebook's check).")
    else:
        use = (f"No NPROC from 1 to {tried[-1]} passes every notebook's check: run them a few "
               "at a time (ONLY=03).")
    # each refusal as the runner says a failing cell (`make gpu-check` reads them so too)
    lines = [f"make run: refused before starting any notebook: nproc={nproc} fails the "
             "checks of these notebooks:",
             *(f"FAILED: {name}, its check cell\n{why}" for name, why in refusals.items()), use]
    print("\n".join(lines), file=sys.stderr)
    raise SystemExit(2)


def _or(numbers: list[int]) -> str:
    """[2, 4, 8] -> "2, 4 or 8"."""
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
