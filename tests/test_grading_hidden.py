"""grading/hidden.py, the batch grader's seeded cases: for every kernel exercise and 20 seeds,
the notebook's own solution (run after the entry's preamble alone) passes every case, a stub
and every known mistake fail one, the seed decides the inputs, and the inputs pickle; with no
seed, the cases are the ones the notebook's check runs. No launches: plain calls."""

from __future__ import annotations

import ast
import json
import pickle
import random

import pytest

from zero_lab import grading
from zero_lab.grading import nb01_memory as nb01
from zero_lab.grading import nb07_scaling as nb07
from zero_lab.grading import nb08_knobs as nb08
from zero_lab.grading.framework import Case, diagnose
from zero_lab.grading.hidden import HIDDEN, Hidden
from zero_lab.launch.paths import NOTEBOOKS

SEEDS = range(20)
KERNEL_EXERCISES = [
    "check_bytes_per_param", "check_per_rank_bytes", "check_largest_model",
    "check_ring_bytes_sent", "check_exposed_communication", "check_most_exposed_unit",
    "check_stage_choice", "check_accumulation_bytes", "check_hsdp_bytes",
    "check_global_grad_norm", "check_fully_shard_plan",
]
ENTRIES = [HIDDEN[name] for name in KERNEL_EXERCISES]
IDS = [h.check for h in ENTRIES]


def drawn(h: Hidden, seed) -> list[Case]:
    """The cases the batch grader draws for `seed` (batch.grade_one's rng)."""
    return h.cases(random.Random(f"{seed}:{h.check}"))


def inputs(cases: list[Case]) -> list:
    return [(c.args, c.kwargs) for c in cases]


def passes(h: Hidden, fn, case: Case) -> bool:
    """What the grader gives `fn` on `case`: a point only for a value the check accepts."""
    try:
        got = fn(*case.args, **case.kwargs)
    except Exception:  # NotImplementedError included
        return False
    return diagnose(case, got, h.compare, h.wrong_answers) is None


