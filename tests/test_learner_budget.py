"""The learner's budget, stated and kept (issue 35): every notebook's header says what the
learner can do after it and how long it takes to study; the README's course map adds those
times up; no notebook's prose outgrows what a learner reads in one sitting.

The study time is the learner's, not the CPU's: reading (about 200 words a minute of technical
prose, the header's reading part within 3 minutes of that), running the cells and reading
their outputs and figures, and the exercises with one failed attempt. The header states its
parts and their sum, so a reader sees how it was reached; the course adds up to 9 1/2 hours.

Issue 50: each of notebooks 01-09 asks at least two predict-then-observe questions
(zero_lab/course/questions.py), each before the cell that reveals its measured answer, and
the seed blog the course grew from, which the learner has not read, takes at most 5% of the
markdown (paragraphs that name it).
"""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MAX_WORDS = 2000  # of markdown, a notebook
MAX_CELL_WORDS = 250  # a markdown cell
WORDS_A_MINUTE = 200
# Issue 50 asks for about 9 hours; the words at 200 a minute give 9 h 31 min with the
# exercises' own estimates (up to 35 minutes a notebook, one failed attempt included).
MAX_TOTAL_MINUTES = 9 * 60 + 30
MIN_QUESTIONS = 2  # in each of notebooks 01-09
BLOG = re.compile(r"\bblog\b", re.IGNORECASE)
MAX_BLOG_SHARE = 0.05
STUDY = re.compile(r"\*\*Study time:\*\* about (\d+) minutes \(reading (\d+), running and "
                   r"reading outputs (\d+), exercises (\d+)\) · \*\*CPU run time:\*\* about "
                   r"\d+ s on 2 (?:idle )?cores\.")
TOTAL = re.compile(r"about (\d+) hours? (\d+) minutes of study in all")


def words(text: str) -> int:
    """Every word of the markdown, a link's address included (the stricter count)."""
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
    assert total <= MAX_TOTAL_MINUTES, f"{total} minutes of study: over the budget"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_reading_time_is_the_words_at_200_a_minute(path):
    header = " ".join(markdown(path)[0].split())
    reading = int(STUDY.search(header).group(2))
    expected = math.ceil(sum(words(c) for c in markdown(path)) / WORDS_A_MINUTE)
    assert abs(reading - expected) <= 3, f"{path.name}: reading {reading} min, words say {expected}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_prose_fits_the_learners_budget(path):
    cells = markdown(path)
    assert sum(words(c) for c in cells) <= MAX_WORDS
    long_cells = [(i, words(c)) for i, c in enumerate(cells) if words(c) > MAX_CELL_WORDS]
    assert long_cells == [], f"markdown cells over {MAX_CELL_WORDS} words: {long_cells}"


def questions(path: Path) -> list[str]:
    """The names `q = ask(...)` binds in a code cell that a later code cell `q.reveal(...)`s."""
    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
             if c["cell_type"] == "code"]
    asked = []
    for i, source in enumerate(cells):
        code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("%"))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and getattr(node.value.func, "id", "") == "ask":
                asked += [(i, t.id) for t in node.targets if isinstance(t, ast.Name)]
    return [name for i, name in asked
            if any(f"{name}.reveal(" in later for later in cells[i + 1:])]


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if "01" <= p.name[:2] <= "09"],
                         ids=lambda p: p.stem)
def test_the_learner_predicts_before_the_course_measures(path):
    found = questions(path)
    assert len(found) >= MIN_QUESTIONS, f"{path.name}: questions asked and revealed: {found}"


def test_a_question_revealed_in_its_own_cell_does_not_count(tmp_path):
    cell = {"cell_type": "code", "source": "q = ask('x', ['a', 'b'])\nq.reveal('a', 'w')"}
    path = tmp_path / "01_x.ipynb"
    path.write_text(json.dumps({"cells": [cell]}))
    assert questions(path) == []
    later = {"cell_type": "code", "source": "q.reveal('a', why='w')"}
    path.write_text(json.dumps({"cells": [cell, later]}))
    assert questions(path) == ["q"]


def test_the_unseen_blog_takes_little_of_the_prose():
    paragraphs = [p for path in NOTEBOOKS for cell in markdown(path) for p in cell.split("\n\n")]
    naming = sum(words(p) for p in paragraphs if BLOG.search(p))
    share = naming / sum(words(p) for p in paragraphs)
    assert share <= MAX_BLOG_SHARE, f"{share:.1%} of the markdown's words name the blog"

