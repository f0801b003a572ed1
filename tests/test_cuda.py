"""The CUDA code paths, on a machine with a GPU (skipped on CPU, with the reason).

On CPU every launch runs on gloo, so the paths below never run there. Here the course's own
rank scripts run on NCCL, one rank per GPU (at most 2), at small sizes:
- launch.resolve_backend picks NCCL; rank_side.init_worker puts each rank on cuda:<local_rank>;
- measure/memory.py's PeakMemory and MemoryTimeline read the CUDA allocator;
- stages 0-3, workloads.train and PeakMemory on CUDA (deep_mlp_runs.py, notebooks 03-04);
- stages 0-3's states on the CUDA allocator against memory.model_state_bytes
  (tests/workers/cuda_state_memory.py);
- memory_timeline.measure_step on CUDA (zero3_lifecycle.py, notebook 05);
- collectives.timing with its CUDA synchronize (collective_sweep.py, notebook 02);
- profiling.capture with CUDA activity, read back as a "cuda" timeline (profile_systems.py,
  notebook 06);
- bench_systems and bench_worker on CUDA (`make bench` with backend="nccl").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zero_lab.launch import resolve_backend, torchrun
from zero_lab.launch.paths import WORKERS

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU here: the CUDA paths (NCCL launches, the CUDA allocator, CUDA "
           "profiler traces) run only on a GPU machine")

NPROC = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
PROBE = Path(__file__).parent / "workers" / "cuda_probe.py"
MiB = 2**20


def test_auto_picks_nccl_and_each_rank_its_own_gpu():
    assert resolve_backend("auto", NPROC) == "nccl"
    result = torchrun(PROBE, nproc=NPROC, stream=False, timeout=120)
    assert result.backend == "nccl"
    for rank, rep in enumerate(result.ranks):
        assert rep == {"backend": "nccl", "device": f"cuda:{rank}", "current_device": rank,
                       "sum": NPROC * (NPROC + 1) / 2}


def test_peak_memory_and_timeline_read_the_cuda_allocator():
    from zero_lab.measure.memory import MemoryTimeline, PeakMemory

    device = torch.device("cuda", 0)
    with PeakMemory(device) as peak:
        x = torch.ones(MiB, device=device)  # 4 MiB
        del x
    assert peak.peak_bytes - peak.start_bytes >= 4 * MiB
    with MemoryTimeline(device) as timeline:
        y = torch.ones(MiB, device=device) * 2  # two 4 MiB tensors alive at once
    assert timeline.peak_bytes - timeline.start_bytes >= 8 * MiB
    del y


def test_stages_train_to_the_one_process_result_on_gpus():
    runs = {f"stage {s}": {"stage": s} for s in range(4)}
    result = torchrun(WORKERS / "deep_mlp_runs.py", nproc=NPROC, backend="nccl", stream=False,
                      timeout=300, args=["--width", 256, "--depth", 3, "--batch", 8,
                                         "--steps", 3, "--runs", json.dumps(runs)])
    for label, run in result.ranks[0]["runs"].items():
        assert run["max_abs_diff"] < 1e-5, (label, run["max_abs_diff"])
        assert run["peak_bytes"] > 0, label


def test_stage3_step_timeline_on_gpus():
    depth = 3
    result = torchrun(WORKERS / "zero3_lifecycle.py", nproc=NPROC, backend="nccl",
                      stream=False, timeout=300,
                      args=["--width", 256, "--depth", depth, "--batch", 4])
    step = result.ranks[0]["stage3_prefetch_on"]
    assert step["ledger"]["all_gather"]["count"] == 2 * depth
    assert step["ledger"]["reduce_scatter"]["count"] == depth
    assert max(step["samples"]) > step["samples"][0]  # the allocator saw units gathered


def test_collective_timing_synchronizes_cuda():
    result = torchrun(WORKERS / "collective_sweep.py", nproc=NPROC, backend="nccl",
                      stream=False, timeout=300,
                      args=["--min-bytes", 1024, "--max-bytes", MiB, "--factor", 32,
                            "--repeats", 1, "--target-s", 0.002])
    rep = result.ranks[0]
    assert rep["backend"] == "nccl"
    assert rep["timings"] and all(t["seconds"] > 0 for t in rep["timings"])


def test_profiler_traces_read_as_a_cuda_timeline(tmp_path):
    from zero_lab.profiling.trace import load_trace

    config = {"width": 256, "depth": 3, "batch": 8, "warmup": 2}
    result = torchrun(WORKERS / "profile_systems.py", nproc=NPROC, backend="nccl",
                      stream=False, timeout=300,
                      args=["--systems", "stage0", "stage3", "--config", json.dumps(config),
                            "--out", tmp_path, "--steps", 2, "--timed", 2])
    rep = result.ranks[0]
    assert rep["device"] == "cuda:0"
    for system in ("stage0", "stage3"):
        trace = load_trace(rep["systems"][system]["trace"])
        assert trace.timeline == "cuda" and trace.steps, system


def test_bench_trains_every_system_alike_on_gpus(tmp_path):
    from zero_lab.course import bench

    config = bench.BenchConfig(width=64, depth=3, batch=4, rounds=1, steps=2, warmup=2)
    result = bench.run(config=config, nproc=NPROC, backend="nccl", out=tmp_path,
                       stream=False, timeout=600)
    for name, system in result["systems"].items():
        assert system["max_abs_diff"] <= 1e-5, name


def test_stage_states_on_the_cuda_allocator_are_the_formula():
    """Stages 0-3 after a step and the next backward: the course's storage count
    (`measure.memory.held_bytes`) is `memory.model_state_bytes` to the byte (Ψ divides by the ranks:
    no padding), and the CUDA allocator's live bytes are that count plus at most its rounding
    (each block a multiple of 512 bytes): nothing else stays alive on the GPU."""
    result = torchrun(Path(__file__).parent / "workers" / "cuda_state_memory.py", nproc=NPROC,
                      backend="nccl", stream=False, timeout=300,
                      args=["--width", 256, "--depth", 3, "--batch", 8])
    wrong = []
    for rep in result.ranks:
        assert rep["device"].startswith("cuda")
        print(f"rank on {rep['device']}: the warm-up allocated {rep['workspace']:,} B")
        for row in rep["stages"]:
            extra = row["allocator"] - row["held"]
            print(f"  stage {row['stage']}: allocator {row['allocator']:,} B, states "
                  f"{row['held']:,} B in {row['storages']} storages, formula {row['formula']:,} B")
            if row["held"] != row["formula"] or not 0 <= extra < 512 * row["storages"]:
                wrong.append(f"stage {row['stage']}: allocator {row['allocator']:,} B, states "
                             f"{row['held']:,} B in {row['storages']} storages, formula "
                             f"{row['formula']:,} B")
    assert not wrong, "; ".join(wrong) + f" (the warm-up allocated {rep['workspace']:,} B)"
