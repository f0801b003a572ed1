"""A throwaway JupyterLab server for tests/test_browser.py, and proof that it left nothing.

Set up the way Galata (JupyterLab's own Playwright harness, `jupyterlab.galata`) sets up its
server: a generated config, a free loopback port, a fresh workspace, and settings of its own,
so no layout is restored and nothing is read from or written to the user's home. Unlike
Galata the server keeps a token: the page is opened with it, as a learner's is.

Every process the server starts (kernels, and the torchrun agents and ranks a kernel launches
in sessions of their own) inherits one environment marker, so the check at the end finds each
of them whatever its parent became; tests/test_launch.py uses the same trick.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

MARKER_VAR = "ZERO_LAB_BROWSER_TEST"

# What the learner sees in a fresh JupyterLab, minus what makes a test flaky or slow:
# no autosave (running notebooks/ in the page must not write outputs into the committed,
# stripped notebooks), no news prompt over the notebook, every cell attached to the DOM
# (the default windowing can leave off-screen cells unrendered).
USER_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                     "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}

CONFIG = """\
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.port = {port}
c.ServerApp.port_retries = 0
c.ServerApp.open_browser = False
c.ServerApp.allow_root = True
c.ServerApp.root_dir = {root!r}
c.ServerApp.terminals_enabled = False
c.IdentityProvider.token = {token!r}
c.LabApp.news_url = None
c.LabApp.workspaces_dir = {workspaces!r}
c.LabApp.user_settings_dir = {settings!r}
"""


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it; never a fixed port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """`jupyter lab` from this interpreter's environment, rooted at `root`, on a free port."""

    def __init__(self, root: Path, scratch: Path, log: Path):
        self.root, self.scratch, self.log_path = root, scratch, log
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.marker = uuid.uuid4().hex
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ start and talk

    def start(self, timeout: float = 60.0) -> None:
        dirs = {name: self.scratch / name for name in
                ("config", "data", "runtime", "ipython", "workspaces", "settings")}
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        for plugin, values in USER_SETTINGS.items():
            target = dirs["settings"] / f"{plugin}.jupyterlab-settings"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(values))
        config = dirs["config"] / "jupyter_server_config.py"
        config.write_text(CONFIG.format(port=self.port, root=str(self.root), token=self.token,
                                        workspaces=str(dirs["workspaces"]),
                                        settings=str(dirs["settings"])))
        env = dict(os.environ)
        env.update({
            # Temp Jupyter and IPython homes: nothing from ~/.jupyter or ~/.ipython is read,
            # nothing is written there. Kernel specs and lab extensions still come from the
            # environment's share/jupyter, where pip installed them.
            "JUPYTER_CONFIG_DIR": str(dirs["config"]),
            "JUPYTER_DATA_DIR": str(dirs["data"]),
            "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
            "IPYTHONDIR": str(dirs["ipython"]),
            MARKER_VAR: self.marker,
        })
        self._log = open(self.log_path, "wb")  # closed in stop()
        # `python -m jupyterlab` is `jupyter lab` of the interpreter running pytest (.venv's).
        # A session of its own: the whole group can be signalled at the end.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", f"--config={config}"],
            cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                self.api("GET", "/api/status")
                return
            except OSError:
                time.sleep(0.25)
        raise TimeoutError(f"jupyter lab did not answer within {timeout:.0f} s:\n"
                           + self.log_tail())

    def url(self, path: str) -> str:
        """The lab page for a file under `root`, with the token and a fresh workspace."""
        return f"{self.base}/lab/tree/{path}?reset&token={self.token}"

    def api(self, method: str, path: str, timeout: float = 10.0):
        request = urllib.request.Request(
            self.base + path, method=method,
            headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def kernel_states(self) -> dict[str, str]:
        """{kernel id: execution_state} as the server sees it (idle, busy, starting)."""
        return {k["id"]: k["execution_state"] for k in self.api("GET", "/api/kernels")}

    def shutdown_kernels(self) -> None:
        """End every session and kernel (what closing and shutting down in the UI does)."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    # ------------------------------------------------------------------ stop and check

    def stop(self) -> list[str]:
        """Stop kernels and server; return the command lines of marked processes left over.

        Polite first (REST shutdown of kernels, SIGTERM to the server's group), then SIGKILL.
        Anything still alive after that is killed too, and returned so the caller can fail.
        """
        if self.proc is None:
            return []
        if self.proc.poll() is None:
            try:
                self.shutdown_kernels()
            except OSError:
                pass  # the server is unwell; the signals below still end everything
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
        # Ranks and agents die with their launcher, which takes a moment after the kernel.
        deadline = time.monotonic() + 10
        while (left := marked_processes(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            _kill(pid)
        self.proc = None
        return [f"pid {pid}: {cmd}" for pid, cmd in left.items()]


def marked_processes(marker: str) -> dict[int, str]:
    """{pid: command line} of live processes whose environment holds `marker`."""
    found = {}
    needle = f"{MARKER_VAR}={marker}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "environ").read_bytes():
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                if cmd:  # a zombie has no command line: it is dead, only not yet reaped
                    found[int(proc.name)] = cmd
        except OSError:
            continue
    return found


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
