"""The node-local cache and the folder store as operators run them: hung lock holders, killed writers.

Real processes hold real ``filelock`` locks and are killed with SIGKILL; the commands run as real
``coldsnap`` subprocesses.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cache_support import REPO, child_command, run_child, sha256_of, temporaries

from coldsnap_core import settings
from coldsnap_core.cache import locks as cache_module
from coldsnap_core.cache import partials
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.errors import ConfigurationError, LockTimeoutError
from coldsnap_core.stores.local import LocalFolderStore
from tests.support.locks import hold_lock


def _age(path: Path, seconds: float = 60.0) -> None:
    """Backdate ``path``'s mtime past the sweep's grace (partials.SWEEP_GRACE_SECONDS, which protects a
    writer between creating its file and locking it)."""
    assert seconds > partials.SWEEP_GRACE_SECONDS
    when = os.stat(path).st_mtime - seconds
    os.utime(path, (when, when))


def test_a_hung_lock_holder_is_named_while_admission_waits_then_times_out_typed(
    captured, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """A live process holds a pack's lock and never releases it; admission of that pack (which needs
    the lock: no validation record) logs at INFO which lock it waits for, with the holder's pid and
    host, and fails after the timeout with LockTimeoutError naming the lock. Fails if the wait is
    silent, or if it expires into a full verification (or a hang) instead of a typed error."""
    root, digest = captured.capture_root, captured.pack.sha256
    cache = PayloadCache(root, lock_timeout_seconds=1.5)
    os.unlink(cache.record_path(digest))
    monkeypatch.setattr(cache_module, "LOCK_NOTICE_SECONDS", 0.2, raising=False)
    holder = hold_lock(root, digest)
    try:
        with caplog.at_level(logging.INFO, logger="coldsnap_core"), pytest.raises(LockTimeoutError) as raised:
            cache.admit(digest)
        lock_path = str(cache.lock_path(digest))
        assert raised.value.rule == "lock-timeout" and raised.value.exit_code == 4
        assert lock_path in str(raised.value) and "COLDSNAP_LOCK_TIMEOUT" in str(raised.value)
        waiting = [r for r in caplog.records if r.levelno == logging.INFO and "waiting for" in r.getMessage()]
        assert waiting, caplog.text
        assert lock_path in waiting[0].getMessage()
        assert f"pid {holder.pid}" in waiting[0].getMessage() and socket.gethostname() in waiting[0].getMessage()
    finally:
        holder.kill()
        holder.wait()
    assert cache.admit(digest) == cache.object_path(digest)  # the holder is gone: no stale lock remains


def test_hung_lock_holder_stalls_cache_verify_and_stage_for_the_configured_time(captured, tmp_path: Path) -> None:
    """``cache verify`` and ``stage`` under COLDSNAP_LOCK_TIMEOUT=1 with a hung holder: exit 4 within
    the timeout, naming the lock. Fails if COLDSNAP_LOCK_TIMEOUT is ignored (the commands would wait
    600 s: the subprocess timeout catches that)."""
    root, digest = captured.capture_root, captured.pack.sha256
    cache = PayloadCache(root)
    os.unlink(cache.record_path(digest))
    holder = hold_lock(root, digest)
    env = {**os.environ, "COLDSNAP_LOCK_TIMEOUT": "1"}
    try:
        for args in (
            ["cache", "verify", "--state-root", str(root)],
            ["stage", str(captured.artifact_dir), "--state-root", str(root)],
        ):
            proc = subprocess.run(
                [sys.executable, "-m", "coldsnap_core.cli.main", "-v", *args],
                capture_output=True,
                text=True,
                cwd=REPO,
                env=env,
                timeout=60,
            )
            assert proc.returncode == 4, (args, proc.stdout, proc.stderr)
            assert "rule lock-timeout failed" in proc.stderr and str(cache.lock_path(digest)) in proc.stderr
    finally:
        holder.kill()
        holder.wait()


def test_lock_timeout_setting_is_validated() -> None:
    """COLDSNAP_LOCK_TIMEOUT is a number of seconds >= 0; anything else is a ConfigurationError naming
    the variable. Fails if a typo silently means the default."""
    assert PayloadCache("/nonexistent", lock_timeout_seconds=None).lock_timeout_seconds == settings.LOCK_TIMEOUT_SECONDS

    def lock_timeout_from_env(environ: dict[str, str]) -> float:  # as the coldsnap command reads it
        return settings.ColdsnapSettings.resolve(environ, rows=settings.COMMAND_SETTINGS)[0].lock_timeout_s

    assert lock_timeout_from_env({"COLDSNAP_LOCK_TIMEOUT": " 2.5 "}) == 2.5
    assert lock_timeout_from_env({"COLDSNAP_LOCK_TIMEOUT": ""}) == settings.LOCK_TIMEOUT_SECONDS
    for bad in ("ten", "-1", "nan"):
        with pytest.raises(ConfigurationError, match="COLDSNAP_LOCK_TIMEOUT"):
            lock_timeout_from_env({"COLDSNAP_LOCK_TIMEOUT": bad})


def test_killed_capture_partial_survives_until_gc_after_an_hour(captured, tmp_path: Path) -> None:
    """A writer SIGKILLed mid-pack leaves a ``tmp/*.partial``; ``cache ls`` shows it with its writer
    gone, and the next writer of the cache removes it at once (its flock is free), not an hour later.
    Fails if the partial survives the next write (it did until ``cache gc`` after 1 h)."""
    state = tmp_path / "state"
    rc, _, err = run_child(child_command(captured.checkpoint, captured.artifact_dir, state, "--kill-at-byte", "4096"))
    assert rc == -signal.SIGKILL, err
    (partial,) = temporaries(state)
    listing = subprocess.run(
        [sys.executable, "-m", "coldsnap_core.cli.main", "cache", "ls", "--json", "--state-root", str(state)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert listing.returncode == 0, listing.stderr
    assert json.loads(listing.stdout)["debris"] == [{"path": str(partial), "kind": "temporary", "owner": "gone"}]
    _age(partial)
    rc, report, err = run_child(child_command(captured.checkpoint, captured.artifact_dir, state))
    assert rc == 0 and report["ok"], err
    assert temporaries(state) == []
    assert sha256_of(PayloadCache(state).object_path(captured.pack.sha256)) == captured.pack.sha256


def test_killed_publish_native_leaves_a_partial_in_the_folder_store(captured, tmp_path: Path) -> None:
    """An upload to a folder store SIGKILLed mid-copy leaves a full-size ``.partial``; the next upload
    to the store removes it (its uploader is gone) and a live uploader's partial is never touched.
    Fails if a killed upload's partial is never removed."""
    store_root = tmp_path / "store"
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, sys\n"
            "from pathlib import Path\n"
            "from coldsnap_core.stores.local import LocalFolderStore\n"
            "def die(n):\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "LocalFolderStore(sys.argv[1]).upload(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), progress=die)\n",
            str(store_root),
            str(captured.pack_path),
            captured.pack.sha256,
            str(captured.pack.size_bytes),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    tmp_dir = store_root / "model-payloads" / "tmp"
    (dead,) = sorted(tmp_dir.iterdir())
    assert dead.name.endswith(".partial") and dead.stat().st_size == captured.pack.size_bytes
    _age(dead)
    # A live uploader's partial (flock held by a live process) must survive the sweep.
    live = tmp_dir / f"{captured.pack.sha256}.{'0' * 16}.partial"
    live.write_bytes(b"in progress")
    _age(live)  # old, but its uploader's flock is held: only the flock tells a live upload from a dead one
    keeper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n",
            str(live),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert keeper.stdout.readline().strip() == "held"
        store = LocalFolderStore(store_root)
        store.upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
        assert sorted(p.name for p in tmp_dir.iterdir()) == [live.name]
        assert store.has(captured.pack.sha256, captured.pack.size_bytes, verify=True)
    finally:
        keeper.kill()
        keeper.wait()
