"""The rank side of a launch: what runs inside every process torchrun starts.

    from zero_lab.launch import init_worker, report      # re-exported from rank_side.py
    info = init_worker()             # process group on the launcher's backend
    report({"rank": info.rank})      # this rank's result, handed to the launching process

`zero_lab.launch.torchrun()` starts `python -m zero_lab.launch.rank_side --agent` (torchrun's agent,
tied to the launching process) and, through it, `python -m zero_lab.launch.rank_side SCRIPT ARGS` on
every rank: this module's entry point sends the rank's output to its log files, runs the
script, records an exception for the launcher, and ends the process without interpreter
finalisation (see `_run_rank`). No process of a launch outlives the process that called
torchrun() (`_die_with_parent`), nor the launch itself: the agent adopts and ends whatever
the ranks started and left behind (`_become_subreaper`, `_end_orphans`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

# Environment variables the launcher sets for its workers.
ENV_RUN_DIR = "ZERO_LAB_RUN_DIR"
ENV_BACKEND = "ZERO_LAB_BACKEND"
# The file the ranks' process group meets on (a FileStore: nothing listens on a port).
ENV_STORE = "ZERO_LAB_STORE"
# The pid each process of a launch expects as its parent (see _die_with_parent): the
# launching process for torchrun's agent, the agent for every rank.
ENV_LAUNCHER_PID = "ZERO_LAB_LAUNCHER_PID"
ENV_AGENT_PID = "ZERO_LAB_AGENT_PID"


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
        _import_group_defaults()
        device_id = device if backend == "nccl" else None
        store_file = os.environ.get(ENV_STORE)
        if store_file:  # torchrun() on one machine: the group meets on a file, not a port
            world_size = int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=dist.FileStore(store_file, world_size),
                                    rank=int(os.environ["RANK"]), world_size=world_size,
                                    device_id=device_id)
        else:  # plain torchrun (several machines): env:// and the TCP store it names
            dist.init_process_group(backend, device_id=device_id)
    return WorkerInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


# torch modules that evaluate `dist.group.WORLD` into default arguments when first imported
# (`def all_reduce(tensor, op=ReduceOp.SUM, group=group.WORLD)`). Imported once the process
# group exists, they hold a reference to it that destroy_process_group() cannot drop, and the
# group's gloo threads live on until interpreter exit. torch.distributed.nn.functional is
# imported lazily, with torch._dynamo, when the first optimizer is built, so every worker
# that trains meets it; it costs 2 ms here. torch.distributed.optim.zero_redundancy_optimizer
# and torch.distributed.fsdp.sharded_grad_scaler bind it too, but only workers that use them
# import them, and importing them costs about 1 s (they pull in torch.distributed.fsdp):
# those threads are left to `os._exit` at the end of `_run_rank`, which never waits for them.
_MODULES_BINDING_WORLD = ("torch.distributed.nn.functional",)


def _import_group_defaults() -> None:
    """Import `_MODULES_BINDING_WORLD` while there is no group: their defaults become None."""
    for name in _MODULES_BINDING_WORLD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def scratch_folder(name: str) -> Path:
    """The folder `name` in this launch's own folder, made if missing: the same path on every
    rank of the machine, so no rank has to broadcast it. It goes with the launch's logs: removed
    when the launch succeeds, kept beside them when it fails. Outside a launch, a new
    temporary folder (a worker run as a plain script)."""
    run_dir = os.environ.get(ENV_RUN_DIR)
    folder = (Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="zero_lab-"))) / name
    folder.mkdir(exist_ok=True)
    return folder


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


def _run_agent(argv: list[str]) -> None:
    """torchrun's agent as torchrun() starts it: `python -m torch.distributed.run ARGV`, entered
    here so that it first ties its life to the launching process and gives its pid to the ranks.
    """
    # SIGTERM, not SIGKILL: torchrun stops its ranks on it, and the `finally` below ends what
    # they started, when the launcher dies without a word (a kernel's hard restart).
    _die_with_parent(os.environ.get(ENV_LAUNCHER_PID), signal.SIGTERM)
    os.environ[ENV_AGENT_PID] = str(os.getpid())  # every rank inherits the agent's environment
    _become_subreaper()
    _no_hostname_lookups()
    from torch.distributed.run import main

    try:
        main(argv)
    finally:  # the ranks are done (or torchrun was told to stop): nothing of theirs lives on
        _end_orphans()


def _no_hostname_lookups() -> None:
    """Make `socket.getfqdn()` in this process (the agent) return the hostname without asking DNS.

    torchelastic's agent puts the machine's full name in every event it records (each rank
    started, each rank's end, ...: seven a 2-rank launch) and in a failed rank's summary, by
    calling socket.getfqdn(), and no option turns that off. getfqdn asks the resolver for the
    hostname. On a machine whose hostname is in no /etc/hosts and whose DNS answers nothing
    (a café Wi-Fi behind its login page, often on macOS), each call waits ~10 s for the
    resolver to give up and then returns the plain hostname: a launch took ~80 s, not ~9 s.
    On one machine the plain hostname is all there is to know, so it is returned at once, as
    getfqdn itself returns it after the wait. The rest of a launch looks nothing up: the
    rendezvous is given its address (`--local-addr`, env.py) and gloo its interface
    (GLOO_SOCKET_IFNAME); tests/test_launch_offline_host.py counts the queries. Only the
    agent is changed: the ranks are interpreters of their own.
    """
    import socket

    def getfqdn(name: str = "") -> str:  # socket.getfqdn, less the lookup
        name = name.strip()
        return name if name and name not in ("0.0.0.0", "::") else socket.gethostname()

    socket.getfqdn = getfqdn


def _become_subreaper() -> None:
    """On Linux, make the agent the *child subreaper* of everything the ranks start.

    A process a rank starts can leave the rank's process group and outlive it: a double
    fork, or a child started in a session of its own (`start_new_session=True`, a daemon).
    Orphaned, it would be adopted by init and live on after the launch, which promises that
    no process is left behind. With PR_SET_CHILD_SUBREAPER the kernel hands such orphans to
    the agent instead, so `_end_orphans` can find them: they are its children.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        pr_set_child_subreaper = 36
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1)


