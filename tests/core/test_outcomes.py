"""The load outcome log (coldsnap_core.outcomes, docs/format.md §10.3) and ``coldsnap status``: the line
format, the failure paths of appending (never fatal, one WARNING), rotation, and the summary."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest

from coldsnap_core import outcomes
from coldsnap_core.cli.main import main
from coldsnap_core.errors import PayloadUnavailableError
from coldsnap_core.outcomes import LoadOutcomeLine, append_outcome, read_outcomes, summarize


def _line(outcome: str = "restored", artifact: str | None = "/a", **kwargs) -> LoadOutcomeLine:
    return LoadOutcomeLine(outcome, "vllm", "worker-0-of-1", artifact, 1.23456, **kwargs)  # type: ignore[arg-type]


FORMAT_DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def documented_outcome_fields() -> list[str]:
    """The field names of the table in docs/format.md §10.3, in its order (a row may name several:
    ``| `host`, `pid` | ...``)."""
    text = FORMAT_DOC.read_text(encoding="utf-8")
    section = text[text.index("### 10.3 ") :]
    section = section[: section.index("\n#", 1)]
    fields = []
    for row in section.splitlines():
        if row.startswith("| `"):
            fields += re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])
    return fields


def test_line_has_exactly_the_documented_fields(tmp_path: Path) -> None:
    """Catches a field added, dropped or renamed without docs/format.md §10.3 (its table is read here):
    the keys, the rounding, the error's class, rule, file and detail cut to 2000 characters."""
    log = tmp_path / "log.jsonl"
    error = PayloadUnavailableError("x" * 3000, file="/cache/p.pack")
    assert append_outcome(log, _line("fell-back", error=error, materialization_started=True))
    (doc,) = [json.loads(line) for line in log.read_text().splitlines()]
    documented = documented_outcome_fields()
    assert len(documented) == len(set(documented)) >= 16, documented
    assert sorted(doc) == sorted(documented)
    assert (doc["format"], doc["format_version"], doc["seconds"]) == ("coldsnap.load-outcome", 1, 1.235)
    assert (doc["error"], doc["rule"], doc["file"]) == ("PayloadUnavailableError", "payload-available", "/cache/p.pack")
    assert len(doc["detail"]) == 2001 and doc["detail"].endswith("…") and doc["materialization_started"] is True
    assert log.stat().st_mode & 0o777 == 0o600


def test_an_unwritable_log_is_one_warning_and_never_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A symbolic link at the log path is refused (``O_NOFOLLOW``) and a folder there cannot be
    appended to: ``append_outcome`` returns False with one WARNING per path, naming it, however many
    loads try. Fails if a load could raise from the log or the warning repeats."""
    target = tmp_path / "elsewhere.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with caplog.at_level(logging.WARNING, logger="coldsnap_core.outcomes"):
        for _ in range(3):
            assert not append_outcome(link, _line())
            assert not append_outcome(folder, _line())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and str(link) in warnings[0] and str(folder) in warnings[1]
    assert not target.exists()


def test_a_log_path_with_a_nul_is_one_warning_and_never_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A NUL in the log's path (no system call takes one): ``append_outcome`` returns False with one WARNING.
    Fails if ``ValueError: embedded null byte`` escapes it (its contract is never to raise for the log)."""
    log = tmp_path / "a\0b.jsonl"
    with caplog.at_level(logging.WARNING, logger="coldsnap_core.outcomes"):
        for _ in range(2):
            assert not append_outcome(log, _line())
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "cannot append to the load outcome log" in warning


