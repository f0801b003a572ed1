"""zero_lab.checkpoint when two jobs save to one name (issue 34, case 11), and steps that are
integers of another type than int (case 2).

Two jobs (two notebook kernels, `make test` beside JupyterLab) saving to one name used to
remove each other's half-written files as leftovers of killed saves. Now a save holds the
name's lock (zero_lab/checkpoint/locking.py): the test plays it for real, with no sleeps:

    job A   a process saving to `shared` on 1 rank, held inside its save (its shard written
            in the partial directory, not yet published) until the test lets it go;
    job B   a launch on 2 ranks that, while A is held, saves to `shared` (refused on both
            ranks, naming A), then to names with a stale lock, with a failing publication,
            with numpy and tensor steps.

This file is also the ranks' side (run as a script; see the bottom): `--hold` is job A,
`--jobs` job B's ranks under zero_lab.launch.torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from zero_lab import checkpoint
from zero_lab.checkpoint import CheckpointError, pointer, read_manifest
from zero_lab.checkpoint.manifest import verify_files
from zero_lab.checkpoint.saving import check_step
from zero_lab.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "workers"))
from checkpoint_cases import Net, adamw, train  # noqa: E402

# Launches that fail on purpose keep their logs: in pytest's temp dir (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("temp_dir")

A_STEP = 5  # job A's checkpoint; job B tries to save step 7 to the same name


def lock_file(directory: Path) -> Path:
    """The lock of a save to `directory`, hidden beside it as everything a save leaves is."""
    return directory.parent / f".{directory.name}.lock"


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped): no process has it now."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def left_around(directory: Path) -> tuple[list[str], list[str]]:
    """(what is beside the checkpoint's folder, hidden like a save's entries; what is in it)."""
    beside = sorted(p.name for p in directory.parent.iterdir()
                    if p.name.startswith(f".{directory.name}."))
    return beside, sorted(p.name for p in directory.iterdir())


def write_lock(directory: Path, pid: int, host: str) -> Path:
    """A lock as a job killed in the middle of a save leaves it."""
    path = lock_file(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "host": host, "started": "2020-01-01T00:00:00+00:00",
                                "job": "python killed.py"}))
    return path


# ------------------------------------------------------------------ in this process
@pytest.mark.parametrize("step, expected", [
    (None, None), (0, 0), (7, 7), (numpy.int64(3), 3), (numpy.uint8(4), 4),
    (torch.tensor(5), 5), (torch.tensor(6, dtype=torch.int32), 6)])
def test_a_step_is_anything_operator_index_accepts_returned_as_a_plain_int(step, expected):
    """Mutant: `type(step) is int` again (numpy.int64 refused); returning `step` itself."""
    got = check_step(step)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("step", [
    True, numpy.True_, torch.tensor(True), 3.0, numpy.float64(3.0), torch.tensor(3.0), -1,
    numpy.int64(-2), torch.tensor(-1), "3"])
def test_bools_floats_and_negative_steps_are_refused_naming_value_and_type(step):
    """Mutants: operator.index without the bool check (True and tensor(True) pass as 1);
    without `< 0` (negatives pass)."""
    with pytest.raises(CheckpointError, match="step must be a non-negative int") as caught:
        check_step(step)
    assert type(step).__name__ in str(caught.value) and repr(step) in str(caught.value)


def test_a_lock_held_by_a_live_job_refuses_a_second_naming_it(tmp_path):
    """Mutant: a live holder taken for stale (`_stale` returns True): the second acquire
    succeeds."""
    from zero_lab.checkpoint import CheckpointBusy, locking

    name = tmp_path / "runs" / "ckpt"
    mine = locking.acquire(name)  # this process plays the other job
    with pytest.raises(CheckpointBusy) as caught:
        locking.acquire(name)
    message = str(caught.value)
    for part in (f"pid {os.getpid()}", socket.gethostname(), mine["started"], str(name),
                 str(lock_file(name))):
        assert part in message, (part, message)
    locking.release(name, mine)
    assert not lock_file(name).exists()
    locking.release(name, locking.acquire(name))  # free again


def test_a_stale_lock_on_this_host_is_taken_over_another_hosts_is_not(tmp_path):
    """Mutants: `_stale` always False (a killed save blocks the name for ever); the host not
    compared (a pid of another machine looked up here)."""
    from zero_lab.checkpoint import CheckpointBusy, locking

    name = tmp_path / "ckpt"
    write_lock(name, dead_pid(), socket.gethostname())
    mine = locking.acquire(name)
    assert json.loads(lock_file(name).read_text())["pid"] == os.getpid()
    locking.release(name, mine)

    write_lock(name, dead_pid(), "another-host")
    with pytest.raises(CheckpointBusy, match="another-host") as caught:
        locking.acquire(name)
    assert "remove" in str(caught.value)  # what to do once that job is gone


def test_a_stale_lock_that_another_job_has_just_taken_over_is_put_back(tmp_path):
    """Two jobs found the same stale lock; the first took it over, then the second moves
    "the stale lock" aside: it sees that it moved a live one, and puts it back. Mutant: the
    moved lock removed without that look (two jobs would both hold the name)."""
    from zero_lab.checkpoint import locking

    name = tmp_path / "ckpt"
    stale = json.loads(write_lock(name, dead_pid(), socket.gethostname()).read_text())
    first = locking.acquire(name)  # the first job took the stale lock over
    locking._take_over(lock_file(name), stale)  # the second, late
    assert json.loads(lock_file(name).read_text()) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.lock"]


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    """Ours removed by hand, then taken by another job: releasing must not remove theirs.
    Mutant: release unlinks without reading."""
    from zero_lab.checkpoint import locking

    name = tmp_path / "ckpt"
    mine = locking.acquire(name)
    lock_file(name).unlink()
    theirs = locking.acquire(name)
    locking.release(name, mine)
    assert lock_file(name).exists()
    locking.release(name, theirs)
    assert not lock_file(name).exists()


# ------------------------------------------------------------------ two real jobs
@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Job A held inside its save to `shared`; meanwhile job B (2 ranks) runs its jobs; then A
    goes on. What each reported, and what the lock held while A was held."""
    from zero_lab.launch import torchrun

    root = tmp_path_factory.mktemp("jobs")
    shared = root / "shared"
    # A killed job's leftovers beside `stale`: its lock (its pid now no process's) and its
    # partial directory, which the next save removes.
    write_lock(root / "stale", dead_pid(), socket.gethostname())
    (root / ".stale.partial-0123abcd").mkdir()
    (root / ".stale.partial-0123abcd" / "rank0.safetensors").write_bytes(b"half")

    a_log = root / "a.stderr"
    with open(a_log, "w") as err:
        a = subprocess.Popen([sys.executable, __file__, "--hold", str(shared)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                             text=True)
    try:
        # A's first line comes when it is held inside its save, its shard on disk. If A died
        # instead, the line is empty and its stderr says why.
        assert a.stdout.readline().strip() == "held", a_log.read_text()
        lock_seen = (json.loads(lock_file(shared).read_text())
                     if lock_file(shared).exists() else None)
        partial_seen = sorted(p.name for p in root.iterdir() if ".shared.partial-" in p.name)
        b = torchrun(__file__, nproc=2, backend="gloo", stream=False, timeout=120,
                     args=["--jobs", str(root)])
    finally:
        with contextlib.suppress(BrokenPipeError):  # A may have died: its report says so
            a.stdin.write("go\n")
            a.stdin.close()
        a_report = a.stdout.readline()
        a.stdout.close()
        a.wait(timeout=120)
    return {"root": root, "a_pid": a.pid, "a": json.loads(a_report or "{}"),
            "a_log": a_log.read_text(), "lock_seen": lock_seen, "partial_seen": partial_seen,
            "b": list(b.ranks)}


def test_a_second_job_saving_to_the_same_name_is_refused_on_every_rank_naming_the_first(jobs):
    """Mutants: no lock taken in save() (B removes A's partial directory as a leftover and
    publishes; A then fails); only rank 0 refusing (rank 1 goes on into the next collective:
    the launch hangs to its timeout)."""
    for rank in jobs["b"]:
        assert rank["busy"].get("error") == "CheckpointBusy", rank["busy"]
    lock = jobs["lock_seen"]  # A's lock, read while A was held
    assert lock is not None and lock["pid"] == jobs["a_pid"], lock
    for rank in jobs["b"]:
        busy = rank["busy"]
        for part in (f"pid {jobs['a_pid']}", socket.gethostname(), lock["started"],
                     str(jobs["root"] / "shared")):
            assert part in busy["message"], (part, busy["message"])


def test_the_first_jobs_save_completes_untouched_by_the_second(jobs):
    """Mutant: leftovers cleaned before the lock is taken (B removes A's partial directory,
    then is refused; A's publication fails)."""
    assert len(jobs["partial_seen"]) == 1  # A's, with its shard in it, while B ran
    assert jobs["a"].get("saved"), jobs["a"] or jobs["a_log"]
    shared = jobs["root"] / "shared"
    manifest = read_manifest(shared)
    verify_files(pointer.resolve(shared), manifest)
    assert manifest["step"] == A_STEP
    # no partial of B's beside, the lock released; in the folder A's step directory alone
    assert left_around(shared) == ([], sorted(["latest", pointer.current(shared).name]))


def test_a_stale_lock_and_its_dead_jobs_partial_directory_are_taken_over(jobs):
    """Mutant: `_stale` always False (B refused by a lock nobody will ever release)."""
    for rank in jobs["b"]:
        assert rank["stale"] == {"saved": True, "step": 2}, rank["stale"]
    stale = jobs["root"] / "stale"  # the partial and the lock gone
    assert left_around(stale) == ([], sorted(["latest", pointer.current(stale).name]))


def test_the_lock_is_released_when_a_save_fails(jobs):
    """Rank 0's publication fails (a full disk): every rank raises, the lock is released, and
    the next save to the name goes through. Mutant: release only after a save that went well
    (not in a `finally`): the next save is refused, by its own job's lock."""
    for rank in jobs["b"]:
        assert rank["fails"]["error"] == "CheckpointError", rank["fails"]
        assert "No space left on device (a test)" in rank["fails"]["message"]
        assert rank["after_failure"] == {"saved": True, "step": 4}, rank["after_failure"]
    assert jobs["b"][0]["lock_during_failed_save"] is True  # there was a lock to release


def test_numpy_and_tensor_steps_are_saved_as_plain_ints(jobs):
    """Mutant: the manifest given `step` as passed (json cannot write numpy.int64)."""
    for rank in jobs["b"]:
        assert rank["numpy_step"] == {"saved": True, "step": 3}, rank["numpy_step"]
        assert rank["tensor_step"] == {"saved": True, "step": 8}, rank["tensor_step"]
    for name, step in (("numpy_step", 3), ("tensor_step", 8)):
        manifest = read_manifest(jobs["root"] / name)
        assert type(manifest["step"]) is int and manifest["step"] == step
        assert pointer.current(jobs["root"] / name).name.startswith(f"step{step}-")


# ------------------------------------------------------------------ the jobs' side
def _sharded(rank: int, world: int):
    from zero_lab.stages import shard

    torch.manual_seed(0)
    model, opt = shard(Net(), 1, optimizer=adamw)
    train(model, opt, 0, 1, rank, world)
    return model, opt


def _outcome(save) -> dict:
    try:
        directory = save()
    except Exception as exc:  # noqa: BLE001 - what was raised is what is tested
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"saved": True, "step": read_manifest(directory)["step"]}


