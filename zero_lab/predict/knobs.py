"""The bytes the knobs of notebook 08 must send, from their construction (no measurement).

One function per knob, shared by the tests and the notebook's checks (parent side) and
usable on the rank side; each returns the collectives one optimizer step issues, per op, in
the ledger's vocabulary (`zero_lab.collectives.CommLedger.summary()`), so a measured step can
be compared with it key for key and byte for byte.

Gradient accumulation (stages/accumulation.py), k micro-batches per optimizer step, Ψ the
bytes of the padded flat buffers (groups at stages 0-2, units at stage 3), G of them:

    stage                         all-reduce  reduce-scatter  all-gather     volume
    0, no_sync                    Ψ once                                    2Ψ
    0, every backward sends       Ψ k times                                 2kΨ
    1, no_sync                                Ψ               Ψ (step)      2Ψ
    2, "sharded"                              kΨ              Ψ (step)      (k+1)Ψ
    2, "unsharded", no_sync                   Ψ               Ψ (step)      2Ψ
    3, "sharded", reshard         kΨ          2kΨ (fwd+bwd)   3kΨ
    3, "unsharded", reshard, no_sync          Ψ               2kΨ           (2k+1)Ψ
    3, "sharded", keep gathered               kΨ              Ψ             (k+1)Ψ
    3, "unsharded", keep gathered, no_sync    Ψ               Ψ             2Ψ

("keep gathered": reshard_after_forward=False; without no_sync it gathers in every forward,
kΨ.) The ZeRO paper's volume counts an all-reduce twice; the bytes a rank sends under the
ring algorithm are (N-1)/N of each message, twice for an all-reduce (collectives/volume.py).

torch's FSDP2 (`fsdp2_accumulation_messages`), the first k - 1 backwards under
`set_requires_gradient_sync(False)`, each with `set_reshard_after_backward(rab)`; Ψ its
parameters padded on dim 0 to a multiple of N:

    reshard_after_forward  reshard_after_backward  all-gather     reduce-scatter  volume
    True (the default)     True (the default)      2kΨ            Ψ               (2k+1)Ψ
    True                   False                   (k+1)Ψ         Ψ               (k+2)Ψ
    False (ZeRO-2-like)    True                    kΨ             Ψ               (k+1)Ψ
    False                  False                   Ψ              Ψ               2Ψ

(FSDP2 reshards after every backward by default, so the next micro-batch's forward gathers
again; a unit resharded after forward is gathered again for its backward either way.)
"""

from __future__ import annotations

from zero_lab.collectives.volume import ring_bytes_sent, zero_volume

GRAD_ACCUMULATION = ("sharded", "unsharded")  # as zero_lab.stages.accumulation


def accumulation_messages(stage: int, psi_bytes: int, k: int, world_size: int, *,
                          n_groups: int = 1, no_sync: bool = True,
                          grad_accumulation: str = "sharded",
                          reshard_after_forward: bool = True) -> dict[str, dict[str, float]]:
    """{op: {"count", "nbytes", "sent_bytes", "volume"}} of one optimizer step of k
    micro-batches at `stage` (the table above), in the keys of CommLedger.summary().

    `no_sync`: the first k - 1 backwards run under model.no_sync(); False: every backward
    sends. `n_groups`: flat groups (stages 0-2) or units (stage 3), one collective each.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if grad_accumulation not in GRAD_ACCUMULATION:
        raise ValueError(f"grad_accumulation must be one of {GRAD_ACCUMULATION}")
    if k < 1 or world_size < 1 or psi_bytes < 0 or n_groups < 1:
        raise ValueError("k, world_size and n_groups must be >= 1, psi_bytes >= 0")
    sends = 1 if no_sync else k  # backwards that send the gradient
    if stage >= 2 and grad_accumulation == "sharded":
        sends = k  # every backward reduce-scatters, no_sync or not
    passes: dict[str, int] = {}  # op -> how many times Ψ goes through it
    if stage == 0:
        passes["all_reduce"] = sends
    elif stage in (1, 2):
        passes["reduce_scatter"] = sends
        passes["all_gather"] = 1  # the step's updated slices
    else:
        kept = not reshard_after_forward
        forward_gathers = 1 if kept and no_sync else k
        backward_gathers = 0 if kept else k
        passes["all_gather"] = forward_gathers + backward_gathers
        passes["reduce_scatter"] = sends
    return _messages(passes, psi_bytes, n_groups, world_size)


def _messages(passes: dict[str, int], psi_bytes: int, n_groups: int,
              world_size: int) -> dict[str, dict[str, float]]:
    """{op: times Ψ goes through it} -> {op: {"count", "nbytes", "sent_bytes", "volume"}}."""
    return {op: {"count": times * n_groups, "nbytes": times * psi_bytes,
                 "sent_bytes": ring_bytes_sent(op, times * psi_bytes, world_size),
                 "volume": zero_volume(op, times * psi_bytes)} for op, times in passes.items()}


def accumulation_volume(stage: int, k: int, **options) -> float:
    """The ZeRO paper's volume of one optimizer step, in units of Ψ (e.g. 2 for stage 0)."""
    return sum(m["volume"] for m in accumulation_messages(stage, 1, k, 2, **options).values())


def fsdp2_accumulation_messages(psi_bytes: int, k: int, world_size: int, *,
                                n_groups: int = 1, reshard_after_forward: bool = True,
                                reshard_after_backward: bool = True
                                ) -> dict[str, dict[str, float]]:
    """{op: {"count", "nbytes", "sent_bytes", "volume"}} of one optimizer step of k
    micro-batches under torch's FSDP2 (`fully_shard` on `n_groups` modules holding Ψ =
    `psi_bytes`), the first k - 1 backwards with `set_requires_gradient_sync(False)` and
    `set_reshard_after_backward(reshard_after_backward)`, the last with both True (the
    table above). In FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) a
    forward gathers unless the parameters are still unsharded, a backward gathers when the
    forward resharded them, and a backward without gradient sync reshards only when
    `reshard_after_backward` is set. On one rank FSDP2 issues no collective at all."""
    if k < 1 or world_size < 1 or psi_bytes < 0 or n_groups < 1:
        raise ValueError("k, world_size and n_groups must be >= 1, psi_bytes >= 0")
    if world_size == 1:
        return {}
    forward_gathers = 1 + (k - 1) * reshard_after_backward
    backward_gathers = k * reshard_after_forward
    return _messages({"all_gather": forward_gathers + backward_gathers, "reduce_scatter": 1},
                     psi_bytes, n_groups, world_size)
