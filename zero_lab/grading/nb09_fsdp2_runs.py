"""Notebook 09's claims about torch's FSDP2, checked on what zero_lab/workers/fsdp2_practice.py
measured: each `check_*` raises AssertionError naming the number that broke the claim.

    check_wrap            every parameter a DTensor sharded on dim 0; a group per block and
                          the root; FSDP2's padded storage = each parameter padded on dim 0
    check_meta            meta init: to_empty keeps the tie under FSDP2 (not without it),
                          memory is garbage until loaded, loading from rank 0 is exact
    check_ledger          every configuration's collectives = notebook 08's formula, group
                          by group (fsdp2_accumulation_messages)
    check_clip            clip_grad_norm_'s total = one process's norm; rank 0's shard norm
                          is not it
    check_three_way       FSDP2, shard(model, 3) and one process end at the same weights
    check_resume          a DCP save on 2 ranks resumed on 3 = training straight through
    check_single_process  the full state dict loads into a plain model, strict, same weights
    check_saved           both checkpoints hold at least the weights and Adam's two states
    check_memory          what a rank holds = notebook 01's 16Ψ/N for fp32 Adam, plus FSDP2's
                          padding (parameters and gradients padded, Adam's states not)
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from zero_lab.course.fsdp2_configs import CONFIGS, MODEL
from zero_lab.grading.framework import check_ledger_matches
from zero_lab.grading.nb08_knobs_accumulation import FP32_ATOL
from zero_lab.memory import model_state_bytes, partition_elements
from zero_lab.predict.knobs import fsdp2_accumulation_messages


def parameter_rows(report: dict) -> list[dict]:
    """One row per parameter as rank 0 holds it."""
    return [{"parameter": p["name"], "type": p["type"], "placements": p["placements"],
             "whole": "x".join(map(str, p["global"])), "rank 0 holds": "x".join(
                 map(str, p["local"]))} for p in report["wrap"]["params"]]


def padding_rows(groups: list[dict], world_size: int) -> list[dict]:
    """Per group: elements, FSDP2's padded local storage (each parameter's dim 0 padded to a
    multiple of N) against the course's flat buffer (the group padded once, notebook 03)."""
    rows = []
    for group in groups:
        flat = partition_elements(group["numel"], world_size)
        rows.append({"group": group["module"], "parameters": len(group["params"]),
                     "elements": group["numel"],
                     "FSDP2 per rank": group["padded_local"], "flat per rank": flat,
                     "FSDP2 padding": group["padded_local"] * world_size - group["numel"],
                     "flat padding": flat * world_size - group["numel"]})
    return rows


def check_wrap(report: dict, world_size: int) -> None:
    wrap = report["wrap"]
    assert wrap["class"][:2] == [f"FSDP{MODEL_CLASS}", "FSDPModule"], wrap["class"]
    for p in wrap["params"]:
        assert p["type"] == "DTensor" and p["placements"] == "(Shard(dim=0),)", p
        assert p["local"][0] == partition_elements(p["global"][0], world_size), p
    names = [g["module"] for g in wrap["groups"]]
    assert names == ["(root)"] + [f"blocks.{i}" for i in range(MODEL["n_layers"])], names
    check_padding(wrap["groups"], report, world_size)


def check_padding(groups: list[dict], report: dict, world_size: int) -> int:
    """FSDP2's local storage of each group = every parameter's dim 0 padded to a multiple of
    N rows (chunked like torch.chunk). Returns the elements of padding on all ranks."""
    shapes = {p["name"]: p["global"] for p in report["wrap"]["params"]}
    padding = 0
    for group in groups:
        padded = sum(partition_elements(shapes[n][0], world_size) * math.prod(shapes[n][1:])
                     for n in group["params"])
        assert group["padded_local"] == padded, (group, padded)
        padding += padded * world_size - group["numel"]
    return padding


MODEL_CLASS = "TinyGPT"


def check_meta(report: dict) -> int:
    """Returns how many elements the untied head adds."""
    meta = report["meta"]
    grown = MODEL["vocab_size"] * MODEL["d_model"]
    assert not meta["plain_tied"] and meta["plain_numel"] == meta["fsdp2_numel"] + grown, meta
    assert meta["fsdp2_tied"], meta
    assert "meta device" in meta["meta_forward"], meta["meta_forward"]
    assert not meta["uninitialised_max_diff"] < 1e-3, meta  # NaN counts as garbage too
    assert meta["loaded_max_diff"] == 0.0, meta
    return grown


def _group_raf(config: dict, root: bool) -> bool:
    """reshard_after_forward as FSDP2 applies it to a group: the default (None) reshards every
    group but the root (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _lazy_init); an
    int N reshards to groups of N ranks, so 1 keeps the whole copy."""
    raf = config.get("reshard_after_forward")
    if raf is None:
        return not root
    if isinstance(raf, bool):
        return raf
    if raf != 1:  # to groups of raf > 1 ranks: its gathers span fewer ranks (not run here)
        raise ValueError(f"reshard_after_forward={raf}: only 1 is in the formula here")
    return False


def expected_messages(run: dict, world_size: int) -> dict[str, dict[str, int]]:
    """{op: {"count", "nbytes"}}: notebook 08's formula summed group by group."""
    config = CONFIGS[run["config"]]
    total = _no_messages()
    for group in run["groups"]:  # each in the dtypes its own policy gives it
        raf = _group_raf(config, group["module"] == "(root)")
        for op, width in (("all_gather", group["gather_bytes"]),
                          ("reduce_scatter", group["reduce_bytes"])):
            padded = group["padded_local"] * world_size * width
            formula = fsdp2_accumulation_messages(
                padded, run["k"], world_size, reshard_after_forward=raf,
                reshard_after_backward=False).get(op, {"count": 0, "nbytes": 0})
            total[op]["count"] += formula["count"]
            total[op]["nbytes"] += formula["nbytes"]
    return total


