"""The learner's budget, stated and kept (issue 35): every notebook's header says what the
learner can do after it and how long it takes to study; the README's course map adds those
times up; no notebook's prose outgrows what a learner reads in one sitting.

The study time is the learner's, not the CPU's: reading (about 150 words a minute of technical
prose), running the cells and reading their outputs and figures, and the exercises. The
header states its parts and their sum, so a reader sees how it was reached.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MAX_WORDS = 2500  # of markdown, a notebook
MAX_CELL_WORDS = 300  # a markdown cell
STUDY = re.compile(r"\*\*Study time:\*\* about (\d+) minutes \(reading (\d+), running and "
                   r"reading outputs (\d+), exercises (\d+)\) · \*\*CPU run time:\*\* about "
                   r"\d+ s on 2 (?:idle )?cores\.")
TOTAL = re.compile(r"about (\d+) hours? (\d+) minutes of study in all")


def words(text: str) -> int:
    return len(re.findall(r"\w+", text))  # the stricter count: "Ψ/N" is two words


def markdown(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def study_minutes(path: Path) -> int:
    header = " ".join(markdown(path)[0].split())  # one line: the header is wrapped anywhere
    found = STUDY.search(header)
    assert found, f"{path.name}: no '**Study time:** about N minutes (reading R, ...)' line"
    total, *parts = (int(x) for x in found.groups())
    assert total == sum(parts), f"{path.name}: {total} minutes is not the sum of {parts}"
    return total


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_header_says_what_the_learner_can_do_and_for_how_long(path):
    header = markdown(path)[0]
    assert header.startswith(f"# {path.name[:2]} · ")
    assert "**After this notebook you can**" in header
    assert 10 <= study_minutes(path) <= 180


def test_the_course_map_states_the_total_study_time():
    total = sum(study_minutes(p) for p in NOTEBOOKS)
    found = TOTAL.search(" ".join((ROOT / "README.md").read_text().split()))
    assert found, "README: no 'about H hours M minutes of study in all' in the course map"
    assert int(found.group(1)) * 60 + int(found.group(2)) == total


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_prose_fits_the_learners_budget(path):
    cells = markdown(path)
    assert sum(words(c) for c in cells) <= MAX_WORDS
    long_cells = [(i, words(c)) for i, c in enumerate(cells) if words(c) > MAX_CELL_WORDS]
    assert long_cells == [], f"markdown cells over {MAX_CELL_WORDS} words: {long_cells}"