def hold(directory: Path) -> None:
    """Job A: one rank, held after writing its shard, before publishing, until stdin says go."""
    import torch.distributed as dist

    from zero_lab.checkpoint import saving

    dist.init_process_group("gloo", init_method=f"file://{directory.parent / 'a.store'}",
                            rank=0, world_size=1)
    model, opt = _sharded(0, 1)
    publish = saving._publish

    def held(*args, **kwargs):
        print("held", flush=True)
        sys.stdin.readline()
        return publish(*args, **kwargs)

    saving._publish = held
    print(json.dumps(_outcome(lambda: checkpoint.save(model, opt, directory, step=A_STEP))),
          flush=True)
    dist.destroy_process_group()


def b_jobs(root: Path) -> None:
    """Job B: every rank, the same saves in the same order."""
    from zero_lab.checkpoint import publication
    from zero_lab.launch import init_worker, report

    info = init_worker()
    model, opt = _sharded(info.rank, info.world_size)
    out = {"busy": _outcome(lambda: checkpoint.save(model, opt, root / "shared", step=7)),
           "stale": _outcome(lambda: checkpoint.save(model, opt, root / "stale", step=2))}

    real_publish = publication.publish
    seen = []

    def full_disk(partial, directory, *args, **kwargs):
        seen.append(lock_file(directory).exists())
        raise OSError(28, "No space left on device (a test)")

    if info.rank == 0:  # rank 0 publishes
        publication.publish = full_disk
    out["fails"] = _outcome(lambda: checkpoint.save(model, opt, root / "fails", step=3))
    publication.publish = real_publish
    out["lock_during_failed_save"] = seen[0] if seen else None
    out["after_failure"] = _outcome(lambda: checkpoint.save(model, opt, root / "fails", step=4))
    out["numpy_step"] = _outcome(lambda: checkpoint.save(model, opt, root / "numpy_step",
                                                         step=numpy.int64(3)))
    out["tensor_step"] = _outcome(lambda: checkpoint.save(model, opt, root / "tensor_step",
                                                          step=torch.tensor(8)))
    report(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", type=Path, help="job A: save to this name, held part-way")
    parser.add_argument("--jobs", type=Path, help="job B's ranks: the saves under this root")
    arguments = parser.parse_args()
    if arguments.hold:
        hold(arguments.hold)
    else:
        b_jobs(arguments.jobs)
