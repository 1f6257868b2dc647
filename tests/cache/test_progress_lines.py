"""Progress off a terminal: plain lines with the bytes, the rate in GB/s and the ETA (``coldsnap_core._progress``),
from the commands that move or hash bytes (``stage``, ``publish-native``, ``verify``, ``cache verify``) on stderr and
from every fetch (a restore's too) in the log at INFO."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from coldsnap_core._progress import ProgressLines, progress_line
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli.main import main
from coldsnap_core.restore.staging import stage_payload
from coldsnap_core.stores.local import LocalFolderStore

LINE = re.compile(
    r"^(?P<desc>.+): [0-9.]+[kMGT]?B(?: of [0-9.]+[kMGT]?B \(\d+%\))?, (?:[0-9.]+|\?) GB/s, (?:ETA \S+|done in \S+)$"
)


def test_a_line_names_bytes_rate_and_eta() -> None:
    """The line's fields (decimal units, GB/s with three decimals, ETA from the rate, ``done in`` at the end,
    ``stopped after`` short of the total). Fails if a field goes or its unit changes."""
    assert progress_line("stage ab", 1.31e9, 2.62e9, 0.854e9, final=False, elapsed_s=1.5) == (
        "stage ab: 1.31GB of 2.62GB (50%), 0.854 GB/s, ETA 00:01"
    )
    assert progress_line("stage ab", 2.62e9, 2.62e9, 0.861e9, final=True, elapsed_s=3.04) == (
        "stage ab: 2.62GB of 2.62GB (100%), 0.861 GB/s, done in 00:03"
    )
    assert (
        progress_line("x", 5e8, 2e9, 1e9, final=True, elapsed_s=61) == "x: 500MB of 2.00GB (25%), 1.000 GB/s, stopped after 01:01"
    )
    assert progress_line("x", 0, 2e9, None, final=False, elapsed_s=0) == "x: 0.00B of 2.00GB (0%), ? GB/s, ETA ?"


def test_lines_come_at_the_interval_not_per_update() -> None:
    """With a long interval a progress writes its first and its last line only, however many updates; with none,
    one per update. Fails if every update writes a line (a log flooded per 64 MiB chunk) or none comes between."""
    for interval_s, expected in ((3600.0, 2), (0.0, 2 + 100)):
        lines: list[str] = []
        with ProgressLines("hash", 100 << 20, lines.append, interval_s=interval_s) as progress:
            for _ in range(100):
                progress.update(1 << 20)
        assert len(lines) == expected, lines
        assert lines[0].startswith("hash: 0.00B of 105MB (0%)") and lines[-1].endswith(
            tuple(f"done in 00:0{i}" for i in range(10))
        )
        assert all(LINE.match(line) for line in lines), lines


def _stderr_lines(text: str) -> list[str]:
    assert "\r" not in text  # a bar redrawn in place is one endless line in a log
    return [line for line in text.splitlines() if LINE.match(line)]


def test_commands_print_progress_lines_off_a_terminal(captured, tmp_path: Path, capsys) -> None:
    """``publish-native``, ``stage``, ``verify`` and ``cache verify`` with stderr not a terminal (a pipe, a log): at
    least a first and a last line per pack, each with bytes, GB/s and the ETA or the time taken, and no carriage
    return. Fails if progress is left out off a terminal again, or drawn as a bar there."""
    artifact, pack = captured.artifact_dir, captured.pack
    store, node = tmp_path / "store", tmp_path / "node"
    digest = pack.sha256[:12]
    runs = [
        (
            {f"verify {digest}", f"upload {digest}"},
            ["publish-native", artifact, "--repo", store, "--state-root", captured.capture_root],
        ),
        ({f"stage {digest} (fetch and hash)"}, ["stage", artifact, "--repo", store, "--state-root", node]),
        ({f"verify {digest}"}, ["verify", artifact, "--state-root", node]),
    ]
    for descs, args in runs:
        assert main([str(a) for a in args]) == 0
        lines = _stderr_lines(capsys.readouterr().err)
        assert len(lines) >= 2 * len(descs) and {LINE.match(line)["desc"] for line in lines} == descs, (descs, lines)
        assert "done in" in lines[-1]
    assert main(["cache", "verify", "--full", "--state-root", str(node)]) == 0
    lines = _stderr_lines(capsys.readouterr().err)
    assert lines[-1].startswith(f"verify {digest}: {pack.size_bytes / 1e6:.2f}MB of") and "done in" in lines[-1]


def test_a_fetch_logs_progress_lines_at_info(captured, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A fetch from a store (what ``stage`` and a restore that misses the cache run) logs progress lines at INFO
    naming the pack and the store: a first one, and a last one with the rate and the time taken. Fails if a restore's
    fetch (no progress callback of its own) is silent until it ends."""
    store = LocalFolderStore(tmp_path / "store")
    pack = captured.pack
    store.upload(captured.pack_path, pack.sha256, pack.size_bytes)
    with caplog.at_level(logging.INFO, logger="coldsnap_core.restore.staging"):
        stage_payload(pack, cache=PayloadCache(tmp_path / "node"), store=store)
    lines = [r.getMessage() for r in caplog.records if LINE.match(r.getMessage())]
    desc = f"coldsnap: fetching pack {pack.sha256} from {store.name}"
    assert len(lines) >= 2 and all(line.startswith(desc) for line in lines), lines
    assert lines[0].startswith(f"{desc}: 0.00B of") and " GB/s, done in " in lines[-1]


def test_a_progress_never_updated_writes_no_line(captured, tmp_path: Path, capsys) -> None:
    """Work that finds nothing to do (``cache verify`` of a pack with a trusted validation record) shows no progress:
    no ``0%`` line then a ``stopped after`` one before its ``ok``. A progress updated once writes its first line
    (0 bytes) then its last. Fails if a progress writes its first line when it is made rather than when work starts."""
    lines: list[str] = []
    with ProgressLines("hash", 100, lines.append, interval_s=3600.0):
        pass
    assert lines == []
    with ProgressLines("hash", 100, lines.append, interval_s=3600.0) as progress:
        progress.update(100)
    assert [line.split(": ")[1].split(",")[0] for line in lines] == ["0.00B of 100B (0%)", "100B of 100B (100%)"]
    pack = captured.pack
    assert main(["cache", "verify", "--state-root", str(captured.capture_root)]) == 0
    err = capsys.readouterr()
    assert f"ok {pack.sha256} (trusted validation record)" in err.out
    assert _stderr_lines(err.err) == []


def test_a_fetch_counts_each_byte_once(captured, tmp_path: Path, capsys) -> None:
    """A pack fetched from a store and hashed as it lands reports each byte once to the progress, so ``stage``'s last
    line says the pack's size of the pack's size (100%) and its GB/s is the pack's rate. Fails if the bytes written
    and the bytes hashed are both counted (the rate shown doubled, over a total of twice the pack)."""
    store = LocalFolderStore(tmp_path / "store")
    pack = captured.pack
    store.upload(captured.pack_path, pack.sha256, pack.size_bytes)
    reported: list[int] = []
    stage_payload(pack, cache=PayloadCache(tmp_path / "node"), store=store, progress=reported.append)
    assert sum(reported) == pack.size_bytes
    assert (
        main(["stage", str(captured.artifact_dir), "--repo", str(tmp_path / "store"), "--state-root", str(tmp_path / "b")]) == 0
    )
    last = _stderr_lines(capsys.readouterr().err)[-1]
    size = f"{pack.size_bytes / 1e6:.2f}MB"
    assert last.startswith(f"stage {pack.sha256[:12]} (fetch and hash): {size} of {size} (100%), "), last
