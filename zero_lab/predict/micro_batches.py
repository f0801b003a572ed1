"""Gradient accumulation in the choice of a stage: k micro-batches per optimizer step.

How each stage really accumulates (the modes of `zero_lab.stages.accumulation`; its bytes
are `knobs.accumulation_messages`, the formulas notebook 08 measures with the ledger):

    stage  mode         sends per optimizer step   holds between micro-batches
    0, 1   (no_sync)    2Ψ, once                   its full gradients, as always
    2      "sharded"    (k+1)Ψ: a reduce-scatter   its gradient slice (DeepSpeed's ZeRO-2;
                        every micro-batch          "unsharded" would be stage 1 exactly)
    3      "sharded"    3kΨ: gathers twice and     its slices (FSDP2's loop as written)
                        reduce-scatters each one
    3      "unsharded"  (2k+1)Ψ: one reduce-       + the full gradients, elem·Ψ a rank
                        scatter at the end         (FSDP2's set_requires_gradient_sync(False))

Stage 3 keeps re-gathering every unit twice a micro-batch in both modes: keeping them
gathered (reshard_after_forward=False and FSDP2's set_reshard_after_backward(False)) costs
the full parameters' memory as well, and `recommend` does not offer it.
"""

from __future__ import annotations

from zero_lab import memory
from zero_lab.predict.knobs import accumulation_volume

# The modes `candidates` prices per stage; stage 3's "unsharded" only when k > 1 (at k = 1
# the two are one and the same).
MODES = {0: ("unsharded",), 1: ("unsharded",), 2: ("sharded",), 3: ("sharded", "unsharded")}

HOW = {  # (stage, mode): what it does with k micro-batches, in words
    (0, "unsharded"): "accumulates into its full gradients and all-reduces once",
    (1, "unsharded"): "accumulates into its full gradients and reduce-scatters once",
    (2, "sharded"): "reduce-scatters every micro-batch, as DeepSpeed's ZeRO-2 does",
    (3, "sharded"): "gathers every unit twice and reduce-scatters every micro-batch",
    (3, "unsharded"): ("FSDP2's set_requires_gradient_sync(False): one reduce-scatter, "
                       "the full gradients held"),
}


def modes(stage: int, accumulation: int) -> tuple[str, ...]:
    """The accumulation modes `candidates` considers for `stage` at k micro-batches."""
    return MODES[stage] if accumulation > 1 else MODES[stage][:1]


def volume_formula(stage: int, mode: str) -> str:
    """The volume per optimizer step as a formula in k: '2Ψ', '(k+1)Ψ', '3kΨ', read off
    `knobs.accumulation_volume` at k = 1 and 2 (it is a + b·k) and checked at k = 8."""
    v1, v2 = (accumulation_volume(stage, k, grad_accumulation=mode) for k in (1, 2))
    b, a = v2 - v1, 2 * v1 - v2
    if accumulation_volume(stage, 8, grad_accumulation=mode) != a + 8 * b:
        raise ValueError(f"stage {stage} {mode}: the volume is not a + b·k")
    k = "k" if b == 1 else f"{b:g}k"
    if not b:
        return f"{a:g}Ψ"
    return f"{k}Ψ" if not a else f"({k}+{a:g})Ψ"


def state_bytes(n_params: float, stage: int, world_size: int, precision: str, optimizer: str,
                mode: str, accumulation: int) -> int:
    """One rank's model states while the micro-batches run: `memory.model_state_bytes`, and
    at stage 3 with "unsharded" accumulation the full gradients in place of their slice
    (stage 1's gradients, `memory.model_state_bytes(..., 1, ...)`). FSDP2 keeps them in
    the working precision, or in fp32 with reduce_dtype=float32 (twice this)."""
    states = memory.model_state_bytes(n_params, stage, world_size, precision, optimizer)
    if stage == 3 and mode == "unsharded" and accumulation > 1:
        full = memory.model_state_bytes(n_params, 1, world_size, precision, optimizer)
        return states["total"] - states["grads"] + full["grads"]
    return states["total"]


def sends_words(row: dict) -> str:
    """'stage 2 sends (k+1)Ψ = 9Ψ at k = 8 (reduce-scatters every micro-batch, ...)'."""
    k, stage, mode = row["accumulation"], row["stage"], row["grad_accumulation"]
    formula = volume_formula(stage, mode)
    value = f"{accumulation_volume(stage, k, grad_accumulation=mode):g}Ψ"
    said = formula if formula == value else f"{formula} = {value}"
    return f"sends {said} at k = {k} ({HOW[stage, mode]})"
