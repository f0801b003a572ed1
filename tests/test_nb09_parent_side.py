"""Notebook 09's checks (zero_lab/grading/nb09_fsdp2_runs.py) on reports built without a launch:
each passes on a report shaped as zero_lab/workers/fsdp2_practice.py writes it and fails on a
mutant of the fact it checks. The notebook runs them on the real launch under nbval."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from zero_lab.course.fsdp2_configs import CONFIGS, MODEL
from zero_lab.course.workloads import TinyGPT
from zero_lab.grading import nb09_fsdp2_runs as runs

N = 2


def _groups(world_size: int) -> tuple[list[dict], list[dict]]:
    model = TinyGPT(**MODEL)
    params, groups = [], {}
    for name, p in model.named_parameters():
        rows = -(-p.shape[0] // world_size)
        params.append({"name": name, "global": list(p.shape),
                       "local": [min(rows, p.shape[0]), *p.shape[1:]],
                       "placements": "(Shard(dim=0),)", "type": "DTensor"})
        module = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "(root)"
        group = groups.setdefault(module, {"module": module, "params": [], "numel": 0,
                                           "padded_local": 0, "gather_bytes": 4,
                                           "reduce_bytes": 4})
        group["params"].append(name)
        group["numel"] += p.numel()
        group["padded_local"] += rows * math.prod(p.shape[1:])
    return params, list(groups.values())


def _ledger(groups: list[dict]) -> list[dict]:
    out = []
    for config, k in [(c, 1) for c in CONFIGS] + [("default", 2)]:
        run = {"config": config, "k": k, "groups": groups, "comm": []}
        for group in groups:  # each group's messages are all of one size
            one = runs.expected_messages({**run, "groups": [group]}, N)
            for op, want in one.items():
                if want["count"]:
                    run["comm"] += [[op, want["nbytes"] // want["count"]]] * want["count"]
        out.append(run)
    return out


def _report() -> dict:
    params, groups = _groups(N)
    weights = {"a": [0.5, -0.25], "b": [1.0]}
    return {
        "wrap": {"class": ["FSDPTinyGPT", "FSDPModule", "TinyGPT"], "params": params,
                 "groups": groups},
        "meta": {"plain_tied": False, "plain_numel": 29344, "fsdp2_tied": True,
                 "fsdp2_numel": 27296, "meta_forward": "RuntimeError: FSDP parameters should "
                 "be materialized from meta device before training", "uninitialised_max_diff":
                 2e37, "loaded_max_diff": 0.0},
        "ledger": _ledger(groups),
        "clip": {"total": 5.0, "local_shard_norm": 3.0},
        "train": {"fsdp2_vs_one": 1e-7, "zero3_vs_one": 1e-7, "fsdp2_vs_zero3": 0.0,
                  "weights": weights,
                  "saved": {"DCP": {"files": 3, "bytes": 340_000, "save_s": 0.1},
                            "zero_lab.checkpoint": {"files": 3, "bytes": 350_000,
                                                    "save_s": 0.1}}},
        "one_process_norm": 5.0,
    }


def test_the_checks_pass_on_a_well_formed_report():
    report = _report()
    runs.check_wrap(report, N)
    assert runs.check_meta(report) == MODEL["vocab_size"] * MODEL["d_model"]
    assert runs.check_ledger(report, N) == len(CONFIGS) + 1
    other = copy.deepcopy(report)
    other["clip"]["local_shard_norm"] = 4.0
    assert runs.check_clip([report, other]) == 5.0  # sqrt(3² + 4²)
    runs.check_three_way(report)
    assert runs.check_resume(report, {"resume": {"weights": report["train"]["weights"]}}) == 0


def test_padding_per_parameter_against_flat_on_three_ranks():
    params, groups = _groups(3)
    report = {"wrap": {"params": params}}
    # tok_emb 64 and pos_emb 16 rows pad 2 rows of 32, ln_f 32 pads 1: 129 in the root
    assert runs.check_padding(groups[:1], report, 3) == 129
    rows = runs.padding_rows(groups, 3)
    assert rows[0]["flat padding"] == 0 and rows[1]["flat padding"] == 2
    groups[1]["padded_local"] -= 1  # mutant: padded once, as a flat buffer would be
    with pytest.raises(AssertionError):
        runs.check_padding(groups, report, 3)


def _mutants():
    def root_first(r):
        r["wrap"]["groups"].reverse()

    def replicated(r):
        r["wrap"]["params"][0]["placements"] = "(Replicate(),)"

    def untied(r):
        r["meta"]["fsdp2_tied"] = False

    def initialised(r):
        r["meta"]["uninitialised_max_diff"] = 0.0

    def no_backward_gather(r):  # the default run without the blocks' backward all-gathers
        comm = r["ledger"][0]["comm"]
        comm.remove(next(c for c in comm if c[0] == "all_gather"))

    def bf16_reduce(r):  # reduce_dtype ignored: gradients reduced in bf16
        run = next(x for x in r["ledger"] if x["config"] == "bf16 params, fp32 reduce")
        run["comm"] = [[op, n // 2 if op == "reduce_scatter" else n] for op, n in run["comm"]]

    def accumulation_sends_twice(r):
        run = r["ledger"][-1]
        run["comm"] += [c for c in run["comm"] if c[0] == "reduce_scatter"]

    def drifted(r):
        r["train"]["zero3_vs_one"] = 1e-3

    def weights_only(r):  # a checkpoint without the optimizer's states
        r["train"]["saved"]["DCP"]["bytes"] = 4 * 27296

    wrap, meta = (lambda r: runs.check_wrap(r, N)), runs.check_meta
    ledger, three_way = (lambda r: runs.check_ledger(r, N)), runs.check_three_way
    return [(root_first, wrap), (replicated, wrap), (untied, meta), (initialised, meta),
            (no_backward_gather, ledger), (bf16_reduce, ledger),
            (accumulation_sends_twice, ledger), (drifted, three_way),
            (weights_only, runs.check_saved)]


@pytest.mark.parametrize("mutant, check", _mutants(), ids=lambda f: getattr(f, "__name__", ""))
def test_each_check_fails_on_its_mutant(mutant, check):
    report = _report()
    check(report)  # passes before the mutant
    mutant(report)
    with pytest.raises(AssertionError):
        check(report)


def test_the_clip_check_fails_on_a_norm_not_reduced_across_ranks():
    report = _report()
    other = copy.deepcopy(report)
    other["clip"]["local_shard_norm"] = 4.0
    for r in (report, other):  # each rank's "total" is its own shards' norm
        r["clip"]["total"] = r["clip"]["local_shard_norm"]
    with pytest.raises(AssertionError):
        runs.check_clip([report, other])


def test_a_resume_that_lost_a_step_fails(tmp_path):
    report = _report()
    moved = {"resume": {"weights": {"a": [0.5, -0.2], "b": [1.0]}}}
    with pytest.raises(AssertionError):
        runs.check_resume(report, moved)
    model = TinyGPT(**MODEL)
    torch.save(model.state_dict(), tmp_path / "full.pt")
    exact = {"train": {"weights": {n: t.reshape(-1).tolist()
                                   for n, t in model.state_dict().items()}}}
    assert runs.check_single_process(tmp_path / "full.pt", exact) == 0.0
    exact["train"]["weights"]["head.weight"][0] += 1e-3
    with pytest.raises(AssertionError):
        runs.check_single_process(tmp_path / "full.pt", exact)


def _memory(world_size: int) -> list[dict]:
    _, groups = _groups(world_size)
    numel = sum(g["numel"] for g in groups)
    padded = sum(g["padded_local"] for g in groups)
    reports = []
    for rank in range(world_size):  # the last rank's shards end in the padding
        local = padded if rank < world_size - 1 else numel - padded * (world_size - 1)
        held = {"params": 4 * padded, "grads": 4 * padded, "optimizer": 8 * local}
        held["total"] = sum(held.values())
        reports.append({"memory": {"held": held, "padded_local": padded, "local": local,
                                   "numel": numel}})
    return reports


def test_memory_is_the_formula_where_nothing_is_padded_and_names_the_padding():
    assert runs.check_memory(_memory(2)) == 0  # 16Ψ/2 to the byte
    assert runs.check_memory(_memory(3)) > 0
    rows = runs.memory_rows(_memory(2))
    assert rows[0]["held"] == rows[0]["16Ψ/N formula"] == 16 * 27296 // 2
    reports = _memory(2)
    reports[1]["memory"]["held"]["optimizer"] += 8  # mutant: Adam's state one element bigger
    with pytest.raises(AssertionError):
        runs.check_memory(reports)
