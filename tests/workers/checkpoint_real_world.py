"""Per-rank worker for tests/test_checkpoint_real_world.py: checkpoints on the paths a real
training job meets (issue 22, points 1-9), every case in one launch per world size.

`--root` is a folder shared by the ranks; a launch on 2 ranks runs CASES_2 in order, one on 1
rank CASES_1 (it reads what the 2-rank launch saved). Each case returns what it observed; a
case that raises reports `Type: message` instead, so one broken case does not hide the others.

    groups        optimizer groups listed in another order at load take the settings of the
                  groups that held their parameters; a group merging two saved groups refused
    identity      ranks loading different checkpoints, or saving to per-rank paths or steps:
                  refused on every rank, nothing changed, nothing written
    edited        hand-edited manifests (piece keys exchanged, a file dropped from `files`, a
                  setting changed): refused by their checksum; resealed ones (a missing entry,
                  a piece naming an unlisted file, a duplicated piece): refused by name
    bad_input     step=numpy.int64 / tensor, extras that are not Stateful: refused naming the
                  argument, nothing written; a parameter frozen since the save: named
    published     two saves to one name: a link to a step directory, nothing left beside it
    fsync_order   every file this rank wrote is fsynced before the name is replaced, and the
                  directory entries too (real fsync calls, by path)
    extras        a run with an LR scheduler, dropout (RNG per rank) and a shuffled data
                  order, interrupted and resumed from a checkpoint: equal to the run that was
                  not; without the extras it is not
    verify_reads  which files each rank hashed in a load at the saved layout
    weights_only  load(model, None, dir) at every stage, fp32 and bf16: the weights, and the
                  optimizer left as it was
    big           a checkpoint of 2 x Linear(2048, 2048) with Adam (the consolidation's memory)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_lab.checkpoint.manifest
from zero_lab import checkpoint
from zero_lab.checkpoint import pointer
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard

ROWS = 8  # global batch: divides over 1 and 2 ranks


class Net(nn.Module):
    """Weights and biases (two optimizer groups), two parameters of the same size (a.weight,
    b.weight: 25 elements each, so exchanged piece keys would fit), dropout."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.c = nn.Linear(5, 3)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.relu(self.b(torch.relu(self.a(x))))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)


def weights_first(params):
    """Decay on matrices, none on biases (nanoGPT's split), each group its own lr."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "lr": 0.05,
                               "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "lr": 0.02,
                               "weight_decay": 0.0}])


def biases_first(params):
    """The same groups, listed the other way round (a refactor)."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() < 2], "lr": 0.02,
                               "weight_decay": 0.0},
                              {"params": [p for p in params if p.dim() >= 2], "lr": 0.05,
                               "weight_decay": 0.1}])


def merged_groups(params):
    """Group 0 holds a.weight (saved in group 0) and every bias (saved in group 1)."""
    first = [params[0]] + [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": first, "lr": 0.05},
                              {"params": [p for p in params[1:] if p.dim() >= 2]}])


