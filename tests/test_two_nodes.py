"""Two "machines" on this one: two torchrun agents, `--nnodes 2 --node-rank 0/1`, meeting by
c10d rendezvous on 127.0.0.1, run stage 3 on 2 x 2 ranks, the command the README's
"Several machines" section gives. The result must be the one-process run's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch

from zero_lab.launch.paths import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "workers" / "two_nodes_case.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stage3_on_two_nodes_of_two_ranks_equals_one_process(tmp_path):
    port, out = _free_port(), tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path),  # torchelastic_*
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(WORKER.parent)])}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", "zero-lab-test",
         "--rdzv-endpoint", f"127.0.0.1:{port}", str(WORKER), "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    try:
        logs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)[-3000:]
    result = json.loads(out.read_text())
    assert (result["world_size"], result["local_world"]) == (4, "2")
    for name, values in result["reference"].items():
        torch.testing.assert_close(torch.tensor(result["final"][name]), torch.tensor(values),
                                   rtol=0, atol=1e-6, msg=name)
