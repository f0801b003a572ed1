"""A transformer's training FLOPs a token, and the seconds they take at an assumed MFU.

    flops_per_token           6Ψ for the weights, 12·L·h·s for attention, plus what
                              activation checkpointing repeats of the forward
    every_second_matmul_share torchtitan's selective (op) policy: which matmuls it recomputes
    transformer_compute_time  seconds of one rank's forward + backward (+ recompute)

`projection` re-exports these names; notebook 07 checks them against torchtitan's Llama 3.1
8B on 8 H100s.
"""

from __future__ import annotations

from zero_lab.predict.links import checked_integer, checked_number

H100_BF16_FLOPS = 989e12  # an H100 SXM's dense bf16 peak, no sparsity (NVIDIA's datasheet)
# The share of it a step is assumed to sustain, recomputed FLOPs included: a free parameter,
# not a measurement (notebook 07 says what its check against torchtitan can and cannot test).
MFU = 0.40

# Llama 3.1 8B's shape, the model torchtitan's published FSDP runs trained
# (torchtitan, benchmarks/llama3_h100_202412_torchtitan.md).
LLAMA3_8B = {"n_layers": 32, "hidden": 4096, "ffn_hidden": 14336, "heads": 32, "kv_heads": 8,
             "vocab": 128256}


def every_second_matmul_share(n_layers: int, hidden: int, ffn_hidden: int, heads: int,
                              kv_heads: int, vocab: int) -> float:
    """The share of a Llama-style model's matmul FLOPs that torchtitan's selective op policy
    recomputes: inside each checkpointed block it saves every mm's output except every
    second one (torchtitan at 9dec370, the benchmark's commit, parallelize_llama.py
    `_save_list` and `_custom_policy`: "Saves output of all compute ops, except every second
    mm"), and saves attention's output. A block's mms run q, k, v, o, w1, w3, w2, so k, o and
    w3 are recomputed: 36.5% of Llama 3.1 8B's block matmuls. The output head lies outside
    the blocks and is never recomputed, so of all its matmul FLOPs the share is 34.0%."""
    h, kv = hidden, hidden // heads * kv_heads
    block = {"q": h * h, "k": h * kv, "v": h * kv, "o": h * h,
             "w1": h * ffn_hidden, "w3": h * ffn_hidden, "w2": h * ffn_hidden}
    recomputed = sum(size for i, size in enumerate(block.values(), 1) if i % 2 == 0)
    return n_layers * recomputed / (n_layers * sum(block.values()) + vocab * h)


# What checkpointing repeats of the forward: (share of the weights' matmul FLOPs, share of
# attention's). "selective": torchtitan's op policy on Llama 3.1 8B (every second matmul in a
# block, attention's output saved); "full": the whole forward again.
RECOMPUTE = {"none": (0.0, 0.0), "selective": (every_second_matmul_share(**LLAMA3_8B), 0.0),
             "full": (1.0, 1.0)}


def flops_per_token(n_params: float, n_layers: int, hidden: int, seq_len: int,
                    recompute: str = "none") -> float:
    """Training FLOPs a token: 6Ψ for the weights' matmuls (2 forward, 4 backward), 12·L·h·s
    for attention's Q·Kᵀ and P·V (2·s·h each a layer forward, x3 with backward; the causal
    mask's saving not counted, as Megatron and torchtitan count), plus what `recompute`
    repeats (full: 2Ψ + 4·L·h·s, 8Ψ + 16·L·h·s in all; selective: 2Ψ x RECOMPUTE's share).
    Ψ: the parameters that multiply (an untied input embedding is a lookup)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE)}; got {recompute!r}")
    matmuls, attention = RECOMPUTE[recompute]
    return ((6 + 2 * matmuls) * checked_number("n_params", n_params)
            + (12 + 4 * attention) * n_layers * hidden * checked_integer("seq_len", seq_len))


def transformer_compute_time(n_params: float, tokens: float, n_layers: int, hidden: int,
                             seq_len: int, recompute: str = "none",
                             flops_per_s: float = MFU * H100_BF16_FLOPS) -> float:
    """Seconds of one rank's forward + backward (+ recompute) on `tokens` tokens."""
    return (checked_number("tokens", tokens) * flops_per_token(n_params, n_layers, hidden, seq_len,
                                                        recompute) / flops_per_s)
