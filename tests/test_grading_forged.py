"""Issue 49, "forge its own report": what the ranks of a graded exercise report comes from the
processes the learner's code runs in, so the grader also counts, outside them, the bytes they
really sent on their sandbox's loopback (zero_lab/grading/wire.py) and grades no report the
count cannot back.

Notebook 03's sharded step (its judge checks the collectives and their bytes), with the
owned slice left a stub (no ranks start for it):

- `no_collective`: every rank computes the expected values itself (the cases are public code),
  writes its own report, claiming one reduce-scatter and one all-gather of the padded buffer a
  step, and exits without any collective. Before: 3/3 ("every rank writing its report file and
  exiting with no collective at all scores 12/12" on the whole notebook).
- `relabelled`: every rank all-reduces the whole gradient (3Ψ a step with the all-gather) and
  rewrites its ledger so the all-reduce reads as a reduce-scatter. Before: 3/3. torch 2.13's
  gloo reduce-scatter is itself an all-reduce on the wire, so the reference sent as much
  (873,336 bytes against 874,116): the rank runner now sends the learner's reduce-scatters as
  real ones (course/exercises.py), and the reference sends 576,132, under the ceiling of
  698,233 its claims allow, the relabelled step 874,636, over it (wire.py: seed 121 too).

Seed 49, on `lo`: the report with no collective ~1,300 bytes, for a floor of 498,528 its
claims need. The reference keeps its full marks under the count in test_grade_batch_ranks.py,
test_grading_sandbox_ranks.py and test_grading_seeds.py (sandboxed, so counted); not graded
again here, to keep this to two launches side by side.
"""

from __future__ import annotations

import pytest
from test_grade_batch import NB03, course, submit, with_body

from zero_lab.grading import batch, jail, wire
from zero_lab.grading.student import student_notebook

NO_COLLECTIVE = """import os, sys
from zero_lab.course.rank_cases.zero1_zero2 import one_process_steps, sharded_step_cases
from zero_lab.launch import report
n, r = dist.get_world_size(), dist.get_rank()
seed = int(sys.argv[sys.argv.index('--seed') + 1])
results = []
for k, case in enumerate(sharded_step_cases(seed), start=1):
    shard = -(-case.numel // n)
    steps = []
    for s, ref in enumerate(one_process_steps(case, n), start=1):
        flat = torch.zeros(shard * n, dtype=torch.float64)
        flat[:case.numel] = ref
        said = [{'op': op, 'nbytes': shard * n * 8, 'in_backward': False}
                for op in ('reduce_scatter', 'all_gather')]
        steps.append({'step': s, 'flat_param': flat.tolist(), 'comm': said,
                      'state_numels': [shard]})
    results.append({'case': k, 'label': case.label(n), 'steps': steps})
report({'sharded_step:sharded_step': {'world_size': n, 'results': results}})
os._exit(0)"""

RELABELLED = """import dataclasses
from zero_lab.collectives import ledger
n, r = dist.get_world_size(), dist.get_rank()
grad = flat_grad.clone()
dist.all_reduce(grad)
s = shard_param.numel()
shard_param.grad = grad[r * s:(r + 1) * s] / n
optimizer.step()
dist.all_gather_single(flat_param, shard_param.detach())
for book in ledger._ACTIVE_LEDGERS:
    book.records[:] = [dataclasses.replace(c, op='reduce_scatter') if c.op == 'all_reduce'
                       else c for c in book.records]"""


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    ok, why = jail.available()
    if not ok or not wire.works():
        pytest.fail(f"this machine cannot count a sandbox's loopback ({why}): install "
                    "bubblewrap")
    folder = tmp_path_factory.mktemp("submitted")
    stub = student_notebook(course(NB03))[0]
    submit(folder, "no_collective", {NB03: with_body(stub, "sharded_step", NO_COLLECTIVE)})
    submit(folder, "relabelled", {NB03: with_body(stub, "sharded_step", RELABELLED)})
    done = batch.grade(folder, folder.parent / "reports", seed=49, jobs=2, only="03",
                       progress=lambda line: None)
    return {g.student: g for g in done if g.exercise.check == "check_sharded_step"}


def test_a_report_written_without_any_collective_scores_zero(graded):
    g = graded["no_collective"]
    assert g.points == 0 and g.status == "fail", g.lines
    assert any("bytes on the wire disagree with their reports" in line for line in g.lines), \
        g.lines


def test_an_all_reduce_recorded_as_a_reduce_scatter_scores_zero(graded):
    g = graded["relabelled"]
    assert g.points == 0 and g.status == "fail", g.lines
    assert any("more than the" in line and "an all-reduce as a reduce-scatter" in line
               for line in g.lines), g.lines


def test_the_floor_counts_what_the_reports_claim():
    said = [{"op": "reduce_scatter", "nbytes": 96, "in_backward": False},
            {"op": "all_gather", "nbytes": 96, "in_backward": False}]
    reports = [{"world_size": 3, "results": [{"case": 1, "steps": [{"comm": said}] * 2}]}] * 3
    # 3 ranks x 2 steps x 2 collectives, each rank sending at least 2/3 of 96 bytes.
    assert wire.floor("check_sharded_step", reports) == 3 * 2 * 2 * 64
    assert wire.disagreement("check_sharded_step", reports, 768) is None
    assert "disagree with their reports" in wire.disagreement("check_sharded_step", reports, 767)
    # A claim of negative bytes lowers nothing.
    lying = [{"op": "all_gather", "nbytes": -10**9, "in_backward": False}]
    worse = [{"world_size": 3, "results": [{"case": 1, "steps": [{"comm": said + lying}] * 2}]}]
    assert wire.floor("check_sharded_step", worse * 3) == 768
    # The ceiling: UP x the floor and SLACK bytes of headers; a byte more is refused.
    most = wire.ceiling("check_sharded_step", reports)
    assert most == int(wire.UP * 768) + wire.SLACK
    assert wire.disagreement("check_sharded_step", reports, most) is None
    assert "more than the" in wire.disagreement("check_sharded_step", reports, most + 1)
