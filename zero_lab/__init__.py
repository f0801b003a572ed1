"""zero_lab: the package behind the zero-lab course on ZeRO stages 1-3 and FSDP.

Modules have one job each (see ../README.md and DESIGN.md): `memory` computes, `launch`
runs workers under torchrun, `stages` shards training, `measure` and `profiling` measure.
Import the module you need; importing the package itself loads nothing heavy.
"""

__version__ = "0.1.0"
