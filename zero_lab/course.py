"""Execute the course's notebooks in order with papermill (`make run`, `make figures`).

    python -m zero_lab.course run [--nproc 2] [--backend auto] [--device auto] [--only 03]
    python -m zero_lab.course figures      # run, then copy the saved figures into figures/

Executed copies land in runs/executed/. On a failure it names the notebook and the cell,
prints the error, and exits non-zero; the partly executed copy is kept for inspection.
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


def run(parameters: dict, only: str | None = None) -> list[Path]:
    """Execute every notebook with `parameters`; return the executed copies' paths."""
    import papermill
    from tqdm import tqdm

    EXECUTED.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ZERO_LAB_FIGURES_DIR", str(RUN_FIGURES))
    notebooks = course_notebooks(only)
    outputs = []
    bar = tqdm(notebooks, desc="course", unit="notebook")
    for nb in bar:
        bar.set_postfix_str(nb.name)
        out = EXECUTED / nb.name
        start = time.perf_counter()
        try:
            papermill.execute_notebook(
                str(nb), str(out), parameters=parameters, cwd=str(NOTEBOOKS),
                kernel_name="python3", progress_bar=False, log_output=False,
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
