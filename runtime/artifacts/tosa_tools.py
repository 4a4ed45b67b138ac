"""The programs of Arm's tosa-tools (`tosa-opt`, `tosa_reference_model`), run as subprocesses.

The `tosa-tools` wheel is installed apart from the venv, in `.tosa-tools/` of the checkout
(`make tosa-tools`): its top-level Python packages (`generator`, `checker`, `runner`...) would
shadow this project's. Only the programs in its `bin/` are used; they link system libraries only
(their own libraries are static), so they need no `LD_LIBRARY_PATH`. The environment variable
`TORCHTOSA_TOSA_TOOLS` names another installation: a directory with `bin/tosa-opt` in it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ..errors import ToolError

ENV = "TORCHTOSA_TOSA_TOOLS"
VERSION = "2026.8.0"  # the tosa-tools release `make tosa-tools` installs (keep in step with the Makefile)
TIMEOUT = 600.0  # seconds a tool may run


def home() -> Path:
    """The tosa-tools installation: `$TORCHTOSA_TOSA_TOOLS`, else `.tosa-tools` of this checkout."""
    configured = os.environ.get(ENV)
    return Path(configured) if configured else Path(__file__).resolve().parents[2] / ".tosa-tools"


def program(name: str) -> Path:
    """The path of one tool, or ToolError saying how to install tosa-tools."""
    path = home() / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ToolError(f"tosa-tools are not installed: {path} is not an executable. Run `make tosa-tools` in "
                        f"the torchtosa checkout, or set {ENV} to a directory where `pip install --target DIR "
                        f"--no-deps tosa-tools=={VERSION}` put them")
    return path


def run(name: str, args: Sequence[str | os.PathLike[str]], *, check: bool = True,
        timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run tool `name` with `args` (no shell), its output captured as text.

    A tool that can't start, runs past `timeout` seconds or (if `check`) exits with an error
    raises ToolError with the command line and the end of what the tool printed."""
    command = [str(program(name)), *map(str, args)]
    # the reference model otherwise attaches gdb to itself to print a backtrace when it aborts
    env = {**os.environ, "TOSA_MODEL_NO_BACKTRACE": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", env=env,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ToolError(f"{name} did not finish within {timeout:.0f} s: {shlex.join(command)}") from None
    except OSError as err:
        raise ToolError(f"{name} could not run ({err}): {shlex.join(command)}") from None
    if check and done.returncode != 0:
        raise ToolError(failure(done))
    return done


def failure(done: subprocess.CompletedProcess[str]) -> str:
    """What went wrong in a finished tool run: its exit status, command line and output's end."""
    name = Path(done.args[0]).name
    return f"{name} failed ({exit_status(done.returncode)}): {shlex.join(done.args)}\n{tail(done.stderr + done.stdout)}"


def exit_status(code: int) -> str:
    """"exit status 2" or, for a process a signal ended, "killed by SIGABRT"."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def tail(text: str, lines: int = 20) -> str:
    """The last `lines` non-empty lines of a tool's output."""
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:]) if kept else "(it printed nothing)"
