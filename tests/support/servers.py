"""Servers the engine tests start as subprocesses (``vllm serve``, ``sglang.launch_server``): a free
loopback port, a stop that lets the server shut down cleanly before it is killed, and a sample of its ``/metrics``."""

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


def scraped(text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels`` in a server's ``/metrics`` text, read by
    ``prometheus_client``'s parser of the text format (0 when the server has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )
