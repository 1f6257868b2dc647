"""What an operator sees of a start (``coldsnap_core.operator_log``, the load policy's lines), on the fake engine of
the conformance suite in this process: the banner, the one ``coldsnap:`` line of a refusal (ERROR) and of a fallback
(WARNING) with its rule and remedy, the termination log, the refusal repeated last by the start's first process, and
the coldsnap load format without an artifact."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap_core import errors, operator_log
from coldsnap_core._version import __version__
from coldsnap_core.artifact.capsules import read_capsule, read_descriptor
from coldsnap_core.cli.main import main
from tests.conformance import fake_adapter, fake_engine
from tests.support.files import flip_byte

REFUSED = "coldsnap: FakeEngine start refused for worker-0-of-1 (COLDSNAP_RESTORE=native: not restored from "


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A fake engine capture: its checkpoint, artifact and state root (read-only; tests copy the state root)."""
    assert fake_adapter.ENGINE  # importing the adapter registers the coldsnap load format
    work = tmp_path_factory.mktemp("operator-lines")
    model = fake_engine.write_checkpoint(work / "checkpoint")
    keys = {"artifact_dir": str(work / "artifact"), "state_root": str(work / "state"), "export_model_payload": "1"}
    fake_engine.start(model, "coldsnap", keys)
    return {"model": model, "artifact": work / "artifact", "state": work / "state"}


def _flipped_state(captured: dict[str, Path], target: Path) -> Path:
    shutil.copytree(captured["state"], target)
    (entry,) = read_descriptor(captured["artifact"]).workers
    extent = read_capsule(captured["artifact"] / entry.capsule).native.model_extents[0]
    flip_byte(target / "model-payloads" / "sha256" / f"{entry.payload.sha256}.pack", extent.pack_offset_bytes)
    return target


def _coldsnap_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.getMessage().startswith("coldsnap")]


