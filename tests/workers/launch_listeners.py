"""Per-rank worker for tests/test_launch_safety.py: once the group has run a collective,
rank 0 lists every listening TCP socket held by a process of this launch (torchrun's agent
and everything below it: the ranks) and reports them as [pid, address, port]; then every
rank waits at a barrier, so none of them closes its sockets before the list is made."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from zero_lab.launch import init_worker, report
from zero_lab.launch.rank_side import ENV_AGENT_PID, _descendants

LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's address: IPv4 as one little-endian word, IPv6 as four."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
    import ipaddress

    return str(ipaddress.IPv6Address(b"".join(words)))


def listening_sockets() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in this network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == LISTEN:
                    addr, port = cols[1].split(":")
                    found[int(cols[9])] = (_address(addr), int(port, 16))
    return found


def held_by(pid: int) -> set[int]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


info = init_worker()
value = torch.ones(1)
dist.all_reduce(value)  # the group has connected every pair
if info.rank == 0:
    agent = int(os.environ[ENV_AGENT_PID])
    sockets = listening_sockets()
    listeners = [[pid, *sockets[inode]] for pid in [agent, *_descendants(agent)]
                 for inode in held_by(pid) if inode in sockets]
    report({"listeners": listeners, "processes": 1 + len(_descendants(agent)),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")})
dist.barrier()
