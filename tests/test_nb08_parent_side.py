"""Notebook 08's parent side, cheap (reports built from the formulas, no launch):

- the accumulation figure shows every configuration (issue 35, finding 16): 8 of our
  configurations and 4 of FSDP2's share 5 distinct formula lines, which drawn one per
  configuration hid each other (4 of the old figure's 8 lines lay under others);
- the printed tables keep every line within 110 characters at GPU-sized numbers (the
  closing markdown table printed lines of up to 212);
- the cells' composite checks fail on a mutant of what they check.
"""

from __future__ import annotations

import copy
import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from zero_lab.course.knob_plots import accumulation_figure  # noqa: E402
from zero_lab.grading import nb08_knobs_recompute as rc_checks  # noqa: E402
from zero_lab.grading import nb08_knobs_tables  # noqa: E402
from zero_lab.predict.knobs import (  # noqa: E402
    accumulation_messages,
    fsdp2_accumulation_messages,
)
from zero_lab.workers.knob_accumulation import FSDP2_RUNS, RUNS  # noqa: E402

KS, PSI, N = (1, 4, 8), 1000, 2


def _report() -> dict:
    runs = [{"label": label, "stage": stage, "grad_accumulation": mode,
             "reshard_after_forward": reshard, "k": k, "psi_bytes": PSI, "n_groups": 1,
             "held_between": {"grads": PSI, "params": PSI},
             "comm": accumulation_messages(stage, PSI, k, N, grad_accumulation=mode,
                                           reshard_after_forward=reshard)}
            for k in KS for label, stage, mode, reshard in RUNS]
    fsdp2 = [{"label": label, "reshard_after_forward": fwd, "reshard_after_backward": bwd,
              "k": k, "psi_bytes": PSI, "n_groups": 1,
              "comm": fsdp2_accumulation_messages(PSI, k, N, reshard_after_forward=fwd,
                                                  reshard_after_backward=bwd)}
             for k in KS for label, fwd, bwd in FSDP2_RUNS]
    return {"runs": runs, "fsdp2": fsdp2, "world_size": N}


def test_no_line_or_dot_of_the_accumulation_figure_hides_another():
    fig = accumulation_figure(_report())
    left = fig.axes[0]
    drawn = [line for line in left.get_lines() if len(line.get_xdata())]
    lines = [line for line in drawn if line.get_linestyle() not in ("None", "none", "")]
    for a, b in itertools.combinations(lines, 2):
        same = (np.array_equal(a.get_xdata(), b.get_xdata())
                and np.allclose(a.get_ydata(), b.get_ydata()))
        assert not same or (a.get_linestyle(), a.get_marker()) != (b.get_linestyle(),
                                                                   b.get_marker()), (
            f"{a.get_label()!r} and {b.get_label()!r} draw the same line in the same style")
    points = [(x, y) for line in drawn if line not in lines
              for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)]
    assert len(points) == len(KS) * (len(RUNS) + len(FSDP2_RUNS))  # one dot per run
    assert len(set(points)) == len(points), "two measured dots drawn at the same place"
    legend = " ".join(t.get_text().replace("\n  ", " ")
                      for t in left.get_legend().get_texts())
    for label in [r[0] for r in RUNS] + [r[0] for r in FSDP2_RUNS]:
        assert label in legend, f"{label!r} is not named in the legend"
    plt.close(fig)


def _big(report: dict) -> dict:
    """The report at GPU sizes: Ψ of 100 MiB, peaks of 60 GiB, steps of seconds."""
    big = copy.deepcopy(report)
    for run in big["runs"] + big["fsdp2"]:
        scale = 100 * 2**20 // PSI
        run["psi_bytes"] *= scale
        for s in run["comm"].values():
            for key in ("nbytes", "sent_bytes", "volume"):
                s[key] *= scale
        run["peak_bytes"] = 60 * 2**30
        run["step_times"] = [1.2345, 12.345, 2.5]
        run["held_between"] = {"grads": 10**8, "params": 10**8}
    return big


def _recompute_runs() -> list[dict]:
    groups = [{"padded": 10**7, "dtype": "torch.float32"}]
    return [{"stage": stage, "recompute": on, "groups": groups, "digest": "d",
             "ledger": rc_checks.expected_collectives(stage, groups),
             "peak_bytes": (50 if on else 60) * 2**30, "step_times": [1.5, 12.3, 2.0]}
            for stage in range(4) for on in (True, False)]


def test_printed_tables_keep_lines_within_110_characters():
    report = _big(_report())
    rows = (nb08_knobs_tables.accumulation_rows(report)
            + nb08_knobs_tables.recompute_rows(_recompute_runs())
            + nb08_knobs_tables.precision_rows([{"recipe": "bf16+keep_ln+reduce_fp32", "stage": 3,
                                                 "ledger": [["all_gather", "bfloat16", 10**8]],
                                                 "peak_bytes": 60 * 2**30,
                                                 "step_times": [1.0, 2.0]}])
            + nb08_knobs_tables.hsdp_rows([{"mesh": [8, 8], **{key: {
                "by_level": {"shard": {"all_gather": 10**9}, "replicate": {"all_reduce": 10**8}},
                "peak_bytes": 60 * 2**30, "step_s": [1.0, 12.0]} for key in ("zero3", "hsdp")}}]))
    for text in (nb08_knobs_tables.text(rows), nb08_knobs_tables.accumulation_text(report)):
        lines = text.split("\n")
        assert max(len(line) for line in lines) <= nb08_knobs_tables.WIDTH, max(lines, key=len)
    names = nb08_knobs_tables.text(rows)
    assert "(measured: 2Ψ)" in names and "(measured: 17Ψ)" in names  # FSDP2 beside ours


def test_recompute_runs_check_rejects_a_step_that_gathers_once_more():
    runs = _recompute_runs()
    rc_checks.check_recompute_runs(runs)
    bad = copy.deepcopy(runs)
    next(r for r in bad if r["stage"] == 3 and r["recompute"])["ledger"].append(
        ["all_gather", "float32", 10**7])
    with pytest.raises(AssertionError, match="stage 3"):
        rc_checks.check_recompute_runs(bad)
    bad = copy.deepcopy(runs)
    bad[0]["digest"] = "other"
    with pytest.raises(AssertionError, match="changed the weights"):
        rc_checks.check_recompute_runs(bad)
