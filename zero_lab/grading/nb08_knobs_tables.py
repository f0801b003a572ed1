"""Notebook 08's closing tables, built from what the notebook's launches measured (parent
side): knob x stage -> bytes per step, peak memory, step time; then each knob's name in
torch or DeepSpeed, with FSDP2's own bytes where the notebook measured them.

Every number comes from a report: bytes from the ledger (the paper's volume, in KiB and in
Ψ), peaks from the step's memory tracking, step times as median (min-max) over the timed
steps. Only the names of the same knob in torch / DeepSpeed are text. Printed as fixed-width
text, no line over 110 characters (long names wrap inside their column).
"""

from __future__ import annotations

import textwrap

from zero_lab.course.formatting import spread, table
from zero_lab.grading import nb08_knobs_accumulation
from zero_lab.grading.nb08_knobs_accumulation import fsdp2_rows, step_volume
from zero_lab.grading.nb08_knobs_recompute import volume

KiB = 2**10
WIDTH = 110  # the longest printed line

# left False on the last micro-batch, the units stay gathered past the step: the next forward
# computes with the pre-step weights (tests/test_fsdp2_reshard_after_backward.py)
NO_RESHARD_BWD = "`set_reshard_after_backward(False)` (`True` on the last micro-batch)"
ACCUMULATION_TORCH = {
    "stage 0": "`DDP.no_sync()`",
    "stage 1": "`DDP.no_sync()` + `ZeroRedundancyOptimizer`; Megatron's distributed optimizer",
    "stage 2 sharded": "DeepSpeed ZeRO-2 (reduce-scatters every micro-batch)",
    "stage 2 unsharded": "FSDP2 `reshard_after_forward=False` (ZeRO-2-like) + "
                         "`set_requires_gradient_sync(False)` + " + NO_RESHARD_BWD,
    "stage 3 sharded, reshard": "DeepSpeed ZeRO-3",
    "stage 3 unsharded, reshard": "FSDP2 `fully_shard` + `set_requires_gradient_sync(False)`",
    "stage 3 sharded, keep": "FSDP2 `reshard_after_forward=False` + " + NO_RESHARD_BWD,
    "stage 3 unsharded, keep": "FSDP2 `reshard_after_forward=False` + " + NO_RESHARD_BWD
                               + " + `set_requires_gradient_sync(False)`",
}
# our accumulation runs -> the FSDP2 run of the same launch that is their torch equivalent
ACCUMULATION_FSDP2 = {"stage 2 unsharded": "FSDP2 reshard neither",
                      "stage 3 unsharded, reshard": "FSDP2 reshard fwd + bwd",
                      "stage 3 unsharded, keep": "FSDP2 reshard neither"}
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
                      "mesh_dim_names=(\"replicate\", \"shard\")))`; "
                      "DeepSpeed's MiCS (removed in 0.19)"}


def spread_ms(seconds: list[float]) -> str:
    """Step times as 'median (min-max)' in ms: a spread, never a single number."""
    return spread([1e3 * t for t in seconds], decimals=0) + " ms"


def unit_for(largest_bytes: float) -> tuple[str, int]:
    """The one binary unit a table prints its bytes in: KiB on a laptop's tiny models, MiB or
    GiB at GPU sizes, so that no number needs more than 9 characters ("99,999.9")."""
    for name, size in (("KiB", KiB), ("MiB", 2**20)):
        if largest_bytes < 100_000 * size:
            return name, size
    return "GiB", 2**30


def accumulation_rows(report: dict) -> list[dict]:
    """One row per configuration at the largest k: the volume per optimizer step in bytes
    and in Ψ, the step's peak, the optimizer step's time; the torch column names FSDP2's
    measured volume where the launch ran FSDP2's equivalent."""
    k = max(r["k"] for r in report["runs"])
    fsdp2 = {r["label"]: r for r in report.get("fsdp2", []) if r["k"] == k}
    rows = []
    for run in (r for r in report["runs"] if r["k"] == k):
        mode = " ".join(run["label"].split(" ")[2:]) or "no_sync"  # "stage 3 sharded, keep"
        torch_name = ACCUMULATION_TORCH.get(run["label"], "")
        theirs = fsdp2.get(ACCUMULATION_FSDP2.get(run["label"], ""))
        if theirs:
            torch_name += f" (measured: {step_volume(theirs) / theirs['psi_bytes']:g}Ψ)"
        rows.append({"knob": f"accumulation k={k}, {mode}", "stage": run["stage"],
                     "bytes": step_volume(run), "psi": run["psi_bytes"],
                     "peak": run["peak_bytes"], "step": run["step_times"],
                     "torch": torch_name})
    return rows


def recompute_rows(runs: list[dict]) -> list[dict]:
    """Two rows per stage, recompute on and off."""
    return [{"knob": f"recompute {'on' if run['recompute'] else 'off'}", "stage": run["stage"],
             "bytes": volume(run["ledger"]),
             "psi": 4 * sum(g["padded"] for g in run["groups"]),  # fp32 flat buffers
             "peak": run["peak_bytes"], "step": run["step_times"],
             "torch": RECOMPUTE_TORCH[0 if run["stage"] < 3 else 3] if run["recompute"] else ""}
            for run in sorted(runs, key=lambda r: (r["stage"], not r["recompute"]))]


