"""Where things live in the repository: one place for every path the course writes or reads.

Both sides of a launch may import it (it imports nothing but pathlib and os).
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent  # zero_lab/
REPO_ROOT = PACKAGE.parent
WORKERS = PACKAGE / "workers"  # the rank-side scripts torchrun starts
NOTEBOOKS = REPO_ROOT / "notebooks"
FIGURES = REPO_ROOT / "figures"  # committed; `make figures` copies RUN_FIGURES here
RUNS = REPO_ROOT / "runs"  # everything a run writes (git-ignored)
RUN_FIGURES = RUNS / "figures"
EXECUTED = RUNS / "executed"  # notebooks executed by `make run`
BENCH = RUNS / "bench"
STUDENT = REPO_ROOT / "build" / "student"  # `make student`


def figures_dir() -> Path:
    """Where notebooks write figures: $ZERO_LAB_FIGURES_DIR, else runs/figures (created)."""
    path = Path(os.environ.get("ZERO_LAB_FIGURES_DIR", RUN_FIGURES))
    path.mkdir(parents=True, exist_ok=True)
    return path
