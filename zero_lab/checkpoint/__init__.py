"""Sharded checkpoints: every rank saves what it holds; any stage at any world size loads it.

    from zero_lab import checkpoint
    extras = {"scheduler": scheduler, "rng": checkpoint.RNGState(), "data": sampler}
    checkpoint.save(model, opt, "runs/ckpt", step=100, extras=extras)  # on every rank
    checkpoint.load(model, opt, "runs/ckpt", extras=extras)            # any stage, any N
    checkpoint.load(model, None, "runs/ckpt")                          # weights only
    weights = checkpoint.consolidate("runs/ckpt")                      # no process group

`runs/ckpt` is a folder: a step directory (`step100-<token>`) and the file `latest` naming it,
replaced in one atomic rename when a newer checkpoint is complete and on disk; the folder
copies with any tool (`cp -r`, `rsync -a`, `tar`) as a checkpoint. A step directory holds one
`rank<r>.safetensors` per saving rank (the pieces of parameters and optimizer states that rank
owned), `extras-rank<r>.pt` when extras were given, and `manifest.json`, written last, which
names every piece by parameter and element range (never by flat-buffer offset, so the padding
of a flat buffer cannot be saved or leak into a parameter), with the model's names, shapes
and dtypes, the optimizer's class and groups, a SHA-256 per file and one of its own content.

    layout.py        what a sharded model holds, as (parameter, element range) pieces
    manifest.py      the manifest: written (sealed by its checksum), read, checked; files
                     verified; every error names the file and what is wrong (CheckpointError)
    reader.py        any element range of any parameter, read in place from the shards
    agreement.py     the ranks of a save or load name one checkpoint, and refuse together
    groups.py        optimizer groups matched by the parameters they hold
    extras.py        Stateful extras (scheduler, RNG, data position), per rank
    locking.py       one save to a name at a time: another job's save is refused by name
    pointer.py       `latest`: which step directory of its folder a name reaches
    in_use.py        a step directory a reader resolved stays until it is done
    publication.py   fsync, then `latest` replaced atomically; leftovers of killed saves
    saving.py        save(): check, write, publish
    loading.py       load(): agree, read everything and check it, and only then overwrite
    consolidation.py full tensors from the shards, one tensor at a time
"""

from zero_lab.checkpoint.consolidation import consolidate, iter_consolidated
from zero_lab.checkpoint.extras import RNGState, Stateful
from zero_lab.checkpoint.in_use import read_manifest
from zero_lab.checkpoint.loading import load
from zero_lab.checkpoint.locking import CheckpointBusy
from zero_lab.checkpoint.manifest import CheckpointError
from zero_lab.checkpoint.saving import save

__all__ = ["CheckpointBusy", "CheckpointError", "RNGState", "Stateful", "consolidate",
           "iter_consolidated", "load", "read_manifest", "save"]
