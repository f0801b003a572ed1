"""The instructor's seed never reaches the ranks of an exercise (issue 49): they draw their
cases from a seed hashed from it and the exercise (batch.case_seed), so a learner's function
that searches every process's command line and environment, and the files of its sandbox,
for the seed finds nothing. Before, `--seed 424242` was on every rank's command line.

Notebook 03's owned slice, the reference behind the search; its other exercise is the stub,
so one launch runs.
"""

from __future__ import annotations

import pytest
from test_grade_batch import NB03, course, submit, with_body

from zero_lab.grading import batch
from zero_lab.grading.student import student_notebook

SEED = 424242
SEARCH = """import glob, os
needles = (('424' + '242').encode(), (424000 + 242).to_bytes(4, 'little'))
places = glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ')
for top in glob.glob('/tmp/zero_lab*') + [os.getcwd()]:
    for folder, _, files in os.walk(top):
        places += [os.path.join(folder, f) for f in files]
for place in places:
    try:
        with open(place, 'rb') as f:
            data = f.read(1 << 20)
    except OSError:
        continue
    if any(n in data for n in needles):
        raise RuntimeError('seed seen in ' + place)
shard = -(-numel // world_size)
return rank * shard, (rank + 1) * shard"""


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    ok, why = __import__("zero_lab.grading.jail", fromlist=["available"]).available()
    if not ok:
        pytest.fail(f"no sandbox on this machine ({why}): install bubblewrap")
    folder = tmp_path_factory.mktemp("submitted")
    stub = student_notebook(course(NB03))[0]
    submit(folder, "searches", {NB03: with_body(stub, "owned_range", SEARCH)})
    done = batch.grade(folder, folder.parent / "reports", seed=SEED, jobs=1, only="03",
                       progress=lambda line: None)
    return {g.exercise.check: g for g in done}


def test_the_ranks_never_see_the_seed(graded):
    g = graded["check_owned_range"]
    assert not any("seed seen" in line for line in g.lines), g.lines
    assert g.status == "pass" and g.points == g.max_points > 1, g.lines
    assert graded["check_sharded_step"].lines == ["not implemented yet"]


def test_the_hashed_seed_is_the_exercises_own():
    one = batch.case_seed(SEED, "check_owned_range")
    assert one != batch.case_seed(SEED, "check_sharded_step") != SEED
    assert one == batch.case_seed(SEED, "check_owned_range")
    assert str(SEED) not in str(one)
