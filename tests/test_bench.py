"""The benchmark harness (`make bench`): a smoke run on a tiny model, not a timing test.

One launch trains every system for a few steps in 2 interleaved rounds and must write the
JSON, the markdown table and the figure; every system must have trained the same weights
(the comparison is fair), held the model-state bytes its design says, and sent 2Ψ per step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zero_lab.course import bench
from zero_lab.launch.capacity import available_cores
from zero_lab.memory import model_state_bytes

CONFIG = bench.BenchConfig(width=48, depth=3, batch=4, rounds=2, steps=2, warmup=2)
PSI = 3 * (48 * 48 + 48)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return bench.run(config=CONFIG, out=out, stream=False, timeout=300)


def test_writes_json_markdown_and_figure(result):
    paths = {k: v for k, v in result["paths"].items()}
    assert set(paths) == {"json", "markdown", "figure"}
    saved = json.loads(open(paths["json"]).read())
    assert list(saved["systems"]) == list(bench.SYSTEMS)
    table = open(paths["markdown"]).read()
    for system in bench.SYSTEMS.values():
        assert f"| {system.label} |" in table
    with open(paths["figure"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_every_system_trained_the_same_weights(result):
    for name, s in result["systems"].items():
        assert s["max_abs_diff"] <= 1e-6, name


def test_rounds_interleaved_and_rotated(result):
    names = list(bench.SYSTEMS)
    assert result["order"] == [names, names[1:] + names[:1]]
    for s in result["systems"].values():
        assert len(s["round_medians_ms"]) == CONFIG.rounds
        assert s["best_round_ms"] == min(s["round_medians_ms"]) > 0


def test_targets_are_ratios_of_best_rounds(result):
    systems = result["systems"]
    assert [(t["system"], t["baseline"]) for t in result["targets"]] == [
        (s, b) for s, b, _ in bench.TARGETS]
    for t in result["targets"]:
        expected = systems[t["system"]]["best_round_ms"] / systems[t["baseline"]]["best_round_ms"]
        assert t["ratio"] == pytest.approx(expected)
        assert t["met"] == (t["ratio"] <= t["limit"])
        assert len(t["round_ratios"]) == CONFIG.rounds


def test_the_spread_of_a_target_is_one_ratio_per_round():
    """Round k's ratio divides the system's median step in round k by the baseline's in the
    same round (the two ran side by side): not best by best, not one round by another."""
    ranks = [_rank_report(r, {"ddp": [[80.0, 82.0, 81.0], [100.0, 98.0, 99.0]],
                              "stage2": [[70.0, 72.0, 71.0], [76.0, 75.0, 74.0]]}, 2)
             for r in range(2)]
    result = bench.summarize(ranks, CONFIG)
    (target,) = [t for t in result["targets"] if (t["system"], t["baseline"]) == ("stage2", "ddp")]
    assert target["round_ratios"] == pytest.approx([71.0 / 81.0, 75.0 / 99.0])
    assert target["ratio"] == pytest.approx(71.0 / 81.0)
    assert "| stage2 / ddp | 0.877 | 0.817 (0.758-0.877) | 1.15 | yes |" in bench.markdown_table(
        {**result, "cores": 2})


def test_held_bytes_follow_each_design(result):
    systems = result["systems"]
    # Ψ = 7056 is divisible by 2: no padding; fp32 Adam states are 8 bytes per element.
    for name, stage in [("ddp", 0), ("stage0", 0), ("stage1", 1), ("stage2", 2), ("stage3", 3),
                        ("stage1_param_gather", 1), ("stage2_param_gather", 2),
                        ("stage3_noprefetch", 3), ("stage3_checked", 3), ("fsdp2", 3),
                        ("stage3_prefetch2", 3), ("stage3_prefetch5", 3),
                        ("stage1_torch", 1),
                        ("stage2_torch", 2), ("stage3_torch", 3),
                        ("stage1_grad_reduce", 1), ("stage1_overlap", 1),
                        ("stage1_overlap_step", 1),
                        ("stage2_overlap_step", 2)]:
        predicted = model_state_bytes(PSI, stage, 2, precision="fp32")
        if name == "stage2_overlap_step":
            # held right after backward, when overlap_step leaves the last reduce-scatters
            # in flight: no gradient slice has landed yet (they land inside opt.step())
            predicted = {**predicted, "grads": 0, "total": predicted["total"] - predicted["grads"]}
        for held in systems[name]["held_bytes"]:
            assert {k: held[k] for k in predicted} == predicted, name
    # torch's ZeroRedundancyOptimizer gives whole parameters to ranks: the two optimizer
    # shards together hold exactly one full set of Adam states.
    shards = [h["optimizer"] for h in systems["zero_redundancy"]["held_bytes"]]
    assert sum(shards) == 8 * PSI


def test_bytes_communicated_per_step(result):
    for name in ("ddp", "stage0", "stage1", "stage2", "stage1_param_gather", "stage2_param_gather",
                 "stage1_torch", "stage2_torch",
                 "stage1_grad_reduce", "stage1_overlap", "stage1_overlap_step",
                 "stage2_overlap_step"):  # hidden, not fewer bytes
        for comm in result["systems"][name]["comm"]:
            assert comm["volume"] == 2 * 4 * PSI, name  # the paper's 2Ψ (fp32)
            assert comm["sent_bytes"] == 4 * PSI, name  # ring: 2(N-1)/N x Ψ x 4 bytes
    for name in ("stage3", "stage3_noprefetch", "fsdp2", "stage3_torch", "stage3_prefetch2",
                 "stage3_prefetch5"):  # 2 AG + 1 RS
        for comm in result["systems"][name]["comm"]:
            assert comm["volume"] == 3 * 4 * PSI, name
            assert comm["by_op"]["all_gather"]["count"] == 2 * CONFIG.depth, name
            assert comm["by_op"]["reduce_scatter"]["count"] == CONFIG.depth, name
    # check_order: a lockstep check of the unit's index before each unit all-gather, a
    # control message (stages/lockstep.py) the ledger keeps apart: the data is stage 3's
    for comm in result["systems"]["stage3_checked"]["comm"]:
        assert comm["by_op"]["all_gather"]["count"] == 2 * CONFIG.depth
        assert comm["by_op"]["all_gather"]["nbytes"] == 2 * 4 * PSI
    assert result["check_order_cost"] == pytest.approx(
        result["systems"]["stage3_checked"]["best_round_ms"]
        / result["systems"]["stage3"]["best_round_ms"])
    zro = result["systems"]["zero_redundancy"]["comm"][0]["by_op"]
    assert zro["broadcast"]["count"] == 2 * CONFIG.depth  # one per parameter, every step
    assert zro["broadcast"]["nbytes"] == 4 * PSI


def test_direct_exchange_and_torch_collectives_are_both_measured(result):
    """On gloo the stages use zero_lab.collectives.exchange; stage{1,2,3}_torch the same stages
    on torch's collectives: the ledger counts the same collectives either way, the gain is
    reported."""
    systems = result["systems"]
    for s in (1, 2, 3):
        direct, torch_ = systems[f"stage{s}"], systems[f"stage{s}_torch"]
        assert direct["comm"][0]["by_op"] == torch_["comm"][0]["by_op"], s
        gain = torch_["best_round_ms"] / direct["best_round_ms"]
        assert result["transport_gain"][f"stage{s}"] == pytest.approx(gain)
    table = open(result["paths"]["markdown"]).read()
    assert "Direct exchange, stage2: best round with torch's collectives / with" in table


def test_unknown_system_is_refused_before_launch():
    with pytest.raises(ValueError, match="unknown system"):
        bench.run(systems=["ddp", "stage9"])


def test_lockstep_check_cost_is_reported_for_stage_3(result):
    """Stage 3's default lockstep check (stages/lockstep.py): its latency between ranks that
    arrive together, as a share of the best round's step; the unchecked twin has none and
    sends the same data (the check is control, kept out of the ledger's records)."""
    s3, unchecked = result["systems"]["stage3"], result["systems"]["stage3_unchecked"]
    assert s3["lockstep_latency_ms"] > 0
    assert s3["lockstep_share"] == pytest.approx(s3["lockstep_latency_ms"]
                                                 / s3["best_round_ms"])
    assert unchecked["lockstep_latency_ms"] is None and "lockstep_share" not in unchecked
    assert [c["volume"] for c in unchecked["comm"]] == [c["volume"] for c in s3["comm"]]
    assert result["lockstep_cost"] == pytest.approx(s3["best_round_ms"]
                                                    / unchecked["best_round_ms"])
    said = f"Stage 3's default lockstep check: best round with / without = " \
           f"{result['lockstep_cost']:.3f}"
    for text in (Path(result["paths"]["markdown"]).read_text(), bench.format_targets(result)):
        assert said in text and "Stage 3's lockstep check: " in text  # both outputs say both


def test_cpu_work_and_its_floor_are_reported_for_every_system(result):
    """Each rank counts the CPU its process spent per step in every round (all threads);
    the floor is the ranks' CPU summed over the cores they share, in the best round."""
    cores = result["cores"]
    assert cores == available_cores()  # the ranks inherit this process's cores
    for name, s in result["systems"].items():
        assert [len(rank) for rank in s["cpu_ms_per_step"]] == [CONFIG.rounds] * 2, name
        assert all(ms > 0 for rank in s["cpu_ms_per_step"] for ms in rank), name
        b = s["best_round"]
        assert s["round_medians_ms"][b] == s["best_round_ms"]
        assert s["cpu_floor_ms"] == pytest.approx(
            sum(rank[b] for rank in s["cpu_ms_per_step"]) / cores), name
        assert s["cores_busy"] == pytest.approx(s["cpu_floor_ms"] / s["best_round_ms"])
    for t in result["targets"]:
        floor = result["systems"][t["system"]]["cpu_floor_ms"]
        assert t["floor_ratio"] == pytest.approx(
            floor / result["systems"][t["baseline"]]["best_round_ms"])
    table = open(result["paths"]["markdown"]).read()
    ddp = result["systems"]["ddp"]
    assert (f"| torch DDP | {ddp['best_round_ms']:.1f} | "
            f"{ddp['cpu_ms_per_step'][0][ddp['best_round']]:.1f}, "
            f"{ddp['cpu_ms_per_step'][1][ddp['best_round']]:.1f} | "
            f"{ddp['cpu_floor_ms']:.1f} | {100 * ddp['cores_busy']:.0f}% |") in table


def _rank_report(rank: int, step_ms: dict[str, list[list[float]]], cores: int,
                 cpu_ms: dict[str, list[float]] | None = None):
    """A bench worker's report, as summarize() reads it: per system, [round][step] times in
    ms and this rank's CPU ms per step per round (zero if not given)."""
    names = list(step_ms)
    rounds = len(step_ms[names[0]])
    cpu_ms = cpu_ms or {name: [0.0] * rounds for name in names}
    held = {"params": 0, "grads": 0, "optimizer": 0}
    report = {"systems": names, "held": {n: held for n in names}, "peak": dict.fromkeys(names, 0),
              "comm": {n: {"sent_bytes": 0, "volume": 0, "by_op": {}} for n in names},
              "backend": "gloo", "device": "cpu", "n_params": 1,
              "cpu_ms_per_step": cpu_ms, "cores": cores}
    if rank == 0:
        report.update({"timing": {n: [[[ms / 1e3] + [0.0] * len(bench.PHASES) for ms in steps]
                                      for steps in step_ms[n]] for n in names},
                       "order": [names] * rounds, "max_abs_diff": dict.fromkeys(names, 0.0)})
    return report


def test_cpu_floor_divides_the_ranks_work_by_the_cores_not_the_ranks():
    # 2 ranks on 4 cores, round 1 the fastest (40 ms): (30 + 34) / 4 = 16 ms, 40% busy.
    steps = {"sys": [[50.0, 52.0, 51.0], [40.0, 41.0, 39.0]]}
    ranks = [_rank_report(0, steps, 4, {"sys": [45.0, 30.0]}),
             _rank_report(1, steps, 4, {"sys": [44.0, 34.0]})]
    s = bench.summarize(ranks, CONFIG)["systems"]["sys"]
    assert (s["best_round"], s["best_round_ms"]) == (1, 40.0)
    assert s["cpu_floor_ms"] == pytest.approx(16.0)
    assert s["cores_busy"] == pytest.approx(0.4)


def test_no_cpu_floor_on_a_gpu():
    """On a GPU the step's work is the device's, which process CPU time does not see."""
    steps = {"sys": [[10.0, 10.0]]}
    ranks = [_rank_report(r, steps, 16, {"sys": [9.0]}) for r in range(2)]
    for r in ranks:
        r["device"] = "cuda:0"
    s = bench.summarize(ranks, CONFIG)["systems"]["sys"]
    assert "cpu_floor_ms" not in s and s["cpu_ms_per_step"] == [[9.0], [9.0]]


def test_ddp_is_built_with_its_defaults(monkeypatch):
    """DDP races as torch ships it: an explicit `bucket_cap_mb` (even 25, the default's size)
    turns off its 1 MiB first bucket, so the whole gradient of the bench's 25 MB model would
    leave in one all-reduce after backward. The arguments `_ddp` passes go through torch
    2.13's own rule (`_BucketCapacityConfig.create`); building a real DDP would cost 3 s of
    torch._dynamo imports. (build_zero_redundancy wraps the same `_ddp`.)"""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import distributed

    from zero_lab.course.bench_systems import build_ddp

    built = {}

    def recorder(module, **kwargs):
        built.update(kwargs)
        return module

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", recorder)
    build_ddp(torch.nn.Linear(8, 8), bench.BenchConfig(), torch.device("cpu"))
    config = distributed._BucketCapacityConfig.create(
        bucket_cap_mb=built.get("bucket_cap_mb"),
        bucket_cap_mb_list=built.get("bucket_cap_mb_list"), use_python_reducer=False)
    assert config.first_bucket_bytes_cap == dist._DEFAULT_FIRST_BUCKET_BYTES, built
    assert config.bucket_bytes_cap == 25 * 2**20, built  # DDP's default bucket_cap_mb


def test_fsdp2s_cpu_times_carry_their_caveat(result):
    """FSDP2 on gloo runs its reduce-scatter as an all-reduce of a copy: both outputs say its
    CPU times are no guide to GPUs, in lines a notebook prints whole; on NCCL they do not."""
    from zero_lab.course.bench_systems import caveats

    assert result["backend"] == "gloo" and "fsdp2" in result["systems"]
    for text in (Path(result["paths"]["markdown"]).read_text(), bench.format_targets(result)):
        assert "FSDP2 on gloo (CPU) is no guide to GPUs" in " ".join(text.split())
    assert all(len(line) <= 100 for line in caveats(["fsdp2"], "gloo"))
    assert caveats(["fsdp2"], "nccl") == caveats(["ddp", "stage3"], "gloo") == []
