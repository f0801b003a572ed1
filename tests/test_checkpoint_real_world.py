"""zero_lab.checkpoint on the paths a real training job meets (issue 22, points 1-9): optimizer
groups listed in another order, ranks that name different checkpoints, hand-edited manifests,
bad arguments, a process killed at every step of publication, fsync before publishing, a
resume with scheduler, RNG and data position, per-rank verification, consolidation's peak
memory, a weights-only load. The ranks' side is tests/workers/checkpoint_real_world.py, one
launch on 2 ranks and one on 1 rank (which reads what the 2 saved)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from common import MEASURE_CONSOLIDATION

from zero_lab.checkpoint import CheckpointError, consolidate, pointer, publication, read_manifest
from zero_lab.checkpoint.groups import match_groups
from zero_lab.checkpoint.manifest import seal, verify_files
from zero_lab.checkpoint.saving import check_step
from zero_lab.launch import torchrun
from zero_lab.launch.paths import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "workers" / "checkpoint_real_world.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real_world")


@pytest.fixture(scope="module")
def two(root) -> list[dict]:
    """Every rank's report of the 2-rank launch (every case but at_one_rank)."""
    result = torchrun(WORKER, nproc=2, backend="gloo", stream=False, timeout=300,
                      args=["--root", str(root)])
    return list(result.ranks)


@pytest.fixture(scope="module")
def one(root, two) -> dict:
    """The 1-rank launch's report, reading what the 2 ranks saved."""
    result = torchrun(WORKER, nproc=1, backend="gloo", stream=False, timeout=300,
                      args=["--root", str(root)])
    return result.ranks[0]["at_one_rank"]


def case(two: list[dict], name: str) -> list[dict]:
    found = [rank[name] for rank in two]
    for rank, report in enumerate(found):
        assert "crashed" not in report, (name, rank, report)
    return found


# ------------------------------------------------------------------ 1. optimizer groups
def test_optimizer_groups_are_matched_by_the_parameters_they_hold(two):
    """Saved with (weights: lr 0.05, wd 0.1), (biases: lr 0.02, wd 0); loaded into the same
    groups listed biases first: each group takes its own settings, and training goes on
    exactly as the run that was not interrupted (by position it was 0.089 off)."""
    for r in case(two, "groups"):
        assert r["settings"] == [{"lr": 0.02, "weight_decay": 0.0},
                                 {"lr": 0.05, "weight_decay": 0.1}]
        assert r["max_abs_diff"] == 0.0


def test_a_group_merging_two_saved_groups_is_refused_naming_both_layouts(two):
    for r in case(two, "groups"):
        assert r["merged"].startswith("CheckpointError: ")
        assert "group 0 holds parameters of saved groups [0, 1]" in r["merged"]
        assert "Saved: group 0: a.weight, b.weight, c.weight; group 1: a.bias" in r["merged"]
        assert "now: group 0: a.weight, a.bias, b.bias, c.bias" in r["merged"]
        assert r["merged_unchanged"]


def test_match_groups_in_one_process():
    manifest = {"parameters": {"w": {"param_group": 0}, "b": {"param_group": 1},
                               "frozen_then": {"param_group": None}},
                "optimizer": {"param_groups": [{"lr": 1}, {"lr": 2}]}}
    assert match_groups("m", manifest, [["b"], ["w"]]) == [1, 0]
    assert match_groups("m", manifest, [["b", "frozen_then"], [], ["w"]]) == [1, None, 0]
    with pytest.raises(CheckpointError, match=r"group 0 holds parameters of saved groups"):
        match_groups("m", manifest, [["w", "b"]])  # the mutant: a merged group


# ------------------------------------------------------------------ 2. one checkpoint
def test_ranks_that_name_different_checkpoints_refuse_together(two):
    for rank, r in enumerate(case(two, "identity")):
        assert r["load"].startswith("CheckpointError: the ranks name different checkpoints")
        assert "rank 0 loads" in r["load"] and "(step 1), rank 1" in r["load"], rank
        assert r["load_unchanged"]
        assert "the ranks name different checkpoints: rank 0 saves to" in r["save_path"]
        assert "per_rank0" in r["save_path"] and "per_rank1" in r["save_path"]
        assert "'0'" in r["save_step"] and "'1'" in r["save_step"]
        assert r["written"] == []  # no per-rank directory, no partial


