"""FSDP2 on top of tensor parallelism, a 2-D mesh of d x t ranks: what one rank holds and sends
(notebook 10). No torch.

Tensor parallelism (Megatron-LM's MLP split; torch's `ColwiseParallel` on the first matrix,
`RowwiseParallel` on the second) gives each of the t ranks of a "tp" group 1/t of every
block's parameters, Ψ_b/t, and of the hidden activations; the block's input and output stay
whole on every tp rank, so the second matrix's partial sums are all-reduced, b·s·h elements,
in forward, and the gradient of the block's input likewise in backward. FSDP2 then shards
each rank's Ψ_b/t over the d ranks of its "dp" group: a rank holds Ψ_b/(t·d), and gathers and
reduce-scatters Ψ_b/t messages over "dp", as notebook 05's stage 3 does with Ψ_b.

    collective      mesh dim  per block and step                      message
    all-gather      dp        forward, and backward if resharded       Ψ_b/t parameters
    reduce-scatter  dp        backward                                 Ψ_b/t gradients
    all-reduce      tp        forward                                  b·s·h activations
    all-reduce      tp        backward, if the block's input needs a   b·s·h activation
                              gradient (not the first block's data)    gradients

What t does not change: the model states of N = t·d ranks fully sharded are 16Ψ/N with Adam
in mixed precision, whatever t is (`model_state_bytes`), so a model whose states do not fit
on N GPUs fits on N GPUs with TP neither. What it divides by t: the unit FSDP gathers, and
the activations inside a block (without sequence parallelism, the block's input and output
stay whole).
"""

from __future__ import annotations

from zero_lab.collectives.volume import ring_bytes_sent


def held_elements(psi: int, t: int, d: int) -> float:
    """Parameters one rank holds: Ψ/(t·d) (each parameter divisible on its split dims)."""
    _check_mesh(t, d)
    return psi / (t * d)


def model_state_bytes(psi: float, t: int, d: int, bytes_per_param: int = 16) -> float:
    """Model states one rank holds fully sharded over t·d ranks: 16Ψ/(t·d) with Adam in mixed
    precision (2 + 2 + 12), the same for every split of N = t·d into t and d."""
    _check_mesh(t, d)
    return bytes_per_param * psi / (t * d)


def gathered_unit_bytes(psi_block: float, t: int, dtype_bytes: int = 2) -> float:
    """A block's parameters as FSDP gathers them on one rank: Ψ_b/t, in the compute dtype."""
    _check_mesh(t, 1)
    return dtype_bytes * psi_block / t


def step_messages(psi_block: int, blocks: int, t: int, d: int, activation_elems: int, *,
                  dtype_bytes: int = 4, reshard_after_forward: bool = True,
                  input_requires_grad: bool = False) -> dict[str, dict[str, float]]:
    """{"<dim> <op> <phase>": {"count", "nbytes", "sent_bytes"}} of one forward and backward of
    `blocks` MLP blocks of `psi_block` parameters under FSDP2 ("dp", size d) on tensor
    parallelism ("tp", size t): `nbytes` the full message of one collective in the ledger's
    sense (`CommRecord`), `sent_bytes` what one rank sends of all of them on a ring.
    `activation_elems`: b·s·h, a block's output on one rank. `input_requires_grad`: whether
    the first block's input needs a gradient (False: it is data)."""
    _check_mesh(t, d)
    shard = psi_block // t * dtype_bytes  # the TP shard of a block, gathered over dp
    acts = activation_elems * dtype_bytes
    rows = {
        "dp all_gather forward": (blocks, shard, d),
        "dp all_gather backward": (blocks if reshard_after_forward else 0, shard, d),
        "dp reduce_scatter backward": (blocks, shard, d),
        "tp all_reduce forward": (blocks, acts, t),
        "tp all_reduce backward": (blocks - (0 if input_requires_grad else 1), acts, t),
    }
    out = {}
    for key, (count, nbytes, n) in rows.items():
        if count and n > 1:
            op = key.split()[1]
            out[key] = {"count": count, "nbytes": nbytes,
                        "sent_bytes": count * ring_bytes_sent(op, nbytes, n)}
    return out


def _check_mesh(t: int, d: int) -> None:
    if t < 1 or d < 1:
        raise ValueError(f"mesh sizes must be >= 1, got t={t}, d={d}")