def test_a_large_log_is_rotated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the rotation size the log moves to ``<path>.1`` before the next line is appended."""
    monkeypatch.setattr(outcomes, "OUTCOME_LOG_ROTATE_BYTES", 600)
    log = tmp_path / "log.jsonl"
    for _ in range(3):
        append_outcome(log, _line())
    assert len(log.read_text().splitlines()) == 1 and len(Path(f"{log}.1").read_text().splitlines()) == 2


def test_status_summarizes_per_artifact_and_skips_malformed_lines(tmp_path: Path, capsys) -> None:
    """``coldsnap status``: counts per outcome and artifact, the latest failure with its rule, malformed
    lines skipped and counted, ``--fail-on-fallback`` exit 1 only when an artifact's latest load fell
    back; a missing log is exit 0; a log that cannot be read is exit 4 naming it."""
    log = tmp_path / "log.jsonl"
    append_outcome(log, _line("fell-back", "/a", error=PayloadUnavailableError("gone", file="/p")))
    append_outcome(log, _line("restored", "/a"))
    with open(log, "a") as f:
        f.write("not json\n" + json.dumps({"format": "other"}) + "\n")
    append_outcome(log, _line("fell-back", "/b", error=PayloadUnavailableError("gone", file="/q")))
    lines, skipped = read_outcomes(log, 100)
    assert len(lines) == 3 and skipped == 2
    by_artifact = {s.artifact_dir: s for s in summarize(lines)}
    assert by_artifact["/a"].counts["fell-back"] == 1 and by_artifact["/a"].last["outcome"] == "restored"
    assert by_artifact["/a"].last_failure["file"] == "/p"
    assert main(["status", "--outcome-log", str(log)]) == 0
    out = capsys.readouterr().out
    assert "2 malformed line(s) skipped" in out and "/b: 1 fell-back" in out and "rule payload-available, file /q" in out
    assert main(["status", "--outcome-log", str(log), "--fail-on-fallback"]) == 1  # /b's latest load fell back
    capsys.readouterr()
    assert main(["status", "--outcome-log", str(tmp_path / "none.jsonl")]) == 0
    assert "no load outcomes recorded" in capsys.readouterr().out
    assert main(["status", "--outcome-log", str(tmp_path)]) == 4
    assert str(tmp_path) in capsys.readouterr().err


def test_status_reads_the_outcome_log_variable_as_the_settings_do(tmp_path: Path, monkeypatch, capsys) -> None:
    """``coldsnap status`` without ``--outcome-log`` reads ``$COLDSNAP_OUTCOME_LOG`` with the settings'
    rule (``~`` expanded, blank means the state root's log). Fails if the command parses the variable
    itself with another rule, or ignores it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    append_outcome(tmp_path / "elsewhere.jsonl", _line("restored", "/a"))
    monkeypatch.setenv("COLDSNAP_OUTCOME_LOG", "~/elsewhere.jsonl")
    assert main(["status", "--state-root", str(tmp_path / "state"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["outcome_log"] == str(tmp_path / "elsewhere.jsonl") and doc["lines"] == 1
    monkeypatch.setenv("COLDSNAP_OUTCOME_LOG", "  ")
    assert main(["status", "--state-root", str(tmp_path / "state"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outcome_log"] == str(tmp_path / "state" / "load-outcomes.jsonl")


def test_status_fail_on_fallback_refuses_a_log_that_does_not_exist(tmp_path: Path, monkeypatch, capsys) -> None:
    """``status --fail-on-fallback`` (an alert) exits 4 naming the path when the outcome log does not exist, also
    when ``COLDSNAP_OUTCOME_LOG`` points into a folder that does not exist; plain ``status`` still exits 0 and says
    the log does not exist (``docs/format.md`` §10.3). Fails if the alert passes (exit 0) on a log it cannot see:
    a mistyped path would then report "no fallback" for ever."""
    missing = tmp_path / "no-such-folder" / "load-outcomes.jsonl"
    monkeypatch.setenv("COLDSNAP_OUTCOME_LOG", str(missing))
    assert main(["status", "--state-root", str(tmp_path / "state"), "--fail-on-fallback"]) == 4
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist (nor its folder)" in err
    assert main(["status", "--state-root", str(tmp_path / "state")]) == 0
    assert f"outcome log: {missing} (does not exist, nor its folder)" in capsys.readouterr().out
    assert main(["status", "--state-root", str(tmp_path / "state"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exists"] is False
    in_folder = tmp_path / "load-outcomes.jsonl"  # the folder exists, no load recorded yet
    assert main(["status", "--outcome-log", str(in_folder), "--fail-on-fallback"]) == 4
    assert "no load recorded yet" in capsys.readouterr().err
    append_outcome(in_folder, _line("restored", "/a"))
    assert main(["status", "--outcome-log", str(in_folder), "--fail-on-fallback"]) == 0


def test_status_counts_derived_cache_seeds_and_shows_why_one_was_skipped(tmp_path: Path, capsys) -> None:
    """``coldsnap status`` counts each artifact's lines by ``derived_cache`` (``docs/format.md`` §17.4) and
    prints the latest line's seed with the reason it was skipped; ``--json`` has the counts. Fails if the
    field is dropped from the line, the summary or the text."""
    log = tmp_path / "log.jsonl"
    append_outcome(log, _line("restored", "/a", derived_cache="used"))
    append_outcome(log, _line("captured", "/a"))
    append_outcome(log, _line("restored", "/a", derived_cache="skipped", derived_cache_reason="torch_version: captured 2.12"))
    assert main(["status", "--outcome-log", str(log)]) == 0
    out = capsys.readouterr().out
    assert "derived-cache seeds: 1 used, 1 skipped" in out
    assert "derived cache skipped (torch_version: captured 2.12)" in out
    assert main(["status", "--outcome-log", str(log), "--json"]) == 0
    (artifact,) = json.loads(capsys.readouterr().out)["artifacts"]
    assert artifact["derived_cache"] == {"used": 1, "skipped": 1, "absent": 0}


def test_status_fail_on_fallback_refuses_a_log_of_only_malformed_lines(tmp_path: Path, capsys) -> None:
    """``status --fail-on-fallback`` on a log whose lines are all malformed exits 4 naming the log and the count of
    malformed lines (an alert that cannot read any load must not pass); plain ``status`` still exits 0 and reports
    them skipped. Fails if the alert passes (exit 0, the old behaviour) when no line could be read."""
    log = tmp_path / "load-outcomes.jsonl"
    log.write_text('not json\n{"format": "other"}\n[1]\n')
    assert main(["status", "--outcome-log", str(log), "--fail-on-fallback"]) == 4
    err = capsys.readouterr().err
    assert str(log) in err and "3 malformed line(s)" in err and "no readable load outcome" in err
    assert main(["status", "--outcome-log", str(log)]) == 0
    assert "3 malformed line(s) skipped" in capsys.readouterr().out
    append_outcome(log, _line("restored", "/a"))  # one readable load: the alert reads it (exit 0)
    assert main(["status", "--outcome-log", str(log), "--fail-on-fallback"]) == 0


def test_status_says_a_symbolic_link_log_is_not_followed(tmp_path: Path, capsys) -> None:
    """``status --outcome-log link.jsonl`` where the path is a symbolic link exits 4 saying the log is a symbolic
    link and is not followed, naming it. Fails if it shows the bare ``O_NOFOLLOW`` error ("Too many levels of
    symbolic links")."""
    target = tmp_path / "real.jsonl"
    append_outcome(target, _line("restored", "/a"))
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert main(["status", "--outcome-log", str(link)]) == 4
    err = capsys.readouterr().err
    assert "is a symbolic link, which is not followed" in err and str(link) in err
    assert "Too many levels" not in err


@pytest.mark.parametrize("last", ["-1", "0", "abc", "1_0"])
def test_status_refuses_a_count_of_loads_below_one(last: str, tmp_path: Path, capsys) -> None:
    """``status --last N`` takes a whole number >= 1; ``-1`` used to read nothing and say "no load outcomes
    recorded". Fails if any of these is accepted (a usage error: exit 4, naming the option)."""
    with pytest.raises(SystemExit) as raised:
        main(["status", "--outcome-log", str(tmp_path / "log.jsonl"), "--last", last])
    assert raised.value.code == 4
    assert "--last" in capsys.readouterr().err


def test_a_named_pipe_at_the_log_never_blocks_a_load_or_status(tmp_path: Path, capsys, caplog) -> None:
    """A FIFO at ``load-outcomes.jsonl`` (no reader): appending used to block the engine after "restored"
    and ``status`` blocked reading it. Now the append returns False at once with its one WARNING, and
    ``status`` exits 4 naming the log; ``/dev/zero`` is refused the same way instead of read without end.
    Fails if either blocks (the test would hang: run under a 60 s subprocess bound below)."""
    import subprocess
    import sys

    fifo = tmp_path / "load-outcomes.jsonl"
    os.mkfifo(fifo)
    script = (
        "import sys\n"
        "from coldsnap_core.outcomes import LoadOutcomeLine, append_outcome\n"
        "from coldsnap_core.cli.main import main\n"
        "print(append_outcome(sys.argv[1], LoadOutcomeLine('restored', 'vllm', 'worker-0-of-1', '/a', 1.0)))\n"
        "print(main(['status', '--outcome-log', sys.argv[1]]))\n"
        "print(main(['status', '--outcome-log', '/dev/zero']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(fifo)], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "4", "4"], done.stdout + done.stderr
    assert "not a regular file" in done.stderr and str(fifo) in done.stderr and "/dev/zero" in done.stderr


def test_status_reads_a_bounded_tail_of_a_large_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_outcomes`` reads at most ``OUTCOME_LOG_READ_BYTES`` from the end and drops the partial first
    line it lands in. Fails if the whole file is read (a log without rotation could be any size)."""
    log = tmp_path / "log.jsonl"
    for i in range(40):
        assert append_outcome(log, _line("restored", artifact=f"/a{i}"))
    size = log.stat().st_size
    monkeypatch.setattr(outcomes, "OUTCOME_LOG_READ_BYTES", size // 4)
    lines, skipped = read_outcomes(log, 1000)
    assert skipped == 0 and 8 <= len(lines) <= 10
    assert lines[-1]["artifact_dir"] == "/a39"


def test_status_escapes_control_characters_and_counts_only_known_seed_values(tmp_path: Path, capsys) -> None:
    """A line whose ``derived_cache`` is no string is not counted (no crash), and a reason holding terminal escapes
    and a newline is printed escaped on one line. Fails if ``status`` crashes on an unhashable value (the old
    code: TypeError, exit 1, the code of a fallback alert) or writes the escape sequence raw."""
    log = tmp_path / "log.jsonl"
    append_outcome(log, _line("restored", "/a", derived_cache="skipped", derived_cache_reason="x\x1b]0;PWNED\x07\nlast: FAKE"))
    with open(log, "a", encoding="utf-8") as f:
        f.write(json.dumps({**json.loads(log.read_text().splitlines()[0]), "derived_cache": ["used"]}) + "\n")
    assert main(["status", "--outcome-log", str(log)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;PWNED\\x07\\nlast: FAKE" in out
    assert "derived-cache seeds: 1 skipped" in out
