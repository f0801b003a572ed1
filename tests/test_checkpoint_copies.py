"""A checkpoint copied with the usual tools loads, with the original gone (issue 47, item 7).

`cp -r runs/ckpt backup/` used to copy a link: the published name was a symbolic link to a
step directory beside it (`runs/.ckpt.step2-<token>`), which no copy of the name carries, so
the copy dangled and loading it said only "no such checkpoint directory" (and after `make
clean` the original was gone too). Now the name is a real folder holding its step directory
and a `latest` file naming it (zero_lab/checkpoint/pointer.py): every tool copies all of it.

One process saves `runs/ckpt` twice (weights all 1.0, then all 2.0: the copy must hold the
second), the test copies it with `cp -r`, `cp -a`, a `tar` round trip and `rsync -a` (where
installed), removes `runs`, and one process loads every copy into a sharded model.

This file is also the processes' side (run as a script; see the bottom).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_lab import checkpoint
from zero_lab.checkpoint import CheckpointError
from zero_lab.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "workers"))
from checkpoint_cases import Net  # noqa: E402

COPIES = {  # how a learner copies `runs/ckpt` into `backup/`, run in the folder above both
    "cp -r": "cp -r runs/ckpt backup/",
    "cp -a": "cp -a runs/ckpt backup/",
    "tar": "tar -C runs -cf ckpt.tar ckpt && tar -C backup -xf ckpt.tar && rm ckpt.tar",
    "rsync -a": "rsync -a runs/ckpt backup/",
}


def run_side(store: Path, *args: str) -> dict:
    """This file as a script in a fresh process, in a process group of one of its own
    (rendezvous on the file `store`)."""
    out = subprocess.run([sys.executable, __file__, "--store", str(store), *args],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def copied(tmp_path_factory) -> dict:
    """Each copy of `runs/ckpt` (one folder per tool), the original removed; what loading
    each one left in a model, and consolidate()'s weights, read after the removal."""
    root = tmp_path_factory.mktemp("copies")
    run_side(root / "save.store", "--save", str(root / "runs" / "ckpt"))
    places = {}
    for tool, command in COPIES.items():
        if shutil.which(command.split()[0]) is None:
            continue
        place = root / tool.replace(" ", "").replace("-", "_")
        shutil.copytree(root / "runs", place / "runs", symlinks=True)  # links as they are
        (place / "backup").mkdir()
        subprocess.run(command, shell=True, check=True, cwd=place)
        shutil.rmtree(place / "runs")  # `make clean`: the original is gone
        places[tool] = place / "backup" / "ckpt"
    shutil.rmtree(root / "runs")
    loaded = run_side(root / "load.store", "--load", *map(str, places.values()))
    return {tool: {"loaded": loaded[str(path)], "path": path} for tool, path in places.items()}


@pytest.mark.parametrize("tool", COPIES)
def test_a_copied_checkpoint_loads_with_the_original_removed(copied, tool):
    """Mutants: the name published as a link to a step directory beside it (as before: the
    copy holds the link alone, dangling); `latest` holding the step directory's absolute
    path (the copy reads the original's, removed)."""
    if tool not in copied:
        pytest.skip(f"{tool.split()[0]} is not installed")
    assert copied[tool]["loaded"] == {"step": 2, "seen": [2.0]}, copied[tool]["loaded"]


@pytest.mark.parametrize("tool", COPIES)
def test_a_copied_checkpoint_consolidates_and_nothing_in_it_leads_outside(copied, tool):
    """Without a process group too. Mutant: consolidate() resolving the name as a link only,
    as before (a folder's `latest` not read: "not a zero_lab checkpoint")."""
    if tool not in copied:
        pytest.skip(f"{tool.split()[0]} is not installed")
    path = copied[tool]["path"]
    weights = checkpoint.consolidate(path)
    assert weights and all(torch.equal(t, torch.full_like(t, 2.0)) for t in weights.values())
    assert checkpoint.read_manifest(path)["step"] == 2
    assert all(p.resolve().is_relative_to(path) for p in path.rglob("*"))


def test_a_copy_of_an_older_zero_labs_link_says_how_to_copy_one(tmp_path):
    """A checkpoint saved by the previous zero_lab is a link to a step directory beside it;
    `cp -r` of the name copies the link alone. Loading the copy says what it is and how to
    copy one. Mutant: the old message, "no such checkpoint directory", alone."""
    step = tmp_path / "runs" / ".ckpt.step2-0123456789ab"
    step.mkdir(parents=True)
    os.symlink(step.name, tmp_path / "runs" / "ckpt")
    (tmp_path / "backup").mkdir()
    subprocess.run("cp -r runs/ckpt backup/", shell=True, check=True, cwd=tmp_path)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.consolidate(tmp_path / "backup" / "ckpt")
    message = str(caught.value)
    for part in ("backup/ckpt", ".ckpt.step2-0123456789ab", "cp -rL"):
        assert part in message, (part, message)


# ------------------------------------------------------------------ the processes' side
def _model():
    from zero_lab.stages import shard

    return shard(Net(), 1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def save_twice(name: Path) -> dict:
    """`name` saved with every weight and buffer 1.0 (step 1), then 2.0 (step 2)."""
    model, opt = _model()
    for step in (1, 2):
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.fill_(float(step))
        checkpoint.save(model, opt, name, step=step)
    return {"saved": 2}


def load_each(names: list[Path]) -> dict:
    """Each of `names` loaded into a model filled with -1: its step and the distinct values
    it left in the model (or the error)."""
    model, opt = _model()
    out = {}
    for name in names:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.fill_(-1.0)
        try:
            manifest = checkpoint.load(model, opt, name)
        except Exception as exc:  # noqa: BLE001 - what failed is what is tested
            out[str(name)] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        seen = sorted({v for t in [*model.parameters(), *model.buffers()]
                       for v in t.unique().tolist()})
        out[str(name)] = {"step": manifest["step"], "seen": seen}
    return out


if __name__ == "__main__":
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path, nargs="*")
    arguments = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{arguments.store}", rank=0,
                            world_size=1)
    print(json.dumps(save_twice(arguments.save) if arguments.save
                     else load_each(arguments.load)))
