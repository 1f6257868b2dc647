"""Servers the engine tests start as subprocesses (``vllm serve``, ``sglang.launch_server``): a free
loopback port, and a stop that lets the server shut down cleanly before it is killed."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(server: subprocess.Popen, *, grace_seconds: float = 60) -> None:
    """SIGINT (the engines' clean shutdown), then SIGKILL if it has not exited within ``grace_seconds``."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
