"""Which step directory a checkpoint's name reaches: the `latest` file in its folder.

A checkpoint saved to `runs/ckpt` is a folder; the checkpoint itself is a step directory in
it, named by the file `latest`:

    runs/ckpt/
        latest                  step100-5f0c2a9e1b7d
        step100-5f0c2a9e1b7d/   manifest.json, rank<r>.safetensors, extras-rank<r>.pt

`latest` holds the step directory's name, relative to the folder, so the folder copied with
any tool (`cp -r`, `cp -a`, `rsync -a`, `tar`, a file manager) is a checkpoint that loads
wherever it is put: nothing in it points outside it. (Until issue 47 the name itself was a
symbolic link to a step directory *beside* it, `runs/.ckpt.step100-<token>`: a copy of the
name carried the link alone, dangling. DeepSpeed's checkpoints keep a `latest` file too.)

A save replaces `latest` in one atomic rename (publication.py). A reader resolves it once
(`resolve`) and reads the step directory it named to the end, whatever saves publish meanwhile
(in_use.py keeps that directory in place until the reader is done).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zero_lab.checkpoint.manifest import CheckpointError

LATEST = "latest"
STEP = re.compile(r"step\d*-[0-9a-f]+")  # `step-<token>` when saved with step=None


def step_name(step: int | None, token: str) -> str:
    return f"step{'' if step is None else step}-{token}"


def current(folder: Path) -> Path | None:
    """The step directory `folder`'s `latest` names; None where there is no `latest`."""
    try:
        name = (folder / LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not STEP.fullmatch(name):  # nor a path: `latest` never leads outside its folder
        raise CheckpointError(f"{folder / LATEST}: names {name!r}, not a step directory of "
                              "this folder (edited by hand?)")
    return folder / name


def resolve(name: Path | str) -> Path:
    """The directory that holds the checkpoint `name` reaches now, looked up once:

    - a checkpoint's folder: the step directory its `latest` names;
    - a link, as the previous zero_lab published a name: the directory it reaches. A copy
      of such a name alone carries the link without what it reaches: refused, saying how
      to copy one;
    - anything else as it is: a step directory, or a checkpoint directory copied on its own
      (reading its manifest then says if it is none)."""
    name = Path(name)
    step = current(name)
    if step is not None:
        return step
    if name.is_symlink():
        target = name.parent / os.readlink(name)
        if not target.exists():
            raise CheckpointError(
                f"{name}: a link to {os.readlink(name)}, which is not there. A checkpoint "
                "saved by an older zero_lab is such a link to a step directory beside it, and "
                "a copy of the name alone (`cp -r`, `rsync -a`, `tar`) carries the link only: "
                "copy the original with `cp -rL` (-L copies what a link reaches), or load it "
                "and save again (checkpoints saved now are folders that copy as they are)")
        return target
    return name
