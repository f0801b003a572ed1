"""Stage 3 (zero_lab/stages/zero3.py) against one process, with its memory and its traffic.

Every multi-rank number comes from tests/workers/zero3_cases.py, run in one launch per world
size N = 1, 2, 3 (tests/workers/world_cases.py, shared with the other case workers); it
trains 12 configurations for 10 steps each on the models of the stages 0-2 tests (odd-sized
MLPs, a nested model with a frozen layer, a layer used twice and a 0-d parameter, a small GPT
with a tied head) and blocks under activation checkpointing, with Adam, AdamW and SGD with
momentum, gradient accumulation, clipping, mixed precision, prefetch on and off, custom and
nested units, a torch optimizer built on model.parameters(), and the seed blog's gradient bug
(which the equivalence test must catch). It also measures one step of the 6-block MLP (memory
timeline, held bytes, live tensors after the step), inference, and refusals.
"""

from __future__ import annotations

import math

import pytest
from common import (
    WORLD_SIZES,
    assert_every_rank_ran_every_case,
    assert_global_clip_norms,
    assert_losses_match_the_global_batch,
    case_reports,
    select_cases,
)
from torch import nn

from zero_lab import memory
from zero_lab.course import workloads as W
from zero_lab.grading.nb05_zero3 import check_stage3_step_memory
from zero_lab.stages.units import ROOT_NAME, plan_units, unit_modules

FP32_ATOL = 1e-6  # fp32 weights of size ~0.1-1 after 10 steps; measured worst 1.2e-7
N_CASES = 12


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N={n}")
def ranks(request) -> tuple[int, tuple[dict, ...]]:
    return request.param, case_reports("zero3", request.param)




# ------------------------------------------------------------------ equivalence


def test_every_rank_ran_every_case(ranks):
    n, reports = ranks
    assert_every_rank_ran_every_case(reports, n, N_CASES)


def test_fp32_training_matches_one_process_on_the_global_batch(ranks):
    n, reports = ranks
    for c in select_cases(reports, precision="fp32", blog_bug=False):
        assert c["keys_match"], c["name"]
        assert c["max_abs_diff"] <= FP32_ATOL, (c["name"], c["worst_key"], c["max_abs_diff"])


def test_the_blog_gradient_bug_is_caught(ranks):
    """The seed blog all-reduced each rank's *own* chunk of its gradient: for N > 1 rank r's
    chunk r is summed with other ranks' other chunks, and the weights go wrong at once. The
    same equivalence check that passes above must fail it (with one rank it is harmless)."""
    n, reports = ranks
    (bug,) = select_cases(reports, blog_bug=True)
    if n == 1:
        assert bug["max_abs_diff"] <= FP32_ATOL
    else:
        assert bug["max_abs_diff"] > 1000 * FP32_ATOL, bug["max_abs_diff"]


def test_full_state_dict_is_identical_on_every_rank(ranks):
    n, reports = ranks
    for i, c in enumerate(reports[0]["cases"]):
        if not c["blog_bug"]:
            assert {rep["cases"][i]["digest"] for rep in reports} == {c["digest"]}, c["name"]


def test_losses_averaged_over_ranks_match_the_global_batch_loss(ranks):
    n, reports = ranks
    assert_losses_match_the_global_batch(reports, skip=lambda c: c["blog_bug"])


def test_clip_grad_norm_returns_the_global_norm(ranks):
    n, reports = ranks

    def clip_of(c):  # the zero3 cases carry their clip value in the name only
        return float(c["name"].split("-clip")[1].split("-")[0])

    assert assert_global_clip_norms(reports, clip_of) == 3