# ------------------------------------------------------------------ 3. and 7. manifest
EDITED = {"swapped_keys": "edited since it was written", "dropped_file": "edited since",
          "changed_lr": "edited since it was written",
          "no_pieces": "manifest.json: entry 'pieces' is missing",
          "no_files": "manifest.json: entry 'files' is missing",
          "no_optimizer": "manifest.json: entry 'optimizer' is missing",
          "unlisted_file": "of 'rank7.safetensors' names a file that 'files' does not list",
          "duplicated_piece": "two pieces hold elements 0.. of the values of 'a.weight'",
          "resealed_drop": "names a file that 'files' does not list"}


def test_an_edited_manifest_is_refused_by_name_with_nothing_changed(two):
    """Edited by hand: its checksum refuses it (exchanged piece keys, a dropped file, a
    changed lr all loaded before); resealed (as by someone who knows the checksum), the
    checks behind it still name what is wrong (KeyError, FileNotFoundError, '182 of 91
    found' before). consolidate() refuses the same, with no process group."""
    for r in case(two, "edited"):
        assert r["errors"].keys() == EDITED.keys()
        for name, fragment in EDITED.items():
            for text in (r["errors"][name], r["consolidate"][name]):
                assert text.startswith("CheckpointError: "), (name, text)
                assert f"edited/{name}/manifest.json" in text and fragment in text, (name, text)
        assert r["unchanged"]


def test_bad_arguments_to_save_are_refused_by_name_before_anything_is_written(two):
    for r in case(two, "bad_input"):
        assert "CheckpointError: step must be a non-negative int or None, got " \
            "numpy.float64" in r["numpy_step"]  # numpy.int64(3) is a step (test_checkpoint_jobs)
        assert "step must be a non-negative int or None, got torch.Tensor" in r["tensor_step"]
        assert "extras['lr'] is a float, which has no state_dict()" in r["extras"]
        assert r["written"] == []  # no directory, no partial, nothing to clean up
        assert "'a.weight' was trained when this was saved and is frozen" in r["frozen"]


def test_check_step_in_one_process():
    check_step(None)
    check_step(3)
    for bad in (True, -1, 3.0, "3"):  # the mutants
        with pytest.raises(CheckpointError, match="step must be a non-negative int"):
            check_step(bad)


def test_a_resealed_good_manifest_reads_and_an_edited_one_does_not(two, root):
    directory = pointer.resolve(root / "groups")  # the step directory: its manifest.json
    manifest = read_manifest(directory)
    copy = root / "reseal_check"
    shutil.copytree(directory, copy)
    (copy / "manifest.json").write_text(json.dumps(seal(manifest), indent=3))
    assert read_manifest(copy) == seal(manifest)  # the checksum ignores spelling
    manifest["step"] = 4
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="edited since it was written"):
        read_manifest(copy)


# ------------------------------------------------------------------ 5. publication
def test_a_save_publishes_a_folder_naming_its_step_directory_and_leaves_nothing_else(two):
    """Mutant: the previous step directory left in the folder (not removed once published)."""
    for r in case(two, "published"):
        for step, found in zip((1, 2), r["steps"], strict=True):
            assert not found["is_link"] and found["step"] == step
            assert found["latest"].startswith(f"step{step}-")
            assert found["in_folder"] == sorted(["latest", found["latest"]])
            assert found["beside"] == []  # no partial, no lock


def _publish_killed(root: Path, tmp_path: Path, kill_after: str | None, before: str) -> Path:
    """`groups` (step 3) under `tmp_path/ckpt` as `before` says, `w_fp32` (step 2) complete
    in its partial directory, published by a child process SIGKILLed after step `kill_after`.
    `before`: "folder" (as a save publishes it), "link" (as the previous zero_lab did: a link
    to a step directory beside it), "real_directory" (a step directory copied under the
    name), "none" (nothing: a first save)."""
    name = tmp_path / "ckpt"
    old, new = (pointer.resolve(root / n) for n in ("groups", "w_fp32"))
    if before == "folder":
        shutil.copytree(old, name / pointer.step_name(3, "a" * 12))
        (name / pointer.LATEST).write_text(pointer.step_name(3, "a" * 12) + "\n")
    elif before == "link":
        shutil.copytree(old, publication.hidden(name, "step3", "a" * 12))
        os.symlink(publication.hidden(name, "step3", "a" * 12).name, name)
    elif before == "real_directory":
        shutil.copytree(old, name)
    partial = publication.hidden(name, "partial", "b" * 12)
    shutil.copytree(new, partial)

    pid = os.fork()
    if pid == 0:  # the child publishes, and is killed where the test says
        try:
            publication.publish(partial, name, 2, "b" * 12, on_step=lambda done: (
                os.kill(os.getpid(), signal.SIGKILL) if done == kill_after else None))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if kill_after is None:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    else:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return name


