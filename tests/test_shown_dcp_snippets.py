"""What the notebooks show of a DCP save runs as shown (issue 48).

`get_state_dict(model, optimizer)` returns a (model_sd, optim_sd) tuple; `dcp.save` wants a
dict. A snippet such as `dcp.save(get_state_dict(model, optimizer))` fails when copied. Every
code span or code cell of a notebook that calls `dcp.save(` is collected, with the
`get_state_dict` spans beside it, and run in a 1-rank gloo group on an FSDP2 model, in
`tmp_path`; the checkpoint it writes must load back.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SPAN = re.compile(r"`([^`]+)`")


def shown_saves(path: Path) -> list[str]:
    """Each snippet of `path` that calls dcp.save: a markdown cell's code spans that call
    dcp.save or get_state_dict, in order, one statement a line; a code cell whole."""
    snippets = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        text = "".join(cell["source"])
        if "dcp.save(" not in text:
            continue
        if cell["cell_type"] == "code":
            snippets.append(text)
        else:
            spans = [" ".join(s.split()) for s in SPAN.findall(text)
                     if "dcp.save(" in s or "get_state_dict(" in s]
            snippets.append("\n".join(spans))
    return snippets


SNIPPETS = [(p.stem, s) for p in NOTEBOOKS for s in shown_saves(p)]

HARNESS = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

tmp = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(3, 4)).sum().backward()
optimizer.step()
path = checkpoint_id = folder = tmp / "ckpt"
SNIPPET
written = sorted(p.name for p in path.iterdir())
assert ".metadata" in written, written
back = {"model": model.state_dict()}
dcp.load(back, checkpoint_id=path)
dist.destroy_process_group()
print("loaded", written)
"""


def test_the_notebooks_show_a_dcp_save():
    assert any(stem == "09_fsdp2" for stem, _ in SNIPPETS), "nb09 shows no dcp.save"


@pytest.mark.parametrize("stem, snippet", SNIPPETS, ids=[s for s, _ in SNIPPETS])
def test_no_shown_dcp_save_is_given_get_state_dicts_tuple(stem, snippet):
    for call in re.findall(r"dcp\.save\(\s*(\w+)\(", snippet):
        assert call != "get_state_dict", f"{stem}: dcp.save(get_state_dict(...)) is a tuple"


@pytest.mark.parametrize("stem, snippet", SNIPPETS, ids=[s for s, _ in SNIPPETS])
def test_a_shown_dcp_save_runs_as_shown(stem, snippet, tmp_path):
    script = tmp_path / "shown.py"
    script.write_text(textwrap.dedent(HARNESS).replace("SNIPPET", snippet))
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, f"{stem}: the shown snippet fails:\n{snippet}\n{done.stderr}"
    assert "loaded" in done.stdout
