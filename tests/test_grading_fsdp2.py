"""Notebook 09's graded exercises (grading/nb09_fsdp2.py): the references pass, the stubs fail,
each typical wrong answer is rejected with its own explanation, an answer of the wrong type
is named, and the batch grader's seeded cases (grading/hidden.py) hold for 20 seeds. The
gradient norm's reference is checked against torch's own norm of a vector cut into shards.

Notebook 09 does not exist yet, so the learner's solution is written here as its cell will
hold it, and run after the hidden entry's preamble alone (as the batch grader runs it)."""

from __future__ import annotations

import math
import pickle
import random

import pytest
import torch
from torch import nn

from zero_lab import grading
from zero_lab.course.workloads import Block
from zero_lab.grading import ExerciseFailed
from zero_lab.grading import nb09_fsdp2 as nb09
from zero_lab.grading.framework import SHOWED, diagnose
from zero_lab.grading.hidden import HIDDEN

SEEDS = range(20)
CHECKS = ["check_global_grad_norm", "check_fully_shard_plan"]
# The two functions as the notebook's cells give them, annotations included (they need the
# preamble's `nn` when the `def` runs).
SOLUTIONS = {
    "check_global_grad_norm": '''
def global_grad_norm(shard_norms: list[float], norm_type: float) -> float:
    if math.isinf(norm_type):
        return float(max(shard_norms))
    return sum(n ** norm_type for n in shard_norms) ** (1 / norm_type)
''',
    "check_fully_shard_plan": '''
def fully_shard_plan(model: nn.Module, block_type: type) -> list[str]:
    blocks = [name for name, m in model.named_modules() if isinstance(m, block_type)]
    return blocks + [""]
''',
}
PREAMBLE = ("import math  # notebook 09, imports cell 0f9a7c31\n"
            "from torch import nn  # notebook 09, imports cell 0f9a7c31\n")
SHOWS = {
    "check_global_grad_norm": "you can turn per-rank shard norms into the model's gradient norm",
    "check_fully_shard_plan": "you can wrap a model for FSDP2 bottom-up",
}


def solution(check: str):
    """The learner's function defined after the entry's preamble and nothing else."""
    h = HIDDEN[check]
    namespace: dict = {"__name__": "__exercise__"}
    exec(compile(h.preamble, "<preamble>", "exec"), namespace)
    exec(compile(SOLUTIONS[check], "<exercise>", "exec"), namespace)
    return namespace[h.functions[0]]


def drawn(check: str, seed) -> list:
    return HIDDEN[check].cases(random.Random(f"{seed}:{check}"))


def inputs(cases) -> list:
    return [(c.args, c.kwargs) for c in cases]


def stub(*args, **kwargs):
    raise NotImplementedError("exercise: complete this function")


# ------------------------------------------------------------ the checks in the notebook


@pytest.mark.parametrize("check", CHECKS)
def test_the_reference_and_the_notebooks_solution_pass(check, capsys):
    reference = {"check_global_grad_norm": nb09.global_grad_norm,
                 "check_fully_shard_plan": nb09.fully_shard_plan}[check]
    for fn in (reference, solution(check)):
        getattr(grading, check)(fn)
        out = capsys.readouterr().out
        assert out.startswith(f"✓ {check}: ") and f"\n{SHOWED}{SHOWS[check]}" in out, out
        assert all(len(line) <= 110 for line in out.splitlines()), out


@pytest.mark.parametrize("check", CHECKS)
def test_the_stub_is_not_implemented_yet(check):
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        getattr(grading, check)(stub)


def _learner_rank0(shard_norms, norm_type):
    return shard_norms[0]


def _learner_sum(shard_norms, norm_type):
    return sum(shard_norms)


def _learner_mean(shard_norms, norm_type):
    return sum(shard_norms) / len(shard_norms)


def _learner_rms(shard_norms, norm_type):
    return math.sqrt(sum(n ** 2 for n in shard_norms) / len(shard_norms))


def _learner_two_norm(shard_norms, norm_type):
    return math.sqrt(sum(n ** 2 for n in shard_norms))


def _learner_root_first(model, block_type):
    return [""] + [n for n, m in model.named_modules() if type(m) is block_type]


def _learner_no_root(model, block_type):
    return [n for n, m in model.named_modules() if isinstance(m, block_type)]


def _learner_linears(model, block_type):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)] + [""]


def _learner_children(model, block_type):
    plan = []
    for name, m in model.named_modules():
        if isinstance(m, block_type):
            plan += [f"{name}.{child}" for child, _ in m.named_children()]
    return plan + [""]


def _learner_top_level(model, block_type):
    return [name for name, _ in model.named_children()]