def test_mixed_precision_matches_its_single_process_reference(ranks):
    """bf16 gradients of each rank's rows (or micro-batch) round differently from those of
    the whole batch, so weights drift apart at bf16 level: the drift must stay within what
    mixed precision itself causes (fp32 reference vs mixed reference). One rank, one
    micro-batch: the same recipe, bit for bit."""
    n, reports = ranks
    mixed = select_cases(reports, precision="mixed")
    assert len(mixed) == 2
    for c in mixed:
        assert c["keys_match"], c["name"]
        if n == 1 and "-acc1-" in c["name"]:
            assert c["max_abs_diff"] == 0.0, c["name"]
        assert 0 < c["precision_gap"] < 0.1, c["name"]
        assert c["max_abs_diff"] <= 2 * c["precision_gap"], (c["name"], c["max_abs_diff"])


def test_gradients_are_final_when_backward_returns(ranks):
    """Two backward calls accumulate; right after, every parameter's .grad is a view of its
    piece of the averaged gradient slice; opt.zero_grad(), zeroing through
    model.parameters() (set to None) and zero_grad(set_to_none=False) all start afresh."""
    n, reports = ranks
    for rep in reports:
        g = rep["grads"]
        assert g["max_error"] <= 1e-6, g
        assert g["grads_are_views"] and g["cleared"] == [True, True, True], g
        assert g["gathered_after"] == 0


def test_inference_leaves_nothing_gathered(ranks):
    """no_grad, and eval mode with grad enabled but no backward: outputs equal one process's,
    one all-gather per unit call (the shared layer runs twice) and one per frozen part (the
    root's frozen Linear, gathered with it), nothing else, nothing left."""
    n, reports = ranks
    for rep in reports:
        inf = rep["inference"]
        for mode in ("no_grad", "eval_grad_enabled"):
            r = inf[mode]
            assert r["error"] <= 1e-6, (mode, r)
            assert r["gathered_after"] == 0 and r["busy_units"] == 0, (mode, r)
            assert inf["n_frozen_parts"] == 1
            assert r["all_gathers"] == 2 * (inf["n_units"] + 1 + inf["n_frozen_parts"]), (mode, r)
            assert r["other_ops"] == [], (mode, r)


# ------------------------------------------------------------------ communication


def test_two_all_gathers_and_one_reduce_scatter_per_unit_per_step(ranks):
    """Each unit's padded flat buffer is all-gathered twice (forward, backward) and its
    gradient reduce-scattered once per step: 3Ψ. Nested's `shared` layer runs twice in
    forward, so it is gathered once more. A unit's frozen parameters (Nested's frozen Linear,
    in the root unit) are all-gathered with it and never reduce-scattered. No all-reduce, no
    broadcast."""
    n, reports = ranks
    for c in reports[0]["cases"]:
        if c["blog_bug"]:
            assert "all_reduce" in c["other_ops"] and c["reduce_scatter_sizes"] == []
            continue
        unit_bytes = [p * c["element_size"] for p in c["unit_padded"]]
        extra = [b for name, b in zip(c["units"], unit_bytes, strict=True) if name == "shared"]
        frozen = [f * c["element_size"] for f in c["frozen_padded"] if f]
        assert len(frozen) == (c["n_frozen"] > 0), c["name"]
        assert c["all_gather_sizes"] == sorted(2 * unit_bytes + extra + 2 * frozen), c["name"]
        assert c["reduce_scatter_sizes"] == sorted(unit_bytes), c["name"]
        assert c["other_ops"] == [], c["name"]
        assert c["in_backward"] == ["all_gather", "reduce_scatter"], c["name"]
        # against the paper's 3Ψ on the unpadded parameters: padding is < N per unit
        volume = (sum(c["all_gather_sizes"]) + sum(c["reduce_scatter_sizes"]) - sum(extra)
                  - 2 * sum(frozen))
        paper = 3 * c["element_size"] * c["n_trainable"]
        assert 0 <= volume - paper < 3 * c["element_size"] * len(unit_bytes) * n, c["name"]
        assert c["gathered_after"] == 0, c["name"]


