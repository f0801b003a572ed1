"""Notebook 08's closing table, knob x stage -> bytes per step, peak memory, step time, and
torch's equivalent, built from what the notebook's launches measured (parent side).

Every number comes from a report: bytes from the ledger (the paper's volume, in Ψ and in
bytes), peaks from the step's memory tracking, step times as median (min-max) over the timed
steps. Only the last column, the name of the same knob in torch / DeepSpeed, is text.
"""

from __future__ import annotations

from zero_lab.formatting import spread
from zero_lab.grading.nb08_knobs_recompute import volume as ledger_volume

KiB = 2**10
COLUMNS = ("knob", "stage", "bytes per step", "peak", "step time", "torch's equivalent")

ACCUMULATION_TORCH = {
    "stage 0": "`DDP.no_sync()`",
    "stage 1": "`DDP.no_sync()` + `ZeroRedundancyOptimizer`; Megatron's distributed optimizer",
    "stage 2 sharded": "DeepSpeed ZeRO-2 (reduce-scatters every micro-batch)",
    "stage 2 unsharded": "FSDP2 `reshard_after_forward=False` (ZeRO-2-like) + "
                         "`set_requires_gradient_sync(False)` + "
                         "`set_reshard_after_backward(False)`",
    "stage 3 sharded, reshard": "DeepSpeed ZeRO-3",
    "stage 3 unsharded, reshard": "FSDP2 `fully_shard` + `set_requires_gradient_sync(False)`",
    "stage 3 sharded, keep": "FSDP2 `reshard_after_forward=False` + "
                             "`set_reshard_after_backward(False)`",
    "stage 3 unsharded, keep": "FSDP2 `reshard_after_forward=False` + "
                               "`set_reshard_after_backward(False)` + "
                               "`set_requires_gradient_sync(False)`",
}
RECOMPUTE_TORCH = {0: "`apply_activation_checkpointing` (non-reentrant) on DDP",
                   3: "activation checkpointing per block inside each FSDP2 unit"}
PRECISION_TORCH = {
    "bf16": "FSDP2 `MixedPrecisionPolicy(param_dtype=torch.bfloat16)`",
    "bf16+keep_ln": "+ `fully_shard(norm, mp_policy=MixedPrecisionPolicy("
                    "param_dtype=torch.float32, output_dtype=torch.bfloat16))`",
    "bf16+reduce_fp32": "`MixedPrecisionPolicy(..., reduce_dtype=torch.float32)`",
    "bf16+keep_ln+reduce_fp32": "both",
}
HSDP_TORCH = {"flat": "FSDP2 `fully_shard(m, mesh=1-D mesh)`",
              "hsdp": "FSDP2 `fully_shard(m, mesh=init_device_mesh(dev, (R, S), "
                      "mesh_dim_names=(\"replicate\", \"shard\")))`; DeepSpeed MiCS"}


def spread_ms(seconds: list[float]) -> str:
    """Step times as 'median (min-max)' in ms: a spread, never a single number."""
    return spread([1e3 * t for t in seconds], decimals=0) + " ms"


def _kib(nbytes: float) -> str:
    return f"{nbytes / KiB:,.1f} KiB"


def accumulation_rows(report: dict) -> list[dict]:
    """One row per configuration at the largest k: the volume per optimizer step in Ψ and
    in bytes, the step's peak, the optimizer step's time."""
    k = max(r["k"] for r in report["runs"])
    rows = []
    for run in (r for r in report["runs"] if r["k"] == k):
        vol = sum(s["volume"] for s in run["comm"].values())
        mode = " ".join(run["label"].split(" ")[2:]) or "no_sync"  # "stage 3 sharded, keep"
        rows.append({"knob": f"accumulation, k = {k}: {mode}",
                     "stage": run["stage"],
                     "bytes per step": f"{vol / run['psi_bytes']:g}Ψ = {_kib(vol)}",
                     "peak": _kib(run["peak_bytes"]), "step time": spread_ms(run["step_times"]),
                     "torch's equivalent": ACCUMULATION_TORCH.get(run["label"], "")})
    return rows


def recompute_rows(runs: list[dict]) -> list[dict]:
    """One row per stage with recompute on, beside its twin without."""
    by = {(r["stage"], r["recompute"]): r for r in runs}
    rows = []
    for stage in sorted({s for s, _ in by}):
        on, off = by[stage, True], by[stage, False]
        psi = 4 * sum(g["padded"] for g in on["groups"])  # fp32 flat buffers
        rows.append({"knob": "recompute on (off)", "stage": stage,
                     "bytes per step": f"{ledger_volume(on['ledger']) / psi:g}Ψ "
                                       f"({ledger_volume(off['ledger']) / psi:g}Ψ)",
                     "peak": f"{_kib(on['peak_bytes'])} ({_kib(off['peak_bytes'])})",
                     "step time": f"{spread_ms(on['step_times'])} "
                                  f"({spread_ms(off['step_times'])})",
                     "torch's equivalent": RECOMPUTE_TORCH[0 if stage < 3 else 3]})
    return rows


def precision_rows(runs: list[dict]) -> list[dict]:
    """One row per bf16 recipe: bytes per step (ledger), peak, step time."""
    return [{"knob": f"precision {run['recipe']}", "stage": run["stage"],
             "bytes per step": f"{ledger_volume(run['ledger']):,} B",
             "peak": _kib(run["peak_bytes"]), "step time": spread_ms(run["step_times"]),
             "torch's equivalent": PRECISION_TORCH.get(run["recipe"], "")} for run in runs]


def hsdp_rows(reports: list[dict]) -> list[dict]:
    """Flat stage 3 and HSDP on the same ranks: bytes per level, peak (largest rank), step."""
    first = reports[0]
    mesh = "x".join(map(str, first["mesh"]))
    rows = []
    for key, name in (("zero3", "flat stage 3"), ("hsdp", f"hybrid sharding {mesh}")):
        levels = first[key]["by_level"]
        words = "; ".join(f"{level}: {_kib(sum(ops.values()))}" for level, ops in levels.items())
        rows.append({"knob": name, "stage": 3, "bytes per step": words,
                     "peak": _kib(max(r[key]["peak_bytes"] for r in reports)),
                     "step time": spread_ms(first[key]["step_s"]),
                     "torch's equivalent": HSDP_TORCH["flat" if key == "zero3" else "hsdp"]})
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (printed in the notebook, pasted anywhere)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)