KILL_POINTS = [*publication.STEPS, None]  # None: publish runs to the end


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("before", ["folder", "link", "real_directory", "none"])
@pytest.mark.parametrize("kill_after", KILL_POINTS)
def test_a_kill_at_every_step_of_publication_leaves_a_complete_checkpoint(
        two, root, tmp_path, kill_after, before):
    """Old: `groups` (step 3) under the name, as a save publishes it, as the previous
    zero_lab did (a link), as a copied step directory, or nothing; new: `w_fp32` (step 2)
    complete in its partial directory. A process publishing it is SIGKILLed after each step:
    the name reaches a complete checkpoint, the old one until `latest` is replaced (or the
    new folder put in place), the new one from then on; the next save's clean-up leaves only
    the name, `latest` and its step directory. Mutant: `latest` written in place, not
    renamed over (killed after "latest written", the name reaches no complete checkpoint)."""
    name = _publish_killed(root, tmp_path, kill_after, before)
    swapped = kill_after is None or KILL_POINTS.index(kill_after) >= 2
    if before == "none" and not swapped:
        with pytest.raises(CheckpointError, match="no such checkpoint directory"):
            read_manifest(name)
    else:
        manifest = read_manifest(name)
        verify_files(pointer.resolve(name), manifest)
        assert manifest["step"] == (2 if swapped else 3)
    publication.clean_leftovers(name)
    left = sorted(p.name for p in tmp_path.iterdir())
    if before == "none" and not swapped:
        assert left == []
        return
    assert left == sorted(["ckpt"] + ([os.readlink(name)] if name.is_symlink() else []))
    if publication.is_folder(name):
        assert sorted(os.listdir(name)) == sorted(["latest", pointer.current(name).name])
    verify_files(pointer.resolve(name), read_manifest(name))


def test_leftovers_are_only_ours(tmp_path):
    """What clean_leftovers may remove: beside the folder, hidden entries of this name's
    saves; in it, step directories and `.latest-` files that `latest` does not name. Never
    the step directory `latest` names, another name's (`ckpt.v2` is not `ckpt`), or what is
    no save's. Mutant: the step directory `latest` names not kept (the checkpoint removed)."""
    for entry in (".ckpt.partial-0123abcd", ".ckpt.new-0c", ".ckpt.v2.partial-0c",
                  "ckpt.notes", ".ckpt.step3-00ff.bak", "ckpt/step3-00ff", "ckpt/step-0d",
                  "ckpt/step7-0123abcd", "ckpt/notes", "ckpt/step7-0123abcd.bak"):
        (tmp_path / entry).mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("step3-00ff\n")
    (tmp_path / "ckpt" / ".latest-0e").write_text("step7-0123abcd\n")
    assert [p.relative_to(tmp_path).as_posix()
            for p in publication.leftovers(tmp_path / "ckpt")] == [
        ".ckpt.new-0c", ".ckpt.partial-0123abcd", "ckpt/.latest-0e", "ckpt/step-0d",
        "ckpt/step7-0123abcd"]


def test_leftovers_of_the_previous_layout_are_only_ours(tmp_path):
    """The previous zero_lab published a name as a link to a step directory beside it: its
    leftovers too, never the step directory the link reaches."""
    for entry in (".ckpt.partial-0123abcd", ".ckpt.step7-0123abcd", ".ckpt.link-0a",
                  ".ckpt.old-0b", ".ckpt.step3-00ff", ".ckpt.v2.partial-0c", "ckpt.notes",
                  ".ckpt.step3-00ff.bak"):
        (tmp_path / entry).mkdir()
    os.symlink(".ckpt.step3-00ff", tmp_path / "ckpt")
    assert [p.name for p in publication.leftovers(tmp_path / "ckpt")] == [
        ".ckpt.link-0a", ".ckpt.old-0b", ".ckpt.partial-0123abcd", ".ckpt.step7-0123abcd"]


