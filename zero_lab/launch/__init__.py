"""Run a worker script on N processes under torchrun, from a notebook, a test or a terminal.

Notebooks never open a process group inside the kernel: they call `torchrun(...)`, which
starts `python -m torch.distributed.run` in a subprocess, streams rank 0's output into the
cell as it is printed, and returns what every rank passed to `report()`.

    result = torchrun("workers/hello.py", nproc=2)
    result.ranks[1]        # the dict rank 1 reported
    result.stdout[1]       # what rank 1 printed

Each launch gets its own run folder (in the system temp dir) holding, per rank, `rank{r}.out`
and `rank{r}.err` (that rank's stdout and stderr), `rank{r}.json` (its report) and, if it
failed, `rank{r}.error.json` (its traceback). A failed launch keeps its folder, and its error
names these files; a launch that succeeded returns every rank's report and stdout, and removes
its folder (a notebook or a test suite launches hundreds of times). A folder kept lives as long
as the process that launched it: a later launch removes it once that process is gone (a
restarted kernel's, even one killed in the middle of a launch).

No process of a launch outlives the process that called `torchrun(...)`, however that one ends
(a timeout, an error, Ctrl-C, a kernel restart, SIGKILL): torchrun's agent dies with it and
every rank dies with the agent (`zero_lab.launch.rank_side._die_with_parent`).

Inside a worker script (the rank side lives in `zero_lab.launch.rank_side`; its two functions are
re-exported here, so a script and a notebook import from one place):

    from zero_lab.launch import init_worker, report
    info = init_worker()             # process group on the launcher's backend
    report({"rank": info.rank})

In a notebook, `%load_ext zero_lab.launch` adds the cell magic `%%rank_script PATH`, which saves
the cell as the worker script PATH (like %%writefile, line read the same way, without its
"Writing PATH" line, and replacing the file whole: a rank reading it never sees it half written).

The rest of the launch, one job a module:
    env.py        what a single-machine launch exposes and inherits (rendezvous on files,
                  sockets on loopback, the caller's launcher variables)
    log_dirs.py   the launch's log folder, removed once the process that launched it is gone
    failures.py   which rank failed a launch, and how (LaunchError)
    capacity.py   will nproc ranks fit: cores and memory, checked before anything starts
    rank_side.py  what runs inside every rank: init_worker(), report(), dying with the parent
    paths.py      where things live in the repository; new_run_dir(), shown()
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zero_lab.launch import capacity, log_dirs
from zero_lab.launch.env import child_env, disk_note, rendezvous_options
from zero_lab.launch.failures import LaunchError, LaunchTimeout, failure, log_listing
from zero_lab.launch.rank_side import (
    WorkerInfo,
    init_worker,
    report,
    scratch_folder,
)

__all__ = ["torchrun", "resolve_backend", "TooFewGPUs", "LaunchResult", "LaunchError",
           "LaunchTimeout", "init_worker", "report", "scratch_folder", "WorkerInfo"]

BACKENDS = ("auto", "gloo", "nccl")

# How long processes get to exit after SIGTERM before they are killed outright.
_GRACE_SECONDS = 3.0


@dataclass
class LaunchResult:
    """What a launch returns: per-rank reports and stdout, the backend used, the time taken."""

    ranks: list[dict]
    backend: str
    nproc: int
    wall_time: float  # seconds, from starting torchrun to its exit (includes start-up)
    stdout: list[str] = field(default_factory=list)  # what each rank printed, in rank order


# --------------------------------------------------------------------------- parent side


DEVICES = ("auto", "cpu", "cuda")


class TooFewGPUs(ValueError):
    """NCCL asked for more ranks than this machine has GPUs (one rank a GPU). `make gpu-check`
    reports a notebook refused so as skipped: its claims need more GPUs, not a fix."""


def resolve_backend(backend: str, nproc: int, device: str = "auto") -> str:
    """The backend a launch runs on. 'auto' means NCCL when CUDA has at least `nproc`
    devices, else gloo on CPU; `device` ("cpu" or "cuda") decides it instead of the GPU count:
    gloo runs ranks on the CPU, NCCL one rank per GPU. A backend that contradicts the device
    is refused, naming both."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    wanted = {"cpu": "gloo", "cuda": "nccl"}.get(device, backend)
    if backend != "auto" and wanted != backend:
        raise ValueError(f"backend={backend!r} cannot run on device={device!r}: gloo runs the "
                         f"ranks on the CPU, nccl on GPUs. Set one of them to 'auto'.")
    if wanted == "gloo":
        return "gloo"
    import torch  # imported here so that `zero_lab.launch` itself stays light

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted == "nccl" and gpus < nproc:
        asked, instead = (("device='cuda'", "device='cpu'") if device == "cuda"
                          else ("backend='nccl'", "backend='gloo'"))
        raise TooFewGPUs(
            f"{asked} needs one CUDA device per rank: nproc={nproc} but this machine "
            f"has {gpus}. Use {instead} (CPU) or a smaller nproc."
        )
    if wanted == "nccl" or gpus >= nproc:
        return "nccl"
    return "gloo"


