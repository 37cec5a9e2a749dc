"""Fresh Python processes without paying for their imports again each time.

A test that runs many short ``python -c``/``python -m``/``python script.py`` children (a
console script is one) spends most of their CPU time importing torch (2-3 s each on a 2-core
CI machine). ``Preloaded`` starts one Python process that imports the heavy modules once and
then forks a child per run: every run is still its own process, in a session of its own, with
its own pid, exit status, stdin (empty), stdout and stderr (files, as a pipe would be: not a
terminal) and shutdown (non-daemon threads joined, ``atexit`` functions run,
output flushed; the teardown of every module is skipped, as multiprocessing's forked children
skip it), and an uncaught exception is printed by ``sys.excepthook`` and exits 1 as at Python's
top level. Only the imports are shared, as a ``fork``-started DataLoader worker shares them; the
server itself starts no work that could hold a lock at the fork.

Use it where what is tested is a run's behaviour and output; keep a plain subprocess where the
process's start (the console script, interpreter flags, signals) is what is tested.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType

__all__ = ["JOB_MODULES", "Preloaded"]

#: What a training job imports before its own code: torch, TensorBoard and accelkit's save path.
#: None of them starts a thread at import (a fork must not copy one); tracker SDKs (wandb,
#: comet_ml, mlflow, swanlab, trackio) do, so a job imports those itself.
JOB_MODULES = (
    "torch",
    "torch._dynamo",
    "torch.utils.tensorboard",
    "accelkit",
    "accelkit.checkpointing.tiered",
)

_SERVER = r"""
import atexit, builtins, gc, json, os, runpy, signal, sys, threading, time
for name in sys.argv[1:]:
    __import__(name)
gc.freeze()  # what was imported: never collected, so a child's collections do not copy it
requests, replies = sys.stdin, os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDONLY)


def _run(job):
    os.dup2(null, 0)
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.setsid()  # its own session: on a timeout it goes down with whatever it started
    os.chdir(job["cwd"])
    argv = job["argv"]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            code = compile(argv[1], "<string>", "exec")
            exec(code, {"__name__": "__main__", "__builtins__": builtins})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # a script's path
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # as Python's top level reports it: without this frame
        frames = exc.__traceback__.tb_next
        sys.excepthook(type(exc), exc.with_traceback(frames), frames)
        code = 1
    # Python's own shutdown, less the teardown of every module: that would write to each
    # object the server imported (reference counts), copying all of its memory, for nothing
    # (multiprocessing's forked children end the same way).
    threading._shutdown()  # non-daemon threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # as Python reports a failed flush at exit
            code = 120
    os._exit(code)


for line in requests:
    job = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        replies.close()
        _run(job)
    deadline = time.monotonic() + job["timeout"]
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline and not timed_out:
            os.killpg(pid, signal.SIGKILL)
            timed_out = True
        time.sleep(0.01)
    reply = {"status": os.waitstatus_to_exitcode(status), "timed_out": timed_out}
    replies.write(json.dumps(reply) + "\n")
    replies.flush()
"""


class Preloaded:
    """A process that imported ``modules`` once; ``run`` forks it for each child.

    ``env`` and ``cwd`` are the server's, hence every child's environment (read at import time
    by the preloaded modules too); a run may give another working folder.
    """

    def __init__(self, modules: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="preloaded-")
        self._count = 0
        self._cwd = str(cwd or Path.cwd())
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, *modules],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=self._cwd,
            text=True,
        )

    def run(
        self, *argv: str, timeout: float = 300, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """``python *argv`` (``-c CODE ...``, ``-m MODULE ...`` or ``SCRIPT ...``) in a forked
        child: its exit code (negative for a signal) and its output as bytes.

        Raises:
            subprocess.TimeoutExpired: the child ran past ``timeout`` s (it was killed, with
                every process it started: each child is a session of its own).
        """
        assert argv and (argv[0] not in ("-c", "-m") or len(argv) > 1), argv
        self._count += 1
        out = Path(self._folder.name) / f"{self._count}.out"
        err = Path(self._folder.name) / f"{self._count}.err"
        job = {
            "argv": list(argv),
            "stdout": str(out),
            "stderr": str(err),
            "cwd": str(cwd) if cwd is not None else self._cwd,
            "timeout": timeout,
        }
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.write(json.dumps(job) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        assert line, f"the preloaded server died (exit {self._server.poll()})"
        reply = json.loads(line)
        stdout, stderr = out.read_bytes(), err.read_bytes()
        out.unlink()
        err.unlink()
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(list(argv), timeout, stdout, stderr)
        return subprocess.CompletedProcess(list(argv), reply["status"], stdout, stderr)

    def close(self) -> None:
        if self._server.stdin is not None:
            self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        self._folder.cleanup()

    def __enter__(self) -> Preloaded:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
