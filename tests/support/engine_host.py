"""A forking host for engine runs: import the engine once, start every engine in a fresh forked process.

Importing vLLM takes about 10 s here and SGLang about 20 s, most of a 2-layer engine run. The host is a
process of the engine's own virtual environment that imports a runner module (``tests/vllm/engine_run.py``,
``tests/sglang/sglang_run.py``) and the engine's heavy modules once (the runner's ``preload()``), then
answers each request by ``os.fork()``: the child sets the request's environment and working folder, sends
its stdout and stderr to the request's log file and calls the runner's ``main(spec, result)``, exactly what
``python RUNNER SPEC RESULT`` would do. Every engine is still its own process: a capture and the restore that
uses it never share memory, and nothing an engine does survives it (the host itself never starts one and
runs no tensor operation, so the fork copies no engine state and no thread pool).

The child leads its own process group; a run that outlives its timeout is killed with that group (the
engine's worker and scheduler processes included) and answered with returncode ``-9``.

Protocol (one JSON object per line): the client writes ``{"spec", "result", "log", "cwd", "env",
"timeout_s"}`` to the host's stdin; the host answers ``{"returncode": N}`` on its stdout, or ``{"error":
TEXT}`` when it could not start the run. The host's own messages go to stderr.

Usage (host side): ``python tests/support/engine_host.py RUNNER.py``. Client side: :class:`EngineHost`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path


class EngineHost:
    """The client of one host process (started on first use, restarted if it died).

    Args:
        python: the engine virtual environment's Python.
        runner: the runner module's path (it defines ``preload()`` and ``main(spec_path, result_path)``).
        env: the host's environment (what every run starts from before its own ``env``).
        stderr_path: where the host's own messages go.
    """

    def __init__(self, python: Path, runner: Path, env: dict[str, str], stderr_path: Path) -> None:
        self._command = [str(python), str(Path(__file__).resolve()), str(runner)]
        self._env = env
        self._stderr_path = stderr_path
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _ensure_started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._stderr_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._stderr_path, "ab") as stderr:
                self._process = subprocess.Popen(
                    self._command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    env=self._env,
                    text=True,
                    bufsize=1,
                )
        return self._process

    def run(self, spec: Path, result: Path, log: Path, cwd: Path, env: dict[str, str], timeout_s: float) -> int:
        """Run the runner's ``main(spec, result)`` in a fresh forked process with exactly ``env`` as its
        environment and ``cwd`` as its working folder, its output in ``log``; return its exit status
        (``-9`` when it was killed after ``timeout_s`` seconds). Raises ``RuntimeError`` with the host's
        messages when the host died or refused the request."""
        with self._lock:
            process = self._ensure_started()
            request = {"spec": str(spec), "result": str(result), "log": str(log), "cwd": str(cwd), "env": env}
            request["timeout_s"] = timeout_s
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                line = process.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                process.wait(timeout=60)
                raise RuntimeError(f"the engine host {self._command} exited with {process.returncode}:\n{self._host_messages()}")
            answer = json.loads(line)
            if "error" in answer:
                raise RuntimeError(f"the engine host could not start a run: {answer['error']}")
            return int(answer["returncode"])

    def _host_messages(self) -> str:
        try:
            return self._stderr_path.read_text()[-6000:]
        except OSError:
            return ""

    def close(self) -> None:
        """End the host (it exits at the end of its input)."""
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def _load_runner(path: str):
    spec = importlib.util.spec_from_file_location("coldsnap_engine_runner", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _child(runner, request: dict) -> int:
    """In the forked child: become the run (its own process group, environment, folder and output)."""
    os.setpgid(0, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the host may have cached its own TMPDIR; the run has its own
    try:
        return int(runner.main(request["spec"], request["result"]) or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1


def _wait(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.05)


def serve(runner_path: str) -> int:
    """The host's loop; returns in the forked child with the run's exit status (the caller exits with it,
    so the child's interpreter shuts down normally: the engine's ``atexit`` handlers run)."""
    runner = _load_runner(runner_path)
    started = time.perf_counter()
    runner.preload()
    print(f"engine host: {runner_path} preloaded in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            print(json.dumps({"error": f"fork failed: {exc}"}), flush=True)
            continue
        if pid == 0:
            return _child(runner, request)
        returncode = _wait(pid, float(request["timeout_s"]))
        print(json.dumps({"returncode": returncode}), flush=True)
    return 0


if __name__ == "__main__":  # engines that spawn processes re-import this file as __mp_main__
    sys.exit(serve(sys.argv[1]))
