"""Console-script runs without paying their imports each time: a server imports the modules a
command needs (torch: 2.5-3.5 s of CPU in a fresh interpreter) once, then forks a fresh
process for each command, which runs the script itself (``runpy``, as ``__main__``) with its
own arguments, working folder, stdout and stderr, and exits with the status the script exits
with (its threads joined and its ``atexit`` functions run, the modules not torn down).

What a command does is unchanged: only the interpreter's start and those imports are shared.
The server forks from its main thread before any command runs, so no thread or lock is copied
half-taken; it must not be used for code whose import starts threads.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ForkServer"]

_SERVER = textwrap.dedent(
    """
    import atexit, importlib, json, os, runpy, sys, threading

    for name in sys.argv[1:]:
        importlib.import_module(name)

    def command(request):
        os.setsid()  # its own session: on a timeout it is killed with whatever it started
        os.chdir(request["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        os.dup2(os.open(request["stdout"], flags), 1)
        os.dup2(os.open(request["stderr"], flags), 2)
        sys.argv = [request["script"], *request["args"]]
        code = 0
        try:
            runpy.run_path(request["script"], run_name="__main__")
        except SystemExit as exc:  # the script's exit, as the interpreter reads it
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        # An interpreter's exit (Py_FinalizeEx), less tearing down the modules (with torch
        # loaded, about 1 s of CPU a command; nothing a command writes depends on it): the
        # threads' shutdown (thread pools first, then the other threads joined), then atexit.
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    for line in sys.stdin:
        request = json.loads(line)
        if "script" in request:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                command(request)
            print(json.dumps({"pid": pid}), flush=True)
        else:
            _, status = os.waitpid(request["pid"], 0)
            print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
    """
)


class ForkServer:
    """Runs scripts as processes forked from one that imported ``preload`` (started here).

    Args:
        preload: the modules to import once.
        env: the environment of the server, hence of every command.
    """

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(env),
            text=True,
        )

    def _ask(self, request: dict[str, object], timeout: float | None) -> dict[str, int] | None:
        assert self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        if not ready:
            return None
        reply = self.server.stdout.readline()
        assert reply, f"the fork server ended: exit {self.server.wait(timeout=60)}"
        answer: dict[str, int] = json.loads(reply)
        return answer

    def run(
        self, script: str, args: Sequence[str], *, cwd: Path, folder: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run ``script args`` to its end, its output in ``folder``: like ``subprocess.run``
        with ``capture_output=True, text=True``; an AssertionError after ``timeout`` s."""
        number = len(list(folder.glob("*.out")))
        out, err = folder / f"{number}.out", folder / f"{number}.err"
        request = {"script": script, "args": list(args), "cwd": str(cwd)}
        started = self._ask({**request, "stdout": str(out), "stderr": str(err)}, 60)
        assert started is not None, "the fork server did not start the command in 60 s"
        pid = started["pid"]
        ended = self._ask({"pid": pid}, timeout)
        if ended is None:  # its session, workers included, goes down with it
            os.killpg(pid, signal.SIGKILL)
            assert self.server.stdout is not None
            self.server.stdout.readline()  # the wait's answer, now that it ended
        assert ended is not None, f"{script} {' '.join(args)} did not end in {timeout} s"
        returncode = ended["returncode"]
        return subprocess.CompletedProcess(
            [script, *args], returncode, out.read_text(), err.read_text()
        )

    def close(self) -> None:
        """End the server (it has no command left running)."""
        assert self.server.stdin is not None
        self.server.stdin.close()
        self.server.wait(timeout=60)