def _no_messages() -> dict[str, dict[str, int]]:
    return {"all_gather": {"count": 0, "nbytes": 0}, "reduce_scatter": {"count": 0, "nbytes": 0}}


def measured_messages(run: dict) -> dict[str, dict[str, int]]:
    total = _no_messages()
    for op, nbytes in run["comm"]:
        total[op]["count"] += 1
        total[op]["nbytes"] += nbytes
    return total


def ledger_rows(report: dict, world_size: int) -> list[dict]:
    rows = []
    for run in report["ledger"]:
        got, want = measured_messages(run), expected_messages(run, world_size)
        rows.append({"configuration": run["config"], "k": run["k"],
                     "all-gathers": got["all_gather"]["count"],
                     "gathered bytes": got["all_gather"]["nbytes"],
                     "formula": want["all_gather"]["nbytes"],
                     "reduce-scattered bytes": got["reduce_scatter"]["nbytes"],
                     "formula ": want["reduce_scatter"]["nbytes"]})
    return rows


def check_ledger(report: dict, world_size: int) -> int:
    """Every run's collectives equal the formula, count and bytes. Returns the runs checked."""
    return check_ledger_matches(report["ledger"], measured_messages,
                                lambda run: expected_messages(run, world_size),
                                lambda run: f"{run['config']} (k = {run['k']})")


def check_clip(reports: list[dict]) -> float:
    """Returns the total norm."""
    one = reports[0]["one_process_norm"]
    totals = [r["clip"]["total"] for r in reports]
    local = [r["clip"]["local_shard_norm"] for r in reports]
    assert all(math.isclose(t, one, rel_tol=1e-5) for t in totals), (totals, one)
    assert math.isclose(math.sqrt(sum(n * n for n in local)), one, rel_tol=1e-5), (local, one)
    if len(reports) > 1:  # on one rank the local shard is the whole gradient
        assert not math.isclose(local[0], one, rel_tol=1e-3), (local[0], one)
    return one


def check_three_way(report: dict, atol: float = FP32_ATOL) -> dict[str, float]:
    train = report["train"]
    diffs = {k: train[k] for k in ("fsdp2_vs_one", "zero3_vs_one", "fsdp2_vs_zero3")}
    assert all(v <= atol for v in diffs.values()), diffs
    return diffs


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for n in a for x, y in zip(a[n], b[n], strict=True))


def check_resume(train_report: dict, resume_report: dict, atol: float = FP32_ATOL) -> float:
    diff = _max_diff(train_report["train"]["weights"], resume_report["resume"]["weights"])
    assert diff <= atol, diff
    return diff


def check_single_process(path: Path, train_report: dict) -> float:
    from zero_lab.course.workloads import TinyGPT

    plain = TinyGPT(**MODEL)
    plain.load_state_dict(torch.load(path, weights_only=True), strict=True)
    weights = {n: t.reshape(-1).tolist() for n, t in plain.state_dict().items()}
    diff = _max_diff(train_report["train"]["weights"], weights)
    assert diff == 0.0, diff
    return diff


def saved_rows(report: dict) -> list[dict]:
    return [{"checkpoint": name, "files": s["files"], "bytes": s["bytes"],
             "save, ms": round(s["save_s"] * 1e3, 1)}
            for name, s in report["train"]["saved"].items()]


def check_saved(report: dict) -> int:
    """Each checkpoint holds at least Ψ fp32 weights and Adam's two fp32 states (3 x 4 bytes
    a parameter). Returns that floor in bytes."""
    numel = sum(g["numel"] for g in report["wrap"]["groups"])
    floor = 3 * 4 * numel
    for name, saved in report["train"]["saved"].items():
        assert saved["bytes"] >= floor, (name, saved, floor)
    return floor


def _memory(report: dict) -> dict:
    """A rank's memory facts: at the top of a training report, under "resume" in a resume's."""
    return report["memory"] if "memory" in report else report["resume"]["memory"]


def memory_rows(reports: list[dict]) -> list[dict]:
    rows = []
    for rank, r in enumerate(reports):
        m = _memory(r)
        formula = model_state_bytes(m["numel"], 3, len(reports), precision="fp32")["total"]
        rows.append({"rank": rank, "held": m["held"]["total"], "16Ψ/N formula": formula,
                     "held - formula": m["held"]["total"] - formula})
    return rows


def check_memory(reports: list[dict]) -> int:
    """Every rank holds 4 bytes a padded element in parameters and in gradients and 8 in
    Adam's states for its unpadded elements; with no padding that is notebook 01's
    model_state_bytes(Ψ, stage 3, N, fp32) exactly. Returns the largest padding in bytes."""
    largest = 0
    for row, r in zip(memory_rows(reports), reports, strict=True):
        m = _memory(r)
        held = m["held"]
        assert held["params"] == held["grads"] == 4 * m["padded_local"], m
        assert held["optimizer"] == 8 * m["local"], m
        padding = held["total"] - row["16Ψ/N formula"]
        if m["padded_local"] * len(reports) == m["numel"]:  # nothing padded: the formula
            assert held["total"] == row["16Ψ/N formula"], row
        largest = max(largest, abs(padding))
    return largest