def _check_arguments(script, args, timeout) -> tuple[Path, list[str]]:
    """The launch's own arguments (nproc is capacity's: check_count, then check_nproc)."""
    if isinstance(args, str):
        raise TypeError(f"args must be a list of strings, not one string: got {args!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(
            f"script {str(script)!r} does not exist (looked in {Path.cwd()}); "
            "pass the path of a Python worker script"
        )
    return path.resolve(), [str(a) for a in args]


def torchrun(
    script: str | os.PathLike,
    nproc: int,
    args: list | tuple = (),
    timeout: float = 300.0,
    backend: str = "auto",
    env: dict[str, str] | None = None,
    stream: bool = True,
) -> LaunchResult:
    """Run `script` on `nproc` ranks of one machine; return every rank's report and stdout.

    Rank 0's stdout is printed line by line as it arrives, prefixed `[rank0]` (stream=False
    keeps it quiet). Raises LaunchError with the first failing rank's traceback, or
    LaunchTimeout after `timeout` seconds; either way no process is left running.
    """
    capacity.check_count(nproc)
    script_path, str_args = _check_arguments(script, args, timeout)
    chosen = resolve_backend(backend, nproc)
    capacity.check_nproc(nproc, stacklevel=3)  # cores and memory, before anything starts
    oom_before = capacity.oom_kills()  # read again if a rank dies: was it the OOM killer?
    log_dirs.sweep()  # the folders of launches whose process is gone (a killed kernel's)
    run_dir = log_dirs.new(script_path.stem)
    environ = child_env(env, run_dir, chosen)
    command = [
        # torchrun (`python -m torch.distributed.run`), entered through rank_side._run_agent
        sys.executable, "-m", "zero_lab.launch.rank_side", "--agent",
        *rendezvous_options(run_dir),  # on a file: nothing listens
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        # torchrun's own folder (it would make one in the temp dir per launch and leave it)
        f"--log-dir={run_dir / 'torchrun'}",
        "-m", "zero_lab.launch.rank_side",  # the per-rank entry point: it runs the script
        str(script_path), *str_args,
    ]

    launcher_log = run_dir / "launcher.log"
    start = time.perf_counter()
    try:
        with open(launcher_log, "wb") as log:
            # A new session makes torchrun the leader of a process group we can signal as a
            # whole. It also leaves torchrun alone when this process dies without running the
            # `finally` below (SIGKILL, a SIGTERM it does not handle): rank_side._run_agent ties
            # torchrun's life to this process instead.
            proc = subprocess.Popen(
                command, env=environ, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            try:
                timed_out = _wait_streaming(proc, run_dir, timeout, stream)
            finally:
                # Always: on success this is a no-op; on timeout, error or KeyboardInterrupt it
                # ends torchrun and every rank (ranks run in sessions of their own).
                _terminate(proc, run_dir, nproc)
    except BaseException:
        # Interrupted (the notebook's stop button) or broken before the launch ended: its
        # logs are of no use to anyone, so nothing of it stays behind.
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    wall = time.perf_counter() - start

    if timed_out:
        raise LaunchTimeout(
            f"{script_path.name} on {nproc} ranks ran past timeout={timeout}s and was stopped "
            f"(a hang is often a collective that some rank never called).\n"
            f"{log_listing(run_dir, nproc)}",
            run_dir=run_dir,
        )
    if proc.returncode != 0:
        error = failure(script_path, nproc, run_dir, proc.returncode, oom_before)
        full = disk_note(run_dir)
        if full:
            error.args = (f"{error}\n{full}",)
        raise error
    ranks = [_read_report(run_dir, r) for r in range(nproc)]
    stdout = [(run_dir / f"rank{r}.out").read_text(errors="replace") for r in range(nproc)]
    # Everything a successful launch left is now in the result; a failed one (raised above)
    # keeps its folder, which its error names.
    shutil.rmtree(run_dir, ignore_errors=True)
    return LaunchResult(ranks, chosen, nproc, wall, stdout)


def _wait_streaming(proc: subprocess.Popen, run_dir: Path, timeout: float, stream: bool) -> bool:
    """Wait for `proc`, echoing rank 0's stdout as it grows. Returns True on timeout."""
    deadline = time.monotonic() + timeout
    lines: queue.Queue[str] = queue.Queue()
    done = threading.Event()
    tail = threading.Thread(target=_follow, args=(run_dir / "rank0.out", lines, done), daemon=True)
    tail.start()
    timed_out = False
    try:
        while True:
            with contextlib.suppress(queue.Empty):
                while True:
                    line = lines.get(timeout=0.05)
                    if stream:
                        print(f"[rank0] {line}", end="" if line.endswith("\n") else "\n",
                              flush=True)
            if proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
    finally:  # an interrupt too: the reader ends and closes rank 0's log
        done.set()
        tail.join()
    while not lines.empty():  # the last lines written before exit
        line = lines.get()
        if stream:
            print(f"[rank0] {line}", end="" if line.endswith("\n") else "\n", flush=True)
    return timed_out


def _follow(path: Path, lines: queue.Queue, done: threading.Event) -> None:
    """Put each complete line appended to `path` on `lines` until `done`, then the rest."""
    while not path.exists() and not done.is_set():
        time.sleep(0.05)
    if not path.exists():
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        partial = ""
        while True:
            chunk = f.readline()
            if chunk:
                partial += chunk
                if partial.endswith("\n"):
                    lines.put(partial)
                    partial = ""
                continue
            if done.is_set():
                rest = partial + f.read()
                if rest:
                    lines.put(rest)
                return
            time.sleep(0.05)


def _terminate(proc: subprocess.Popen, run_dir: Path, nproc: int) -> None:
    """End torchrun's process group and every rank's, politely then firmly."""
    groups = [proc.pid] + _rank_pids(run_dir, nproc)
    if proc.poll() is None:
        _signal_groups(groups, signal.SIGTERM)
        try:
            proc.wait(timeout=_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    # Ranks run in sessions of their own, so they can outlive torchrun: kill what is left.
    _signal_groups(groups, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()


def _signal_groups(pgids: list[int], sig: int) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def _rank_pids(run_dir: Path, nproc: int) -> list[int]:
    pids = []
    for r in range(nproc):
        with contextlib.suppress(FileNotFoundError, ValueError):
            pids.append(int((run_dir / f"rank{r}.pid").read_text()))
    return pids


def _read_report(run_dir: Path, rank: int) -> dict:
    path = run_dir / f"rank{rank}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- notebooks


def load_ipython_extension(ipython) -> None:
    """`%load_ext zero_lab.launch`: adds the cell magic %%rank_script (see `rank_script`)."""
    ipython.register_magic_function(rank_script, magic_kind="cell", magic_name="rank_script")


def rank_script(line: str, cell: str) -> None:
    """%%rank_script [-a] PATH: save the cell as the worker script PATH (folders made); run nothing.

    %%writefile does the same and prints "Writing PATH" / "Overwriting PATH" every time; the
    cell already shows the code, and the kernel never runs a rank script: torchrun's ranks do.
    The line is read as %%writefile reads it: quotes around a path with spaces, ~ for the
    home folder, -a to append; anything else on the line is refused. Unlike %%writefile, the
    script is replaced whole (see `_replace_file`).
    """
    from IPython.core.error import UsageError  # only a notebook kernel comes here

    from zero_lab.launch.paths import REPO_ROOT

    path, append = _script_path(line)
    if not path.is_absolute() and Path.cwd().resolve() == REPO_ROOT:
        # papermill run from the repository root without --cwd: the scripts would land in a
        # stray workers/ beside the package, and torchrun("workers/...") would find them there
        raise UsageError(f"%%rank_script {path}: this kernel runs in the repository root, not "
                         f"in notebooks/. Run the notebook from notebooks/ (papermill --cwd "
                         f"notebooks, or `make run`).")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = path.read_text(encoding="utf-8") if append and path.exists() else ""
        _replace_file(path, kept + cell)
    except OSError as exc:
        raise UsageError(
            f"%%rank_script {path}: cannot write it in {path.parent.resolve()}: "
            f"{(exc.strerror or str(exc)).lower()}. The course folder must be writable: copy "
            f"it to a writable folder of yours (a read-only or shared install cannot hold the "
            f"scripts its notebooks write).") from None


def _replace_file(path: Path, text: str) -> None:
    """Write `text` to a new file beside `path`, then rename it over `path` (one atomic step).

    The ranks of another launch may be reading the script right now (two kernels running one
    notebook, as a test and nbval can): rewritten in place, they could read it truncated or
    half written; renamed over, they read the old text or the new. A failed write leaves the
    old script and no temporary file.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with temporary.open("x", encoding="utf-8") as f:  # "x": never someone else's file
            f.write(text)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()  # still there only if the write or the rename failed


def _script_path(line: str) -> tuple[Path, bool]:
    """(path, append) from a %%rank_script line, parsed by %%writefile's own argument parser
    and then, as %%writefile does, one pair of surrounding quotes dropped and ~ expanded."""
    from IPython.core.error import UsageError  # only a notebook kernel comes here
    from IPython.core.magic_arguments import parse_argstring
    from IPython.core.magics.osm import OSMagics

    if not line.strip():
        raise UsageError("%%rank_script needs the path to write, e.g. %%rank_script workers/x.py")
    try:
        args = parse_argstring(OSMagics.writefile, line)
    except ValueError as exc:  # the line's quotes do not pair up
        raise UsageError(f"%%rank_script {line.strip()}: {exc}") from None
    name = args.filename
    if re.match(r"""^('.*')|(".*")$""", name):  # %%writefile's own test, as it writes it
        name = name[1:-1]
    return Path(os.path.expanduser(name)), args.append