def test_a_native_refusal_is_one_error_line_with_rule_and_remedy_also_in_the_termination_log(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pack byte flipped on this node, ``native``: exactly one ERROR ``coldsnap:`` line naming the engine, the
    worker, the artifact, the rule and the remedy (stage the pack again: the corrupt pack is quarantined), and no
    WARNING; the same line is the whole termination log (``termination_log`` pointed at a file
    that exists). Fails if a refusal is only an exception, is logged at another level or twice, lacks its remedy,
    or the termination log is not written."""
    termination = tmp_path / "termination-log"
    termination.write_text("left by an earlier container\n")
    state = _flipped_state(captured, tmp_path / "state")
    keys = {"artifact_dir": str(captured["artifact"]), "state_root": str(state), "restore": "native"}
    with caplog.at_level(logging.INFO), pytest.raises(errors.ColdsnapError) as raised:
        fake_engine.start(captured["model"], "coldsnap", {**keys, "termination_log": str(termination)})
    (line,) = set(_coldsnap_records(caplog, logging.ERROR))
    assert line == f"{REFUSED}{captured['artifact']}): {raised.value}"
    assert f"rule {raised.value.rule} failed" in line and line.count("; remedy: ") == 1
    # the corrupt pack was quarantined, so staging it again is the whole remedy
    assert "; remedy: stage the pack again from the payload store (coldsnap stage ARTIFACT --repo STORE)" in line
    assert _coldsnap_records(caplog, logging.WARNING) == []
    assert termination.read_text() == line + "\n"


def test_no_termination_log_is_created_where_none_exists(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The termination log is written only where it exists (Kubernetes creates it): a refusal on a node without the
    file creates none. Fails if coldsnap creates files at the configured path (``/dev/termination-log`` outside a
    container)."""
    state = _flipped_state(captured, tmp_path / "state")
    keys = {"artifact_dir": str(captured["artifact"]), "state_root": str(state), "restore": "native"}
    with pytest.raises(errors.ColdsnapError):
        fake_engine.start(captured["model"], "coldsnap", {**keys, "termination_log": str(tmp_path / "absent")})
    assert not (tmp_path / "absent").exists()


def test_a_fallback_is_one_warning_naming_the_stage_command_of_this_artifact(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``auto`` on a node whose cache lacks the pack and that names no store: one WARNING ``coldsnap:`` line with
    rule ``payload-available`` and the remedy ``coldsnap stage <this artifact> --repo STORE`` (or
    ``COLDSNAP_PAYLOAD_REPO``), no ERROR. Fails if the remedy is missing or names no artifact."""
    keys = {"artifact_dir": str(captured["artifact"]), "state_root": str(tmp_path / "empty"), "materialize": "off"}
    with caplog.at_level(logging.INFO):
        fake_engine.start(captured["model"], "coldsnap", keys)
    (warning,) = set(_coldsnap_records(caplog, logging.WARNING))
    assert warning.startswith("coldsnap: could not restore worker-0-of-1 from ") and "rule payload-available failed" in warning
    assert warning.endswith(
        f"; remedy: stage the pack on this node: `coldsnap stage {captured['artifact']} --repo STORE`, or set"
        " COLDSNAP_PAYLOAD_REPO to the store that holds it"
    )
    assert _coldsnap_records(caplog, logging.ERROR) == []


def test_each_worker_logs_one_banner_with_the_store_redacted(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker process's first load logs one INFO banner: coldsnap's version, the artifact, the state root, the
    restore mode and the payload store with its password redacted; a second load of the process logs none. Fails if
    the banner is missing, repeated per load, lacks a field, or shows a store secret."""
    monkeypatch.setattr(operator_log, "_bannered", False)  # this test process: a fresh worker
    state = shutil.copytree(captured["state"], tmp_path / "state")
    store = "https://user:hunter2@store.example/payloads"
    keys = {"artifact_dir": str(captured["artifact"]), "state_root": str(state), "payload_dir": store}
    with caplog.at_level(logging.INFO):
        fake_engine.start(captured["model"], "coldsnap", keys)
        fake_engine.start(captured["model"], "coldsnap", keys)
    (banner,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"coldsnap {__version__} active")]
    assert banner == (
        f"coldsnap {__version__} active in FakeEngine: artifact {captured['artifact']}, state root {state},"
        " restore mode auto, store https://***@store.example/payloads"
    )
    assert "hunter2" not in caplog.text


def test_a_restore_logs_its_seconds_and_rate(captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A restore's INFO line gives its seconds and GB/s (the engine's own weight-loading line does not run). Fails if
    the rate goes missing."""
    state = shutil.copytree(captured["state"], tmp_path / "state")
    with caplog.at_level(logging.INFO):
        fake_engine.start(captured["model"], "coldsnap", {"artifact_dir": str(captured["artifact"]), "state_root": str(state)})
    (restored,) = [m for m in _coldsnap_records(caplog, logging.INFO) if m.startswith("coldsnap: restored worker-0-of-1")]
    assert " s, " in restored and " GB/s (" in restored


def test_the_coldsnap_load_format_without_an_artifact_warns_and_counts_as_a_fallback(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The coldsnap load format with no artifact configured: one WARNING naming ``COLDSNAP_ARTIFACT_DIR`` with its
    remedy, the checkpoint serves, and the outcome line is ``fell-back`` with rule ``configuration``, so ``coldsnap
    status --fail-on-fallback`` exits 1. Fails if such a start is silent (an INFO line) or its outcome is
    ``checkpoint``, which the alert does not flag."""
    state = tmp_path / "state"
    with caplog.at_level(logging.INFO):
        fake_engine.start(captured["model"], "coldsnap", {"state_root": str(state)})
    (warning,) = set(_coldsnap_records(caplog, logging.WARNING))
    assert "rule configuration failed: FakeEngine runs the coldsnap load format without an artifact" in warning
    assert "COLDSNAP_ARTIFACT_DIR is not set" in warning and "; remedy: set COLDSNAP_ARTIFACT_DIR" in warning
    log = state / "load-outcomes.jsonl"
    assert main(["status", "--outcome-log", str(log), "--fail-on-fallback"]) == 1
    assert main(["status", "--outcome-log", str(log)]) == 0


def _outcome_lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_invalid_settings_are_a_refused_start_with_its_line_termination_log_and_outcome(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``COLDSNAP_RESTORE=native`` without ``COLDSNAP_ARTIFACT_DIR``: the error raised where the loader resolves its
    settings (before any load) is a refused start like the others: no banner, one ERROR ``coldsnap:`` line naming
    the engine, the worker, rule ``configuration`` and one remedy, the same line in the termination log, and one
    outcome line ``refused`` with that rule. Fails if a settings error stays a bare exception (no line, no
    termination log, no outcome line: the start's failure invisible to ``coldsnap status`` and Kubernetes)."""
    monkeypatch.setattr(operator_log, "_bannered", False)
    termination = tmp_path / "termination-log"
    termination.touch()
    state = tmp_path / "state"
    keys = {"state_root": str(state), "restore": "native", "termination_log": str(termination)}
    with caplog.at_level(logging.INFO), pytest.raises(errors.ConfigurationError) as raised:
        fake_engine.start(captured["model"], "coldsnap", keys)
    line = f"coldsnap: FakeEngine start refused for worker-0-of-1 (its coldsnap settings are invalid): {raised.value}"
    assert _coldsnap_records(caplog, logging.ERROR) == [line]
    assert "rule configuration failed: COLDSNAP_RESTORE=native needs an artifact folder" in line
    assert line.count("; remedy: ") == 1 and "; remedy: set COLDSNAP_ARTIFACT_DIR" in line
    assert " active in FakeEngine" not in caplog.text  # no banner: its settings did not resolve
    assert termination.read_text() == line + "\n"
    (outcome,) = _outcome_lines(state / "load-outcomes.jsonl")
    assert (outcome["engine"], outcome["worker"], outcome["outcome"]) == ("fake-engine", "worker-0-of-1", "refused")
    assert (outcome["error"], outcome["rule"]) == ("ConfigurationError", "configuration")


def test_an_invalid_state_root_is_refused_with_the_default_outcome_log(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The setting that is invalid is the one that says where the outcome log goes (a state root with a NUL): the
    refusal still has its line, and its outcome line goes where the valid settings say (``COLDSNAP_OUTCOME_LOG``).
    Fails if reporting a refusal of invalid settings needs every setting to be valid (it then raised inside the
    report, or reported nothing)."""
    log = tmp_path / "outcomes.jsonl"
    keys = {"state_root": "/bad\0root", "outcome_log": str(log)}
    with caplog.at_level(logging.INFO), pytest.raises(errors.ConfigurationError, match="NUL"):
        fake_engine.start(captured["model"], "coldsnap", keys)
    (line,) = _coldsnap_records(caplog, logging.ERROR)
    assert line.startswith("coldsnap: FakeEngine start refused for worker-0-of-1 (its coldsnap settings are invalid)")
    assert [o["rule"] for o in _outcome_lines(log)] == ["configuration"]


def test_a_weight_free_model_folder_without_an_artifact_is_refused_with_one_remedy(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``auto`` (the default) without ``COLDSNAP_ARTIFACT_DIR`` on a model folder without weight files (what
    ``coldsnap pull`` writes): the start is refused before the engine's checkpoint load, with
    ``CheckpointAbsentError``, one ERROR ``coldsnap:`` line whose one remedy is to set ``COLDSNAP_ARTIFACT_DIR`` to
    the pulled artifact folder, no WARNING, and an outcome line ``refused``, rule ``configuration``, checkpoint
    absent. Fails if such a start warns and lets the engine fail with its own "no model weights" error (no outcome
    line, a remedy buried in a WARNING above a traceback)."""
    model = tmp_path / "pulled" / "model"
    model.mkdir(parents=True)
    shutil.copy(captured["model"] / "config.json", model)
    state = tmp_path / "state"
    with caplog.at_level(logging.INFO), pytest.raises(errors.CheckpointAbsentError) as raised:
        fake_engine.start(model, "coldsnap", {"state_root": str(state)})
    assert isinstance(raised.value.__cause__, errors.ConfigurationError)
    (line,) = _coldsnap_records(caplog, logging.ERROR)
    assert line.startswith(
        "coldsnap: FakeEngine start refused for worker-0-of-1 (COLDSNAP_RESTORE=auto: no artifact configured, and no"
        " checkpoint on this node to load instead): rule configuration failed: "
    )
    assert line.count("; remedy: ") == 1
    assert line.endswith(f"; remedy: set COLDSNAP_ARTIFACT_DIR to the pulled artifact folder (the one that holds {model})")
    assert _coldsnap_records(caplog, logging.WARNING) == []
    (outcome,) = _outcome_lines(state / "load-outcomes.jsonl")
    assert (outcome["outcome"], outcome["rule"], outcome["checkpoint"]) == ("refused", "configuration", "absent")


def test_the_first_process_of_a_start_repeats_a_childs_refusal_last(tmp_path: Path) -> None:
    """A start's first process (vLLM's API server) installs the last words, a grandchild (a worker) refuses, then the
    first process prints its own traceback and exits 1: its last stderr line is the worker's refusal line, once; the
    file is removed. Fails if the refusal stays buried above the engine's traceback, or is said twice."""
    child = (
        "import logging, subprocess, sys; from pathlib import Path;"
        " from coldsnap_core.operator_log import refuse; from coldsnap_core.settings import ColdsnapSettings;"
        f" s = ColdsnapSettings(termination_log=Path({str(tmp_path / 'none')!r}));"
        " refuse('coldsnap: X start refused for worker-0-of-1: rule r failed: why; remedy: do', s, logging.getLogger('w'))"
    )
    worker = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    first = (
        "import subprocess, sys, os; from coldsnap_core.operator_log import install_last_words, LAST_WORDS_ENV;"
        " install_last_words(); install_last_words(); print(os.environ[LAST_WORDS_ENV].partition(':')[2]);"
        f" subprocess.run([sys.executable, '-c', {worker!r}], check=True);"
        " raise RuntimeError('Engine core initialization failed')"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != operator_log.LAST_WORDS_ENV}
    result = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-2] == "RuntimeError: Engine core initialization failed", result.stderr
    assert lines[-1] == "coldsnap: X start refused for worker-0-of-1: rule r failed: why; remedy: do"
    assert not Path(result.stdout.strip()).exists()


def test_a_refusal_is_said_again_right_after_the_engines_own_traceback_of_it(tmp_path: Path) -> None:
    """SGLang's scheduler logs "Scheduler hit an exception: <traceback>" after the refusal, then its launcher kills
    the process tree (no exit hook runs): the refusing process says the line once more right after the engine's
    ERROR record that quotes the refusal's exception, once, and not after an unrelated ERROR. Fails if the line
    stays only above the traceback, is repeated on any ERROR record, or more than once."""
    line = "coldsnap: X start refused for worker-0-of-1: rule r failed: why it failed; remedy: do"
    script = (
        "import logging; from pathlib import Path; from coldsnap_core.operator_log import refuse;"
        " from coldsnap_core.settings import ColdsnapSettings;"
        " logging.basicConfig(format='%(name)s|%(message)s', level=logging.INFO);"
        f" s = ColdsnapSettings(termination_log=Path({str(tmp_path / 'none')!r}));"
        f" refuse({line!r}, s, logging.getLogger('coldsnap.policy'), cause='rule r failed: why it failed');"
        " engine = logging.getLogger('sglang.srt.managers.scheduler');"
        " engine.error('a detokenizer warning unrelated to it');"
        " engine.error('Scheduler hit an exception: Traceback ... ColdsnapError: rule r failed: why it failed');"
        " engine.error('Received sigquit from a child process.'); engine.error('rule r failed: why it failed')"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stderr.splitlines() == [
        f"coldsnap.policy|{line}",
        "sglang.srt.managers.scheduler|a detokenizer warning unrelated to it",
        "sglang.srt.managers.scheduler|Scheduler hit an exception: Traceback ... ColdsnapError: rule r failed: why it failed",
        f"coldsnap.policy|{line}",
        "sglang.srt.managers.scheduler|Received sigquit from a child process.",
        "sglang.srt.managers.scheduler|rule r failed: why it failed",
    ]


@pytest.mark.parametrize(
    ("error", "remedy"),
    [
        (errors.TargetMismatchError, "export the artifact on this target (`coldsnap export`), or capture a target-local"),
        (errors.EngineVersionError, "install an engine version this coldsnap supports"),
        (errors.ModelIdentityMismatchError, "serve the model (checkpoint, revision, engine flags) the artifact was"),
        (errors.LayoutMismatchError, "with the flags it was captured with (--model, --dtype, --tensor-parallel-size)"),
        (errors.PayloadUnavailableError, "stage the pack on this node (`coldsnap stage ARTIFACT --repo STORE`)"),
        (errors.CapsulePinMismatchError, "pull it again (coldsnap pull REF DIR)"),
        (errors.ManifestSchemaError, "pull the artifact again (`coldsnap pull REF DIR`) or export it again"),
        (errors.ResidualDigestMismatchError, "pull the artifact again"),
        (errors.StoreError, "check the store reference (its scheme, bucket and prefix)"),
        (errors.LockTimeoutError, "raise COLDSNAP_LOCK_TIMEOUT"),
    ],
)
def test_the_commonest_rules_name_one_remedy(error: type[errors.ColdsnapError], remedy: str) -> None:
    """Each of the commonest refusals and fallbacks ends its message with one remedy in the operator's terms (a
    command, an engine flag, a setting) where its raise site knows no better one. Fails if a rule loses its remedy."""
    message = str(error("what was found", file="/f"))
    assert message.count("; remedy: ") == 1 and remedy in message.split("; remedy: ")[1], message
