"""Where things live in the repository: one place for every path the course writes or reads.

Both sides of a launch may import it (it imports nothing but pathlib and os; its package,
zero_lab.launch, only the standard library).
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # zero_lab/ (this file: zero_lab/launch/paths.py)
REPO_ROOT = PACKAGE.parent
WORKERS = PACKAGE / "workers"  # the rank-side scripts torchrun starts
NOTEBOOKS = REPO_ROOT / "notebooks"
FIGURES = REPO_ROOT / "figures"  # committed; `make figures` copies RUN_FIGURES here
RUNS = REPO_ROOT / "runs"  # everything a run writes (git-ignored)
RUN_FIGURES = RUNS / "figures"
EXECUTED = RUNS / "executed"  # notebooks executed by `make run`
STUDENT = REPO_ROOT / "build" / "student"  # `make student`


def figures_dir() -> Path:
    """Where notebooks write figures: $ZERO_LAB_FIGURES_DIR, else runs/figures (created).
    A relative one is taken from the folder this process started in (see `new_run_dir`)."""
    path = Path(os.environ.get("ZERO_LAB_FIGURES_DIR", RUN_FIGURES)).absolute()
    path.mkdir(parents=True, exist_ok=True)
    return path


def shown(path: Path) -> str:
    """`path` as a learner reads it in printed output: under the course (runs/at_work/...) when
    it is there, whole when not. An absolute path grows with the checkout's depth and would break
    the 110-character lines the notebooks keep."""
    try:
        return str(Path(path).relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def new_run_dir(kind: str, root: Path | None = None) -> Path:
    """A new folder of this run's own under runs/<kind>/ (created; never one another run has).

    Two kernels, `make test` beside `make lab`, or two learners in one course folder each get
    their own: named by the time, this process's pid and a random suffix, and made with
    `mkdir(exist_ok=False)`, so a name already taken is never shared. `root` defaults to
    $ZERO_LAB_RUNS_DIR, else runs/. A relative root is taken from the folder this process
    started in, and the path returned is absolute: what this process passes down to a kernel
    that runs elsewhere (papermill runs notebooks in notebooks/) still names the same folder.
    """
    import secrets
    import time

    if not kind or "/" in kind or kind.startswith("."):
        raise ValueError(f"kind must be a plain folder name, got {kind!r}")
    base = Path(root or os.environ.get("ZERO_LAB_RUNS_DIR", RUNS)).absolute() / kind
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    while True:
        path = base / f"{stamp}-{os.getpid()}-{secrets.token_hex(2)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