def precision_rows(runs: list[dict]) -> list[dict]:
    """One row per bf16 recipe: bytes per step (ledger), peak, step time."""
    return [{"knob": f"precision {run['recipe']}", "stage": run["stage"],
             "bytes": volume(run["ledger"]), "peak": run["peak_bytes"],
             "step": run["step_times"], "torch": PRECISION_TORCH.get(run["recipe"], "")}
            for run in runs]


def hsdp_rows(reports: list[dict]) -> list[dict]:
    """Flat stage 3 and HSDP on the same ranks: bytes (and what crosses the groups), peak
    (largest rank), step time."""
    first = reports[0]
    mesh = "x".join(map(str, first["mesh"]))
    rows = []
    for key, name in (("zero3", "flat stage 3"), ("hsdp", f"hybrid sharding {mesh}")):
        levels = first[key]["by_level"]
        rows.append({"knob": name, "stage": 3,
                     "bytes": sum(sum(ops.values()) for ops in levels.values()),
                     "across": sum(levels.get("replicate", {}).values()),
                     "peak": max(r[key]["peak_bytes"] for r in reports),
                     "step": first[key]["step_s"],
                     "torch": HSDP_TORCH["flat" if key == "zero3" else "hsdp"]})
    return rows


def _bytes_cell(row: dict, size: int) -> str:
    cell = f"{row['bytes'] / size:,.1f}"
    if row.get("psi"):
        cell += f" ({row['bytes'] / row['psi']:g}Ψ)"
    if row.get("across"):
        cell += f" ({row['across'] / size:,.1f} across)"
    return cell


def text(rows: list[dict]) -> str:
    """The rows as two fixed-width tables: what was measured (bytes and peaks in one unit,
    `unit_for` the largest), then each knob's name in torch or DeepSpeed (wrapped inside its
    column); no line longer than WIDTH."""
    unit, size = unit_for(max(max(r["bytes"], r["peak"]) for r in rows))
    sent, peak = f"{unit} per step", f"peak {unit}"
    measured = table([{"knob": row["knob"], "stage": str(row["stage"]),
                       sent: _bytes_cell(row, size), peak: f"{row['peak'] / size:,.1f}",
                       "step, median (min-max)": spread_ms(row["step"])} for row in rows],
                     right=(sent, peak))
    knob, rule = max(len(r["knob"]) for r in rows), measured.split("\n")[1]
    lines = [measured, "", f"{'knob':{knob}s}  stage  the same knob in torch or DeepSpeed", rule]
    indent = knob + 2 + 5 + 2
    for row in (r for r in rows if r["torch"]):
        wrapped = textwrap.wrap(row["torch"], WIDTH - indent - 2)
        lines.append(f"{row['knob']:{knob}s}  {row['stage']!s:5s}  {wrapped[0]}")
        lines += [" " * (indent + 2) + more for more in wrapped[1:]]
    return "\n".join(lines)


def accumulation_text(report: dict) -> str:
    """Section 1's table at the largest k: our runs (bytes sent, volume, what a rank holds
    between micro-batches, peak, step), then FSDP2's beside the formula and the runs of ours
    that send the same bytes op by op. Every line at most WIDTH characters."""
    k = max(r["k"] for r in report["runs"])
    ours = [r for r in nb08_knobs_accumulation.accumulation_rows(report) if r["k"] == k]
    unit, size = unit_for(KiB * max(max(r["sent KiB"], r["peak KiB"]) for r in ours))
    scale = KiB / size  # the rows are in KiB
    lines = [f"k = {k}, rank 0{'':14s}{'sent ' + unit:>9s}  vol Ψ  {'grads ' + unit:>10s}  "
             f"{'params ' + unit:>11s}  {'peak ' + unit:>9s}  step ms, median (min-max)"]
    for row in ours:
        lines.append(f"{row['run']:28s} {row['sent KiB'] * scale:9,.1f} {row['volume Ψ']:6g} "
                     f"{row['held grads KiB'] * scale:11,.1f} "
                     f"{row['held params KiB'] * scale:12,.1f} "
                     f"{row['peak KiB'] * scale:10,.1f}  {row['step ms']}")
    lines += ["", "FSDP2, gradient sync off in the first k - 1 backwards, resharding after "
              "forward (fwd) / after", "those backwards (bwd) or not (its step times on "
              "CPU and gloo are not its speed on GPUs: compare bytes):",
              f"{'':24s} {'sent ' + unit:>9s} {'vol Ψ':>6s} {'formula Ψ':>10s}  "
              f"{'step ms':24s}same bytes as ours"]
    for row in (r for r in fsdp2_rows(report) if r["k"] == k):
        same = _pack(row["same as ours"] or ["-"], WIDTH - 78)
        lines.append(f"{row['run']:24s} {row['sent KiB'] * scale:9,.1f} {row['volume Ψ']:6g} "
                     f"{row['formula Ψ']:10g}  {row['step ms']:24s}{same[0]}")
        lines += [" " * 78 + more for more in same[1:]]
    return "\n".join(lines)


def _pack(names: list[str], width: int) -> list[str]:
    """`names` joined by commas into lines of at most `width`, never breaking a name."""
    lines = [names[0]]
    for name in names[1:]:
        if len(lines[-1]) + 2 + len(name) <= width:
            lines[-1] += ", " + name
        else:
            lines[-1] += ","
            lines.append(name)
    return lines
