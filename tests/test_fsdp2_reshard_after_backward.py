"""FSDP2's `set_reshard_after_backward(False)` must be turned back on for the last micro-batch
(issue 48), and notebooks 08 and 09 say so where they describe accumulation with it.

Left False, the units stay gathered past `optimizer.step()`: the next forward finds them
unsharded, gathers nothing, and computes with the pre-step weights, with no error. Measured
here on one gloo rank, then the notebooks' sentences and notebook 08's closing table.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from finding_text import without_links

from zero_lab.grading import nb08_knobs_tables

ROOT = Path(__file__).resolve().parent.parent
KNOB = "set_reshard_after_backward(False)"

EXPERIMENT = """
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))


def stale(turn_back_on: bool) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(3, 4)
    for last in (False, True):  # two micro-batches
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last if turn_back_on else False)
        model(x).sum().backward()
    opt.step()
    with torch.no_grad():  # the next forward against the stepped shards
        w = [p.full_tensor() for p in opt.param_groups[0]["params"]]  # what the step wrote
        want = nn.functional.linear(nn.functional.linear(x, w[0], w[1]), w[2], w[3])
        return (model(x) - want).abs().max().item()


print(stale(True), stale(False))
dist.destroy_process_group()
"""


def test_left_false_the_next_forward_uses_the_pre_step_weights(tmp_path):
    script = tmp_path / "stale.py"
    script.write_text(textwrap.dedent(EXPERIMENT))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    turned_back_on, left_false = (float(x) for x in done.stdout.split())
    assert turned_back_on == 0.0  # the next forward gathers the stepped weights
    assert left_false > 1e-3  # it computes with the old ones


def markdown(name: str) -> list[str]:
    cells = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))["cells"]
    return [" ".join(without_links("".join(c["source"])).split())
            for c in cells if c["cell_type"] == "markdown"]


def test_the_notebooks_say_the_last_micro_batch_turns_it_back_on():
    for name in ("08_knobs.ipynb", "09_fsdp2.ipynb"):
        described = [c for c in markdown(name)
                     if KNOB in c and "set_requires_gradient_sync(False)" in c]
        assert described, f"{name}: no cell describes accumulation with {KNOB}"
        for cell in described:
            assert "last micro-batch" in cell and "pre-step weights" in cell, (
                f"{name}: accumulation with {KNOB} without turning it back on: {cell[:120]}")


def test_the_closing_table_turns_it_back_on_in_every_row_that_uses_it():
    rows = [v for v in nb08_knobs_tables.ACCUMULATION_TORCH.values() if KNOB in v]
    assert len(rows) == 3
    assert all("`True` on the last micro-batch" in v for v in rows), rows
