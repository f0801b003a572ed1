"""Notebook 08, gradient accumulation: the checks its cells assert on the report of
zero_lab/workers/knob_accumulation.py (one launch; see there for the runs).

    check_bytes_match_formula   every run's ledger, op by op, equals predict/knobs.py's
                                accumulation_messages: counts, bytes, ring bytes, volume
    check_held_between          what accumulation keeps between micro-batches, by
                                construction: full gradients (stages 0, 1, "unsharded") or
                                the slice ("sharded"); stage 3's full parameters when kept
    check_zero2_pays_k_times    stage 2 "sharded" sends (k + 1)/2 times stage 1's bytes
    check_equal_to_one_process  every run's weights equal one process on the global batch
                                (torch's FSDP2 runs too)
    check_fsdp2_bytes_match_formula   FSDP2's ledger, op by op, equals predict/knobs.py's
                                fsdp2_accumulation_messages (gradient sync off for k - 1
                                backwards, resharding after forward / backward or not)
    accumulation_rows           the table the notebook prints (step time as median, min-max)
    fsdp2_rows                  FSDP2's runs beside the formula and our runs that issue the
                                same collectives

Exact equalities only: bytes and held states follow from the flat layouts; step times are
printed with their spread, never compared.
"""

from __future__ import annotations

from zero_lab.course.formatting import spread
from zero_lab.grading.framework import check_ledger_matches
from zero_lab.predict.knobs import accumulation_messages, fsdp2_accumulation_messages

FP32_ATOL = 1e-5  # weights ~0.1 after a few Adam steps; k micro-batches sum in another order


def _name(run: dict) -> str:
    return f"{run['label']} (k = {run['k']})"


def expected_messages(run: dict, world_size: int) -> dict:
    """The formula for one run of the report."""
    return accumulation_messages(run["stage"], run["psi_bytes"], run["k"], world_size,
                                 n_groups=run["n_groups"],
                                 grad_accumulation=run["grad_accumulation"],
                                 reshard_after_forward=run["reshard_after_forward"])


def check_bytes_match_formula(report: dict) -> int:
    """Every run's collectives of one optimizer step equal the formula exactly; returns how
    many runs were checked."""
    return check_ledger_matches(report["runs"], lambda r: r["comm"],
                                lambda r: expected_messages(r, report["world_size"]), _name)


def expected_fsdp2_messages(run: dict, world_size: int) -> dict:
    """The formula for one FSDP2 run of the report."""
    return fsdp2_accumulation_messages(run["psi_bytes"], run["k"], world_size,
                                       n_groups=run["n_groups"],
                                       reshard_after_forward=run["reshard_after_forward"],
                                       reshard_after_backward=run["reshard_after_backward"])


def check_fsdp2_bytes_match_formula(report: dict) -> int:
    """Every FSDP2 run's collectives of one optimizer step equal the formula exactly (the
    same ledger as ours); returns how many runs were checked."""
    return check_ledger_matches(report["fsdp2"], lambda r: r["comm"],
                                lambda r: expected_fsdp2_messages(r, report["world_size"]), _name)


def check_held_between(report: dict) -> None:
    """Between two micro-batches (k > 1), after k - 1 backwards under no_sync, a rank holds:
    gradients of Ψ bytes (the full padded buffers) at stages 0, 1 and with "unsharded", of
    its slices only with "sharded"; parameters of Ψ at stages 0-2, of its slices at stage 3,
    plus Ψ of gathered units when reshard_after_forward=False keeps them."""
    for run in report["runs"]:
        if run["k"] == 1:
            continue
        psi, mine, held = run["psi_bytes"], run["shard_bytes"], run["held_between"]
        full_grads = run["stage"] < 2 or run["grad_accumulation"] == "unsharded"
        grads = psi if full_grads else mine
        params = psi if run["stage"] < 3 else mine + (0 if run["reshard_after_forward"] else psi)
        assert held["grads"] == grads, (f"{_name(run)}: {held['grads']} bytes of gradients "
                                        f"held between micro-batches, expected {grads}")
        assert held["params"] == params, (f"{_name(run)}: {held['params']} bytes of "
                                          f"parameters held between micro-batches, expected "
                                          f"{params}")


