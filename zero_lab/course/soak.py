"""Run notebooks under nbval again and again beside busy processes, and count the passes.

    python -m zero_lab.course.soak [--only 06] [--runs 50] [--load 2]
    make soak NB=06 RUNS=50 LOAD=2

Why this exists. A check that passes on an idle machine can still fail on a learner's laptop,
where a browser or a video call shares the cores: a check on two wall-clock timings is the
usual culprit. The course's rule (DESIGN.md, "Claims and checks") is that no check may fail
that way, and this is the instrument that holds it to the rule: each notebook runs `--runs`
times under `pytest --nbval-lax` (what `make test` runs) while `--load` processes spin on the
CPU beside it, and the pass count per notebook is printed, with the cell and the error of
every failure. Nothing is retried and nothing is skipped: a 49/50 is a defect to fix.

The summary also lands in runs/soak/<this soak's own folder>/summary.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zero_lab.course.runner import course_notebooks
from zero_lab.launch.paths import REPO_ROOT, new_run_dir

# The load: a process that does nothing but keep one core busy, as a CPU-bound program does.
SPIN = "while True: pass"


@dataclass
class Soaked:
    """One notebook's soak: how many runs passed, how long each took, what failed."""

    notebook: str
    runs: int = 0
    passed: int = 0
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # one line per failed run

    def line(self) -> str:
        spread = (f"{min(self.seconds):.0f}-{max(self.seconds):.0f} s, median "
                  f"{statistics.median(self.seconds):.0f} s" if self.seconds else "")
        return f"{self.notebook}: {self.passed}/{self.runs} passed ({spread})"


@contextmanager
def busy_processes(count: int):
    """`count` CPU-bound processes running for as long as the block runs (killed after it)."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def failed_cells(output: str) -> list[str]:
    """The cells nbval reported failing, with the error's last line: `cell 14: AssertionError...`.

    nbval names a failing cell in its test id (`notebook.ipynb::Cell 14`); the error is the
    last `...Error: ...` line of that cell's report.
    """
    output = re.sub(r"\x1b\[[0-9;]*m", "", output)  # nbval colours its report
    found = []
    # Each failure's report opens with a line `____ path.ipynb::Cell 14 ____`; a long path
    # leaves room for a single underscore on each side.
    for block in re.split(r"^_+ (?=\S+\.ipynb::Cell \d+ _+$)", output, flags=re.M)[1:]:
        cell = re.match(r"\S+\.ipynb::Cell (\d+)", block)
        errors = re.findall(r"^(\w*(?:Error|Exception|Timeout)\b: .*)$", block, re.M)
        message = errors[-1].strip() if errors else "failed"
        found.append(f"cell {cell.group(1)}: {message[:200]}")
    return found


def run_once(notebook: Path) -> tuple[bool, float, list[str]]:
    """One nbval run of `notebook`: (passed, seconds, the failed cells)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "-q",
         "--no-header", str(notebook)],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode == 0:
        return True, seconds, []
    return False, seconds, failed_cells(done.stdout) or [f"pytest exited {done.returncode}: "
                                                        f"{done.stdout.strip()[-300:]}"]


def soak(notebooks: list[Path], runs: int, load: int) -> list[Soaked]:
    """Run each notebook `runs` times under nbval with `load` busy processes beside it."""
    results = []
    with busy_processes(load):
        for nb in notebooks:
            result = Soaked(nb.name)
            for k in range(runs):
                passed, seconds, failures = run_once(nb)
                result.runs += 1
                result.passed += passed
                result.seconds.append(seconds)
                result.failures += [f"run {k + 1}: {f}" for f in failures]
                print(f"{nb.name} run {k + 1}/{runs}: {'passed' if passed else 'FAILED'} "
                      f"in {seconds:.0f} s" + "".join(f"\n    {f}" for f in failures),
                      flush=True)
            results.append(result)
            print(result.line(), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_lab.course.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebook files (default: the course's, or those --only picks)")
    parser.add_argument("--only", default=None, help="notebooks whose name starts with this")
    parser.add_argument("--runs", type=int, default=50, help="runs per notebook")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs")
    opts = parser.parse_args(argv)
    if opts.runs < 1 or opts.load < 0:
        parser.error(f"--runs must be >= 1 and --load >= 0, got {opts.runs} and {opts.load}")
    notebooks = opts.notebooks or course_notebooks(opts.only)
    print(f"soaking {len(notebooks)} notebook(s), {opts.runs} run(s) each, "
          f"{opts.load} busy process(es) beside them", flush=True)
    results = soak(notebooks, opts.runs, opts.load)
    summary = new_run_dir("soak") / "summary.json"  # this soak's own: two never share one
    summary.write_text(json.dumps(
        {"runs": opts.runs, "load": opts.load, "notebooks": [asdict(r) for r in results]},
        indent=1))
    print(f"\nsummary (load {opts.load}; also in {summary}):")
    for r in results:
        print("  " + r.line())
    return 0 if all(r.passed == r.runs for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
