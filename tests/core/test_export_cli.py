"""``coldsnap export -- COMMAND`` (its ``main``, in process) on real processes: a stand-in engine command
(``tests/support/export_engine.py``) that starts the fake engine with the ``coldsnap`` load format and serves
``/health``, or exits early, refuses, or captures one worker of two and ignores SIGTERM. The one real-engine export
(``vllm serve``) is the session's second capture (``vllm_two_layer`` in ``tests/conftest.py``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from coldsnap_core.artifact.capsules import read_descriptor
from coldsnap_core.cli import export_cmd
from coldsnap_core.cli.main import main
from tests.conformance import fake_engine
from tests.support.servers import free_port

ENGINE = Path(__file__).resolve().parents[1] / "support" / "export_engine.py"


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node's environment as an export job sets it: the artifact folder and the state root in ``COLDSNAP_*``
    variables; the stand-in engine writes its pid to ``tmp_path / "engine.pid"``."""
    for name in [n for n in os.environ if n.startswith("COLDSNAP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("COLDSNAP_ARTIFACT_DIR", str(tmp_path / "artifact"))
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", str(tmp_path / "state"))
    monkeypatch.setenv("EXPORT_ENGINE_PID_FILE", str(tmp_path / "engine.pid"))
    return tmp_path


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    """``coldsnap export --json ARGS``: (exit code, the JSON document, stderr)."""
    code = main(["export", "--json", *args])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def _stopped(node: Path) -> bool:
    pid = int((node / "engine.pid").read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_export_captures_stops_the_engine_and_verifies(node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The export starts the command with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``, waits for its ``captured`` line and for
    ``--ready-url``, stops it with SIGTERM and exits 0 with the artifact verified and the model's non-weight files
    pinned. Fails if the export flag does not reach the engine, the engine is left running, the artifact is not
    verified, or the model files are not in it."""
    model = fake_engine.write_checkpoint(node / "checkpoint")
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    port = free_port()
    command = [sys.executable, str(ENGINE), "serve", str(model), str(port)]
    code, doc, err = _export(capsys, "--ready-url", f"http://127.0.0.1:{port}/health", "--", *command)
    assert code == 0, doc
    assert "export engine: serve with COLDSNAP_EXPORT_MODEL_PAYLOAD=1" in err  # the engine's output, passed through
    descriptor = read_descriptor(node / "artifact")
    assert [w["capsule"] for w in doc["workers"]] == ["worker-0-of-1"]
    assert doc["distinct_payloads"] == [descriptor.workers[0].payload.sha256]
    assert [f["name"] for f in doc["model_files"]] == ["config.json", "tokenizer.json"]
    assert sorted(p.name for p in (node / "artifact" / "model").iterdir()) == ["config.json", "tokenizer.json"]
    assert doc["engine_returncode"] == 0  # it exited on SIGTERM, as a server does
    assert _stopped(node)


def test_an_engine_that_exits_before_capturing_fails_the_export_with_its_last_lines(
    node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fails if an engine that exits early leaves the export waiting, exits 0, or is not named with its exit status
    and its last line of output."""
    code, doc, _ = _export(capsys, "--timeout", "600", "--", sys.executable, str(ENGINE), "exit")
    assert code == 4 and doc["error"]["rule"] == "export"
    message = doc["error"]["message"]
    assert "the engine exited with 3 before the first worker's capture" in message
    assert "export engine: cannot load the model (a last line of output)" in message


def test_a_refused_worker_fails_the_export_naming_its_rule_and_stops_the_engine(
    node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fails if a ``refused`` outcome line for the artifact is not reported with its rule and detail, or the engine
    is left running."""
    code, doc, _ = _export(capsys, "--timeout", "600", "--", sys.executable, str(ENGINE), "refuse")
    assert code == 4 and doc["error"]["rule"] == "export"
    assert "worker-0-of-1's load was refused, not captured (rule observer: the loader's load_weights" in doc["error"]["message"]
    assert _stopped(node)


def test_a_capture_that_does_not_come_times_out_says_what_it_waits_for_and_kills_the_engine(
    node: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker of two captured, an engine that ignores SIGTERM: the wait names the missing worker while it waits
    and when it times out, and the engine is killed after the grace period. Fails if the world size is not taken
    from the capsule name (the export would end after one worker), no progress line is written, or the engine
    outlives the export."""
    monkeypatch.setattr(export_cmd, "PROGRESS_INTERVAL_SECONDS", 0.0)
    command = [sys.executable, str(ENGINE), "partial"]
    code, doc, err = _export(capsys, "--timeout", "3", "--grace", "0.5", "--", *command)
    assert code == 4 and doc["error"]["rule"] == "export"
    assert "timed out after --timeout 3 s waiting for the capture of worker-1-of-2 (1 of 2 captured)" in doc["error"]["message"]
    assert "coldsnap export: waiting for the capture of worker-1-of-2 (1 of 2 captured)" in err
    assert "did not stop within 0.5 s of SIGTERM; killing it" in err
    assert _stopped(node)


def test_export_without_a_command_or_an_artifact_folder_is_a_configuration_error(
    node: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails if an export starts with nothing to start or nowhere to capture to."""
    code, doc, _ = _export(capsys, "--")
    assert (code, doc["error"]["rule"]) == (4, "configuration") and "needs the engine's command" in doc["error"]["message"]
    monkeypatch.delenv("COLDSNAP_ARTIFACT_DIR")
    code, doc, _ = _export(capsys, "--", sys.executable, str(ENGINE), "exit")
    assert (code, doc["error"]["rule"]) == (4, "configuration") and "COLDSNAP_ARTIFACT_DIR" in doc["error"]["message"]
