"""What a single-machine launch exposes and inherits: where it meets, which interface its
sockets bind, what of the caller's environment reaches the ranks, and a full disk named.

torchrun() (launch.py) starts every launch with these, so nothing a launch starts listens
beyond loopback: the README's section "What a launch exposes" says what each choice closes
and what remains, and tests/test_launch_safety.py lists a running launch's listening sockets.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import warnings
from pathlib import Path

from zero_lab.launch.rank_side import ENV_BACKEND, ENV_LAUNCHER_PID, ENV_RUN_DIR, ENV_STORE

# Variables torchrun reads as its own options (PET_NNODES is --nnodes) or its agent as its
# state: a Kubeflow PyTorchJob pod sets them for a multi-node job, and a single-machine launch
# that inherits them waits for nodes that never come.
_INHERITED_PREFIXES = ("PET_", "TORCHELASTIC_")


def rendezvous_options(run_dir: Path) -> list[str]:
    """torchrun's rendezvous on a file in the run folder, not on a TCP store.

    `--standalone` starts a TCP store that listens on every interface, unauthenticated, for
    the whole launch: anyone on the same Wi-Fi or server could read and write its keys, and
    the agent unpickles the state it reads there. torch's TCPStore has no option to bind one
    address, so the course's single-machine launches use the c10d rendezvous on a FileStore
    in the run folder (mode 0700: this user's only). The agent's second TCP store, shared
    with the ranks, is turned off (TORCH_DISABLE_SHARE_RDZV_TCP_STORE in `child_env`) and
    the ranks meet on a FileStore of their own (rank_side.init_worker reads ENV_STORE).

    `--local-addr` gives the agent its address: without it the rendezvous looks the hostname
    up, which waits ~10 s on a machine whose DNS answers nothing (the agent's other lookups:
    rank_side._no_hostname_lookups).
    """
    return ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={run_dir / 'rendezvous'}",
            "--rdzv-conf=store_type=file", f"--rdzv-id={run_dir.name}",
            "--local-addr=127.0.0.1"]


def loopback_interface() -> str:
    """The loopback interface's name: 'lo' on Linux, 'lo0' on macOS."""
    import socket

    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return "lo0" if sys.platform == "darwin" else "lo"


def child_env(env: dict[str, str] | None, run_dir: Path, backend: str) -> dict[str, str]:
    """The environment of torchrun's agent and, through it, of every rank."""
    environment = dict(os.environ)
    environment.update(env or {})
    inherited = sorted(k for k in environment if k.startswith(_INHERITED_PREFIXES))
    if inherited:
        warnings.warn(f"a single-machine launch ignores the launcher variables it inherited: "
                      f"{', '.join(inherited)} (set for a multi-node job)", stacklevel=3)
        for key in inherited:
            del environment[key]
    environment.setdefault("OMP_NUM_THREADS", "1")  # 1 thread per rank: ranks share the cores
    loopback = loopback_interface()
    environment.update(
        {
            ENV_RUN_DIR: str(run_dir),
            ENV_BACKEND: backend,
            ENV_LAUNCHER_PID: str(os.getpid()),
            ENV_STORE: str(run_dir / "store"),  # the ranks' process-group store: a file
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # no agent TCP store for the ranks
            # gloo binds the address the hostname resolves to (often the Wi-Fi's), NCCL's
            # bootstrap the first interface it likes: on one machine, the loopback for both.
            "GLOO_SOCKET_IFNAME": loopback,
            "NCCL_SOCKET_IFNAME": loopback,
            "PYTHONUNBUFFERED": "1",  # so rank 0's lines reach the cell as they are printed
            # Workers import zero_lab from wherever this process does (e.g. a notebook kernel
            # started beside an uninstalled checkout).
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parents[2]),
                            environment.get("PYTHONPATH", "")) if p
            ),
        }
    )
    return environment


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def disk_note(run_dir: Path) -> str:
    """A line for a failed launch's error when its disk is (nearly) full: a rank that cannot
    write fails with logs that say nothing of the disk."""
    try:
        free = free_bytes(run_dir)
    except OSError:
        return ""
    if free >= 16 * 2**20:
        return ""
    return (f"The disk of {run_dir.parent} has {free // 1024:,} KiB free: it is (nearly) full, "
            f"the likely cause. Free space there, or point TMPDIR at a folder with space.")
