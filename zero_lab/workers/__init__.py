"""The rank side: the scripts `zero_lab.launch.torchrun` starts, one process per rank.

Each is a plain script: it calls `init_worker()`, does its rank's work and `report()`s a
JSON-serialisable dict. It imports shared modules only (stages, partition, collectives,
workloads, measured, exercises, ...), never parent-only code (grading, bench, plots, course,
widgets) and never another script here: what two scripts share lives in a shared module.
Notebooks and the grader start them by path (`zero_lab.launch.paths.WORKERS / "<name>.py"`), never
import them. Run one through the launcher, which sets up the per-rank logs and reports:

    from zero_lab.launch import torchrun
    from zero_lab.launch.paths import WORKERS
    result = torchrun(WORKERS / "collectives_demo.py", nproc=2)
"""
