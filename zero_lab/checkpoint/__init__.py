"""Sharded checkpoints: every rank saves what it holds; any stage at any world size loads it.

    from zero_lab import checkpoint
    checkpoint.save(model, opt, "runs/ckpt/step100", step=100)     # on every rank
    checkpoint.load(model, opt, "runs/ckpt/step100")               # any stage, any N
    weights = checkpoint.consolidate("runs/ckpt/step100")          # no process group needed

A checkpoint is a directory: one `rank<r>.safetensors` per saving rank, holding the pieces of
parameters and optimizer states that rank owned, and `manifest.json`, written last, which
names every piece by parameter and element range (never by flat-buffer offset, so the padding
of a flat buffer cannot be saved or leak into a parameter), with the model's names, shapes
and dtypes, the optimizer's class and hyper-parameters, and a SHA-256 per file.

    layout.py       what a sharded model holds, as (parameter, element range) pieces
    manifest.py     the manifest: written, read, checked; files verified; every error names
                    the file and what is wrong (CheckpointError)
    reader.py       any element range of any parameter, from whichever shards hold it
    saving.py       save(): shards into a hidden directory, renamed into place when complete
    loading.py      load(): read everything, check it, and only then change the model
    consolidation.py  full tensors from the shards, one tensor at a time
"""

from zero_lab.checkpoint.consolidation import consolidate, iter_consolidated
from zero_lab.checkpoint.loading import load
from zero_lab.checkpoint.manifest import CheckpointError, read_manifest
from zero_lab.checkpoint.saving import save

__all__ = ["CheckpointError", "consolidate", "iter_consolidated", "load", "read_manifest",
           "save"]
