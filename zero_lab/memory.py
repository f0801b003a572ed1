"""Where training memory goes: pure-Python calculators (no torch needed).

Notation follows the ZeRO paper (Rajbhandari et al., 2020, arXiv:1910.02054, section 3.1):
Ψ (`n_params`) parameters, N_d (`world_size`) data-parallel ranks, and K the optimizer's
bytes per parameter *including* the fp32 master copy that mixed precision keeps. A training
recipe spends, per parameter, `p` bytes on the working parameters, `g` on gradients and `K`
on the optimizer, and ZeRO stage s shards more of them across the N_d ranks:

    stage 0 (plain data parallel)  (p + g + K)·Ψ          per rank
    stage 1 (P_os)                 (p + g)·Ψ + K·Ψ/N_d
    stage 2 (P_os+g)               p·Ψ + (g + K)·Ψ/N_d
    stage 3 (P_os+g+p)             (p + g + K)·Ψ/N_d

The paper's mixed precision is p = 2, g = 2, K = 12 with Adam: 16 bytes. That is one
accounting, not the only one: Megatron-LM, for example with bf16, accumulates and all-reduces
gradients in an fp32 "main grad" buffer (g = 4), 2 + 4 + 12 = 18 bytes; `grad_bytes=4` says so
here. Whatever g is, stages 2 and 3 divide it by N_d; stage 1 divides K only (fp32 master too).

Every function returns exact integer bytes per rank; Ψ/N_d becomes the size of one rank's
partition, ceil(Ψ/N_d) elements (optionally padded the way real implementations pad).
Published numbers (the paper's Figure 1, Tables 1 and 2; DeepSpeed's estimators) live at
the end of the module with their sources, so notebooks and tests compare against them.
"""

from __future__ import annotations

import math
from fractions import Fraction
from numbers import Integral, Real

# shard()'s names too: "bf16" and "fp16" are mixed precision (16-bit compute, fp32 masters),
# "mixed" is bf16; one vocabulary, so a learner can pass the same word to both.
PRECISIONS = ("fp32", "mixed", "bf16", "fp16")
OPTIMIZERS = ("adam", "adamw", "sgd_momentum", "sgd")
STAGES = (0, 1, 2, 3)
CHECKPOINTING = ("none", "selective", "full")
ATTENTION = ("unfused", "fused")  # attention written out (the paper's count), or a fused kernel
# Gradient bytes per parameter a recipe keeps: `grad_bytes=None` means the working precision's
# (4 in fp32, 2 in mixed precision, the ZeRO paper's count); 4 in mixed precision is an fp32
# gradient buffer, such as Megatron-LM's main_grad (bf16 params + fp32 grads: 18 bytes/param).
GRAD_BYTES = (2, 4)

# fp32 optimizer state tensors each optimizer keeps per parameter (Adam: m and v).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}

GB = 10**9  # the paper's (and the seed blog's) "GB"
GiB = 2**30  # what GPU vendors, torch and DeepSpeed's printouts actually count in
MiB = 2**20


# ------------------------------------------------------------------------ validation
# Every public function checks its arguments with these helpers and raises ValueError naming
# the argument and the value it got. Counts (Ψ, layers, tokens) are positive whole numbers,
# floats such as 7.5e9 included; ranks, stages and pad_to are ints (True and 1.0 are not);
# byte budgets are finite positive numbers; switches are True or False; names are one of the
# module's tuples (PRECISIONS, OPTIMIZERS, CHECKPOINTING).


def _choice(name: str, value, accepted: tuple, expected: str | None = None):
    """`value` if it is one of `accepted` *and* of their kind: True and 1.0 are not stage 1."""
    kind = str if isinstance(accepted[0], str) else Integral
    if isinstance(value, kind) and not isinstance(value, bool) and value in accepted:
        return value if kind is str else int(value)
    expected = expected or "one of " + ", ".join(map(repr, accepted))
    raise ValueError(f"{name} must be {expected}; got {value!r}")


