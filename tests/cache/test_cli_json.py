"""``--json`` on every ``coldsnap`` command: stdout is one JSON document, the result or the error (its rule, message
and exit code), and the exit code is the one the command exits with without ``--json`` (``docs/format.md`` §8)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from cache_support import flip_byte

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli.main import build_parser, main


def _leaf_commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_leaf_commands(sub, (*prefix, name)))
    return found or {prefix: parser}


def test_every_command_takes_json() -> None:
    """Fails naming a command (or ``cache`` action) without ``--json``, e.g. a new command added without it."""
    lacking = [" ".join(c) for c, p in _leaf_commands(build_parser()).items() if "--json" not in p._option_string_actions]
    assert lacking == []
    assert {("stage",), ("cache", "gc"), ("status",)} <= set(_leaf_commands(build_parser()))  # the walk reaches them


def run_json(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, dict[str, object]]:
    """``coldsnap ARGS --json``: the exit code and stdout parsed as exactly one JSON document (``json.loads`` refuses
    anything after it)."""
    code = main([*map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_each_command_prints_one_document(captured, tmp_path: Path, capsys) -> None:
    """Each command's result as JSON, with what its text says. Fails if a command prints its text lines (or
    anything else) on stdout under ``--json``."""
    artifact, root, pack = captured.artifact_dir, captured.capture_root, captured.pack
    code, doc = run_json(capsys, "verify", artifact, "--state-root", root)
    assert code == 0 and doc["verified"] is True and doc["workers"][0]["pack"]["sha256"] == pack.sha256
    store, node = tmp_path / "store", tmp_path / "node"
    code, doc = run_json(capsys, "publish-native", artifact, "--repo", store, "--state-root", root)
    assert code == 0 and doc["payloads"] == [
        {"action": "uploaded", "sha256": pack.sha256, "size_bytes": pack.size_bytes, "owners": [f"{artifact}:worker-0-of-1"]}
    ]
    code, doc = run_json(capsys, "stage", artifact, "--repo", store, "--state-root", node)
    assert code == 0 and doc["workers"] == [
        {"capsule": "worker-0-of-1", "pack": pack.sha256, "path": str(PayloadCache(node).object_path(pack.sha256))}
    ]
    code, doc = run_json(capsys, "cache", "verify", "--state-root", node)
    assert code == 0 and doc["objects"] == [{"digest": pack.sha256, "verified": True, "how": "trusted validation record"}]
    code, doc = run_json(capsys, "cache", "gc", "--state-root", node, "--older-than", "0")
    assert code == 0 and doc["exit_code"] == 0 and doc["removed"]["temporaries"] == []
    for args in (("inspect", artifact), ("status", "--state-root", node), ("cache", "ls", "--state-root", node)):
        assert run_json(capsys, *args)[0] == 0


def test_an_error_is_a_document_with_the_rule_and_the_same_exit_code(captured, tmp_path: Path, capsys) -> None:
    """A failing command under ``--json`` prints ``{"command", "error": {"rule", "message", "exit_code", ...}}`` on
    stdout and nothing on stderr, and exits as without ``--json`` (3 missing, 1 corrupt, 4 usage). Fails if an
    error still goes to stderr as text only, or ``--json`` changes the exit code."""
    missing = tmp_path / "nothing"
    assert main(["stage", str(missing), "--state-root", str(tmp_path)]) == 3
    capsys.readouterr()
    code, doc = run_json(capsys, "stage", missing, "--state-root", tmp_path)
    assert code == 3 and doc["command"] == "stage"
    assert doc["error"]["rule"] == "object-present" and doc["error"]["exit_code"] == 3
    assert doc["error"]["file"] == str(missing / "artifact.json") and str(missing) in doc["error"]["message"]

    flip_byte(captured.pack_path, 100)
    code, doc = run_json(capsys, "cache", "verify", "--full", "--state-root", captured.capture_root)
    assert code == 1 and doc["exit_code"] == 1
    (failed,) = doc["objects"]
    assert failed["verified"] is False and failed["error"]["rule"] == "pack-sha256" and failed["error"]["exit_code"] == 1

    code = main(["cache", "verify", "--json", "--no-such-option"])
    out = capsys.readouterr()
    assert code == 4 and out.err == ""
    assert json.loads(out.out) == {
        "command": "cache verify",
        "error": {"rule": "usage", "message": "unrecognized arguments: --no-such-option", "exit_code": 4},
    }


def test_a_usage_error_without_json_stays_text(capsys) -> None:
    """Without ``--json`` a usage error is argparse's usage and message on stderr, exit 4, nothing on stdout."""
    with pytest.raises(SystemExit) as raised:
        main(["stage"])
    out = capsys.readouterr()
    assert raised.value.code == 4 and out.out == "" and "the following arguments are required: ARTIFACT" in out.err
