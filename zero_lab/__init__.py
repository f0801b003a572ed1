"""zero_lab: the package behind the zero-lab course on ZeRO stages 1-3 and FSDP.

Every multi-rank cell of the course is a *launch*: the notebook kernel (the *parent side*)
starts a worker script on N processes with torchrun (the *rank side*) and reads back what
each rank reported. The package has one home for each side, and shared modules between:

    parent side   grading/        exercise checks, student copies, the launcher for learner code
                  bench.py        `make bench`: the command and its summary
                  plots.py        figures          widgets.py   the interactive calculator
                  trace_plots.py  figures of profiler traces (notebook 06)
                  course.py       `make run`: the notebooks, executed in order
    rank side     workers/        the scripts torchrun starts, one per notebook job
    shared        stages/         shard(): stages 0-3 and what they share
                  partition.py    the flat-buffer partition every stage is built on
                  plain/          ZeRO with nothing else, for reading: the flat partition and
                                  stages 0-3, one short file each, pinned to stages/ by tests
                  collectives/    ring algorithms, the byte ledger, the cost model, the
                                  direct exchange the stages send on gloo
                  memory.py       PREDICTED bytes: the calculators (formulas, no torch)
                  measured.py     MEASURED bytes: storages counted, peaks, timelines
                  step_timeline.py  one training step measured op by op (notebook 05)
                  profiling/      marks the stages leave in a trace, capture, analysis
                  workloads.py    demo models, synthetic batches, the measured training loop
                  exercises.py    what graded learner code meets on the ranks
                  seed_blog.py    the seed blog's ZeRO, paraphrased once, to be measured
                  bench_systems.py  the systems `make bench` races, built on every rank
                  launch.py       torchrun(): start a launch, stream it, end it, read reports
                  launch_env.py   what a launch exposes and inherits: rendezvous on files,
                                  sockets on loopback, the caller's launcher variables
                  launch_failures.py  which rank failed a launch, and how (LaunchError)
                  capacity.py     will nproc ranks fit: cores and memory, checked first
                  worker.py       the rank side of a launch: init_worker(), report(), the
                                  per-rank entry point (launch.py re-exports the two)
                  paths.py        where things live in the repository; new_run_dir()
                  parameters.py   a notebook's parameters checked by name, before any work
                  torch_names.py  the collective names torch 2.13 uses, on an older torch

The rule (tests/test_layout.py reads the import graph and holds it): code the kernel runs
never imports a rank script, and a rank script never imports parent-only code; shared
modules import neither side's own code. A piece both sides need (a config, a fixture the
learner's function receives, a system builder) lives in a shared module.

Import the module you need; importing the package itself loads nothing heavy.
"""

__version__ = "0.1.0"