def step_volume(run: dict) -> int:
    """The ZeRO paper's volume of one run's optimizer step (an all-reduce counts twice)."""
    return sum(s["volume"] for s in run["comm"].values())


def check_zero2_pays_k_times(report: dict) -> dict[int, float]:
    """The teaching point: per optimizer step, stage 2 with "sharded" accumulation sends
    (k + 1)/2 times what stage 1 sends (kΨ + Ψ against 2Ψ), and stage 2 "unsharded" as much
    as stage 1. Returns {k: the measured ratio}."""
    by = {(r["label"], r["k"]): r for r in report["runs"]}
    ratios = {}
    for k in sorted({r["k"] for r in report["runs"]}):
        one, sharded = step_volume(by["stage 1", k]), step_volume(by["stage 2 sharded", k])
        ratios[k] = sharded / one
        assert sharded * 2 == one * (k + 1), (f"k = {k}: stage 2 sharded sent {sharded} B, "
                                              f"stage 1 {one} B: expected a ratio (k+1)/2")
        assert step_volume(by["stage 2 unsharded", k]) == one, (
            f"k = {k}: stage 2 unsharded should send stage 1's {one} B")
    return ratios


def check_equal_to_one_process(report: dict, atol: float = FP32_ATOL) -> float:
    """Every run ends within `atol` of one process on the global batch; returns the worst."""
    worst = 0.0
    for run in report["runs"] + report.get("fsdp2", []):
        assert run["max_abs_diff"] <= atol, (f"{_name(run)}: weights {run['max_abs_diff']:.2e} "
                                             "from one process on the global batch")
        worst = max(worst, run["max_abs_diff"])
    return worst


def accumulation_rows(report: dict) -> list[dict]:
    """One row per run: bytes sent per optimizer step (and in Ψ, the paper's volume), the
    gradients and parameters held between micro-batches, the peak, the step time."""
    rows = []
    for run in report["runs"]:
        held = run["held_between"]
        rows.append({**_sent(run),
                     "held grads KiB": held["grads"] / 1024 if held else None,
                     "held params KiB": held["params"] / 1024 if held else None,
                     "peak KiB": run["peak_bytes"] / 1024, "step ms": _step_ms(run)})
    return rows


def _sent(run: dict) -> dict:
    """A row's first columns: the run, k, bytes sent per optimizer step and its volume in Ψ."""
    return {"run": run["label"], "k": run["k"],
            "sent KiB": sum(s["sent_bytes"] for s in run["comm"].values()) / 1024,
            "volume Ψ": step_volume(run) / run["psi_bytes"]}


def _step_ms(run: dict) -> str:
    return spread([1e3 * t for t in run["step_times"]], decimals=1)


def _in_psi(run: dict) -> dict[str, float]:
    return {op: s["nbytes"] / run["psi_bytes"] for op, s in run["comm"].items()}


def fsdp2_rows(report: dict) -> list[dict]:
    """One row per FSDP2 run: bytes sent, volume in Ψ measured and by the formula, the step
    time, and our runs at the same k whose collectives carry the same bytes op by op."""
    n = report["world_size"]
    rows = []
    for run in report.get("fsdp2", []):
        formula = expected_fsdp2_messages(run, n)
        rows.append({**_sent(run),
                     "formula Ψ": sum(m["volume"] for m in formula.values()) / run["psi_bytes"],
                     "step ms": _step_ms(run),
                     "same as ours": [r["label"] for r in report["runs"]
                                      if r["k"] == run["k"] and _in_psi(r) == _in_psi(run)]})
    return rows
