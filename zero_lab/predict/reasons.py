"""`recommend`'s reasons in words: each names the numbers behind the choice.

    label               "stage 2", "stage 3 as HSDP (8 x 8)", "stage 3 (gradients unsharded)"
    memory_words        states + activations + floor, in GiB
    why_not             why a stage tied in time lost the tie-break
    hybrid_words        HSDP against flat stage 3 on several nodes
    accumulation_words  with k micro-batches: what each stage sends per optimizer step
    tensor_parallel_words  nothing fits: whether tensor parallelism inside a node would help
"""

from __future__ import annotations

from zero_lab.predict.micro_batches import sends_words
from zero_lab.predict.step_time import COLLECTIVES_PER_BUCKET

GiB = 2**30


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def label(row: dict) -> str:
    """How a row is named in a reason: "stage 2", or "stage 3 as HSDP (8 x 8)"."""
    if row.get("mesh"):
        return f"stage 3 as HSDP ({row['mesh'][0]} x {row['mesh'][1]})"
    if row["stage"] == 3 and row.get("accumulation", 1) > 1 and \
            row["grad_accumulation"] == "unsharded":
        return "stage 3 (gradients unsharded)"
    return f"stage {row['stage']}"


def memory_words(row: dict) -> str:
    words = f"states {gib(row['model_state_bytes'])}"
    if row["activation_bytes"]:
        words += f" + activations {gib(row['activation_bytes'])}"
    if row["floor_bytes"]:
        words += f" + floor {gib(row['floor_bytes'])}"
    return words


def _per_bucket(row: dict) -> int:
    """Collectives per bucket: HSDP adds the all-reduce across the groups to stage 3's."""
    return COLLECTIVES_PER_BUCKET[row["stage"]] + (1 if row.get("mesh") else 0)


def why_not(other: dict, chosen: dict) -> str:
    """Why `other`, tied in time with `chosen`, lost the tie-break, in words."""
    s = label(other)
    if other["volume_psi"] > chosen["volume_psi"]:
        if other.get("accumulation", 1) > 1 and not other.get("mesh"):
            return f"{s} {sends_words(other)}"
        return f"{s} sends {other['volume_psi']:g}Ψ"
    per_bucket = other["collectives"] / (chosen["collectives"] / _per_bucket(chosen))
    if other["collectives"] > chosen["collectives"]:
        return f"{s} makes {per_bucket:g} collectives per bucket"
    return f"{s} holds {gib(chosen['headroom_bytes'] - other['headroom_bytes'])} more"


def hybrid_words(row: dict, rows: list[dict]) -> str:
    """Stage 3 chosen on several nodes: HSDP against flat stage 3, in words."""
    flat = next(r for r in rows if r["stage"] == 3 and r["mesh"] is None)
    hsdp = next((r for r in rows if r["mesh"]), None)
    if hsdp is None:
        return ""
    if row is hsdp:
        return (f"; its all-gathers stay inside a node: {hsdp['network_bytes'] / 1e9:.3g} GB a "
                f"step over the network per GPU, where flat stage 3 sends "
                f"{flat['network_bytes'] / 1e9:.3g} GB")
    if not hsdp["fits_memory"]:
        return (f"; {label(hsdp)} would need {gib(hsdp['per_rank_bytes'])} (its states "
                f"sharded over one node's {hsdp['mesh'][1]} GPUs)")
    return ""


def accumulation_words(row: dict, rows: list[dict], said: list[dict]) -> str:
    """With k > 1 micro-batches a step: what the chosen stage sends per optimizer step, and
    the same stage's other mode (`said` lists those named already) if it would send less
    but does not fit (stage 3 holding its gradients unsharded)."""
    if row.get("accumulation", 1) == 1:
        return ""
    words = f"; {label(row)} {sends_words(row)}" if not row.get("mesh") else ""
    for other in rows:
        if other is row or other.get("mesh") or any(other is r for r in said) or \
                other["stage"] != row["stage"] or other["fits_memory"] or \
                other["volume_psi"] >= row["volume_psi"]:
            continue
        words += (f"; {label(other)} would send {sends_words(other).removeprefix('sends ')} "
                  f"but needs {gib(other['per_rank_bytes'])}")
    return words


def tensor_parallel_words(row: dict, gpu_bytes: float, reserve_fraction: float,
                          world_size: int, degree: int) -> str:
    """Nothing fits: would tensor parallelism of `degree` GPUs inside a node help? It splits
    every matmul's weights and, with sequence parallelism, the activations and the unit a
    step gathers, each by t; it does not shrink fully sharded model states below 16Ψ/N, for
    the N GPUs hold them all between them whatever the layout."""
    room = gpu_bytes * (1 - reserve_fraction)
    states = row["model_state_bytes"]
    if states > room:
        return (f"; tensor parallelism would not help: it divides activations and the "
                f"gathered unit, not the states, {gib(states)} a GPU at 16Ψ/N "
                f"({gib(states * world_size)} of states on {world_size} x {gib(gpu_bytes)} = "
                f"{gib(gpu_bytes * world_size)})")
    t = max(1, min(degree, world_size))
    needed = states + (row["activation_bytes"] + row["floor_bytes"]) / t
    verdict = "fits" if needed <= room else "still does not fit"
    return (f"; the activations are the reason: tensor parallelism inside a node (t = {t}) "
            f"divides them and the gathered unit by t, about {gib(needed)} a GPU, which "
            f"{verdict}")
