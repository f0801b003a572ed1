"""Per-rank worker for tests/test_launch_orphans.py: each rank leaves a process behind that
escaped its process group, in one of the two ways real code does, then either finishes or
hangs until the launch's timeout.

    launch_orphan.py PID_DIR finish|hang

- a double fork: the grandchild is orphaned at once (its parent exits);
- a child in a session of its own (`start_new_session=True`, as a daemon is started).
Each writes its pid to PID_DIR/rank{r}-{how}.pid and sleeps for ten minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from zero_lab.launch import init_worker, report

SLEEPER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"


def double_fork(path: str) -> None:
    if os.fork() == 0:  # child: start the grandchild, leave at once
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c", SLEEPER, path])
        os._exit(0)
    os.wait()


def main() -> None:
    info = init_worker()
    pid_dir, then = sys.argv[1], sys.argv[2]
    double_fork(os.path.join(pid_dir, f"rank{info.rank}-double_fork.pid"))
    subprocess.Popen([sys.executable, "-c", SLEEPER,
                      os.path.join(pid_dir, f"rank{info.rank}-session.pid")],
                     start_new_session=True)
    mine = [os.path.join(pid_dir, f"rank{info.rank}-{how}.pid")
            for how in ("double_fork", "session")]
    while not all(os.path.exists(p) for p in mine):
        time.sleep(0.05)  # both pids are on disk before the rank goes on
    if then == "hang":
        time.sleep(600)
    report({"rank": info.rank})


if __name__ == "__main__":
    main()
