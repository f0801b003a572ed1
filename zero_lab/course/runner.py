"""Execute the course's notebooks in order with papermill (`make run`, `make figures`).

    python -m zero_lab.course run [--nproc 2] [--backend auto] [--device auto] [--only 03]
    python -m zero_lab.course figures      # run, then copy the saved figures into figures/

Each run executes into a folder of its own, runs/course/<time>-<pid>-<suffix>/ (two runs in
one course folder never overwrite each other): executed notebooks in executed/, figures in
figures/, and the folders notebooks make for their files (`paths.new_run_dir`) inside it. The
run ends with its total time and that folder.

What would fail is refused before any kernel starts (course/preflight.py): parameters of the
wrong type, more ranks than the machine's cores or memory hold (`capacity.check_nproc`), a
device it lacks, and whatever a notebook's own check cell would refuse (its fewest ranks, the
batches nproc must divide).
An executed notebook is written under a temporary name beside its own and renamed when
papermill is done with it, so a full disk leaves no half-written notebook; a write that fails
(disk full, read-only, permission) is one line naming the path, the cause and what to do. On
a failing cell it names the notebook and the cell, prints the error, and exits non-zero; the
executed copy up to the failure is kept for inspection. A kernel that dies (most often the
out-of-memory killer) is named with its notebook and nproc.

The command itself only waits: the work runs in a child process (this module again, told the
run folder), so that when the out-of-memory killer ends the runner, the command is left to say
so in one line. The run folder's status.json says which notebooks are done and which one ran.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from zero_lab.course import figure_sources
from zero_lab.course.preflight import check_notebooks, preflight
from zero_lab.launch import capacity
from zero_lab.launch.paths import FIGURES, NOTEBOOKS, new_run_dir


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


def summary(count: int, seconds: float, run_dir: Path) -> str:
    """The last lines of a run: its total time and where its results are."""
    minutes, rest = divmod(round(seconds), 60)
    took = f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"
    return (f"{count} notebook{'s' if count != 1 else ''} executed in {took}\n"
            f"run folder: {run_dir}\n"
            f"executed notebooks: {run_dir / 'executed'}\n"
            f"figures: {run_dir / 'figures'} (`make figures` copies them into {FIGURES.name}/)")


WHAT_TO_DO = {
    errno.ENOSPC: ("no space left on the device", "free space (`make clean` removes runs/, "
                   "old runs/course/ folders can go) or set ZERO_LAB_RUNS_DIR to a folder on "
                   "another disk, then run again"),
    errno.EROFS: ("the file system is read-only", "set ZERO_LAB_RUNS_DIR to a writable "
                  "folder, then run again"),
    errno.EACCES: ("permission denied", "make the folder writable for you or set "
                   "ZERO_LAB_RUNS_DIR to a folder you own, then run again"),
}
WHAT_TO_DO[errno.EDQUOT] = ("disk quota exceeded", WHAT_TO_DO[errno.ENOSPC][1])
WHAT_TO_DO[errno.EPERM] = ("operation not permitted", WHAT_TO_DO[errno.EACCES][1])


def write_failed(err: OSError, path: Path) -> SystemExit:
    """A write that failed, as one line: the path, the cause and what to do (exit status 1).
    Other OSErrors than a full disk, a read-only file system or a refused permission are
    not this function's: they are raised again by the caller."""
    cause, todo = WHAT_TO_DO[err.errno]
    print(f"\nmake run: cannot write {path}: {cause} ({errno.errorcode[err.errno]}); {todo}.",
          file=sys.stderr)
    return SystemExit(1)


@contextlib.contextmanager
def writes(what: str):
    """A write that fails for a reason WHAT_TO_DO knows ends the run in its one line."""
    try:
        yield
    except OSError as err:
        if err.errno not in WHAT_TO_DO:
            raise
        raise write_failed(err, Path(err.filename or what)) from None


