"""Run a worker script on N processes under torchrun, from a notebook, a test or a terminal.

Notebooks never open a process group inside the kernel: they call `torchrun(...)`, which
starts `python -m torch.distributed.run` in a subprocess, streams rank 0's output into the
cell as it is printed, and returns what every rank passed to `report()`.

    result = torchrun("workers/hello.py", nproc=2)
    result.ranks[1]        # the dict rank 1 reported

Each launch gets its own run folder (in the system temp dir) holding, per rank, `rank{r}.out`
and `rank{r}.err` (that rank's stdout and stderr), `rank{r}.json` (its report) and, if it
failed, `rank{r}.error.json` (its traceback). Errors name these files.

Inside a worker script:

    from zero_lab.launch import init_worker, report
    info = init_worker()             # process group on the launcher's backend
    report({"rank": info.rank})
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

BACKENDS = ("auto", "gloo", "nccl")

# Environment variables the launcher sets for its workers.
ENV_RUN_DIR = "ZERO_LAB_RUN_DIR"
ENV_BACKEND = "ZERO_LAB_BACKEND"

# How long processes get to exit after SIGTERM before they are killed outright.
_GRACE_SECONDS = 3.0


class LaunchError(RuntimeError):
    """A launch failed: a rank raised or died. The message holds its traceback and log paths."""

    def __init__(self, message: str, run_dir: Path | None = None, rank: int | None = None):
        super().__init__(message)
        self.run_dir = run_dir
        self.rank = rank


class LaunchTimeout(LaunchError):
    """A launch ran past its timeout (a hang, often a collective some rank never joined)."""


@dataclass
class LaunchResult:
    """What a launch returns: per-rank reports, the backend used, and where the logs are."""

    ranks: list[dict]
    backend: str
    nproc: int
    wall_time: float  # seconds, from starting torchrun to its exit (includes start-up)
    run_dir: Path
    logs: list[Path] = field(default_factory=list)  # rank{r}.out, in rank order


# --------------------------------------------------------------------------- parent side


def resolve_backend(backend: str, nproc: int) -> str:
    """'auto' means NCCL when CUDA has at least `nproc` devices, else gloo on CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gloo":
        return "gloo"
    import torch  # imported here so that `zero_lab.launch` itself stays light

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < nproc:
        raise ValueError(
            f"backend='nccl' needs one CUDA device per rank: nproc={nproc} but this machine "
            f"has {gpus}. Use backend='gloo' (CPU) or a smaller nproc."
        )
    if backend == "nccl" or gpus >= nproc:
        return "nccl"
    return "gloo"