WRONG = [  # (check, a learner's wrong function, a phrase of the explanation it must get)
    ("check_global_grad_norm", _learner_rank0, "that is rank 0's shard norm only"),
    ("check_global_grad_norm", _learner_sum, "the norms were added"),
    ("check_global_grad_norm", _learner_mean, "a mean of the shard norms"),
    ("check_global_grad_norm", _learner_rms, "averaged across ranks instead of summed"),
    ("check_global_grad_norm", _learner_two_norm, "that is the 2-norm whatever norm_type says"),
    ("check_fully_shard_plan", _learner_root_first, "ZeRO-3's memory saving is gone"),
    ("check_fully_shard_plan", _learner_no_root, "the root is missing: call fully_shard(model)"),
    ("check_fully_shard_plan", _learner_linears, "one group per nn.Linear"),
    ("check_fully_shard_plan", _learner_children, "one level too deep"),
    ("check_fully_shard_plan", _learner_top_level, "model.named_children() stops at the top"),
]


@pytest.mark.parametrize("check, mistake, phrase", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_each_mistake_fails_with_its_own_explanation(check, mistake, phrase):
    with pytest.raises(ExerciseFailed, match="hint: ") as info:
        getattr(grading, check)(mistake)
    text = str(info.value)
    assert phrase in text, text
    others = [p for c, _, p in WRONG if c == check and p != phrase]
    assert not any(p in text for p in others), text  # its own explanation, not another's


@pytest.mark.parametrize("answer, phrase", [
    (lambda norms, p: 5, "your function returned a value of type int, 5, not a float"),
    (lambda norms, p: torch.linalg.vector_norm(torch.tensor(norms), p),
     "your function returned a value of type Tensor"),
    (lambda norms, p: str(nb09.global_grad_norm(norms, p)),
     "your function returned a value of type str"),
])
def test_a_grad_norm_that_is_not_a_float_is_named(answer, phrase):
    with pytest.raises(ExerciseFailed) as info:
        grading.check_global_grad_norm(answer)
    assert str(info.value).startswith(f"check_global_grad_norm: {phrase}"), info.value
    assert "hint: return a Python float" in str(info.value)


def test_a_nan_fails_its_case():
    with pytest.raises(ExerciseFailed, match="got:      nan") as info:
        grading.check_global_grad_norm(lambda norms, p: math.nan)
    assert "case 1/7" in str(info.value) and nb09.GRAD_NORM_HINT in str(info.value)


@pytest.mark.parametrize("answer, phrase, hint", [
    (lambda model, t: tuple(nb09.fully_shard_plan(model, t)),
     "returned a value of type tuple", "list(...) of a tuple"),
    (lambda model, t: (n for n in nb09.fully_shard_plan(model, t)),
     "returned a value of type generator", "list(...) of a tuple"),
    (lambda model, t: None, "returned a value of type NoneType", "list(...) of a tuple"),
    (lambda model, t: [m for m in model.modules() if isinstance(m, t)] + [model],
     "returned a list holding a value of type Block", "not the module"),
    (lambda model, t: [1, 2], "returned a list holding a value of type int", nb09.PLAN_HINT),
])
def test_a_plan_that_is_not_a_list_of_str_is_named(answer, phrase, hint):
    with pytest.raises(ExerciseFailed) as info:
        grading.check_fully_shard_plan(answer)
    message, _, given = str(info.value).partition("\n  hint: ")
    assert message.startswith(f"check_fully_shard_plan: your function {phrase}"), message
    assert message.endswith(("not a list of str", "not only str")), message
    assert hint in given, given


def test_a_plan_of_the_right_type_in_the_wrong_order_gets_the_general_hint():
    def reversed_blocks(model, block_type):
        return nb09.fully_shard_plan(model, block_type)[-2::-1] + [""]

    with pytest.raises(ExerciseFailed, match="in that order, then '' \\(the root\\) last"):
        grading.check_fully_shard_plan(reversed_blocks)


# ------------------------------------------------------------ the batch grader's cases


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_and_a_stub_and_every_mistake_fail_whatever_the_seed(check):
    h, fn = HIDDEN[check], solution(check)
    assert h.notebook == "09_fsdp2.ipynb" and h.preamble == PREAMBLE
    for seed in SEEDS:
        cases = drawn(check, seed)
        assert len(cases) >= len(h.cases(None)), seed
        for c in cases:
            assert diagnose(c, fn(*c.args, **c.kwargs), h.compare, h.wrong_answers) is None
            assert h.compare(c.expected, c.expected)
        for mistake, explanation in h.wrong_answers:
            apart = [c for c in cases if not h.compare(c.expected, mistake(*c.args))]
            assert apart, (seed, mistake.__name__)
            for c in apart:  # the grader names the mistake when a learner gives its value
                assert explanation in diagnose(c, mistake(*c.args), h.compare, h.wrong_answers)


@pytest.mark.parametrize("check", CHECKS)
def test_the_seed_decides_the_inputs_and_they_pickle(check):
    state, torch_state = random.getstate(), torch.random.get_rng_state()
    for seed in SEEDS:
        cases = drawn(check, seed)
        assert inputs(drawn(check, seed)) == inputs(cases), seed
        assert inputs(drawn(check, seed + 1000)) != inputs(cases), seed
        assert inputs(cases) != inputs(HIDDEN[check].cases(None)), seed
        for c in cases:
            assert pickle.loads(pickle.dumps((c.args, c.kwargs))) == (c.args, c.kwargs)
    assert random.getstate() == state, "drawing cases must not touch the global random"
    assert torch.equal(torch.random.get_rng_state(), torch_state), "nor torch's seed"


@pytest.mark.parametrize("check", CHECKS)
def test_without_a_seed_the_cases_are_the_ones_the_notebooks_check_runs(check, monkeypatch):
    h, ran = HIDDEN[check], {}

    def record(name, fn, cases, compare=None, wrong_answers=(), *, shows):
        ran.update(name=name, cases=list(cases), wrong=tuple(wrong_answers), compare=compare)

    monkeypatch.setattr(nb09, "run_cases", record)
    getattr(grading, check)(lambda *args, **kwargs: None)
    assert ran["name"] == check and ran["compare"] is h.compare
    assert ran["wrong"] == h.wrong_answers
    assert inputs(ran["cases"]) == inputs(h.cases(None))
    assert [c.expected for c in ran["cases"]] == [c.expected for c in h.cases(None)]


def test_the_drawn_cases_vary_what_the_exercises_are_about():
    def seen(check, pick):
        return {pick(c) for seed in SEEDS for c in drawn(check, seed)}

    assert seen("check_global_grad_norm", lambda c: c.args[1]) == {1.0, 2.0, 3.0, math.inf}
    assert seen("check_global_grad_norm", lambda c: len(c.args[0])) == set(range(1, 9))
    assert True in seen("check_global_grad_norm", lambda c: 0.0 in c.args[0])  # padded shards
    assert seen("check_fully_shard_plan", lambda c: type(c.args[0]).__name__) == {
        "TinyGPTCase", "DeepMLP", "EncoderDecoder"}
    assert seen("check_fully_shard_plan", lambda c: len(c.expected) - 1) >= {1, 2, 3, 4}


def test_the_notebooks_cases_are_the_brief_ones():
    norms = nb09.global_grad_norm_cases(None)
    assert [(c.args, c.expected) for c in norms[:2]] == [(([3.0, 4.0], 2.0), 5.0),
                                                         (([1.5, 2.0, 6.0], 2.0), 6.5)]
    assert {c.args[1] for c in norms} == {1.0, 2.0, 3.0, math.inf}
    assert any(0.0 in c.args[0] for c in norms) and any(len(c.args[0]) == 1 for c in norms)
    plans = nb09.fully_shard_plan_cases(None)
    assert plans[0].args[1] is Block and plans[0].expected == ["blocks.0", "blocks.1", ""]
    assert plans[3].expected == ["body.layers.0", "body.layers.1", "body.layers.2", ""]
    assert plans[4].expected == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0", ""]
    for c in plans:  # tiny models (d_model <= 32); every block holds Linears of its own
        model, block_type = c.args
        assert max(min(p.shape) for p in model.parameters() if p.dim() == 2) <= 32
        blocks = [m for m in model.modules() if isinstance(m, block_type)]
        assert blocks and all(any(isinstance(x, nn.Linear) for x in b.modules()) for b in blocks)


# ------------------------------------------------------------ the references themselves


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_the_grad_norm_reference_is_torchs_norm_of_the_whole_vector(p):
    """Cut one gradient into rank shards as FSDP2 does (dim 0 in equal chunks, the last ones
    short or empty): the norms of the shards give the norm of the whole."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    for world in (1, 2, 3, 4, 8):
        rows = -(-len(grad) // world)  # ceil: 10 rows on 8 ranks give 2, 2, 2, 2, 2, 0, 0, 0
        shards = [grad[r * rows:(r + 1) * rows] for r in range(world)]
        norms = [float(torch.linalg.vector_norm(s, p)) if s.numel() else 0.0 for s in shards]
        whole = float(torch.linalg.vector_norm(grad, p))
        assert math.isclose(nb09.global_grad_norm(norms, p), whole, rel_tol=1e-12), (world, p)


def test_the_plan_is_bottom_up_and_the_models_compare_by_architecture():
    model = nb09.DeepMLP(n_layers=2)
    plan = nb09.fully_shard_plan(model, nb09.MLPBlock)
    assert plan == ["body.layers.0", "body.layers.1", ""]
    names = [n for n, _ in model.named_modules()]
    assert [names.index(n) for n in plan[:-1]] == sorted(names.index(n) for n in plan[:-1])
    assert nb09.DeepMLP(n_layers=2) == model and nb09.DeepMLP(n_layers=3) != model
    assert hash(nb09.DeepMLP(n_layers=2)) == hash(model)
    assert nb09.EncoderDecoder() != model and model != "DeepMLP"
    out = nb09.TinyGPTCase(n_layers=1)(torch.zeros(1, 4, dtype=torch.long))  # they run
    assert out.shape == (1, 4, 64) and model(torch.zeros(1, 3, dtype=torch.long)).shape[-1] == 32
