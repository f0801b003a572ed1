"""`make setup` twice at once (two `make run` in two terminals on a fresh clone) installs the
venv once: the second make waits on the first's lock, then finds `.installed` current.

The installs are stand-ins (FAKE_PYTHON): a real one takes ~40 s. Nothing here decides by
racing: the first install is held until the second make has printed (`--trace`) that it will
rebuild `.installed`, so without a lock both install, every time; the log's start/end lines
say whether two ever overlapped or ran one after the other."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")

# python3 and, once `-m venv DIR` made it, DIR/bin/python: each install step appends its start
# and end to $FAKE_LOG. `-c` is the Makefile's fcntl lock where flock(1) is missing: the real
# Python runs it. The venv step waits for $FAKE_GO (bounded, so nothing hangs for ever).
FAKE_PYTHON = """#!/bin/sh
case "$1 $2" in
  "-m venv"|"-m pip"|"-m compileall") step=$2;;
  -c*) exec "$REAL_PYTHON" "$@";;
  *) echo "fake python: unexpected arguments: $*" >&2; exit 2;;
esac
echo "start $step" >> "$FAKE_LOG"
if [ "$step" = venv ]; then
  i=0; while [ ! -e "$FAKE_GO" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
fi
echo "end $step" >> "$FAKE_LOG"
"""
ONE_INSTALL = ["start venv", "end venv", "start pip", "end pip", "start compileall",
               "end compileall"]


def _wait_for(done, what: str, shown, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {limit:.0f} s for {what}; so far:\n{shown()}")
        time.sleep(0.05)


def two_setups_at_once(makefile: Path, tmp_path: Path, path: str) -> tuple[list[str], str]:
    """Run `make setup` of `makefile` twice at once in tmp_path (PATH=`path`): the install
    log's lines and both makes' output. Fails if either make fails."""
    shutil.copy(makefile, tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "tiny"\nversion = "0"\n')
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log, go, venv = tmp_path / "install.log", tmp_path / "go", tmp_path / ".venv"
    log.touch()
    # A make of its own: under `make test`, MAKEFLAGS would hand it the outer make's variables.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env |= {"PATH": path, "FAKE_LOG": str(log), "FAKE_GO": str(go),
            "REAL_PYTHON": sys.executable}
    command = [MAKE, "setup", f"PYTHON={fake}", f"VENV={venv}"]
    outs = [tmp_path / "first.out", tmp_path / "second.out"]

    def shown() -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text() if p.exists() else ''}"
                         for p in [log, *outs])

    makes = []
    try:
        with open(outs[0], "w") as first_out:
            makes.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=first_out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        _wait_for(lambda: "start venv" in log.read_text() or makes[0].poll() is not None,
                  "the first make setup to start installing", shown)
        # --trace prints, before a target's recipe runs, why make rebuilds it: once that line
        # is out (or the make ended), the second make has decided; only then may the first
        # install go on and write .installed.
        with open(outs[1], "w") as second_out:
            makes.append(subprocess.Popen([*command, "--trace"], cwd=tmp_path, env=env,
                                          stdout=second_out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        _wait_for(lambda: f"{venv}/.installed" in outs[1].read_text()
                  or makes[1].poll() is not None,
                  "the second make setup to decide whether to install", shown)
        go.touch()
        for make in makes:
            make.wait(timeout=60)
    finally:
        for make in makes:  # each in a group of its own: on a failure, all of it is stopped
            with contextlib.suppress(ProcessLookupError):
                os.killpg(make.pid, signal.SIGKILL)
            make.wait()
    statuses = [make.returncode for make in makes]
    assert statuses == [0, 0], f"make setup exit statuses {statuses}:\n{shown()}"
    assert (venv / ".installed").is_file() and (venv / "bin" / "python").is_file(), shown()
    return log.read_text().splitlines(), shown()


def path_without_flock(tmp_path: Path) -> str:
    """A PATH with only what the setup recipe and FAKE_PYTHON call, and no flock: macOS's case
    (make's own shell is /bin/sh, found without PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "mkdir", "touch", "cp", "sleep"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


@pytest.mark.skipif(MAKE is None, reason="needs make")
@pytest.mark.parametrize("lock", ["flock", "fcntl"])
def test_two_make_setups_at_once_install_once(tmp_path, lock):
    """Mutants: the lock's command left out of the recipe (both install at once, as before it
    existed); the `.installed` check under the lock left out (the second installs again after
    the first); the fcntl fallback's file not kept in a name (`fcntl.flock(open(...))`: freed at
    once, so the lock with it)."""
    if lock == "flock":
        if shutil.which("flock") is None:
            pytest.skip("no flock(1) on this machine; the fcntl case runs its fallback")
        path = os.environ["PATH"]
    else:
        path = path_without_flock(tmp_path)
    work = tmp_path / "clone"
    work.mkdir()
    steps, shown = two_setups_at_once(ROOT / "Makefile", work, path)
    assert steps == ONE_INSTALL, f"not one install, alone:\n{shown}"
    said = (work / "second.out").read_text().splitlines()  # the second says why it did not
    assert f"{work / '.venv'} is current: another make setup installed it meanwhile" in said, shown