def notebook_solution(h: Hidden):
    """The notebook's reference function: its `def` from the exercise cell, the solution
    markers cut, run in a fresh namespace after the entry's preamble and nothing else."""
    nb = json.loads((NOTEBOOKS / h.notebook).read_text(encoding="utf-8"))
    name = h.functions[0]
    for cell in nb["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] != "code" or f"def {name}(" not in source:
            continue
        source = "\n".join(line for line in source.splitlines()
                           if line.strip() not in (grading.BEGIN_MARK, grading.END_MARK))
        tree = ast.parse(source)
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        namespace: dict = {"__name__": "__exercise__"}
        exec(compile(h.preamble, "<preamble>", "exec"), namespace)
        exec(compile(ast.get_source_segment(source, node), h.notebook, "exec"), namespace)
        return namespace[name]
    raise AssertionError(f"{h.notebook} has no cell defining {name}")


def test_the_table_holds_every_kernel_exercise_and_no_exercise_on_ranks():
    assert list(HIDDEN) == KERNEL_EXERCISES
    assert "check_owned_range" not in HIDDEN  # notebook 03's slice runs on 3 ranks
    for h in ENTRIES:
        assert callable(getattr(grading, h.check)), h.check
        assert (NOTEBOOKS / h.notebook).is_file(), h.notebook
        assert h.timeout_s > 0 and h.functions and h.wrong_answers, h.check


@pytest.mark.parametrize("h", ENTRIES, ids=IDS)
def test_the_notebooks_solution_after_the_preamble_alone_passes_every_drawn_case(h):
    solution = notebook_solution(h)
    for seed in SEEDS:
        cases = drawn(h, seed)
        failed = [c.describe() for c in cases if not passes(h, solution, c)]
        assert failed == [], (h.check, seed, failed)
        assert all(h.compare(c.expected, c.expected) for c in cases), (h.check, seed)


@pytest.mark.parametrize("h", ENTRIES, ids=IDS)
def test_a_stub_and_every_known_mistake_fail_a_drawn_case_whatever_the_seed(h):
    def stub(*args, **kwargs):
        raise NotImplementedError

    for seed in SEEDS:
        cases = drawn(h, seed)
        assert len(cases) >= len(h.cases(None)), (h.check, seed)
        assert not any(passes(h, stub, c) for c in cases), (h.check, seed)
        for mistake, explanation in h.wrong_answers:
            told_apart = []
            for c in cases:
                try:
                    value = mistake(*c.args, **c.kwargs)
                except Exception:  # a mistake model that does not apply to this case
                    continue
                if not h.compare(c.expected, value):
                    told_apart.append(c)
                    # the grader names the mistake when a learner gives its value
                    assert explanation in diagnose(c, value, h.compare, h.wrong_answers)
            assert told_apart, (h.check, seed, mistake.__name__)


@pytest.mark.parametrize("h", ENTRIES, ids=IDS)
def test_the_seed_decides_the_inputs_and_they_pickle(h):
    state = random.getstate()
    for seed in SEEDS:
        cases = drawn(h, seed)
        assert inputs(drawn(h, seed)) == inputs(cases), (h.check, seed)
        assert inputs(drawn(h, seed + 1000)) != inputs(cases), (h.check, seed)
        assert inputs(cases) != inputs(h.cases(None)), (h.check, seed)
        for c in cases:  # the grader sends (args, kwargs) to the child pickled
            assert pickle.loads(pickle.dumps((c.args, c.kwargs))) == (c.args, c.kwargs)
    assert random.getstate() == state, "drawing cases must not touch the global random"


@pytest.mark.parametrize("h", ENTRIES, ids=IDS)
def test_without_a_seed_the_cases_are_the_ones_the_notebooks_check_runs(h, monkeypatch):
    module = __import__(getattr(grading, h.check).__module__, fromlist=["run_cases"])
    ran = {}

    def record(name, fn, cases, compare=None, wrong_answers=(), *, shows):
        ran.update(name=name, cases=list(cases), wrong=tuple(wrong_answers),
                   compare=compare or grading.same)

    monkeypatch.setattr(module, "run_cases", record)
    getattr(grading, h.check)(lambda *args, **kwargs: None)
    assert ran["name"] == h.check
    assert inputs(ran["cases"]) == inputs(h.cases(None))
    assert [c.expected for c in ran["cases"]] == [c.expected for c in h.cases(None)]
    assert ran["wrong"] == h.wrong_answers and ran["compare"] is h.compare


def test_without_a_seed_the_cases_are_the_notebooks_tables():
    assert [c.args for c in nb01.bytes_per_param_cases(None)] == list(nb01.RECIPES.values())
    assert [c.kwargs for c in nb07.stage_choice_cases(None)] == nb07.CASES
    assert [c.args for c in nb08.accumulation_bytes_cases(None)] == nb08.ACCUMULATION_CASES
    assert [c.args for c in nb08.hsdp_bytes_cases(None)] == nb08.HSDP_CASES


def test_the_drawn_cases_vary_what_the_exercise_is_about():
    """Across seeds the draws cover the exercise's space, not one corner of it."""
    def seen(check, pick):
        return {pick(c) for seed in SEEDS for c in drawn(HIDDEN[check], seed)}

    assert seen("check_bytes_per_param", lambda c: c.args[3]) == {"fp32", "bf16", "fp16", "int8"}
    assert seen("check_per_rank_bytes", lambda c: c.args[1]) == {0, 1, 2, 3}
    assert len(seen("check_per_rank_bytes", lambda c: c.args[2])) >= 8  # world sizes
    assert seen("check_ring_bytes_sent", lambda c: c.args[0]) == {
        "all_reduce", "reduce_scatter", "all_gather", "broadcast"}
    assert seen("check_accumulation_bytes", lambda c: (c.args[0], c.args[3])) >= {
        (2, "sharded"), (2, "unsharded"), (3, "sharded"), (3, "unsharded")}
    assert len(seen("check_stage_choice", lambda c: c.kwargs["gpu_bytes"])) >= 5
    turning = seen("check_stage_choice", lambda c: tuple(c.expected.values()))
    assert (None, None, None, None) in turning and (1, 1, 1, 1) in turning
    assert len(seen("check_most_exposed_unit", lambda c: c.expected)) >= 5
    assert len(seen("check_hsdp_bytes", lambda c: (c.args[1], c.args[2]))) >= 8  # meshes
