"""Rank side of the step view (notebook 03): one step of DDP and ZeRO stages 1-3, every rank's
buffers after each phase (zero_lab/course/step_record.py), reported for
zero_lab/course/step_view.py to draw.

    step_record.py        (no arguments; 2 or 3 ranks)
"""

from __future__ import annotations

from zero_lab.course.step_record import record
from zero_lab.launch import init_worker, report

if __name__ == "__main__":
    info = init_worker()
    report(record(info.rank, info.world_size))