def _check_arguments(script, nproc, args, timeout) -> tuple[Path, list[str]]:
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise TypeError(f"nproc must be an int (number of ranks), got {nproc!r}")
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
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
    """Run `script` on `nproc` ranks of one machine; return every rank's report.

    Rank 0's stdout is printed line by line as it arrives, prefixed `[rank0]` (stream=False
    keeps it quiet). Raises LaunchError with the first failing rank's traceback, or
    LaunchTimeout after `timeout` seconds; either way no process is left running.
    """
    script_path, str_args = _check_arguments(script, nproc, args, timeout)
    chosen = resolve_backend(backend, nproc)
    run_dir = Path(tempfile.mkdtemp(prefix=f"zero_lab-{script_path.stem}-"))

    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env.setdefault("OMP_NUM_THREADS", "1")  # 1 thread per rank: ranks share the cores
    child_env.update(
        {
            ENV_RUN_DIR: str(run_dir),
            ENV_BACKEND: chosen,
            "PYTHONUNBUFFERED": "1",  # so rank 0's lines reach the cell as they are printed
            # Workers import zero_lab from wherever this process does (e.g. a notebook kernel
            # started beside an uninstalled checkout).
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parent.parent),
                            child_env.get("PYTHONPATH", "")) if p
            ),
        }
    )
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",  # rendezvous on localhost port 0: the OS picks a free port
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m", "zero_lab.launch",  # the per-rank entry point below runs the script
        str(script_path), *str_args,
    ]

    launcher_log = run_dir / "launcher.log"
    start = time.perf_counter()
    with open(launcher_log, "wb") as log:
        # A new session makes torchrun the leader of a process group we can signal as a whole.
        proc = subprocess.Popen(
            command, env=child_env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            timed_out = _wait_streaming(proc, run_dir, timeout, stream)
        finally:
            # Always: on success this is a no-op; on timeout, error or KeyboardInterrupt it
            # ends torchrun and every rank (ranks run in sessions of their own).
            _terminate(proc, run_dir, nproc)
    wall = time.perf_counter() - start

    logs = [run_dir / f"rank{r}.out" for r in range(nproc)]
    if timed_out:
        raise LaunchTimeout(
            f"{script_path.name} on {nproc} ranks ran past timeout={timeout}s and was stopped "
            f"(a hang is often a collective that some rank never called).\n"
            f"{_log_listing(run_dir, nproc)}",
            run_dir=run_dir,
        )
    if proc.returncode != 0:
        raise _failure(script_path, nproc, run_dir, proc.returncode)
    ranks = [_read_report(run_dir, r) for r in range(nproc)]
    return LaunchResult(ranks, chosen, nproc, wall, run_dir, logs)


def _wait_streaming(proc: subprocess.Popen, run_dir: Path, timeout: float, stream: bool) -> bool:
    """Wait for `proc`, echoing rank 0's stdout as it grows. Returns True on timeout."""
    deadline = time.monotonic() + timeout
    lines: queue.Queue[str] = queue.Queue()
    done = threading.Event()
    tail = threading.Thread(target=_follow, args=(run_dir / "rank0.out", lines, done), daemon=True)
    tail.start()
    timed_out = False
    while True:
        with contextlib.suppress(queue.Empty):
            while True:
                line = lines.get(timeout=0.05)
                if stream:
                    print(f"[rank0] {line}", end="" if line.endswith("\n") else "\n", flush=True)
        if proc.poll() is not None:
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
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


def _log_listing(run_dir: Path, nproc: int) -> str:
    files = [f"  rank {r}: {run_dir / f'rank{r}.out'}  {run_dir / f'rank{r}.err'}"
             for r in range(nproc)]
    return "Logs:\n" + "\n".join(files + [f"  torchrun: {run_dir / 'launcher.log'}"])


def _failure(script: Path, nproc: int, run_dir: Path, returncode: int) -> LaunchError:
    """Build the error for a failed launch from the rank that failed first."""
    errors = []
    for r in range(nproc):
        path = run_dir / f"rank{r}.error.json"
        if path.exists():
            errors.append(json.loads(path.read_text()))
    if errors:
        first = min(errors, key=lambda e: e["time"])
        rank = first["rank"]
        body = first["traceback"].rstrip()
        lines = body.splitlines()
        if len(lines) > 40:
            body = "\n".join(["  ..."] + lines[-40:])
        head = f"rank {rank} of {nproc} failed in {script.name}: {first['error']}"
    else:
        # No rank recorded an exception: one was killed (out of memory, a signal) or torchrun
        # itself failed. The stderr tails say which.
        rank = None
        head = f"{script.name} on {nproc} ranks failed (torchrun exit code {returncode})"
        body = "\n".join(
            f"--- {p.name} (last lines) ---\n{_tail(p)}"
            for p in [*(run_dir / f"rank{r}.err" for r in range(nproc)),
                      run_dir / "launcher.log"]
            if p.exists() and p.stat().st_size
        )
    return LaunchError(f"{head}\n{body}\n{_log_listing(run_dir, nproc)}", run_dir, rank)


def _tail(path: Path, n: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


# --------------------------------------------------------------------------- worker side


@dataclass
class WorkerInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: object  # torch.device: cuda:<local_rank> under NCCL, cpu under gloo


def init_worker() -> WorkerInfo:
    """Join the process group on the backend the launcher chose (gloo if run by plain torchrun).

    Under NCCL each rank takes the GPU of its local rank; under gloo everything is on CPU.
    """
    import torch
    import torch.distributed as dist

    backend = os.environ.get(ENV_BACKEND, "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return WorkerInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


_reported: dict = {}


def report(data: dict) -> dict:
    """Hand `data` (a JSON-serialisable dict) to the launching process as this rank's result.

    Several calls merge into one dict (later keys win). Outside a launch it only returns the
    merged dict, so a worker can also run as a plain script.
    """
    if not isinstance(data, dict):
        raise TypeError(f"report(data) takes a dict, got {type(data).__name__}")
    for key, value in data.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"report(data): data[{key!r}] is not JSON-serialisable "
                f"({type(value).__name__}: {exc}). Convert tensors with .item() or .tolist()."
            ) from None
    _reported.update(data)
    run_dir = os.environ.get(ENV_RUN_DIR)
    if run_dir:
        rank = int(os.environ.get("RANK", "0"))
        path = Path(run_dir) / f"rank{rank}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_reported))
        tmp.replace(path)  # atomic: the parent never reads half a file
    return dict(_reported)


def _run_rank(argv: list[str]) -> int:
    """Entry point of every rank (torchrun runs `python -m zero_lab.launch script args`).

    Sends this rank's stdout/stderr to its log files, runs the script as __main__, and on an
    exception records the traceback with a timestamp so the parent can name the rank that
    failed first.
    """
    import runpy

    run_dir = Path(os.environ[ENV_RUN_DIR])
    rank = int(os.environ.get("RANK", "0"))
    (run_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    _die_with_parent()
    for fd, name in ((1, f"rank{rank}.out"), (2, f"rank{rank}.err")):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        target = os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)  # at the descriptor level, so C++ (gloo, NCCL) output lands too
        os.close(target)

    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record_error(run_dir, rank, f"SystemExit({exc.code!r})", traceback.format_exc())
            raise
    except BaseException as exc:
        _record_error(run_dir, rank, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        raise
    # Only after success: after a failure the other ranks may be stuck in a collective.
    _destroy_group()
    return 0


def _record_error(run_dir: Path, rank: int, error: str, tb: str) -> None:
    # Drop the frames of this entry point and runpy: the learner's script is what matters.
    lines = tb.splitlines()
    start = next((i for i, ln in enumerate(lines) if "<module>" in ln and "runpy" not in ln), 1)
    tb = "\n".join(lines[:1] + lines[start:]) if start > 1 else tb
    record = {"rank": rank, "time": time.time(), "error": error, "traceback": tb}
    (run_dir / f"rank{rank}.error.json").write_text(json.dumps(record))


def _destroy_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - shutting down after a failure must not mask it
        pass


def _die_with_parent() -> None:
    """On Linux, ask the kernel to kill this rank if torchrun's agent dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() == 1:  # the parent already died before prctl took effect
            os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) < 2 or ENV_RUN_DIR not in os.environ:
        sys.exit("zero_lab.launch is started by zero_lab.launch.torchrun(), not by hand")
    sys.exit(_run_rank(sys.argv[1:]))
