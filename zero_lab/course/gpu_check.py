"""`make gpu-check`: what the course does on a machine with an NVIDIA GPU, as one table.

    python -m zero_lab.course.gpu_check [--nproc N] [--only 03] [--no-notebooks | --no-tests]

For a machine with PyTorch and a GPU but no network (a rented instance, a cluster node). Its
rows, each pass, fail or skip with the seconds it took and what it saw:

- the machine: torch, CUDA, the GPU, NCCL;
- every test of tests/test_cuda.py, run by pytest and read back from its JUnit XML: NCCL
  launches, the CUDA allocator read by `measure.memory`, stages 0-3 trained against one
  process, stage 3's memory timeline, collective timing with its CUDA synchronize, a CUDA
  profiler trace read by `zero_lab.profiling` (kernels, streams), the bench;
- every notebook, executed with papermill on backend="nccl", device="cuda", `--nproc` ranks
  (one GPU per rank; by default the GPUs, at most 2), each in a process of its own, so one
  failure does not hide the next. A notebook that needs more ranks than that (its parameters
  cell raises TooFewRanks, e.g. 02 on one GPU) or more GPUs (TooFewGPUs) is a skip, its reason
  in the row; more `--nproc` than GPUs skips the notebooks, saying what to pass instead.

It prints the table, writes it to runs/gpu-check/<run>/table.md with the logs beside it, and
exits 1 if any row failed. Without a GPU every row that needs one is "skip", with the reason,
and it exits 0: the same command rehearses on a laptop. Python packages it needs beyond
torch: pytest, and for the notebooks papermill, nbclient, ipykernel, matplotlib, ipywidgets,
tqdm (`pip install -e .[dev]` installs them).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from zero_lab.launch.paths import NOTEBOOKS, new_run_dir

ROOT = NOTEBOOKS.parent
CUDA_TESTS = ROOT / "tests" / "test_cuda.py"
TESTS_LIMIT_S = 300
NOTEBOOK_LIMIT_S = 180


@dataclass
class Row:
    check: str
    status: str  # pass, fail, skip
    seconds: float
    detail: str = ""


def machine_row() -> tuple[Row, bool]:
    """What this machine has; and whether it has a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return Row("machine", "skip", 0.0, f"torch {torch.__version__}, no CUDA GPU: every "
                   "row that needs one is skipped"), False
    props = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return Row("machine", "pass", 0.0, f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
               f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} "
               f"GiB), NCCL {nccl}"), True


def test_rows(junit: Path, seconds: float, returncode: int, log: Path) -> list[Row]:
    """One row per test case in pytest's JUnit XML; a run that wrote none is one failed row."""
    if not junit.exists():
        return [Row("tests/test_cuda.py", "fail", seconds,
                    f"pytest exited {returncode} without results: see {log}")]
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name, took = case.get("name", "?"), float(case.get("time", 0))
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            message = (problem.get("message") or "").splitlines()
            rows.append(Row(name, "fail", took, message[0][:200] if message else ""))
        elif skipped is not None:
            rows.append(Row(name, "skip", took, (skipped.get("message") or "")[:200]))
        else:
            rows.append(Row(name, "pass", took))
    if returncode not in (0, 1, 5) or not rows:  # 1: tests failed (rows say which); 5: none
        rows.append(Row("tests/test_cuda.py", "fail", seconds, f"pytest exited {returncode}"))
    return rows


def run_tests(out: Path) -> list[Row]:
    if not CUDA_TESTS.exists():
        return [Row("tests/test_cuda.py", "skip", 0.0, "not in this installation (run it "
                    "from a clone of the course)")]
    junit, log = out / "test_cuda.xml", out / "test_cuda.log"
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            code = subprocess.run([sys.executable, "-m", "pytest", str(CUDA_TESTS), "-q",
                                   "-p", "no:cacheprovider", f"--junitxml={junit}"],
                                  stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                  timeout=TESTS_LIMIT_S).returncode
        except subprocess.TimeoutExpired:
            return [Row("tests/test_cuda.py", "fail", TESTS_LIMIT_S,
                        f"stopped after {TESTS_LIMIT_S} s: see {log}")]
    return test_rows(junit, time.monotonic() - start, code, log)