@contextlib.contextmanager
def environment(**values: str):
    """os.environ with `values` set (the kernels papermill starts inherit it), put back after."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# The widest printed line a notebook may show: it fits a laptop's JupyterLab beside the file
# browser without wrapping. nbval holds every notebook to it (conftest.py at the repository
# root), the browser test notebooks 00 and 01, and `make run` names the lines over it.
PRINT_WIDTH = 110
RICH = ("text/html", "image/png", "image/svg+xml", "application/vnd.jupyter.widget-view+json")


def wide_lines(outputs: list[dict], width: int = PRINT_WIDTH) -> list[str]:
    """The lines of a cell's `outputs` (nbformat output dicts) wider than `width`: its stdout
    joined across messages, and the plain text of results and displays that show as text
    (not a figure's or a widget's fallback text). A carriage return redraws its line: only
    what follows the last one is shown."""
    texts, stdout = [], []
    for out in outputs:
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            stdout.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/plain" in data and not any(kind in data for kind in RICH):
                plain = data["text/plain"]
                texts.append(plain if isinstance(plain, str) else "".join(plain))
    texts.append("".join("".join(t) if isinstance(t, list) else t for t in stdout))
    shown = (line.rsplit("\r", 1)[-1] for text in texts for line in text.split("\n"))
    return [line for line in shown if len(line) > width]


def partial_path(out: Path) -> Path:
    """The temporary name papermill writes `out` under (it wants *.ipynb)."""
    return out.with_name(f".{out.stem}.partial.ipynb")


def execute(nb: Path, out: Path, parameters: dict, config) -> None:
    """Execute `nb` into `out` through a temporary name beside it: `out` appears whole (also
    after a failing cell or a dead kernel, whose copies papermill saved whole), or not at all
    (a write that failed: the half-written temporary file is removed)."""
    import papermill

    partial = partial_path(out)
    try:
        try:
            papermill.execute_notebook(
                str(nb), str(partial), parameters=parameters, cwd=str(NOTEBOOKS),
                kernel_name="python3", progress_bar=False, log_output=False, config=config,
            )
        except BaseException as failure:
            if partial.exists() and not isinstance(failure, OSError):
                os.replace(partial, out)  # saved whole by papermill before it raised: kept
            raise
        os.replace(partial, out)
    except OSError as err:
        with contextlib.suppress(OSError):
            partial.unlink()
        if err.filename in (None, str(partial)):  # name the file it was writing, not its
            raise OSError(err.errno, err.strerror, str(out)) from err  # temporary name
        raise


def execute_or_exit(nb: Path, out: Path, parameters: dict, config, bar) -> None:
    """`execute`, and where it fails, why in the learner's words (exit status 1)."""
    from nbclient.exceptions import DeadKernelError
    from papermill import PapermillExecutionError

    try:
        execute(nb, out, parameters, config)
    except PapermillExecutionError as err:
        first_line = (err.source or "").strip().splitlines()[:1]
        why = (f"{nb.name}, cell {err.cell_index} (execution count {err.exec_count}), starting "
               f"{first_line[0] if first_line else ''!r}\n{err.ename}: {err.evalue}\nThe "
               f"executed copy up to the failure is {out}")
    except DeadKernelError:
        kept = f"; the executed copy up to then is {out}" if out.exists() else ""
        why = (f"{nb.name}: its kernel died with nproc={parameters.get('nproc')}, most likely "
               "killed for running out of memory (the out-of-memory killer ends the largest "
               f"process). Run it again with fewer ranks (make run NPROC=2 ONLY={nb.name[:2]}) "
               f"or with less else running{kept}.")
    except OSError:
        bar.close()
        with writes(str(out)):  # the learner's one line where the reason is known
            raise
    else:
        return
    bar.close()
    print(f"\nFAILED: {why}", file=sys.stderr)
    raise SystemExit(1)


STATUS = "status.json"


def write_status(run_dir: Path, status: dict) -> None:
    """The run folder's status.json, rewritten whole: {"nproc", "done": the notebooks
    executed whole, "running": the one under way, "ended": None while it runs, then
    "finished", "failed" or how it was killed}. A run killed mid-notebook writes nothing
    more, so this is what says which notebooks are complete and which one is partial."""
    temporary = run_dir / f".{STATUS}"
    with contextlib.suppress(OSError):  # a courtesy: a full disk is said elsewhere
        temporary.write_text(json.dumps(status, indent=1) + "\n")
        os.replace(temporary, run_dir / STATUS)


def run(parameters: dict, only: str | None = None, run_dir: Path | None = None) -> Path:
    """Execute every notebook with `parameters` into a run folder (`run_dir`, else a new
    one); return that folder."""
    from tqdm import tqdm

    notebooks = course_notebooks(only)
    preflight(parameters)
    check_notebooks(notebooks, parameters)
    with writes("runs/course"):
        run_dir = new_run_dir("course") if run_dir is None else run_dir
        (run_dir / "executed").mkdir()
        (run_dir / "figures").mkdir()
    executed = run_dir / "executed"
    config = kernel_config()
    status = {"nproc": parameters.get("nproc"), "done": [], "running": None, "ended": None}
    started = time.perf_counter()
    bar = tqdm(notebooks, desc="course", unit="notebook")
    with environment(ZERO_LAB_FIGURES_DIR=str(run_dir / "figures"),
                     ZERO_LAB_RUNS_DIR=str(run_dir)):
        for nb in bar:
            bar.set_postfix_str(nb.name)
            out = executed / nb.name
            status["running"] = nb.name
            write_status(run_dir, status)
            start = time.perf_counter()
            try:
                execute_or_exit(nb, out, parameters, config, bar)
            except SystemExit:
                write_status(run_dir, {**status, "ended": "failed"})
                raise
            tqdm.write(f"{nb.name}: {time.perf_counter() - start:.1f} s -> {out}")
            wide = [line for cell in json.loads(out.read_text(encoding="utf-8"))["cells"]
                    for line in wide_lines(cell.get("outputs", []))]
            if wide:  # the course's own rule; nbval fails on it, a run only says it
                tqdm.write(f"  {len(wide)} printed lines over {PRINT_WIDTH} characters, the "
                           f"first: {wide[0][:PRINT_WIDTH]}...")
            status["done"].append(nb.name)
    bar.close()
    write_status(run_dir, {**status, "running": None, "ended": "finished"})
    print(summary(len(status["done"]), time.perf_counter() - started, run_dir))
    return run_dir


