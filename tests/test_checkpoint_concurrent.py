"""zero_lab.checkpoint loaded while another job saves to the same name (issue 47, item 3).

A probe loaded a checkpoint 150 times while another job saved to its name: 27 loads failed
with "shard file missing", because each save removed the step directory a load had just
resolved. Now a reader holds the step directory it resolved until its reads are done, and a
save leaves a held one for a later save to remove (zero_lab/checkpoint/in_use.py). The test
plays it with two real jobs, as the probe did:

    job S   one process saving versions 1, 2, 3, ... to `shared` until the test says stop:
            every weight and buffer of version v equals v, and so does an extra;
    job L   a launch on 2 ranks loading `shared` LOADS times meanwhile, each load into a
            model filled with -1 first.

Every load must succeed and see exactly one version: everything it loaded equal to one v,
never a mix of two saves, nor a -1 left unloaded; the versions it sees never go back.

This file is also the jobs' side (run as a script; see the bottom): `--save` is job S,
`--load` job L's ranks under zero_lab.launch.torchrun.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zero_lab import checkpoint
from zero_lab.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "workers"))
from checkpoint_cases import Net  # noqa: E402

# Launches that fail on purpose keep their logs: in pytest's temp dir (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("temp_dir")

LOADS = 150


class Version:
    """An extra holding the version number a save wrote (saved in its own file)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"version": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["version"]


def _fill(model, value: float) -> None:
    """Every parameter and buffer of `model` set to `value` (in place: at stages 0-2 the
    parameters are views of the flat buffers that save() reads)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(value)


def _seen(model, version: Version) -> list[float]:
    """Every distinct value a load left in the model and the extra."""
    values = {version.value}
    for t in [*model.parameters(), *model.buffers()]:
        values.update(t.unique().tolist())
    return sorted(values)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Job S and job L started together (each takes seconds to import torch); S publishes
    version 1, L's ranks are ready, and only then do S's saves and L's loads run, together.
    Then S is told to stop. What each reported (L's ranks: each load, and how long the loads
    took together)."""
    from zero_lab.launch import torchrun

    root = tmp_path_factory.mktemp("concurrent")
    shared = root / "shared"
    s_log = root / "s.stderr"
    with open(s_log, "w") as err:
        saver = subprocess.Popen([sys.executable, __file__, "--save", str(shared)],
                                 stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        loader = torchrun(__file__, nproc=2, backend="gloo", stream=False, timeout=120,
                          args=["--load", str(shared)])
    finally:
        signal(shared, "stop").touch()
        s_report = saver.stdout.readline()  # empty if S died: its stderr says why
        saver.stdout.close()
        saver.wait(timeout=60)
    return {"s": json.loads(s_report or "{}"), "s_log": s_log.read_text(),
            "l": list(loader.ranks)}


def test_loads_during_saves_to_the_same_name_never_fail(jobs):
    """Mutants: the previous step directory removed whatever readers hold (in_use's
    `remove_unless_read` without its lock): loads fail with "shard file missing" (27 of 150
    in the probe); the ranks resolving the name each on their own: a save published between
    their looks makes them "name different checkpoints"."""
    for rank in jobs["l"]:
        failed = [f for f in rank["loads"] if "error" in f]
        assert len(rank["loads"]) == LOADS and failed == [], (len(failed), failed[:3])


def test_every_load_sees_one_complete_version_and_never_an_older_one(jobs):
    """Mutant: the extra read from the name resolved again rather than from the step
    directory the load holds (weights of one save, the extra of the next: a mix)."""
    versions = []
    for load in jobs["l"][0]["loads"]:
        seen = load.get("seen", [])
        assert len(seen) == 1 and seen[0] >= 1, load  # one v, and no -1 left unloaded
        versions.append(seen[0])
    assert [load.get("seen") for load in jobs["l"][1]["loads"]] == [[v] for v in versions]
    assert versions == sorted(versions)  # a load never sees an older save than the last
    # The saves went on while the loads ran: otherwise the test would prove nothing.
    assert jobs["s"].get("saves", 0) > versions[0] and len(set(versions)) >= 2, jobs


def test_the_saving_job_was_never_refused_or_failed(jobs):
    """Readers never stand in a save's way: every save of job S went through. Mutant: the
    removal of a held step directory raising instead of leaving it for a later save."""
    assert jobs["s"].get("error") is None and jobs["s"].get("saves", 0) >= 2, (
        jobs["s"], jobs["s_log"])


# ------------------------------------------------------------------ the jobs' side
def signal(shared: Path, name: str) -> Path:
    """A file beside `shared` by which one job tells the other: `ready` (S: version 1 is
    published), `go` (L: its ranks are ready), `stop` (the test: L is done)."""
    return shared.parent / name


def wait_for(path: Path, unless: Path | None = None, seconds: float = 60) -> None:
    """Until `path` (or `unless`) exists: the jobs start together and each imports torch
    for seconds first; they share no process group to wait in."""
    deadline = time.monotonic() + seconds
    while not path.exists() and not (unless and unless.exists()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def save_forever(shared: Path) -> None:
    """Job S: one rank, saving version 1, 2, ... until `stop`; prints {"saves": n} or
    {"error": ...} as it ends."""
    import torch.distributed as dist

    from zero_lab.stages import shard

    dist.init_process_group("gloo", init_method=f"file://{shared.parent / 's.store'}",
                            rank=0, world_size=1)
    model, opt = shard(Net(), 0, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    version, out, stop = Version(0), {}, signal(shared, "stop")
    try:
        while version.value == 0 or not stop.exists():
            version.value += 1
            _fill(model, version.value)
            checkpoint.save(model, opt, shared, step=version.value,
                            extras={"version": version})
            if version.value == 1:
                signal(shared, "ready").touch()
                wait_for(signal(shared, "go"), unless=stop)
        out["saves"] = version.value
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def load_many(shared: Path) -> None:
    """Job L's ranks: LOADS loads of `shared` (weights and the extra), each into a model
    filled with -1; what each load saw, or its error; how long the loads took."""
    import torch.distributed as dist

    from zero_lab.launch import init_worker, report
    from zero_lab.stages import shard

    info = init_worker()
    model, _ = shard(Net(), 1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    if info.rank == 0:
        wait_for(signal(shared, "ready"))
        signal(shared, "go").touch()
    dist.barrier()
    loads, started = [], time.perf_counter()
    for _ in range(LOADS):
        _fill(model, -1.0)
        version = Version(-1)
        try:
            checkpoint.load(model, None, shared, extras={"version": version})
        except Exception as exc:  # noqa: BLE001 - what failed is what is tested
            loads.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        loads.append({"seen": _seen(model, version)})
    report({"loads": loads, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", type=Path, help="job S: save to this name until told")
    parser.add_argument("--load", type=Path, help="job L's ranks: load this name")
    arguments = parser.parse_args()
    if arguments.save:
        save_forever(arguments.save)
    else:
        load_many(arguments.load)
