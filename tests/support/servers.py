"""Servers the engine tests start as subprocesses (``vllm serve``, ``sglang.launch_server``): a free
loopback port, a stop that lets the server shut down cleanly before it is killed, and a sample of its ``/metrics``."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, below the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``). Every port a process binds as port 0 (vLLM's ``get_open_port``,
    a registry, another test's server) comes from that range, so none taken between this call and the server's own
    bind can be this one (a port the OS picked here was once taken that way: "Address already in use")."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(10000, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: try another
            return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 between 10000 and {ephemeral_low} after 100 tries")


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
