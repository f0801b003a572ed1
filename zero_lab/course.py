"""Execute the course's notebooks in order with papermill (`make run`, `make figures`).

    python -m zero_lab.course run [--nproc 2] [--backend auto] [--device auto] [--only 03]
    python -m zero_lab.course figures      # run, then copy the saved figures into figures/

Executed copies land in runs/executed/, figures in runs/figures/; the run ends with its total
time and those two places. On a failure it names the notebook and the cell, prints the error,
and exits non-zero; the partly executed copy is kept for inspection.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from zero_lab.paths import EXECUTED, FIGURES, NOTEBOOKS, RUN_FIGURES


def course_notebooks(only: str | None = None) -> list[Path]:
    """The numbered notebooks, in course order (optionally those whose name starts with `only`)."""
    found = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if only is not None:
        found = [p for p in found if p.name.startswith(only)]
        if not found:
            raise SystemExit(f"--only {only!r} matches no notebook in {NOTEBOOKS}")
    return found


def kernel_config():
    """The kernels' settings: their channels encrypted, where this installation can.

    ipykernel (7.4) warns at every start that a kernel on TCP without encryption sends code
    and outputs in plain text. jupyter_client (8.10) can give the kernel CurveZMQ keys:
    `transport_encryption = "auto"` does so for kernels whose spec declares support (as
    ipykernel's does). It needs a pyzmq built with CURVE, as pyzmq's wheels are; without one
    the kernel stays unencrypted and says so.
    """
    import zmq
    from jupyter_client import KernelManager
    from traitlets.config import Config

    config = Config()
    if zmq.has("curve") and "transport_encryption" in KernelManager.class_traits():
        config.KernelManager.transport_encryption = "auto"
    return config


def summary(count: int, seconds: float, executed: Path, figures: Path) -> str:
    """The last lines of a run: its total time and where its results are."""
    minutes, rest = divmod(round(seconds), 60)
    took = f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"
    return (f"{count} notebook{'s' if count != 1 else ''} executed in {took}\n"
            f"executed notebooks: {executed}\n"
            f"figures: {figures} (`make figures` copies them into {FIGURES.name}/)")


def run(parameters: dict, only: str | None = None) -> list[Path]:
    """Execute every notebook with `parameters`; return the executed copies' paths."""
    import papermill
    from tqdm import tqdm

    EXECUTED.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ZERO_LAB_FIGURES_DIR", str(RUN_FIGURES))
    notebooks = course_notebooks(only)
    outputs = []
    config = kernel_config()
    started = time.perf_counter()
    bar = tqdm(notebooks, desc="course", unit="notebook")
    for nb in bar:
        bar.set_postfix_str(nb.name)
        out = EXECUTED / nb.name
        start = time.perf_counter()
        try:
            papermill.execute_notebook(
                str(nb), str(out), parameters=parameters, cwd=str(NOTEBOOKS),
                kernel_name="python3", progress_bar=False, log_output=False, config=config,
            )
        except papermill.PapermillExecutionError as err:
            bar.close()
            first_line = (err.source or "").strip().splitlines()[:1]
            print(
                f"\nFAILED: {nb.name}, cell {err.cell_index} (execution count {err.exec_count}),"
                f" starting {first_line[0] if first_line else ''!r}"
                f"\n{err.ename}: {err.evalue}\nThe executed copy up to the failure is {out}",
                file=sys.stderr,
            )
            raise SystemExit(1) from None
        tqdm.write(f"{nb.name}: {time.perf_counter() - start:.1f} s -> {out}")
        outputs.append(out)
    bar.close()
    print(summary(len(outputs), time.perf_counter() - started, EXECUTED,
                  Path(os.environ["ZERO_LAB_FIGURES_DIR"])))
    return outputs


def copy_figures() -> list[Path]:
    """Copy the PNGs the notebooks saved under runs/figures/ into the committed figures/."""
    FIGURES.mkdir(exist_ok=True)
    copied = []
    for png in sorted(RUN_FIGURES.glob("*.png")):
        shutil.copy2(png, FIGURES / png.name)
        copied.append(FIGURES / png.name)
    print(f"copied {len(copied)} figures into {FIGURES}")
    return copied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_lab.course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "figures"])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per multi-rank cell")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--only", default=None, help="run only notebooks starting with this")
    opts = parser.parse_args(argv)
    if opts.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {opts.nproc}")
    params = {"nproc": opts.nproc, "backend": opts.backend, "device": opts.device}
    run(params, opts.only)
    if opts.command == "figures":
        copy_figures()


if __name__ == "__main__":
    main()
