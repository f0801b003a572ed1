"""Test worker for tests/test_launch_lifetime.py: records its pid and its parent's (torchrun's
agent) in OUT_DIR/rank{r}.pids, then sleeps until something kills it.

    launch_hang.py OUT_DIR
"""

import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ["RANK"]
tmp = out / f"rank{rank}.tmp"
tmp.write_text(f"{os.getpid()} {os.getppid()}")
tmp.replace(out / f"rank{rank}.pids")  # atomic: the test never reads half a file
while True:
    time.sleep(3600)