def test_six_block_mlp_sends_12_all_gathers_and_3_psi(ranks):
    n, reports = ranks
    life = reports[0]["lifecycle"]
    for key in ("prefetch_False", "prefetch_True"):
        step = life[key]
        padded = sum(u["padded"] for u in step["units"])
        assert len(step["units"]) == 6
        assert step["ledger"]["all_gather"]["count"] == 12
        assert step["ledger"]["reduce_scatter"]["count"] == 6
        assert set(step["ledger"]) == {"all_gather", "reduce_scatter"}
        volume = sum(s["volume"] for s in step["ledger"].values())
        assert volume == 3 * 4 * padded  # 3Ψ, fp32, padded units
        assert 0 <= padded - life["psi"] < 6 * n


# ------------------------------------------------------------------ memory


def test_held_bytes_are_16_psi_over_n(ranks):
    """After backward, per rank: exactly the unit slices' params, grads and Adam states
    (16 bytes per slice element in fp32, and in mixed precision), which is
    memory.model_state_bytes(Ψ, 3, N) up to the padding of each unit."""
    n, reports = ranks
    for rep in reports:
        for c in rep["cases"]:
            per_elem = memory.bytes_per_param(c["precision"], c["optimizer"])
            held, s = c["held_after_backward"], c["shard_numel"]
            # frozen parameters: this rank's slice of them (fp32 here), not the whole
            assert c["frozen_at_rest"] == 4 * math.ceil(c["n_frozen"] / n), c["name"]
            assert held["params"] == per_elem["params"] * s + c["frozen_at_rest"], c["name"]
            assert held["grads"] == per_elem["grads"] * s, c["name"]
            if c["torch_optimizer"]:  # states for the local pieces, no padding
                assert held["optimizer"] == per_elem["optimizer"] * c["local_param_numels"]
            else:  # fp32 masters of the whole slice (mixed), states for its real elements
                masters = 4 * s if c["precision"] == "mixed" else 0
                states = (per_elem["optimizer"] - masters // s) * c["stepped_numel"]
                assert held["optimizer"] == masters + states, c["name"]
            if c["n_frozen"] or c["torch_optimizer"]:
                continue  # the formula counts trainable parameters of padded slices
            predicted = memory.model_state_bytes(c["n_trainable"], 3, n, c["precision"],
                                                 c["optimizer"], pad_to=1)
            slack = sum(per_elem[k] for k in ("params", "grads", "optimizer"))
            # padding: buffers hold up to N more elements per unit, optimizer states none
            assert abs(held["total"] - predicted["total"]) <= slack * len(c["units"]), c["name"]
        life = rep["lifecycle"]
        for key in ("prefetch_False", "prefetch_True"):
            held = life[key]["held"]["total"]
            slices = sum(u["slice"] for u in life[key]["units"])
            assert held == 8 * slices + 8 * life[key]["stepped_numel"]  # Adam: no padding
            assert abs(held - memory.model_state_bytes(life["psi"], 3, n, "fp32", "adam",
                                                       pad_to=1)["total"]) < 16 * 6


def test_peak_is_held_plus_two_units_plus_activations(ranks):
    """Live bytes over one training step of the 6-block MLP (every storage counted at its
    current size after every op): above the start of the step, at most the gradient slices
    (held after backward), the full parameters and full gradients of two units (the current
    one and the prefetched or in-flight one), and the activations the same step needs in one
    process; the optimizer's step then adds at most one set of the slices (Adam's temporaries).
    Without prefetch the peak is lower, but not by more than one unit's params. Failed before
    at N=1 with foreach Adam: the whole step was held to the lifecycle's bound (as notebook 05
    did, failing on one H100)."""
    n, reports = ranks
    for rep in reports:
        life = rep["lifecycle"]
        peaks = {}
        for key in ("prefetch_False", "prefetch_True", "foreach_adam"):
            peaks[key] = check_stage3_step_memory(life[key], life["activations"], life["psi"], n)
        assert peaks["prefetch_True"]["forward_backward"] >= \
            peaks["prefetch_False"]["forward_backward"]
        # foreach Adam (CUDA's default) computes sqrt(v) for every slice at once: its step adds
        # one set of slices exactly; the for-loop one adds less. The lifecycle is the same.
        foreach, loop = peaks["foreach_adam"], peaks["prefetch_True"]
        step = life["foreach_adam"]
        assert foreach["optimizer_step"] == step["element_bytes"] * step["stepped_numel"]
        assert loop["optimizer_step"] < foreach["optimizer_step"]
        assert foreach["forward_backward"] == loop["forward_backward"]


def test_no_full_parameter_stays_allocated_after_a_step(ranks):
    """Walk every live tensor after a step: beyond the model states (and Adam's 0-d step
    counters) nothing is left: no full parameter, gradient or activation."""
    n, reports = ranks
    for rep in reports:
        step = rep["lifecycle"]["prefetch_True"]
        assert step["leftover"] == 0
        assert step["gathered_after"] == 0
        # Back where the step began, up to one unit-sized buffer: gloo's worker thread may
        # drop its reference to the last reduce-scatter's input a moment after wait().
        assert 0 <= step["samples"][-1] - step["start_bytes"] <= max(step["unit_param_bytes"])


def test_prefetch_gathers_the_next_unit_before_releasing_the_current(ranks):
    """From the timeline's marks: without prefetch one unit is gathered at a time; with it
    the next unit's all-gather starts while the current one computes (forward and backward),
    so two are gathered at once."""
    n, reports = ranks
    for key, most in (("prefetch_False", 1), ("prefetch_True", 2)):
        gathered: set[str] = set()
        seen = {"forward": 0, "backward": 0}  # most units gathered at once, per phase
        for _, label in reports[0]["lifecycle"][key]["marks"]:
            phase, what, *unit = label.split()
            if what == "gather":
                gathered.add(unit[0])
                seen[phase] = max(seen[phase], len(gathered))
            elif what == "release":
                gathered.discard(unit[0])
        assert seen == {"forward": most, "backward": most}, (key, seen)


# ------------------------------------------------------------------ prefetch depth

PREFETCH_DEPTHS = ("False", "True", "2", "3")


def check_prefetch_limit(variant: dict) -> None:
    """With prefetch depth k, at most k + 1 units are gathered at once (the one computing
    and k ahead), and as many are at some point of forward and of backward, when there are
    that many units; equal units here, so the bytes are exact: (k + 1) x one unit's."""
    (unit,) = variant["unit_bytes"]
    most = min(variant["depth"] + 1, variant["units"]) * unit
    assert variant["peak_gathered"] == {"forward": most, "backward": most}, variant
    assert variant["gathered_after"] == 0, variant


def check_same_bytes(variant: dict, default: dict) -> None:
    """The same collectives, of the same sizes, as the default prefetch: a depth changes
    only when each all-gather starts."""
    assert variant["collectives"] == default["collectives"], variant


def test_prefetch_depths_match_one_process_and_send_the_same_bytes(ranks):
    """prefetch=False, True, 2, 3: equal to one process on the global batch after 3 steps,
    and a step sends what the default sends: 2 all-gathers and 1 reduce-scatter of each unit
    (3Ψ)."""
    n, reports = ranks
    for rep in reports:
        variants = rep["prefetch"]
        for name in PREFETCH_DEPTHS:
            assert variants[name]["max_abs_diff"] <= FP32_ATOL, (name, variants[name])
            check_same_bytes(variants[name], variants["True"])
        unit = variants["True"]["unit_bytes"][0]
        units = variants["True"]["units"]
        assert variants["True"]["collectives"] == (  # (op, bytes), sorted
            [["all_gather", unit]] * 2 * units + [["reduce_scatter", unit]] * units)


def test_bytes_check_fails_a_variant_that_sends_other_bytes(ranks):
    """Negative control: reshard_after_forward=False sends 2Ψ, not 3Ψ (no second gather)."""
    n, reports = ranks
    variants = reports[0]["prefetch"]
    with pytest.raises(AssertionError):
        check_same_bytes(variants["kept"], variants["True"])


def test_prefetch_depth_k_gathers_k_plus_one_units_at_most(ranks):
    n, reports = ranks
    for rep in reports:
        for name in PREFETCH_DEPTHS:
            check_prefetch_limit(rep["prefetch"][name])


def check_gathers_started(variant: dict) -> None:
    """Where each of the step's 2 x units all-gathers starts: one per unit in forward and one
    in backward, whatever the depth (a prefetch starts a gather earlier, in the same phase)."""
    units = variant["units"]
    assert variant["gathers_started"] == {"forward": units, "backward": units}, variant


def test_each_unit_gathers_once_in_forward_and_once_in_backward(ranks):
    n, reports = ranks
    for rep in reports:
        for name in PREFETCH_DEPTHS:
            check_gathers_started(rep["prefetch"][name])
        # negative control: a record with backward's first gather started at forward end
        started = rep["prefetch"]["True"]["gathers_started"]
        with pytest.raises(AssertionError):
            check_gathers_started({**rep["prefetch"]["True"], "gathers_started": {
                "forward": started["forward"] + 1, "backward": started["backward"] - 1}})


def test_limit_check_fails_a_prefetch_that_ignores_the_limit(ranks):
    """Negative control: prefetch=2 whose units prefetch every later unit gathers all 5."""
    n, reports = ranks
    for rep in reports:
        mutant = rep["prefetch"]["unlimited"]
        assert mutant["depth"] == 2 and mutant["max_abs_diff"] <= FP32_ATOL
        with pytest.raises(AssertionError):
            check_prefetch_limit(mutant)


# ------------------------------------------------------------------ refusals, hygiene


def test_refusals(ranks):
    n, reports = ranks
    if n != 2:
        pytest.skip("checked once, on 2 ranks")
    errors = reports[0]["errors"]
    assert errors["unit_classes"] == (
        "TypeError: unit_classes must be nn.Module subclasses, got ('Linear',)")
    assert errors["twice"] == "ValueError: this model is already sharded; shard() a fresh model"
    assert errors["batchnorm"].startswith("RuntimeError: 1 is a BatchNorm1d in training mode")
    assert errors["frozen"].startswith("ValueError: the model has no trainable parameters")
    depth = ("a prefetch depth (how many units stage 3 gathers ahead) is an int k >= 1, at "
             "stage 3 only; prefetch=False gathers none ahead, True one")
    for k in ("0", "-1", "2 stage 2"):
        assert errors[f"prefetch={k}"] == f"ValueError: prefetch={k.split()[0]}: {depth}"
    for k in ("1.0", "'2'", "None"):
        assert errors[f"prefetch={k}"] == (
            f"TypeError: prefetch must be True, False or an int k >= 1, got {k}")


def test_no_warnings(ranks):
    n, reports = ranks
    for rep in reports:
        assert rep["warnings"] == []


# ------------------------------------------------------------------ units (one process)


def _plan(model, unit_classes=None) -> dict[str, list[str]]:
    return {name: [n for n, _ in params] for name, _, params in plan_units(model, unit_classes)}


def test_default_units_are_the_called_children_of_containers():
    """The MLP's Linear layers (ReLUs own nothing); TinyGPT's blocks and layers, with the
    tied token embedding / head weight in the root, their common ancestor."""
    assert list(_plan(W.deep_mlp(4, 3))) == ["0", "2", "4"]
    gpt = _plan(W.TinyGPT(n_layers=2))
    assert list(gpt) == ["pos_emb", "blocks.0", "blocks.1", "ln_f", ROOT_NAME]
    assert gpt[ROOT_NAME] == ["tok_emb.weight"]
    assert len(gpt["blocks.0"]) == 12  # 2 LayerNorms, qkv, proj, 2 MLP Linears: w + b each


def test_unit_classes_choose_units_like_a_wrapping_policy():
    gpt = W.TinyGPT(n_layers=2)
    assert list(_plan(gpt, (W.Block,))) == ["blocks.0", "blocks.1", ROOT_NAME]
    assert _plan(gpt, (W.Block,))[ROOT_NAME] == [
        "tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"]
    nested = _plan(gpt, (W.Block, nn.Linear))  # units inside units
    assert nested["blocks.0"] == ["blocks.0.ln1.weight", "blocks.0.ln1.bias",
                                  "blocks.0.ln2.weight", "blocks.0.ln2.bias"]
    assert nested["blocks.0.attn.qkv"] == ["blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"]
    assert "head" not in nested  # its weight is the tied embedding: in the root
    assert [n for n, _ in unit_modules(gpt, (W.Block,))] == ["blocks.0", "blocks.1"]


def test_a_weight_tied_across_two_blocks_goes_to_their_common_ancestor():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left, self.right = Pair(), Pair()
            self.right.b.weight = self.left.a.weight

    plan = _plan(Model(), (Pair,))
    assert plan["left"] == ["left.a.bias", "left.b.weight", "left.b.bias"]
    assert plan["right"] == ["right.a.weight", "right.a.bias", "right.b.bias"]
    assert plan[ROOT_NAME] == ["left.a.weight"]
    inner = _plan(Model(), (Pair, nn.Linear))  # tied between left.a and right.b: the root
    assert inner[ROOT_NAME] == ["left.a.weight"] and "right.b" in inner


def test_a_submodule_shared_by_two_blocks_goes_to_their_common_ancestor():
    class Block(nn.Module):
        def __init__(self, shared: nn.Module) -> None:
            super().__init__()
            self.own, self.shared = nn.Linear(3, 3), shared

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = nn.Linear(3, 3)
            self.a, self.b = Block(shared), Block(shared)

    plan = _plan(Model(), (Block,))
    assert plan == {"a": ["a.own.weight", "a.own.bias"], "b": ["b.own.weight", "b.own.bias"],
                    ROOT_NAME: ["a.shared.weight", "a.shared.bias"]}
    # the shared module as a unit of its own: it keeps its parameters wherever it is called
    plan = _plan(Model(), (Block, nn.Linear))
    assert plan["a.shared"] == ["a.shared.weight", "a.shared.bias"] and ROOT_NAME not in plan


def test_frozen_parameters_are_not_in_any_unit():
    model = W.deep_mlp(4, 2)
    model[0].requires_grad_(False)
    assert _plan(model) == {"2": ["2.weight", "2.bias"]}
    with pytest.raises(TypeError, match="unit_classes must be nn.Module subclasses"):
        plan_units(model, [int])


def test_the_step_memory_check_bounds_each_phase():
    """check_stage3_step_memory on made-up steps (no launch): 6 units of 100 four-byte
    elements on one rank, no activations. Lifecycle bound: gradient slices 2,400 B + two
    units' parameters and gradients 1,600 B = 4,000 B. Mutants: the whole step held to that
    bound (the foreach case fails: 2,400 + 2,400 B), no bound on the optimizer's step (the
    oversized step passes)."""
    step = {"held": {"total": 8 * 600 + 8 * 600}, "units": [{"slice": 100}] * 6,
            "stepped_numel": 600, "unit_param_bytes": [400] * 6, "element_bytes": 4,
            "grad_shard_bytes": 2_400, "start_bytes": 10_000,
            "peak_forward_backward": 10_000 + 3_600, "backward_done_bytes": 10_000 + 2_400}
    foreach = {**step, "peak_optimizer_step": 12_400 + 2_400, "peak_bytes": 14_800}
    rises = check_stage3_step_memory(foreach, activations=0, psi=600, world=1)
    assert rises == {"forward_backward": 3_600, "optimizer_step": 2_400, "step": 4_800}
    oversized = {**step, "peak_optimizer_step": 12_400 + 2_401, "peak_bytes": 14_801}
    with pytest.raises(AssertionError, match="the optimizer's step added 2,401 B"):
        check_stage3_step_memory(oversized, activations=0, psi=600, world=1)
    over = {**step, "peak_forward_backward": 10_000 + 4_001}
    with pytest.raises(AssertionError, match="forward and backward rose 4,001 B"):
        check_stage3_step_memory(over, activations=0, psi=600, world=1)