# ------------------------------------------------------------------ 4. fsync
def durable_order_problems(events: list, rank: int, folder: str) -> list[str]:
    """What is wrong with the order of one rank's fsyncs and renames in a save (empty: all
    right): its shard (rank 0: and the manifest, then the directory) fsynced before the
    partial directory is renamed into the checkpoint's folder; the folder fsynced after that
    rename; `latest`'s new content fsynced before it replaces `latest`, the folder after."""
    problems = []
    wrote = [f"rank{rank}.safetensors"] + (["manifest.json"] if rank == 0 else [])
    for file in wrote:
        if ("fsync", file) not in events:
            problems.append(f"{file} never fsynced")
    if rank != 0:
        return problems
    renames = [i for i, e in enumerate(events) if e[0] == "rename" and ".partial-" in e[1]]
    swaps = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == "latest"]
    if len(renames) != 1 or len(swaps) != 1 or swaps[0] < renames[0]:
        return problems + [f"not one rename then one swap: {events}"]
    partial = events[renames[0]][1]
    before = events[:renames[0]]
    for needed in [*(("fsync", f) for f in wrote), ("fsync", partial)]:
        if needed not in before:
            problems.append(f"{needed} not before the rename")
    if ("fsync", events[swaps[0]][1]) not in events[renames[0]:swaps[0]]:
        problems.append("the new latest not fsynced before it replaces latest")
    folder_synced = [i for i, e in enumerate(events) if e == ("fsync", folder)]
    if not any(renames[0] < i < swaps[0] for i in folder_synced):
        problems.append("the folder not fsynced between the rename and the swap")
    if not any(i > swaps[0] for i in folder_synced):
        problems.append("the folder not fsynced after the swap")
    return problems


def test_every_file_and_directory_is_fsynced_before_publication(two):
    for rank, r in enumerate(case(two, "fsync_order")):
        events = [tuple(e) for e in r["events"]]
        assert durable_order_problems(events, rank, "durable") == [], events


def test_durable_order_problems_catches_missing_fsyncs(two):
    """The mutants: the same save without the directory's fsync, without the folder's,
    without the new `latest`'s."""
    events = [tuple(e) for e in case(two, "fsync_order")[0]["events"]]
    without_dir = [e for e in events if not (e[0] == "fsync" and ".partial-" in e[1])]
    assert any("not before the rename" in p
               for p in durable_order_problems(without_dir, 0, "durable"))
    no_folder = [e for e in events if e != ("fsync", "durable")]
    assert len(durable_order_problems(no_folder, 0, "durable")) == 2
    no_latest = [e for e in events if not (e[0] == "fsync" and e[1].startswith(".latest-"))]
    assert durable_order_problems(no_latest, 0, "durable") == [
        "the new latest not fsynced before it replaces latest"]
    assert durable_order_problems([], 1, "durable") == ["rank1.safetensors never fsynced"]


# ------------------------------------------------------------------ 6. extras
def test_a_resume_with_scheduler_rng_and_data_position_equals_the_uninterrupted_run(two):
    """Stage 2, dropout with an RNG seeded per rank, a shuffled data order, Python's random in
    the loss, StepLR: 4 steps, saved, everything rebuilt from another seed, loaded, 5 more
    steps: bit for bit the 9-step run. Without the extras (the control) it is not."""
    for r in case(two, "extras"):
        assert r["equal"] is True
        assert r["without_extras_equal"] is False
        assert r["same_on_every_rank"] == {"scheduler": {"same_on_every_rank": True},
                                           "data": {"same_on_every_rank": True},
                                           "rng": {"same_on_every_rank": False}}


def test_per_rank_extras_are_refused_at_another_world_size_and_shared_ones_load(one):
    assert "extras ['rng'] differed between the 2 ranks that saved them" in (
        one["per_rank_extras"])
    assert one["shared_extras"] == "no error"
    # StepLR(2, 0.5) after 4 steps, from the checkpoint: each group's lr / 4
    assert one["lr"] == [0.05 * 0.5 ** 2, 0.02 * 0.5 ** 2]


# ------------------------------------------------------------------ 8. cost at scale
def test_each_rank_hashes_only_the_files_it_reads(two):
    """Stage 3 on 2 ranks, loaded at the same layout: rank r reads (so hashes) rank r's file
    only; before, every rank hashed every shard."""
    for rank, r in enumerate(case(two, "verify_reads")):
        assert r["hashed"] == [f"rank{rank}.safetensors"]




