"""The real stages' opening docstrings (zero_lab/stages/ddp.py, zero1-3.py): each says which
plain stage (zero_lab/plain/) it extends, every module its table names exists, and nothing
that goes stale (bench medians, timings) is kept there."""

from __future__ import annotations

import ast
import re

import pytest

from zero_lab.launch.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "zero_lab"
REAL = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
MAX_LINES = 60  # zero3.py's opened with 118 lines before the plain stages existed
STALE = re.compile(r"median|\bms\b|make bench|\d\.\d{3}")


def opening(stage: int) -> str:
    source = (PACKAGE / "stages" / f"{REAL[stage]}.py").read_text()
    return ast.get_docstring(ast.parse(source), clean=False)


@pytest.mark.parametrize("stage", sorted(REAL))
def test_a_real_stage_opens_with_the_plain_stage_it_extends(stage):
    doc = opening(stage)
    plain = f"zero_lab/plain/stage{stage}.py"
    assert f"The plain stage (`{plain}`" in doc and (REPO_ROOT / plain).is_file()
    named = set(re.findall(r"\b(\w+\.py)\b", doc.split(plain, 1)[1]))
    files = {p.name for p in PACKAGE.rglob("*.py")}
    assert named and not named - files, f"modules named but not in zero_lab/: {named - files}"
    assert len(doc.splitlines()) <= MAX_LINES
    assert not STALE.findall(doc), "bench figures go stale: keep them in the README"