def train(model, opt, first: int, last: int, rank: int, world: int, scheduler=None) -> None:
    rows = ROWS // world
    for step in range(first, last):
        x, y = batch(step)
        F.mse_loss(model(x[rank * rows:(rank + 1) * rows]),
                   y[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def weights(model) -> dict:
    return {k: v.double().flatten().tolist() for k, v in full_state_dict(model).items()}


def opt_state(opt) -> list:
    return [{k: v.double().flatten().tolist() for k, v in s.items()}
            for s in opt.optim.state.values()]


def message(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def made(stage: int, optimizer=weights_first, seed: int = 0, precision: str = "fp32",
         model=None):
    torch.manual_seed(seed)
    return shard(model or Net(), stage, optimizer=optimizer, precision=precision)


# ---------------------------------------------------------------------------------- cases
def groups(root: Path, rank: int, world: int) -> dict:
    model, opt = made(2)
    train(model, opt, 0, 3, rank, world)
    checkpoint.save(model, opt, root / "groups", step=3)
    train(model, opt, 3, 5, rank, world)
    uninterrupted = weights(model)
    model, opt = made(2, biases_first, seed=1)  # the same groups, the other way round
    checkpoint.load(model, opt, root / "groups")
    settings = [{k: pg[k] for k in ("lr", "weight_decay")} for pg in opt.param_groups]
    train(model, opt, 3, 5, rank, world)
    diff = max(abs(a - b) for k in uninterrupted
               for a, b in zip(uninterrupted[k], weights(model)[k], strict=True))
    model, opt = made(2, merged_groups, seed=1)
    before = (weights(model), [dict(pg, params=None) for pg in opt.param_groups])
    refused = message(lambda: checkpoint.load(model, opt, root / "groups"))
    after = (weights(model), [dict(pg, params=None) for pg in opt.param_groups])
    return {"max_abs_diff": diff, "settings": settings, "merged": refused,
            "merged_unchanged": after == before}


def identity(root: Path, rank: int, world: int) -> dict:
    model, opt = made(1)
    train(model, opt, 0, 1, rank, world)
    checkpoint.save(model, opt, root / "one", step=1)
    train(model, opt, 1, 2, rank, world)
    checkpoint.save(model, opt, root / "two", step=2)
    before = (weights(model), opt_state(opt))
    out = {"load": message(lambda: checkpoint.load(model, opt, root / ["one", "two"][rank]))}
    out["load_unchanged"] = (weights(model), opt_state(opt)) == before
    out["save_path"] = message(lambda: checkpoint.save(model, opt, root / f"per_rank{rank}"))
    out["save_step"] = message(lambda: checkpoint.save(model, opt, root / "steps", step=rank))
    dist.barrier()
    out["written"] = sorted(p.name for p in root.iterdir()
                            if "per_rank" in p.name or "steps" in p.name)
    return out


def _edit(source: Path, target: Path, change, reseal: bool) -> None:
    shutil.copytree(pointer.resolve(source), target)  # the step directory, manifest and all
    path = target / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    if reseal:  # as if the editor knew the checksum: the checks behind it must still hold
        manifest = zero_lab.checkpoint.manifest.seal(manifest)
    path.write_text(json.dumps(manifest))


def _swap_keys(m: dict) -> None:
    a = next(p for p in m["pieces"] if p["name"] == "a.weight" and p["kind"] == "value")
    b = next(p for p in m["pieces"] if p["name"] == "b.weight" and p["kind"] == "value"
             and p["file"] == a["file"] and p["numel"] == a["numel"])
    a["key"], b["key"] = b["key"], a["key"]


def _drop_file(m: dict) -> None:
    del m["files"]["rank0.safetensors"]  # at stage 0 it holds every piece


def _lr(m: dict) -> None:
    m["optimizer"]["param_groups"][0]["lr"] = 10.0


def _unlisted(m: dict) -> None:
    m["pieces"][0]["file"] = "rank7.safetensors"


def _duplicate(m: dict) -> None:
    m["pieces"].append(dict(m["pieces"][0]))


EDITS = {"swapped_keys": (_swap_keys, False), "dropped_file": (_drop_file, False),
         "changed_lr": (_lr, False), "no_pieces": (lambda m: m.pop("pieces"), True),
         "no_files": (lambda m: m.pop("files"), True),
         "no_optimizer": (lambda m: m.pop("optimizer"), True),
         "unlisted_file": (_unlisted, True), "duplicated_piece": (_duplicate, True),
         "resealed_drop": (_drop_file, True)}


def edited(root: Path, rank: int, world: int) -> dict:
    model, opt = made(0)  # stage 0 at N = 2: each rank saves whole, so a.weight and b.weight
    train(model, opt, 0, 1, rank, world)  # are both in rank 0's file, of one size
    checkpoint.save(model, opt, root / "edit_source", step=1)
    if rank == 0:
        for name, (change, reseal) in EDITS.items():
            _edit(root / "edit_source", root / "edited" / name, change, reseal)
    dist.barrier()
    before = (weights(model), opt_state(opt))
    errors = {name: message(lambda n=name: checkpoint.load(model, opt, root / "edited" / n))
              for name in EDITS}
    consolidated = {name: message(lambda n=name: checkpoint.consolidate(root / "edited" / n))
                    for name in EDITS}
    return {"errors": errors, "consolidate": consolidated,
            "unchanged": (weights(model), opt_state(opt)) == before}


def bad_input(root: Path, rank: int, world: int) -> dict:
    model, opt = made(1)
    train(model, opt, 0, 1, rank, world)
    out = {
        "numpy_step": message(lambda: checkpoint.save(model, opt, root / "bad_np",
                                                      step=numpy.float64(3))),
        "tensor_step": message(lambda: checkpoint.save(model, opt, root / "bad_t",
                                                       step=torch.tensor(3.0))),
        "extras": message(lambda: checkpoint.save(model, opt, root / "bad_x", step=1,
                                                  extras={"lr": 0.1})),
    }
    dist.barrier()
    out["written"] = sorted(p.name for p in root.iterdir() if "bad_" in p.name)
    checkpoint.save(model, opt, root / "frozen_src", step=1)
    frozen = Net()
    frozen.a.weight.requires_grad_(False)
    model, opt = made(1, model=frozen)
    out["frozen"] = message(lambda: checkpoint.load(model, opt, root / "frozen_src"))
    return out


def published(root: Path, rank: int, world: int) -> dict:
    model, opt = made(2)
    name = root / "pub"
    steps = []
    for step in (1, 2):
        train(model, opt, step - 1, step, rank, world)
        checkpoint.save(model, opt, name, step=step)
        dist.barrier()
        steps.append({"is_link": name.is_symlink(), "latest": pointer.current(name).name,
                      "in_folder": sorted(p.name for p in name.iterdir()),
                      "beside": sorted(p.name for p in root.iterdir() if ".pub." in p.name),
                      "step": checkpoint.read_manifest(name)["step"]})
    return {"steps": steps}


def fsync_order(root: Path, rank: int, world: int) -> dict:
    """Log every real fsync (by path) and every rename/replace this rank makes in a save."""
    events = []
    real = {"fsync": os.fsync, "rename": os.rename, "replace": os.replace}

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real["fsync"](fd)

    def renamer(kind):
        def rename(src, dst, *a, **k):
            events.append((kind, os.path.basename(os.fspath(src)),
                           os.path.basename(os.fspath(dst))))
            return real[kind](src, dst, *a, **k)
        return rename

    model, opt = made(3)
    train(model, opt, 0, 1, rank, world)
    checkpoint.save(model, opt, root / "durable", step=1)  # a previous one to replace
    os.fsync, os.rename, os.replace = fsync, renamer("rename"), renamer("replace")
    try:
        checkpoint.save(model, opt, root / "durable", step=2)
    finally:
        os.fsync, os.rename, os.replace = real["fsync"], real["rename"], real["replace"]
    return {"events": events}


class ShuffledData:
    """A shuffled order of the sample indices, reshuffled every epoch from (seed, epoch); its
    position is what a resume needs (a Stateful)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.index = n, seed, 0, 0

    def next_indices(self, k: int) -> list[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(
            self.seed * 1000 + self.epoch)).tolist()
        out = order[self.index:self.index + k]
        self.index += k
        if self.index >= self.n:
            self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


DATA = torch.Generator().manual_seed(77)
SAMPLES = (torch.randn(24, 5, generator=DATA), torch.randn(24, 3, generator=DATA))


def _fresh(rank: int, seed: int):
    """Model with dropout at stage 2, a scheduler, the data order, the RNG seeded per rank."""
    torch.manual_seed(seed)
    model, opt = shard(Net(p=0.3), 2, optimizer=weights_first)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = ShuffledData(24, seed=5 + rank)  # each rank its own order of its data
    torch.manual_seed(seed * 10 + rank)  # dropout masks differ per rank
    random.seed(seed * 10 + rank)
    return model, opt, {"scheduler": scheduler, "data": data, "rng": checkpoint.RNGState()}


def _run(model, opt, extras: dict, first: int, last: int) -> None:
    for _ in range(first, last):
        idx = extras["data"].next_indices(4)
        jitter = random.random()  # Python's random feeds the loss too
        F.mse_loss(model(SAMPLES[0][idx]) * (1 + 0.01 * jitter), SAMPLES[1][idx]).backward()
        opt.step()
        opt.zero_grad()
        extras["scheduler"].step()


def extras(root: Path, rank: int, world: int) -> dict:
    model, opt, state = _fresh(rank, seed=1)
    _run(model, opt, state, 0, 9)
    uninterrupted = weights(model)
    model, opt, state = _fresh(rank, seed=1)
    _run(model, opt, state, 0, 4)
    checkpoint.save(model, opt, root / "extras", step=4, extras=state)
    resumed = {}
    for carried in (True, False):
        model, opt, state = _fresh(rank, seed=2)  # another seed: everything must come back
        checkpoint.load(model, opt, root / "extras", extras=state if carried else None)
        _run(model, opt, state, 4, 9)
        resumed[carried] = weights(model)
    manifest = checkpoint.read_manifest(root / "extras")
    return {"equal": resumed[True] == uninterrupted,
            "without_extras_equal": resumed[False] == uninterrupted,
            "lr": opt.param_groups[0]["lr"], "same_on_every_rank": manifest["extras"]}


def verify_reads(root: Path, rank: int, world: int) -> dict:
    model, opt = made(3, optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    train(model, opt, 0, 1, rank, world)
    checkpoint.save(model, opt, root / "reads", step=1)
    hashed = []
    real = zero_lab.checkpoint.manifest.sha256

    def recording(path):
        hashed.append(Path(path).name)
        return real(path)

    zero_lab.checkpoint.manifest.sha256 = recording
    try:
        model, opt = made(3, optimizer=lambda p: torch.optim.Adam(p, lr=0.01), seed=3)
        checkpoint.load(model, opt, root / "reads")
    finally:
        zero_lab.checkpoint.manifest.sha256 = real
    return {"hashed": hashed}


def weights_only(root: Path, rank: int, world: int) -> dict:
    model, opt = made(3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    train(model, opt, 0, 2, rank, world)
    checkpoint.save(model, opt, root / "w_fp32", step=2)
    saved = weights(model)
    model, opt = made(3, precision="bf16")
    train(model, opt, 0, 2, rank, world)
    checkpoint.save(model, opt, root / "w_bf16", step=2)
    saved_bf16 = weights(model)
    out = {}
    for stage in (0, 1, 2, 3):
        for precision, source, expected in (("fp32", "w_fp32", saved),
                                            ("bf16", "w_bf16", saved_bf16)):
            model, opt = made(stage, seed=9, precision=precision)  # AdamW: another optimizer
            error = message(lambda m=model, s=source: checkpoint.load(m, None, root / s))
            out[f"{stage}/{precision}"] = {"error": error, "equal": weights(model) == expected,
                                           "optimizer_untouched": not opt.optim.state}
    return out


def big(root: Path, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model, opt = shard(nn.Sequential(nn.Linear(2048, 2048, bias=False),
                                     nn.Linear(2048, 2048, bias=False)), 3,
                       optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    x = torch.randn(2, 2048)
    F.mse_loss(model(x), x).backward()
    opt.step()
    checkpoint.save(model, opt, root / "big", step=1)
    return {"saved": True}


def at_one_rank(root: Path, rank: int, world: int) -> dict:
    """N = 1, reading what N = 2 saved: extras that were the same on every rank load, the
    per-rank ones are refused by name; a weights-only load."""
    model, opt, state = _fresh(rank, seed=2)
    refused = message(lambda: checkpoint.load(model, opt, root / "extras", extras=state))
    same = {"scheduler": state["scheduler"]}
    loaded = message(lambda: checkpoint.load(model, opt, root / "extras", extras=same))
    model, opt = made(0, seed=9)
    weights_loaded = message(lambda: checkpoint.load(model, None, root / "w_fp32"))
    return {"per_rank_extras": refused, "shared_extras": loaded,
            "lr": state["scheduler"].get_last_lr(), "weights_only": weights_loaded}


CASES_2 = (groups, identity, edited, bad_input, published, fsync_order, extras, verify_reads,
           weights_only, big)
CASES_1 = (at_one_rank,)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--cases", default="", help="comma-separated names: only these")
    args = parser.parse_args()
    root, only = Path(args.root), [c for c in args.cases.split(",") if c]
    info = init_worker()
    results = {}
    for case in CASES_2 if info.world_size == 2 else CASES_1:
        if only and case.__name__ not in only:
            continue
        try:
            results[case.__name__] = case(root, info.rank, info.world_size)
        except Exception as exc:  # noqa: BLE001 - reported; the other cases still run
            results[case.__name__] = {"crashed": f"{type(exc).__name__}: {exc}"}
            if info.world_size > 1:
                raise  # the ranks may be out of step: stop the launch, named
    report(results)


if __name__ == "__main__":
    main()
