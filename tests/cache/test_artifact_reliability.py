"""Artifact folders as operators leave them: a symbolic link at a lock path, folders nobody may read.

Real captures of a real safetensors checkpoint, real ``coldsnap`` subprocesses, a real non-root user
(as root, for whom permissions do not apply, through ``setpriv`` without the two capabilities that
bypass them, ``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH``: a switch to ``nobody`` fails where the
interpreter lives below a folder only root may enter, as a pyenv under ``/root`` does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_support import REPO, capture

from coldsnap_core.errors import UnsafePathError


@pytest.mark.parametrize(
    "lock_name,target",
    [(".artifact.json.lock", "loop"), (".artifact.json.lock", "elsewhere"), ("workers/.worker-0-of-1.lock", "loop")],
)
def test_symlink_at_artifact_lock_crashes_a_capture(tiny_checkpoint: Path, tmp_path: Path, lock_name: str, target: str) -> None:
    """A symbolic link at ``<artifact>/.artifact.json.lock`` (or a capsule's lock) is refused as rule
    no-symlinks naming the link, before anything is written: no capsule, no descriptor, no pack. Fails
    if the capture crashes with a raw OSError (ELOOP) after writing the capsule, or follows the link."""
    artifact, state = tmp_path / "artifact", tmp_path / "state"
    link = artifact / lock_name
    link.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere.lock"
    elsewhere.write_bytes(b"")
    link.symlink_to(link.name if target == "loop" else elsewhere)
    before = sorted(str(p.relative_to(artifact)) for p in artifact.rglob("*"))
    with pytest.raises(UnsafePathError) as raised:
        capture(tiny_checkpoint, artifact, state)
    assert raised.value.rule == "no-symlinks" and raised.value.file == str(link)
    assert sorted(str(p.relative_to(artifact)) for p in artifact.rglob("*")) == before
    assert not (state / "model-payloads" / "sha256").exists() or not any((state / "model-payloads" / "sha256").iterdir())
    assert elsewhere.read_bytes() == b""


def _as_non_root() -> list[str]:
    """The command prefix that runs a child as a user for whom permissions apply."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot run a command as a non-root user")
    # Stay uid 0 (the interpreter and the checkout stay reachable) but drop the capabilities that
    # bypass permission checks, so a mode-0 file owned by root is refused as it is to any user.
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


def _coldsnap(prefix: list[str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "coldsnap_core.cli.main", *args],
        capture_output=True,
        text=True,
        cwd="/",
        env=env,
        timeout=120,
    )


@pytest.fixture
def public_artifact(tiny_checkpoint: Path) -> Iterator[tuple[Path, Path, Path]]:
    """A captured artifact, its state root and a store folder, in a folder any user may enter
    (``tmp_path`` lies below a folder only its owner may enter)."""
    top = Path(tempfile.mkdtemp(prefix="coldsnap-perm-"))
    try:
        os.chmod(top, 0o755)
        artifact, state, store = top / "artifact", top / "state", top / "store"
        capture(tiny_checkpoint, artifact, state)
        for path in [state, *state.rglob("*"), store]:
            path.mkdir(exist_ok=True) if path == store else None
            os.chmod(path, 0o777 if path.is_dir() else 0o644)
        for path in artifact.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.chmod(artifact, 0o755)
        yield artifact, state, store
    finally:
        for path in [top, *top.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                os.chmod(path, 0o700)
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("unreadable", ["folder", "artifact.json"])
def test_unreadable_artifact_folder_is_reported_as_missing(public_artifact: tuple[Path, Path, Path], unreadable: str) -> None:
    """An artifact folder (or its artifact.json) that the user may not read: inspect, verify, stage
    and publish-native all exit 4 (rule io, permission denied) and name the path. Fails if any says
    "no artifact.json here" / exit 3 (what inspect and verify did), or does not name the path."""
    prefix = _as_non_root()
    artifact, state, store = public_artifact
    probe = _coldsnap(prefix, "inspect", str(artifact))
    if probe.returncode != 0:
        pytest.skip(f"the non-root user cannot run coldsnap from this checkout: {probe.stderr[-300:]}")
    denied = artifact if unreadable == "folder" else artifact / "artifact.json"
    os.chmod(denied, 0)
    try:
        for args in (
            ["inspect", str(artifact)],
            ["inspect", str(artifact / "artifact.json")],
            ["verify", str(artifact), "--state-root", str(state)],
            ["stage", str(artifact), "--state-root", str(state)],
            ["publish-native", str(artifact), "--repo", str(store), "--state-root", str(state)],
        ):
            proc = _coldsnap(prefix, *args)
            assert proc.returncode == 4, (args, proc.returncode, proc.stderr)
            assert "Permission denied" in proc.stderr and str(denied) in proc.stderr, (args, proc.stderr)
    finally:
        os.chmod(denied, 0o755)


def test_unreadable_state_root_is_a_permission_error_for_every_cache_command(public_artifact: tuple[Path, Path, Path]) -> None:
    """``cache ls``, ``cache verify`` and ``cache gc`` on a state root the user may not enter exit 4
    naming the unreadable folder. Fails if a permission error reads as an empty cache (exit 0)."""
    prefix = _as_non_root()
    _, state, _ = public_artifact
    probe = _coldsnap(prefix, "cache", "ls", "--state-root", str(state))
    if probe.returncode != 0:
        pytest.skip(f"the non-root user cannot run coldsnap from this checkout: {probe.stderr[-300:]}")
    os.chmod(state, 0)
    try:
        for action in ("ls", "verify", "gc"):
            proc = _coldsnap(prefix, "cache", action, "--state-root", str(state))
            assert proc.returncode == 4, (action, proc.returncode, proc.stderr)
            assert "Permission denied" in proc.stderr and str(state) in proc.stderr, (action, proc.stderr)
    finally:
        os.chmod(state, 0o777)