def _whole_positive(name: str, value, what: str = "count", minimum: int = 1) -> int:
    """`value` as an int >= `minimum` (1 or 0); integral floats such as 7.5e9 are accepted."""
    ok = isinstance(value, Real) and not isinstance(value, bool)
    if ok and not isinstance(value, Integral):
        ok = math.isfinite(value) and float(value).is_integer()
    if not ok or value < minimum:
        sign = "positive" if minimum == 1 else "non-negative"
        raise ValueError(
            f"{name} must be a {sign} whole {what} (an int, or a float with no fractional "
            f"part such as 7.5e9); got {value!r}"
        )
    return int(value)


def _positive_int(name: str, value, what: str, optional: bool = False) -> int | None:
    """`value` as an int >= 1, never a bool or a float (ranks, alignment); None if optional."""
    if optional and value is None:
        return None
    if not isinstance(value, Integral) or isinstance(value, bool) or value < 1:
        none = "None or " if optional else ""
        raise ValueError(f"{name} must be {none}an int >= 1 ({what}); got {value!r}")
    return int(value)


def _world_size(world_size) -> int:
    return _positive_int("world_size", world_size, "number of ranks")


def _positive_number(name: str, value, what: str = "number"):
    """`value` if it is a finite real number > 0 (not a bool, not a string)."""
    ok = isinstance(value, Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive {what}; got {value!r}")
    return value


def _positive_bytes(name: str, value) -> float:
    return _positive_number(name, value, "number of bytes")


def _flag(name: str, value) -> bool:
    """`value` if it is True or False: 1, "False" and None are not switches."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


_DIMENSIONS = {"n_layers": "number of layers", "seq_len": "number of tokens",
               "batch": "number of sequences", "hidden": "hidden size", "heads": "number of heads"}


def _grad_bytes(grad_bytes, precision: str) -> int:
    """Gradient bytes per parameter: the working precision's if None, else 2 or 4 (not 4.0)."""
    working = 4 if precision == "fp32" else 2
    if grad_bytes is None:
        return working
    if precision == "fp32":  # fp32 training keeps fp32 gradients; 16-bit ones are no recipe
        return _choice("grad_bytes", grad_bytes, (4,), f"None or 4 with precision {precision!r}")
    return _choice("grad_bytes", grad_bytes, GRAD_BYTES, "None, 2 or 4")


def _dims(**dims) -> tuple[int, ...]:
    """Transformer dimensions (L, s, b, h, a), in the order given, as positive whole counts."""
    return tuple(_whole_positive(name, value, _DIMENSIONS[name]) for name, value in dims.items())


# ------------------------------------------------------------------- bytes per param


def bytes_per_param(
    precision: str = "mixed", optimizer: str = "adam", grad_bytes: int | None = None
) -> dict[str, int]:
    """Bytes each parameter costs in model states, broken down.

    Returns {"params", "grads", "master", "optimizer_states", "optimizer", "total"} where
    "optimizer" = master + optimizer_states is the paper's K. "fp32" keeps everything in
    fp32 (4 + 4 + 8 = 16 with Adam, K = 8); "mixed" keeps 16-bit params and grads plus an
    fp32 master copy and fp32 states (2 + 2 + 12 = 16 with Adam, K = 12: the ZeRO paper's
    accounting). `grad_bytes=4` with "mixed" keeps the gradients in fp32 instead, as
    Megatron-LM's main_grad buffer does (2 + 4 + 12 = 18 with Adam; K is still 12).
    """
    _choice("precision", precision, PRECISIONS)
    _choice("optimizer", optimizer, OPTIMIZERS)
    grads = _grad_bytes(grad_bytes, precision)
    working = 4 if precision == "fp32" else 2  # bf16/fp16 in mixed precision
    master = 0 if precision == "fp32" else 4  # fp32 copy the update is applied to
    states = 4 * OPTIMIZER_STATES[optimizer]  # states are fp32 in both recipes
    return {
        "params": working,
        "grads": grads,
        "master": master,
        "optimizer_states": states,
        "optimizer": master + states,
        "total": working + grads + master + states,
    }


# ------------------------------------------------------------------ per-rank states


def partition_elements(n_params: int, world_size: int, pad_to: int | None = None) -> int:
    """Elements one rank owns when Ψ is split into `world_size` equal slices.

    ceil(Ψ/N): the flat buffer is padded at the end so every rank holds the same number.
    `pad_to` additionally rounds each slice up to a multiple of `pad_to` elements
    (pad_to=1 is the course's partition.py; DeepSpeed ZeRO-1/2 aligns slices to 2 elements).
    """
    n = _whole_positive("n_params", n_params, "number of parameters")
    world = _world_size(world_size)
    pad = _positive_int("pad_to", pad_to, "elements", optional=True)
    size = -(-n // world)
    if pad is not None:
        size = -(-size // pad) * pad
    return size


def model_state_bytes(
    n_params: int | float,
    stage: int,
    world_size: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    pad_to: int | None = None,
    grad_bytes: int | None = None,
) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer states under ZeRO `stage`.

    Returns {"params", "grads", "optimizer", "total"} (ints). Sharded states cost one
    partition, `partition_elements(...)`. With `pad_to=None` the replicated states hold
    exactly Ψ elements (the paper's arithmetic); with `pad_to` set they hold the whole
    padded flat buffer, N·partition elements, as a flat-buffer implementation does.
    `grad_bytes` as in `bytes_per_param`: fp32 gradients (4) are sharded from stage 2 on,
    like 16-bit ones; stage 1 shards the optimizer (fp32 master and states) only, which is
    Megatron-LM's distributed optimizer: 6 + 12/N bytes/param with bf16 params, fp32 grads.
    """
    n = _whole_positive("n_params", n_params, "number of parameters")
    stage = _choice("stage", stage, STAGES)
    world = _world_size(world_size)
    b = bytes_per_param(precision, optimizer, grad_bytes)
    shard = partition_elements(n, world, pad_to)
    full = n if (pad_to is None or stage == 0) else shard * world
    owned = {  # elements of each state this rank holds
        0: (n, n, n),
        1: (full, full, shard),
        2: (full, shard, shard),
        3: (shard, shard, shard),
    }[stage]
    out = {
        "params": b["params"] * owned[0],
        "grads": b["grads"] * owned[1],
        "optimizer": b["optimizer"] * owned[2],
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def largest_model(
    gpu_bytes: float,
    world_size: int,
    stage: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    pad_to: int | None = None,
    grad_bytes: int | None = None,
) -> int:
    """The largest Ψ whose per-rank model states fit in `gpu_bytes` (0 if none does).

    Exact: binary search on `model_state_bytes`, which is monotone in Ψ.
    Activations and buffers are not counted, as in the paper's Table 2.
    """
    budget = _positive_bytes("gpu_bytes", gpu_bytes)
    world = _world_size(world_size)
    stage = _choice("stage", stage, STAGES)
    pad_to = _positive_int("pad_to", pad_to, "elements", optional=True)
    b = bytes_per_param(precision, optimizer, grad_bytes)

    def fits(n: int) -> bool:
        return model_state_bytes(n, stage, world, precision, optimizer, pad_to,
                                 grad_bytes)["total"] <= budget

    # Upper bound from the paper's formula: bytes/param/rank >= replicated part + sharded/N.
    replicated = {0: b["total"], 1: b["params"] + b["grads"], 2: b["params"], 3: 0}[stage]
    per_param = Fraction(replicated) + Fraction(b["total"] - replicated, world)
    lo, hi = 0, int(Fraction(budget) / per_param) + 1
    while lo < hi:  # invariant: fits(lo) or lo == 0; not fits(hi + 1)
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def state_breakdown_by_stage(
    n_params: int | float,
    world_size: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    pad_to: int | None = None,
    grad_bytes: int | None = None,
) -> dict[int, dict[str, int]]:
    """`model_state_bytes` for stages 0-3 at once: {stage: {"params", ...}}."""
    return {
        s: model_state_bytes(n_params, s, world_size, precision, optimizer, pad_to, grad_bytes)
        for s in STAGES
    }


# ------------------------------------------------------------------ residual states


def activation_bytes_per_layer(
    seq_len: int,
    batch: int,
    hidden: int,
    heads: int,
    checkpointing: str = "none",
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    attention: str = "unfused",
) -> int:
    """Activation bytes one GPT-style transformer layer keeps for backward (16-bit).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", section 4): s·b·h·(34 + 5·a·s/h) bytes with no parallelism, made of
    attention 11·sbh + 5·a·s²·b, MLP 19·sbh, two layer norms 4·sbh (16-bit values,
    1-byte dropout masks). "selective" recomputes the attention core (drops 5·a·s²·b);
    "full" keeps only the layer's 16-bit input, 2·sbh; the backward pass then
    re-materialises one layer at a time. Tensor parallelism t splits everything but the
    layer-norm and dropout terms (10·sbh); sequence parallelism splits those too.

    attention="fused" is what current frameworks run (FlashAttention, torch's
    scaled_dot_product_attention): the kernel keeps Q, K, V, its output and one fp32
    log-sum-exp per head and token (4·a·s·b bytes), and recomputes the softmax and its
    dropout mask in backward, so the 5·a·s²·b term becomes 4·a·s·b. The default, "unfused",
    is the paper's count (attention written out, as `workloads.GPTLayer` does).
    """
    s, b, h, a = _dims(seq_len=seq_len, batch=batch, hidden=hidden, heads=heads)
    t = _positive_int("tensor_parallel", tensor_parallel, "number of ranks")
    checkpointing = _choice("checkpointing", checkpointing, CHECKPOINTING)
    sequence_parallel = _flag("sequence_parallel", sequence_parallel)
    attention = _choice("attention", attention, ATTENTION)
    sbh = s * b * h
    if checkpointing == "full":
        return 2 * sbh // t if sequence_parallel else 2 * sbh
    unsplit = 10 * sbh  # layer norms + dropout masks + their inputs: replicated under TP
    split = 24 * sbh  # QKV/projections/MLP inputs: divided by t
    attention_core = 5 * a * s * s * b  # softmax, its dropout mask, and attention-over-V input
    if attention == "fused":
        attention_core = 4 * a * s * b  # the kernel's fp32 log-sum-exp; no s x s tensor
    if checkpointing == "selective":
        attention_core = 0
    if sequence_parallel:
        return (unsplit + split + attention_core) // t
    return unsplit + (split + attention_core) // t


def activation_bytes_saved_by_torch(seq_len: int, batch: int, hidden: int, heads: int,
                                    mask_bytes: int = 2) -> int:
    """What PyTorch's autograd keeps for `workloads.GPTLayer` in 16-bit: Korthikanti's count
    with two implementation details. Dropout masks take `mask_bytes` each (2 on CPU, where
    torch keeps the mask in the activation dtype; Korthikanti counts 1, as CUDA's bool
    masks), and each LayerNorm keeps a 16-bit mean and 1/std per token (2 x 2·s·b per norm).
    """
    s, b, h, a = _dims(seq_len=seq_len, batch=batch, hidden=hidden, heads=heads)
    mask_bytes = _whole_positive("mask_bytes", mask_bytes, "bytes per mask element")
    dropout_elements = a * s * s * b + 2 * s * b * h  # after the softmax, projection and MLP
    layernorm_stats = 2 * (2 * s * b * 2)
    return (activation_bytes_per_layer(s, b, h, a) + (mask_bytes - 1) * dropout_elements
            + layernorm_stats)


def activation_breakdown_per_layer(seq_len: int, batch: int, hidden: int, heads: int) -> dict:
    """Korthikanti et al.'s per-layer terms (16-bit, no parallelism), summing to the total."""
    s, b, h, a = _dims(seq_len=seq_len, batch=batch, hidden=hidden, heads=heads)
    sbh = s * b * h
    return {
        "layernorm inputs (2 x 2sbh)": 4 * sbh,
        "QKV input 2sbh": 2 * sbh,
        "Q and K for QK^T 4sbh": 4 * sbh,
        "softmax output 2as^2b": 2 * a * s * s * b,
        "softmax dropout mask as^2b": a * s * s * b,
        "attention-over-V inputs 2as^2b + 2sbh": 2 * a * s * s * b + 2 * sbh,
        "output projection input 2sbh": 2 * sbh,
        "attention dropout mask sbh": sbh,
        "MLP: first linear input 2sbh": 2 * sbh,
        "MLP: GeLU input 8sbh": 8 * sbh,
        "MLP: second linear input 8sbh": 8 * sbh,
        "MLP dropout mask sbh": sbh,
    }


def activation_bytes(
    n_layers: int,
    seq_len: int,
    batch: int,
    hidden: int,
    heads: int,
    checkpointing: str = "none",
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    attention: str = "unfused",
) -> int:
    """Activation bytes stored by `n_layers` transformer layers (see the per-layer function).

    With full checkpointing the backward pass also holds one layer's full activations
    while it recomputes that layer; that working set is added once.
    """
    layers, *args = _dims(n_layers=n_layers, seq_len=seq_len, batch=batch, hidden=hidden,
                          heads=heads)
    per_layer = activation_bytes_per_layer(
        *args, checkpointing, tensor_parallel, sequence_parallel, attention
    )
    total = layers * per_layer
    if checkpointing == "full":
        total += activation_bytes_per_layer(*args, "none", tensor_parallel, sequence_parallel,
                                            attention)
    return total


def zero_paper_activation_bytes(n_layers: int, seq_len: int, batch: int, hidden: int) -> int:
    """The ZeRO paper's rough count (section 3.2, footnote): 12·h·b·s·L 16-bit values.

    For GPT-2 1.5B (L=48, h=1600) at s=1024, b=32 this is the paper's "about 60 GB".
    """
    layers, s, b, h = _dims(n_layers=n_layers, seq_len=seq_len, batch=batch, hidden=hidden)
    return 2 * 12 * h * b * s * layers


def gpt_shape(n_params: int | float, hidden_per_layer: int = 128) -> dict[str, int]:
    """A plausible GPT shape for Ψ parameters: Ψ ≈ 12·L·h² with h = 128·L (GPT-3's ratio).

    Returns {"n_layers", "hidden", "heads"} with head dimension 128. GPT-3 175B gives
    96 layers and hidden 12288, its published shape. Used by the calculator widget to turn
    a parameter count into an activation estimate.
    """
    n = _whole_positive("n_params", n_params, "number of parameters")
    ratio = _whole_positive("hidden_per_layer", hidden_per_layer, "ratio h/L")
    layers = max(1, round((n / (12 * ratio**2)) ** (1 / 3)))
    hidden = max(128, round(math.sqrt(n / (12 * layers)) / 128) * 128)
    return {"n_layers": layers, "hidden": hidden, "heads": hidden // 128}


def fused_buffer_bytes(
    n_params: int | float, bytes_per_element: int = 4, bucket_elements: int | None = None
) -> int:
    """Temporary buffer for a fused gradient all-reduce or norm (ZeRO paper, section 3.2).

    Fusing every gradient into one fp32 buffer costs 4·Ψ bytes (6 GB for GPT-2 1.5B);
    ZeRO-R's constant-size buffers (section 6.2) cap it at `bucket_elements`.
    """
    n = _whole_positive("n_params", n_params, "number of parameters")
    width = _whole_positive("bytes_per_element", bytes_per_element, "number of bytes")
    if bucket_elements is not None:
        n = min(n, _whole_positive("bucket_elements", bucket_elements, "number of elements"))
    return width * n


# ------------------------------------------------------------------------- offload


def offload_state_bytes(
    n_params: int | float,
    stage: int,
    world_size: int,
    offload_optimizer: bool = True,
    offload_params: bool = False,
    precision: str = "mixed",
    optimizer: str = "adam",
    grad_bytes: int | None = None,
) -> dict[str, dict[str, int]]:
    """Per-rank GPU and CPU bytes of model states with ZeRO-Offload / ZeRO-Infinity.

    ZeRO-Offload (Ren et al. 2021) keeps the 16-bit parameters on the GPU and moves the
    optimizer (fp32 master + states) and the rank's gradient partition to CPU memory,
    where the CPU runs the update; gradients stream out bucket by bucket, so stages 2-3
    keep none on the GPU. ZeRO-Infinity (Rajbhandari et al. 2021) also moves the stage-3
    parameter partition off the GPU. Returns {"gpu": {...}, "cpu": {...}} with the keys
    of `model_state_bytes`. Working buffers (gathered layers, buckets) are not counted.
    """
    n = _whole_positive("n_params", n_params, "number of parameters")
    stage = _choice("stage", stage, STAGES)
    world = _world_size(world_size)
    offload_optimizer = _flag("offload_optimizer", offload_optimizer)
    offload_params = _flag("offload_params", offload_params)
    if offload_params and stage != 3:
        raise ValueError(f"offload_params needs stage 3 (partitioned parameters); got {stage}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs stage 1, 2 or 3 (a partitioned optimizer)")
    if offload_params and not offload_optimizer:
        raise ValueError("offload_params=True also needs offload_optimizer=True")
    gpu = model_state_bytes(n, stage, world, precision, optimizer, grad_bytes=grad_bytes)
    cpu = {"params": 0, "grads": 0, "optimizer": 0}
    b = bytes_per_param(precision, optimizer, grad_bytes)
    shard = partition_elements(n, world)
    if offload_optimizer:
        cpu["optimizer"], gpu["optimizer"] = gpu["optimizer"], 0
        cpu["grads"] = b["grads"] * shard  # the owned, reduced gradient slice
        if stage >= 2:
            gpu["grads"] = 0  # streamed to the CPU as each bucket is reduce-scattered
    if offload_params:
        cpu["params"], gpu["params"] = gpu["params"], 0
    for side in (gpu, cpu):
        side["total"] = side["params"] + side["grads"] + side["optimizer"]
    return {"gpu": gpu, "cpu": cpu}


# ------------------------------------------------------------ DeepSpeed's estimators
# Re-implemented from DeepSpeed's source so the course can compare without installing it:
# deepspeed/runtime/zero/stage_1_and_2.py `estimate_zero2_model_states_mem_needs` and
# deepspeed/runtime/zero/stage3.py `estimate_zero3_model_states_mem_needs` (deepspeedai/
# DeepSpeed at commits 02aa38c3 and 007cca6a respectively), checked against the tables in
# DeepSpeed's docs/code-docs/source/memory.rst. The `*_all_live` variants count a model's
# parameters (shared ones once) and call these; they print bytes / 2**30 labelled "GB".


def deepspeed_zero2_estimate(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
    legacy: bool = False,
) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) exactly as DeepSpeed's ZeRO-2 estimator.

    GPU without offload: 2Ψ + 18Ψ/N, where 18 = 2 (fp16 grads) + 4 (fp32 grads)
    + 4 (fp32 params) + 8 (Adam states). `legacy=True` uses the older 4Ψ + 16Ψ/N that
    DeepSpeed's memory docs example (t5-3b, 15.93GB) was printed with.
    """
    total_params = _whole_positive("total_params", total_params, "number of parameters")
    num_gpus_per_node = _positive_int("num_gpus_per_node", num_gpus_per_node, "GPUs per node")
    num_nodes = _positive_int("num_nodes", num_nodes, "number of nodes")
    cpu_offload, legacy = _flag("cpu_offload", cpu_offload), _flag("legacy", legacy)
    additional_buffer_factor = _positive_number("additional_buffer_factor",
                                                additional_buffer_factor, "factor")
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        if legacy:
            gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        else:
            gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3_estimate(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(CPU bytes per node, GPU bytes per GPU, largest-layer bytes) as DeepSpeed's ZeRO-3.

    GPU: 4·(largest layer) to gather one layer's fp16 params and grads, plus
    18Ψ/N (2 fp16 params + 4 fp32 grads + 4 fp32 params + 8 Adam states) without offload,
    2Ψ/N with the optimizer offloaded, nothing more with parameters offloaded too.
    """
    total_params = _whole_positive("total_params", total_params, "number of parameters")
    largest_layer_params = _whole_positive("largest_layer_params", largest_layer_params,
                                           "number of parameters")
    num_gpus_per_node = _positive_int("num_gpus_per_node", num_gpus_per_node, "GPUs per node")
    num_nodes = _positive_int("num_nodes", num_nodes, "number of nodes")
    cpu_offload = _flag("cpu_offload", cpu_offload)
    cpu_offload_params = _flag("cpu_offload_params", cpu_offload_params)
    zero_init = _flag("zero_init", zero_init)
    additional_buffer_factor = _positive_number("additional_buffer_factor",
                                                additional_buffer_factor, "factor")
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            per_param = 18 * gpus_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            per_param = 16 * gpus_factor
        if zero_init:
            cpu_mem = total_params * per_param * additional_buffer_factor
        else:
            factor = max(4 * num_gpus_per_node, per_param)
            cpu_mem = total_params * factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        init_params = largest_layer_params if zero_init else total_params
        cpu_mem = init_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def deepspeed_gpu_gap(
    n_params: int, stage: int, world_size: int, largest_layer_params: int = 0
) -> dict[str, int]:
    """Terms that turn the course's per-GPU bytes (mixed + Adam, no offload) into DeepSpeed's.

    course + fp32 gradient partition (+ one gathered layer at stage 3) == DeepSpeed, up to
    DeepSpeed's int() rounding. Stage 2: DeepSpeed's 18/N carries a 4-byte fp32 copy of the
    gradient partition next to the 2-byte one (18 = 14 + 4). Stage 3: its 18/N counts the
    gradient partition in fp32 only (4 bytes where the paper has 2), which is
    `model_state_bytes(..., grad_bytes=4)`, and adds 4 bytes per parameter of the largest
    layer for the gathered fp16 weights and gradients.
    """
    n = _whole_positive("n_params", n_params, "number of parameters")
    stage = _choice("stage", stage, (2, 3), "2 or 3 (DeepSpeed's estimators)")
    world = _world_size(world_size)
    layer = _whole_positive("largest_layer_params", largest_layer_params,
                            "number of parameters", minimum=0)
    course = model_state_bytes(n, stage, world)["total"]
    if stage == 2:
        terms = {"course (paper)": course, "fp32 gradient partition": 4 * n // world}
    else:
        terms = {
            "course (paper)": course,
            "fp32 instead of fp16 gradient partition": 2 * n // world,
            "gathered largest layer (fp16 params + grads)": 4 * layer,
        }
    terms["total"] = sum(terms.values())
    return terms


# ---------------------------------------------------------- the paper's published values
# ZeRO paper (arXiv:1910.02054v3). The paper's "GB" is 10**9 bytes, and it rounds
# inconsistently: Table 1 rounds 41.25 to 41.3 but prints 257.75 as 257 (truncated), and
# Table 2 rounds Ψ_max at MP=1 to one decimal (7.6B) *then* multiplies by MP (121.6B at
# MP=16, where the unrounded value is 122.3B). Tests compare with that rounding in mind.

PAPER_K = 12
PAPER_FIGURE_1 = {"n_params": 7.5e9, "world_size": 64, "gb": {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}}

# Table 1: per-device memory (GB) for stages 1-3 at DP degrees 1 ... 1024.
PAPER_TABLE_1_DP = (1, 4, 16, 64, 256, 1024)
PAPER_TABLE_1 = {
    7.5e9: {
        1: (120, 52.5, 35.6, 31.4, 30.4, 30.1),
        2: (120, 41.3, 21.6, 16.6, 15.4, 15.1),
        3: (120, 30, 7.5, 1.88, 0.47, 0.12),
    },
    128e9: {
        1: (2048, 896, 608, 536, 518, 513),
        2: (2048, 704, 368, 284, 263, 257),
        3: (2048, 512, 128, 32, 8, 2),
    },
    1e12: {
        1: (16000, 7000, 4750, 4187, 4046, 4011),
        2: (16000, 5500, 2875, 2218, 2054, 2013),
        3: (16000, 4000, 1000, 250, 62.5, 15.6),
    },
}

# Table 2: largest model (billions of parameters) on 32 GB V100s with N_d = 64 and model
# parallelism MP, theoretical for stages 0-3, and the sizes the paper measured.
PAPER_TABLE_2_GPU_BYTES = 32 * GB
PAPER_TABLE_2_DP = 64
PAPER_TABLE_2 = {  # MP: {stage: as printed}, then the two measured columns
    1: {0: "2B", 1: "7.6B", 2: "14.4B", 3: "128B", "measured_baseline": "1.3B",
        "measured_zero1": "6.2B"},
    2: {0: "4B", 1: "15.2B", 2: "28.8B", 3: "256B", "measured_baseline": "2.5B",
        "measured_zero1": "12.5B"},
    4: {0: "8B", 1: "30.4B", 2: "57.6B", 3: "0.5T", "measured_baseline": "5B",
        "measured_zero1": "25B"},
    8: {0: "16B", 1: "60.8B", 2: "115.2B", 3: "1T", "measured_baseline": "10B",
        "measured_zero1": "50B"},
    16: {0: "32B", 1: "121.6B", 2: "230.4B", 3: "2T", "measured_baseline": "20B",
         "measured_zero1": "100B"},
}


def parse_count(text: str) -> float:
    """'7.6B' -> 7.6e9, '0.5T' -> 5e11: the paper's way of printing parameter counts ('7.6b'
    and ' 7.6B ' too)."""
    units = {"M": 1e6, "B": 1e9, "T": 1e12}
    original, text = text, text.strip().upper() if isinstance(text, str) else text
    if not isinstance(text, str) or not text or text[-1] not in units:
        raise ValueError(
            f"text must end in one of M, B, T (a count such as '7.6B'); got {original!r}")
    try:
        number = float(text[:-1])
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"text must be a positive number before its M, B or T; got {original!r}")
    return number * units[text[-1]]


def paper_figure1() -> dict[int, int]:
    """Figure 1: per-device model-state bytes for Ψ = 7.5B, K = 12, N_d = 64, stages 0-3."""
    fig = PAPER_FIGURE_1
    return {
        s: model_state_bytes(fig["n_params"], s, fig["world_size"])["total"] for s in STAGES
    }


def paper_table1() -> dict[float, dict[int, tuple[int, ...]]]:
    """Table 1 recomputed: {Ψ: {stage 1-3: bytes per device at each DP degree}}."""
    return {
        psi: {
            s: tuple(model_state_bytes(psi, s, n)["total"] for n in PAPER_TABLE_1_DP)
            for s in (1, 2, 3)
        }
        for psi in PAPER_TABLE_1
    }


def paper_table2(
    gpu_bytes: float = PAPER_TABLE_2_GPU_BYTES, world_size: int = PAPER_TABLE_2_DP
) -> dict[int, dict[int, int]]:
    """Table 2 recomputed: {MP: {stage: largest Ψ}}.

    Model parallelism of degree MP splits each layer's weights MP ways, so each GPU holds
    1/MP of the model and the largest trainable Ψ is MP times the pure-DP value.
    """
    return {
        mp: {s: mp * largest_model(gpu_bytes, world_size, s) for s in STAGES}
        for mp in PAPER_TABLE_2
    }