def _end_orphans() -> None:
    """SIGKILL and reap every process still descending from the agent (Linux: /proc).

    Killing a process hands its own children to the agent (the subreaper), so repeat until
    none is left."""
    if not sys.platform.startswith("linux"):
        return
    for _ in range(100):
        family = _descendants(os.getpid())
        if not family:
            return
        for pid in family:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in family:  # reap our direct children (the rest come to us as they die)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _descendants(root: int) -> list[int]:
    """The pids below `root` in the process tree, read from /proc/*/stat (field 4: ppid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                after_name = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(after_name[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _run_rank(argv: list[str]) -> NoReturn:
    """Entry point of every rank (torchrun runs `python -m zero_lab.launch.rank_side script args`).

    Sends this rank's stdout/stderr to its log files, runs the script as __main__, and on an
    exception records the traceback with a timestamp so the parent can name the rank that
    failed first. A crash in native code leaves the Python stack in the rank's stderr.
    """
    import faulthandler

    run_dir = Path(os.environ[ENV_RUN_DIR])
    rank = int(os.environ.get("RANK", "0"))
    _die_with_parent(os.environ.get(ENV_AGENT_PID))
    (run_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    for fd, name in ((1, f"rank{rank}.out"), (2, f"rank{rank}.err")):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        target = os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)  # at the descriptor level, so C++ (gloo, NCCL) output lands too
        os.close(target)
    faulthandler.enable()  # SIGSEGV, SIGABRT...: the Python stack goes to rank{r}.err

    code = _run_script(argv, run_dir, rank)
    # Interpreter finalisation (Py_FinalizeEx) races the C++ threads a backend may leave
    # behind: a gloo thread that drops its last reference to a finished work object needs the
    # GIL, cannot take it once finalisation has begun, and the rank aborts ("terminate called
    # without an active exception", SIGABRT), about one 3-rank launch in 27 under CPU load,
    # after its report is written. So a rank never finalises: its report and any error record
    # are on disk by now, atexit handlers run, streams are flushed, and it leaves with os._exit.
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _run_script(argv: list[str], run_dir: Path, rank: int) -> int:
    """Run the worker script as __main__; return the rank's exit code."""
    import runpy

    import torch.distributed as dist

    from zero_lab.collectives import torch_names

    torch_names.provide(dist)  # the course's collective names on an older torch too
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record_error(run_dir, rank, f"SystemExit({exc.code!r})", traceback.format_exc())
            if isinstance(exc.code, int):
                return exc.code
            print(exc.code, file=sys.stderr)
            return 1
    except BaseException as exc:
        _record_error(run_dir, rank, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        traceback.print_exc()
        return 1
    _finish_in_flight()
    # The parent learns that this rank finished its script (a rank that skipped a collective
    # the others wait in finishes early, and their "connection closed" errors point here).
    (run_dir / f"rank{rank}.finished").write_text(str(time.time()))
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


def _finish_in_flight() -> None:
    """The direct exchanges this rank still has in flight finish before it leaves, so no peer
    still receiving meets a closed connection (collectives/exchange.py)."""
    exchange = sys.modules.get("zero_lab.collectives.exchange")
    if exchange is not None:
        exchange.finish_in_flight()


def _destroy_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - shutting down after a failure must not mask it
        pass


def _die_with_parent(expected_parent: str | None, sig: int = signal.SIGKILL) -> None:
    """On Linux, have the kernel send `sig` (SIGKILL by default) to this process as soon as
    its parent dies (no orphans).

    Each link of a launch does this at start-up: torchrun's agent against the launching
    process (a notebook kernel, pytest), each rank against the agent. Whatever ends the
    launcher, even a SIGKILL that runs no `finally`, then ends the agent, and the agent's
    death ends the ranks. If the parent died before the prctl call took effect, our parent
    is no longer `expected_parent` (a pid) and we leave at once.

    PR_SET_PDEATHSIG fires when the *thread* that forked us exits, even if its process lives
    on. That is safe here because each forking thread outlives its children: the launcher's
    thread that starts the agent stays inside torchrun() until the agent has exited and been
    reaped (`_terminate` in a `finally`), and the agent starts and waits for its ranks on its
    main thread.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, sig)
    parent = os.getppid()
    if (parent != int(expected_parent)) if expected_parent else (parent == 1):
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) < 2 or ENV_RUN_DIR not in os.environ:
        sys.exit("zero_lab.launch.rank_side is started by zero_lab.launch.torchrun(), not by hand")
    if sys.argv[1] == "--agent":
        _run_agent(sys.argv[2:])
    else:
        _run_rank(sys.argv[1:])