def notebook_row(name: str, returncode: int | None, seconds: float, log: Path) -> Row:
    """A notebook's row from its run's exit and log (the runner names the failing cell)."""
    if returncode == 0:
        return Row(name, "pass", seconds)
    if returncode is None:
        return Row(name, "fail", seconds, f"stopped after {NOTEBOOK_LIMIT_S} s: see {log}")
    lines = log.read_text(errors="replace").splitlines()
    failed = [i for i, ln in enumerate(lines) if ln.startswith("FAILED")]
    if failed:
        cell, error = lines[failed[0]], lines[failed[0] + 1:failed[0] + 2]
        if error and error[0].startswith(("TooFewRanks", "TooFewGPUs")):  # needs more GPUs
            return Row(name, "skip", seconds, error[0].split(": ", 1)[1][:300])
        return Row(name, "fail", seconds, " ".join([cell.split(", starting")[0], *error])[:300])
    tail = [ln for ln in lines if ln.strip()][-1:] or [f"exit {returncode}"]
    return Row(name, "fail", seconds, tail[0][:300])


def run_notebooks(out: Path, nproc: int, only: str | None) -> list[Row]:
    from zero_lab.course.runner import course_notebooks

    # The kernels start in notebooks/: the course they import is this checkout's, whatever
    # PYTHONPATH says (a relative entry there would name a folder under notebooks/).
    paths = [str(ROOT)] + [str(Path(p).resolve()) for p in
                           os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    rows = []
    for path in course_notebooks(only):
        log = out / f"{path.stem}.log"
        start = time.monotonic()
        with open(log, "w") as f:
            try:
                code: int | None = subprocess.run(
                    [sys.executable, "-m", "zero_lab.course", "run", "--backend", "nccl",
                     "--device", "cuda", "--nproc", str(nproc), "--only", path.name[:2]],
                    stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                    timeout=NOTEBOOK_LIMIT_S).returncode
            except subprocess.TimeoutExpired:
                code = None
        rows.append(notebook_row(path.name, code, time.monotonic() - start, log))
        print(f"  {rows[-1].check}: {rows[-1].status} ({rows[-1].seconds:.0f} s)", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| check | result | seconds | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.check} | {r.status} | {r.seconds:.1f} | {r.detail.replace('|', '/')} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_lab.course.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks per notebook launch, one GPU each (default: the GPUs, "
                        "at most 2); notebooks that need more ranks are skipped")
    parser.add_argument("--only", default=None, help="notebooks whose name starts with this")
    parser.add_argument("--no-notebooks", action="store_true", help="the tests only")
    parser.add_argument("--no-tests", action="store_true", help="the notebooks only")
    args = parser.parse_args(argv)
    out = new_run_dir("gpu-check")
    first, cuda = machine_row()
    rows = [first]
    print(f"gpu-check into {out}\n  machine: {first.detail}", flush=True)
    if not args.no_tests:
        rows += run_tests(out)
    if args.no_notebooks:
        pass
    elif not cuda:
        rows.append(Row("notebooks", "skip", 0.0, "no CUDA GPU: backend nccl needs one per rank"))
    else:
        import torch

        gpus = torch.cuda.device_count()
        nproc = args.nproc or min(2, gpus)
        if nproc > gpus:  # the runner refuses NCCL without a GPU per rank: each would fail
            rows.append(Row("notebooks", "skip", 0.0, f"--nproc {nproc} needs one GPU per rank "
                            f"and this machine has {gpus}: leave --nproc out (make gpu-check "
                            f"without NPROC: one rank per GPU, at most 2) or pass --nproc "
                            f"{gpus}"))
        else:  # a notebook that needs more ranks than nproc refuses it: its row is a skip
            rows += run_notebooks(out, nproc, args.only)
    text = table(rows)
    (out / "table.md").write_text(text)
    print(text + f"\n(also in {out / 'table.md'})")
    return 1 if any(r.status == "fail" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
