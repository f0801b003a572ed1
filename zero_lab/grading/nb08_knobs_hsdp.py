"""Notebook 08, hybrid sharding: the claims its cells assert on a launch of
zero_lab/workers/knob_hsdp.py, as named checks that tests/test_hsdp.py feeds mutants.

Each holds by construction (bytes, equality to torch's FSDP2), never by the machine's speed:
- bytes per level: what HSDP's step sent inside its groups and across them is, op by op and
  byte for byte, `projection.hybrid_bytes_per_step`; flat stage 3 sent the same formula's
  inside-the-group part with the whole world as the group, and nothing across;
- memory: each layout holds `memory.model_state_bytes` at stage 3 over the ranks it shards
  across (S for HSDP, N flat) plus its padding, so HSDP holds more than flat stage 3;
- FSDP2 as HSDP on the same 2-D layout ends at our weights.
"""

from __future__ import annotations

from zero_lab import memory
from zero_lab.predict.projection import hybrid_bytes_per_step

FSDP2_TOLERANCE = 1e-5  # fp32 after a few Adam steps; the sums may run in another order


def check_bytes_per_level(by_level: dict, unit_numels: list[int], replicas: int, shards: int,
                          element_size: int = 4, stage: int = 3) -> dict:
    """A hybrid step's ledger, {level: {op: bytes}}, equals the formula exactly; returns it."""
    expected = hybrid_bytes_per_step(unit_numels, stage, replicas, shards, element_size)
    assert by_level == expected, (f"sent per level {by_level}, the formula says {expected} "
                                  f"(mesh {replicas} x {shards}, units {unit_numels})")
    return expected


def check_flat_bytes(by_level: dict, unit_numels: list[int], world_size: int,
                     element_size: int = 4) -> dict:
    """Flat stage 3 on N ranks: the formula's inside-the-group bytes with S = N, all on the
    whole world, nothing across."""
    expected = {"world": hybrid_bytes_per_step(unit_numels, 3, 1, world_size,
                                               element_size)["shard"]}
    assert by_level == expected, f"flat stage 3 sent {by_level}, expected {expected}"
    return expected


def check_held(held_bytes: int, psi: int, shard_over: int, units: int) -> int:
    """Model states held after a step = 16 bytes x Ψ/shard_over (fp32 + Adam) plus at most
    the padding of its units (< shard_over elements each, 16 bytes an element). Returns
    the padding in bytes."""
    formula = memory.model_state_bytes(psi, 3, shard_over, "fp32", "adam")["total"]
    pad = held_bytes - formula
    assert 0 <= pad <= 16 * shard_over * units, (
        f"held {held_bytes:,} B, the formula for stage 3 over {shard_over} ranks says "
        f"{formula:,} B (+ at most {16 * shard_over * units:,} B of padding)")
    return pad


def check_knob_hsdp(reports: list[dict]) -> dict:
    """Every check above on every rank's report of knob_hsdp.py, and FSDP2's weights; returns
    rank 0's numbers for the notebook to print."""
    for rep in reports:
        replicas, shards = rep["mesh"]
        world, elem = rep["world_size"], rep["element_size"]
        assert replicas * shards == world, rep["mesh"]
        hsdp, flat = rep["hsdp"], rep["zero3"]
        check_bytes_per_level(hsdp["by_level"], hsdp["unit_numels"], replicas, shards, elem)
        check_flat_bytes(flat["by_level"], flat["unit_numels"], world, elem)
        check_held(hsdp["held_bytes"], rep["psi"], shards, len(hsdp["unit_numels"]))
        check_held(flat["held_bytes"], rep["psi"], world, len(flat["unit_numels"]))
        if shards < world:
            assert hsdp["held_bytes"] > flat["held_bytes"], (
                "HSDP shards over fewer ranks than flat stage 3: it must hold more")
        assert rep["fsdp2"]["same_names"], "FSDP2's parameter names differ from ours"
        assert rep["fsdp2"]["max_abs_diff"] <= FSDP2_TOLERANCE, (
            f"FSDP2-HSDP's weights differ from ours by {rep['fsdp2']['max_abs_diff']:.2e}")
    first = reports[0]
    return {"inside": first["hsdp"]["by_level"]["shard"],
            "across": first["hsdp"]["by_level"]["replicate"],
            "flat": first["zero3"]["by_level"]["world"],
            "held": {"hsdp": first["hsdp"]["held_bytes"], "zero3": first["zero3"]["held_bytes"]},
            "peak": {"hsdp": max(r["hsdp"]["peak_bytes"] for r in reports),
                     "zero3": max(r["zero3"]["peak_bytes"] for r in reports)},
            "fsdp2_max_abs_diff": max(r["fsdp2"]["max_abs_diff"] for r in reports)}
