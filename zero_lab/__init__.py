"""zero_lab: the package behind the zero-lab course on ZeRO stages 1-3 and FSDP.

Every multi-rank cell of the course is a *launch*: the notebook kernel (the *parent side*)
starts a worker script on N processes with torchrun (the *rank side*) and reads back what
each rank reported. The package groups its modules by job; the guide (README.md beside this
file) names each one:

    the mechanism     stages/       shard(): stages 0-3 on the flat partition, and what they share
                      plain/        ZeRO with nothing else, one short file a stage, for reading;
                                    pinned to stages/ by tests (same weights, same bytes)
                      collectives/  ring algorithms, the byte ledger, bytes and timing per
                                    collective, the direct exchange the stages send on gloo
    measurement and   memory.py     PREDICTED memory: the calculators, the public API outside
    prediction                      checks call (`from zero_lab import memory`; no torch)
                      predict/      PREDICTED time and bytes: step-time projection, links,
                                    the knobs' bytes, the recompute trade-off (formulas only)
                      measure/      MEASURED: bytes tensors hold, a step's memory timeline,
                                    step timing
                      profiling/    marks the stages leave in a trace, capture, analysis, checks
    infrastructure    launch/       torchrun(): start a launch, stream it, end it, read reports;
                                    what it exposes (loopback only), its failures, capacity,
                                    the rank side, the repository's paths
                      workers/      RANK SIDE: the scripts torchrun starts, one per notebook job
    the course        course/       the runner (`make run`), soak, bench, figures, widgets, tables,
                                    demo workloads, the shared side of exercises, the seed
                                    blog's ZeRO
                      grading/      PARENT SIDE: exercise checks, student copies, launches of
                                    learner code
                      checkpoint/   sharded checkpoints: any stage at any world size loads them
    taken to work     practice/     torch only, no zero_lab import: the FSDP2 training script
                                    notebook 09 ends by running
    README.md         the package guide: every module's job, shard()'s contract, the checks

The rule (tests/test_layout.py reads the import graph and holds it): code the kernel runs
never imports a rank script, and a rank script never imports parent-only code; shared
modules import neither side's own code. A piece both sides need (a config, a fixture the
learner's function receives, a system builder) lives in a shared module.

Import the module you need; importing the package itself loads nothing heavy.
"""

__version__ = "0.1.0"
