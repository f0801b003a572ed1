"""Learner code without a network: each grading child in a network namespace of its own.

On Linux, `unshare --user --map-root-user --net` starts a process in new user and network
namespaces without privileges (where the kernel allows unprivileged user namespaces, as most
distributions do): the only interface is a loopback of its own, brought up so that an
exercise's ranks can still meet on 127.0.0.1, and nothing outside the namespace can be
reached or listened for. Where that is not possible (macOS, a kernel or container that forbids
user namespaces, no `unshare` or `ip`), the child runs with the host's network, and the
grader's summary says so: `offline_prefix()` returns the reason instead of a prefix.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--"]
# Bring the namespace's own loopback up, then become the child (same pid: its session and
# process group are the ones the grader kills).
LOOPBACK_UP = ["sh", "-c", 'ip link set lo up && exec "$0" "$@"']


@functools.lru_cache(maxsize=1)
def offline_prefix() -> tuple[list[str], str]:
    """(the command prefix that cuts the child off the network, "") where it works, else
    ([], why not). Tried once per process, on a command that needs what the children need."""
    missing = [tool for tool in ("unshare", "ip", "sh") if shutil.which(tool) is None]
    if missing:
        return [], f"{', '.join(missing)} not found"
    try:
        probe = subprocess.run([*UNSHARE, *LOOPBACK_UP, "true"], capture_output=True,
                               timeout=20, text=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"unshare could not run ({exc})"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return [], f"unshare refused a new network namespace here ({last})"
    return [*UNSHARE, *LOOPBACK_UP], ""


def network_note() -> str:
    """One line for the instructor: is learner code cut off the network on this machine?"""
    prefix, why = offline_prefix()
    if prefix:
        return ("Learner code ran without a network: each exercise in a network namespace of "
                "its own, loopback only.")
    return (f"Learner code ran WITH this machine's network ({why}): run the grader in a "
            "container without a network if that matters.")