def copy_figures(source: Path) -> list[Path]:
    """Copy the PNGs a run saved (its figures/ folder) into the committed figures/; none to
    copy is a failure (exit status 1): the notebooks saved them elsewhere, or saved none."""
    FIGURES.mkdir(exist_ok=True)
    copied = []
    for png in sorted(Path(source).glob("*.png")):
        shutil.copy2(png, FIGURES / png.name)
        copied.append(FIGURES / png.name)
    if not copied:
        print(f"make figures: the run saved no figure in {source}, so none was copied into "
              f"{FIGURES}: did its notebooks save them elsewhere (ZERO_LAB_FIGURES_DIR)?",
              file=sys.stderr)
        raise SystemExit(1)
    figure_sources.record(copied)  # what drew them: tests/test_figures_fresh.py compares
    print(f"copied {len(copied)} figures from {source} into {FIGURES}")
    return copied


# ---- the command: it waits while a child process does the work ------------------------------
# The out-of-memory killer ends the process using the most memory. That is the runner, which
# holds torch and papermill, or one of its kernels, never the command that only waits: so the
# command outlives a killed runner and can say what happened and what the run folder holds.

def child_command(argv: list[str], run_dir: Path) -> list[str]:
    """The process that does the work: this command again, told its run folder."""
    return [sys.executable, "-m", "zero_lab.course", *argv, "--run-dir", str(run_dir)]


def supervise(argv: list[str], nproc: int) -> int:
    """Run the course in a child process; return its exit status (128 + the signal that
    killed it, as a shell says), after one line saying how a killed run ended."""
    with writes("runs/course"):
        run_dir = new_run_dir("course")
    oom_before = capacity.oom_kills()
    child = subprocess.Popen(child_command(argv, run_dir))
    try:
        code = child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the child too (one process group): it ends
        code = child.wait()
    if code < 0 and code != -signal.SIGINT:
        report_killed(-code, run_dir, nproc, oom_before)
    with contextlib.suppress(OSError):
        run_dir.rmdir()  # still empty: refused before any notebook, so no run to keep
    return 128 - code if code < 0 else code


def report_killed(sig: int, run_dir: Path, nproc: int,
                  oom_before: capacity.OomKills | None) -> None:
    """Say how the run was killed, in one line; keep the notebook it was running (papermill
    saved it after each cell) under its own name; mark the status file."""
    try:
        status = json.loads((run_dir / STATUS).read_text())
    except (OSError, ValueError):  # killed before the first notebook started
        status = {"nproc": nproc, "done": [], "running": None}
    if status["running"]:
        out = run_dir / "executed" / status["running"]
        with contextlib.suppress(OSError):
            os.replace(partial_path(out), out)
    line = killed(sig, status, run_dir, oom_before)
    if (run_dir / STATUS).exists():
        write_status(run_dir, {**status, "ended": line.removeprefix("the run was ")})
    print(f"\nmake run: {line}", file=sys.stderr)  # below the progress bar it cut short


def killed(sig: int, status: dict, run_dir: Path, oom_before: capacity.OomKills | None) -> str:
    """One line: what killed the run (the out-of-memory killer as a fact where its count rose
    since `oom_before`), what it was running, what the run folder holds, what to try."""
    name = signal.Signals(sig).name
    rose = oom_before.since() if oom_before is not None else 0
    if sig == signal.SIGKILL and rose > 0:
        how = (f"killed by the out-of-memory killer (oom_kill in {oom_before.file} rose by "
               f"{rose})")
    elif sig == signal.SIGKILL:
        how = "killed (SIGKILL), most likely by the out-of-memory killer,"
    else:
        how = f"ended by signal {sig} ({name})"
    nproc, done, running = status["nproc"], status["done"], status["running"]
    if running is None:
        return f"the run was {how} before any notebook started"
    held = (f"{len(done)} notebook{'s' if len(done) != 1 else ''} complete "
            f"({', '.join(n[:2] for n in done)})" if done else "no notebook complete")
    line = (f"the run was {how} while running {running} with nproc={nproc}; "
            f"{run_dir / 'executed'} holds {held} and {running} partial")
    if sig != signal.SIGKILL:
        return line
    return line + ("; try NPROC=2" if nproc > 2 else
                   "; close other kernels and programs or ask for more memory")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m zero_lab.course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "figures"])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per multi-rank cell")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--only", default=None, help="run only notebooks starting with this")
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)  # the child's
    opts = parser.parse_args(argv)
    if opts.run_dir is None:  # the command a learner typed: it waits on the child
        code = supervise(argv, opts.nproc)
        if code:
            raise SystemExit(code)
        return
    params = {"nproc": opts.nproc, "backend": opts.backend, "device": opts.device}
    run_dir = run(params, opts.only, opts.run_dir)
    if opts.command == "figures":
        copy_figures(run_dir / "figures")


if __name__ == "__main__":
    main()
