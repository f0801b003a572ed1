"""What the notebooks use around the mechanism.

Parent side (the notebook kernel; tests/test_layout.py holds it):
    runner.py        `python -m zero_lab.course run`: the notebooks executed in order (`make run`)
    preflight.py     what `make run` refuses before any kernel starts (each notebook's own checks)
    soak.py          `make soak`: notebooks run again and again beside busy processes
    bench.py         `make bench`: DDP, ZeroRedundancyOptimizer and the stages, raced
    plots.py, knob_plots.py, scaling_plots.py, trace_plots.py   the figures
    (notebook 08's closing tables are grading/nb08_knobs_tables.py, beside the checks)
    widgets.py       the interactive memory calculator
    cheat_sheet.py   `python -m zero_lab.course.cheat_sheet` writes practice/cheat_sheet.md
Shared (both sides of a launch):
    parameters.py    a notebook's parameters, checked before any work
    workloads.py     demo models, synthetic batches, the measured training loop
    exercises.py     what graded learner code meets on the ranks
    seed_blog.py     the seed blog's ZeRO, paraphrased once, to be measured
    bench_systems.py the systems `make bench` races, built on every rank
    formatting.py    numbers as a reader takes them in
"""