def test_consolidation_peaks_at_most_one_and_a_half_largest_tensors(two, root):
    """2 x Linear(2048, 2048) with Adam's two states (6 tensors of 16 MiB), measured in a
    fresh process (its peak resident memory): one tensor at a time, read in place (was 2.6x:
    the generator kept the previous tensor, and the memory map added a second copy)."""
    # glibc's dynamic mmap threshold would keep freed 16 MiB blocks resident (1.2x-2.2x
    # from run to run, with the same live tensors); a fixed threshold hands them back.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    out = subprocess.run([sys.executable, "-c", MEASURE_CONSOLIDATION, str(root / "big")],
                         capture_output=True, text=True, check=True, env=env).stdout
    measured = json.loads(out)
    assert measured["largest"] == 16 * 2**20
    assert 6 * 16 * 2**20 <= measured["total"] < 6 * 16 * 2**20 + 64  # and two 0-d steps
    assert measured["rise"] <= 1.5 * measured["largest"], measured


# ------------------------------------------------------------------ 9. weights only
def test_a_weights_only_load_at_every_stage(two, one):
    """load(model, None, dir): the weights (fp32 masters in bf16) into a model sharded at
    each stage with another optimizer (AdamW, saved with SGD); its optimizer untouched."""
    for r in case(two, "weights_only"):
        assert sorted(r) == [f"{s}/{p}" for s in range(4) for p in ("bf16", "fp32")]
        for key, found in r.items():
            assert found == {"error": "no error", "equal": True, "optimizer_untouched": True}, key
    assert one["weights_only"] == "no error"


# ------------------------------------------------------------------ stricter than DCP
# These two state torch 2.13's DCP behaviour beside zero_lab's (the README's comparison): if
# a torch release verifies data or publishes atomically, they fail and the README must change.
def test_a_flipped_byte_dcp_loads_zero_lab_refuses(two, root, tmp_path):
    """torch.distributed.checkpoint (one process) loads a shard with a flipped byte, wrong
    and silent; zero_lab refuses the same damage by the shard's SHA-256."""
    import warnings

    import numpy
    import torch
    import torch.distributed.checkpoint as dcp

    saved = torch.arange(8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialised
        dcp.save({"w": saved}, checkpoint_id=tmp_path / "dcp")
        data = next((tmp_path / "dcp").glob("*.distcp"))
        raw = bytearray(data.read_bytes())
        raw[raw.find(numpy.arange(8, dtype=numpy.float32).tobytes()) + 7] ^= 0xFF
        data.write_bytes(bytes(raw))
        loaded = {"w": torch.zeros(8)}
        dcp.load(loaded, checkpoint_id=tmp_path / "dcp")
    assert not torch.equal(loaded["w"], saved)  # DCP: no error, a wrong value
    ours = tmp_path / "ours"
    shutil.copytree(pointer.resolve(root / "groups"), ours)  # its step directory
    shard = ours / "rank0.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="rank0.safetensors: corrupted"):
        consolidate(ours)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_an_interrupted_save_dcp_loads_unfinished_zero_lab_keeps_the_previous(
        two, root, tmp_path):
    """A save into an existing checkpoint killed before it finished: DCP (one process,
    killed before its metadata is written) then loads the unfinished save's values; under
    zero_lab's name the previous checkpoint stays, whole, until the new one is published."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(8.0)}, checkpoint_id=tmp_path / "dcp")
        pid = os.fork()
        if pid == 0:
            try:
                FileSystemWriter.finish = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
                dcp.save({"w": torch.full((8,), 7.0)}, checkpoint_id=tmp_path / "dcp")
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status)
        loaded = {"w": torch.zeros(8)}
        dcp.load(loaded, checkpoint_id=tmp_path / "dcp")
    assert torch.equal(loaded["w"], torch.full((8,), 7.0))  # the save that never finished
    for kill_after in publication.STEPS[:2]:  # zero_lab, killed before `latest` is replaced
        shutil.rmtree(tmp_path / "z", ignore_errors=True)
        (tmp_path / "z").mkdir()
        name = _publish_killed(root, tmp_path / "z", kill_after, before="folder")
        assert read_manifest(name)["step"] == 3  # the previous one
