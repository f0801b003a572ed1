"""MEASURED: what a training step really holds and how long it really takes.

    memory.py           the bytes tensors hold, on CPU and CUDA: storages counted, peaks
    memory_timeline.py  one training step measured op by op (notebook 05's timeline)
    step_timing.py      how the course times training steps: back to back, as training runs

The formulas they are checked against are in `zero_lab.predict`; traces in `zero_lab.profiling`.
"""
