"""zero_lab.checkpoint: saved at stage 3 on 2 ranks, resumed at other stages and world sizes
exactly as an uninterrupted run; consolidated without a process group (into the plain model
and into FSDP2); every broken checkpoint refused by name with nothing changed; a save killed
part-way leaves nothing that looks complete."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from functools import cache

import pytest
import torch
from common import MEASURE_CONSOLIDATION

from zero_lab import checkpoint
from zero_lab.checkpoint import CheckpointError, pointer
from zero_lab.launch import LaunchError, torchrun
from zero_lab.launch.paths import REPO_ROOT

CASES = REPO_ROOT / "tests" / "workers" / "checkpoint_cases.py"
sys.path.insert(0, str(CASES.parent))
from checkpoint_cases import Net  # noqa: E402

# Launches that fail on purpose keep their logs: in pytest's temp dir (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("temp_dir")


def launch(nproc: int, **jobs: dict) -> dict[str, list[dict]]:
    """One launch on `nproc` ranks running the named jobs in turn (see checkpoint_cases.py);
    {name: every rank's report of that job}."""
    result = torchrun(CASES, nproc=nproc, backend="gloo", stream=False, timeout=300,
                      args=["--jobs", json.dumps(jobs, default=str)])
    return {name: [rank[name] for rank in result.ranks] for name in jobs}


def job(case: str, directory, **options) -> dict:
    return {"case": case, "dir": str(directory), **options}


def close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(torch.tensor(a[k]), torch.tensor(b[k]), rtol=0, atol=atol,
                                   msg=k)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def saves(root) -> dict[str, list[dict]]:
    """Every checkpoint the tests load, saved in one launch on 2 ranks: stage 3 for 3 steps,
    then on to step 5 (the uninterrupted run); bf16 at stage 3; another run (for a swapped
    shard file); the one a killed save must leave intact (stage 1); a ~100 MB one."""
    return launch(
        2,
        step3=job("train_save", root / "step3", stage=3, steps=3, total=5),
        bf16=job("train_save", root / "bf16", stage=3, steps=2, total=2, precision="bf16"),
        other=job("train_save", root / "other", stage=3, steps=2, total=2),
        before_kill=job("train_save", root / "kill" / "ckpt", stage=1, steps=1, total=1),
        big=job("save_big", root / "big"))


@pytest.fixture(scope="module")
def saved(root, saves):
    """Stage 3 on 2 ranks, 3 steps, saved; then on to step 5 (the uninterrupted run)."""
    return root / "step3", saves["step3"][0]


@pytest.fixture(scope="module")
def loads(root, saves):
    """What loading those checkpoints gave, one launch per world size (made on first use):
    {name: every rank's report}. N = 2 also loads the broken copies _break makes."""
    step3 = root / "step3"
    jobs = {
        1: {"resume_0": job("resume", step3, stage=0, total=5)},
        2: {"resume_1": job("resume", step3, stage=1, total=5),
            "fsdp2": job("fsdp2", step3),
            "bad_inputs": job("bad_inputs", root, stage=2)},
        3: {"resume_2": job("resume", step3, stage=2, total=5),
            "resume_3": job("resume", step3, stage=3, total=5),
            "bf16": job("resume", root / "bf16", stage=2, total=2, precision="bf16")},
    }

    @cache
    def at(nproc: int) -> dict[str, list[dict]]:
        if nproc == 2:
            _break(step3, root / "broken", root / "other")
        return launch(nproc, **jobs[nproc])

    return at


def test_the_uninterrupted_stage3_run_is_the_one_process_run(saved):
    _, ran = saved
    close(ran["final"], ran["reference"])


@pytest.mark.parametrize("stage, nproc", [(2, 3), (0, 1), (3, 3), (1, 2)])
def test_resume_at_another_stage_and_world_size_continues_exactly(saved, loads, stage, nproc):
    directory, ran = saved
    resumed = loads(nproc)[f"resume_{stage}"]
    assert resumed[0]["step"] == 3
    for rank in resumed:
        close(rank["final"], ran["reference"])
        close(rank["final"], ran["final"])


def test_mixed_precision_restores_the_fp32_masters_exactly(root, saves, loads):
    """bf16 at stage 3 on 2 ranks, loaded at stage 2 on 3 ranks: the fp32 masters (what
    full_state_dict returns in mixed precision) come back bit for bit."""
    directory = root / "bf16"
    ran = saves["bf16"][0]
    resumed = loads(3)["bf16"]
    assert checkpoint.read_manifest(directory)["parameters"]["a.weight"]["dtype"] == "bfloat16"
    for rank in resumed:
        assert rank["final"] == ran["at_save"]
    weights = checkpoint.consolidate(directory)
    assert {k: v.double().flatten().tolist() for k, v in weights.items()} == ran["at_save"]


def test_manifest_names_pieces_by_parameter_and_never_saves_padding(saved):
    directory, _ = saved
    manifest = checkpoint.read_manifest(directory)
    assert (manifest["stage"], manifest["world_size"], manifest["step"]) == (3, 2, 3)
    assert [g["numel"] for g in manifest["layout"]] == [35, 25, 55]
    assert [g["padded_numel"] for g in manifest["layout"]] == [36, 26, 56]  # padded to N
    for name, meta in manifest["parameters"].items():
        values = sorted((p["start"], p["numel"]) for p in manifest["pieces"]
                        if p["kind"] == "value" and p["name"] == name)
        assert sum(n for _, n in values) == meta["numel"]  # every element once, no padding
        assert values[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(values, values[1:], strict=False))
    assert manifest["others"] == {"scale": {"shape": [2], "dtype": "float32"}}
    assert manifest["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert manifest["optimizer"]["param_groups"][0]["weight_decay"] == 0.1
    assert sorted(manifest["files"]) == ["rank0.safetensors", "rank1.safetensors"]


def test_consolidate_equals_full_state_dict_and_loads_into_the_plain_model(saved):
    directory, ran = saved
    weights = checkpoint.consolidate(directory)
    assert {k: v.double().flatten().tolist() for k, v in weights.items()} == ran["at_save"]
    model = Net()
    model.load_state_dict(weights)  # strict: every name, every shape
    with_states = checkpoint.consolidate(directory, optimizer=True)
    assert with_states["optimizer.exp_avg.a.weight"].shape == (5, 7)
    assert with_states["optimizer.step.a.weight"].item() == 3


def test_consolidated_weights_load_into_fsdp2(saved, loads):
    directory, ran = saved
    loaded = loads(2)["fsdp2"]
    for rank in loaded:
        assert rank["loaded"] == ran["at_save"]


def _break(source, broken_root, other):
    """Copies of `source`'s step directory, each broken one way; `other` is another model's
    checkpoint."""
    source, other = pointer.resolve(source), pointer.resolve(other)

    def copy(name):
        target = broken_root / name
        shutil.copytree(source, target)
        return target

    shutil.rmtree(broken_root, ignore_errors=True)
    broken_root.mkdir(parents=True)
    (copy("missing") / "rank1.safetensors").unlink()
    f = copy("truncated") / "rank0.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    f = copy("corrupted") / "rank1.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    shutil.copy(other / "rank1.safetensors", copy("swapped") / "rank1.safetensors")
    m = copy("other_model") / "manifest.json"
    manifest = json.loads(m.read_text())
    manifest["parameters"]["a.weight"]["shape"] = [5, 8]
    # resealed, so what is tested is the shape check behind the manifest's checksum
    m.write_text(json.dumps(checkpoint.manifest.seal(manifest)))
    m = copy("hand_edited") / "manifest.json"  # the same edit, not resealed
    m.write_text(json.dumps(manifest))
    (broken_root / "empty").mkdir()
    (broken_root / "not_a_checkpoint").mkdir()
    (broken_root / "not_a_checkpoint" / "notes.txt").write_text("hello")
    m = copy("bad_manifest") / "manifest.json"
    m.write_text("{ not json")


EXPECTED = {
    "missing": "rank1.safetensors: shard file missing",
    "truncated": "rank0.safetensors: truncated or overwritten",
    "corrupted": "rank1.safetensors: corrupted",
    "swapped": "rank1.safetensors: corrupted",
    "other_model": "a checkpoint of a different model: parameter 'a.weight' has shape (5, 8)",
    "hand_edited": "manifest.json: edited since it was written",
    "empty": "not a zero_lab checkpoint (no manifest.json",
    "not_a_checkpoint": "not a zero_lab checkpoint (no manifest.json",
    "bad_manifest": "manifest.json: unreadable manifest",
}


def test_broken_checkpoints_are_refused_by_name_and_change_nothing(root, loads):
    result = loads(2)["bad_inputs"]  # on copies of `saved` broken by _break
    for rank in result:
        assert rank["unchanged"], "a failed load changed the model or the optimizer"
        assert rank["errors"].keys() == EXPECTED.keys()
        for name, fragment in EXPECTED.items():
            assert rank["errors"][name] is not None and fragment in rank["errors"][name], name
            assert name in rank["errors"][name]  # the path names the broken checkpoint
    for name, fragment in EXPECTED.items():  # consolidation checks the same, with no group
        if name == "other_model":
            continue
        with pytest.raises(CheckpointError, match=fragment.replace("(", r"\(")):
            checkpoint.consolidate(root / "broken" / name)


def test_a_save_killed_part_way_leaves_nothing_that_looks_complete(root, saves):
    directory = root / "kill" / "ckpt"  # saved at step 1 (stage 1) by `saves`
    with pytest.raises(LaunchError, match="exit"):
        launch(2, die=job("die_in_save", directory, stage=1))
    assert checkpoint.read_manifest(directory)["step"] == 1  # the previous one, intact
    checkpoint.consolidate(directory)
    partial = [p for p in directory.parent.iterdir() if p.name.startswith(".ckpt.partial-")]
    assert len(partial) == 1 and not (partial[0] / "manifest.json").exists()
    fresh = directory.parent / "fresh"
    with pytest.raises(LaunchError):
        launch(2, die=job("die_in_save", fresh, stage=2))
    assert not fresh.exists()
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        checkpoint.consolidate(fresh)


def test_a_model_that_was_not_sharded_is_refused():
    model = Net()
    with pytest.raises(TypeError, match=r"call zero_lab.stages.shard\(model, stage\) first"):
        checkpoint.save(model, torch.optim.Adam(model.parameters()), "unused")




def test_consolidation_holds_about_one_tensor_at_a_time(root, saves):
    """Measured in a fresh process (its peak resident memory): assembling every tensor of a
    ~100 MB checkpoint (8 x Linear(1024, 1024) with Adam's two states), one at a time."""
    out = subprocess.run([sys.executable, "-c", MEASURE_CONSOLIDATION, str(root / "big")],
                         capture_output=True, text=True, check=True).stdout
    measured = json.loads(out)
    assert measured["total"] > 90e6 and measured["largest"] == 4 * 2**20
    assert measured["rise"] < 4 * measured["largest"], measured  # not the whole model
