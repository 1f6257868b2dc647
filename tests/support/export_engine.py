"""A stand-in engine command for ``coldsnap export`` (``tests/core/test_export_cli.py``): started by the command as
``python export_engine.py MODE ...`` with the environment ``coldsnap export`` gives an engine, it does what one
engine start would, as far as the export sees it. It writes its pid to ``$EXPORT_ENGINE_PID_FILE`` first.

Modes:

* ``serve MODEL PORT``: one real start of the fake engine (``tests/conformance/fake_engine.py``) with the
  ``coldsnap`` load format, so the load policy captures into the artifact and appends its ``captured`` line; then,
  like a server, it answers ``GET /health`` with 200 on ``127.0.0.1:PORT`` until SIGTERM;
* ``exit``: two lines of output, then exit status 3 before any capture;
* ``refuse``: a ``refused`` outcome line for ``worker-0-of-1`` (rule ``observer``), then wait for SIGTERM;
* ``partial``: a ``captured`` line for ``worker-0-of-2`` only, then ignore SIGTERM (only SIGKILL stops it).
"""

from __future__ import annotations

import http.server
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coldsnap_core.errors import ObserverError
from coldsnap_core.outcomes import LoadOutcomeLine, append_outcome
from coldsnap_core.settings import ColdsnapSettings


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format, *args) -> None:
        pass


def _line(outcome: str, worker: str, **fields) -> None:
    settings = ColdsnapSettings.resolve()[0]
    artifact_dir = None if settings.artifact_dir is None else str(settings.artifact_dir)
    append_outcome(settings.outcome_log_path, LoadOutcomeLine(outcome, "vllm", worker, artifact_dir, 0.1, **fields))  # type: ignore[arg-type]


def main(mode: str, *args: str) -> int:
    Path(os.environ["EXPORT_ENGINE_PID_FILE"]).write_text(str(os.getpid()))
    print(
        f"export engine: {mode} with COLDSNAP_EXPORT_MODEL_PAYLOAD={os.environ.get('COLDSNAP_EXPORT_MODEL_PAYLOAD')}", flush=True
    )
    if mode == "serve":
        from tests.conformance import fake_adapter, fake_engine  # noqa: F401 (registers the coldsnap load format)

        fake_engine.start(Path(args[0]), "coldsnap")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        http.server.HTTPServer(("127.0.0.1", int(args[1])), _Health).serve_forever()
    if mode == "exit":
        print("export engine: cannot load the model (a last line of output)", flush=True)
        return 3
    if mode == "refuse":
        _line("refused", "worker-0-of-1", error=ObserverError("the loader's load_weights ran outside load_model"))
    if mode == "partial":
        _line("captured", "worker-0-of-2", pack_sha256="0" * 64)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
