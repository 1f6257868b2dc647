"""Operating-system failures reach callers as typed coldsnap errors, never as bare ``OSError``.

A bare ``OSError`` escapes ``COLDSNAP_RESTORE=auto`` (the loaders fall back on ``ColdsnapError``) and
prints no rule in the CLI. Each test builds the real condition on real files (a file where the state
root should be, a symbolic link loop, a folder where the residual blob or the pack should be) and
names the regression it catches.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cache_support import hydrate_captured

from coldsnap_core.artifact.capsules import read_capsule
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli.main import main
from coldsnap_core.errors import (
    ConfigurationError,
    FileAccessError,
    MissingObjectError,
    NotRegularFileError,
    UnsafePathError,
)
from coldsnap_core.format.verify import verify_blob_file, verify_pack_file
from coldsnap_core.restore.staging import stage_payload
from coldsnap_core.settings import COMMAND_SETTINGS, ColdsnapSettings
from coldsnap_core.stores import artifact_ref
from coldsnap_core.stores.local import LocalFolderStore
from coldsnap_core.stores.publish import publish_native
from tests.support.files import raised_without_blocking


def coldsnap(*args: object) -> int:
    return main([str(a) for a in args])


# --- the state root ------------------------------------------------------------------------------------


def test_state_root_that_is_a_file_is_a_configuration_error(captured, tmp_path: Path) -> None:
    """``COLDSNAP_STATE_ROOT`` naming a regular file: every cache entry point (admission, staging,
    the commit's folders, hydration) raises ConfigurationError naming the state root, where
    ``lstat(<file>/model-payloads)`` used to raise a bare NotADirectoryError that crashed ``auto``."""
    blocker = tmp_path / "f"
    blocker.write_text("x\n")
    cache = PayloadCache(blocker)
    with pytest.raises(ConfigurationError, match="not a folder") as info:
        cache.admit(captured.pack.sha256, captured.pack.size_bytes)
    assert info.value.file == str(blocker)
    with pytest.raises(ConfigurationError):
        stage_payload(captured.pack, cache=cache)
    with pytest.raises(ConfigurationError):
        cache.ensure_dirs()
    with pytest.raises(ConfigurationError):
        hydrate_captured(captured, cache)
    # A path below a file (a component is not a folder) is refused the same way.
    with pytest.raises(ConfigurationError, match="not a usable folder"):
        PayloadCache(blocker / "sub").check_dirs()


def test_state_root_symlink_loop_is_a_configuration_error(captured, tmp_path: Path) -> None:
    """A state root that is a symbolic link loop (ELOOP): ConfigurationError, not a bare OSError."""
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    with pytest.raises(ConfigurationError, match="not a usable folder"):
        PayloadCache(loop).admit(captured.pack.sha256)


def test_cli_state_root_that_is_a_file_exits_4_with_a_rule(captured, tmp_path: Path, capsys) -> None:
    """``coldsnap stage --state-root FILE``: exit 4 and a message naming rule ``configuration``."""
    blocker = tmp_path / "f"
    blocker.write_text("x\n")
    assert coldsnap("stage", captured.artifact_dir, "--state-root", blocker) == 4
    assert "rule configuration failed" in capsys.readouterr().err


@pytest.mark.parametrize("empty", ["", "  "])
def test_empty_state_root_means_the_default_for_option_and_variable(tmp_path: Path, monkeypatch, empty: str) -> None:
    """``--state-root ""`` and ``COLDSNAP_STATE_ROOT=""`` both mean "not given": the variable, then
    ``~/.cache/coldsnap``; never the current folder (``Path("")`` is ``.``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", empty)
    default = tmp_path / "home" / ".cache" / "coldsnap"

    def resolve_state_root(option: str | None) -> Path:  # as the coldsnap command resolves --state-root
        return ColdsnapSettings.resolve(flags={"state_root": option}, rows=COMMAND_SETTINGS)[0].state_root

    assert resolve_state_root(empty) == default
    assert resolve_state_root(None) == default
    assert PayloadCache(empty).state_root == default
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", str(tmp_path / "env"))
    assert resolve_state_root(empty) == tmp_path / "env"


# --- paths inside the cache ------------------------------------------------------------------------------


def test_symlink_loop_in_a_store_path_is_unsafe(captured, tmp_path: Path) -> None:
    """A folder store whose root is a symbolic link loop: looking the object up (``lstat`` through
    the loop, ELOOP) raises UnsafePathError (rule no-symlinks), not a bare OSError."""
    from coldsnap_core.stores.local import LocalFolderStore

    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    with pytest.raises(UnsafePathError, match="not a usable folder"):
        LocalFolderStore(loop).has(captured.pack.sha256, captured.pack.size_bytes)


def test_folder_at_the_object_path_is_not_a_regular_file(captured, tmp_path: Path) -> None:
    """A folder where the pack should be: NotRegularFileError (rule regular-file, exit 4) from
    admission, and the folder is left alone."""
    cache = PayloadCache(tmp_path / "state")
    cache.ensure_dirs()
    cache.object_path(captured.pack.sha256).mkdir()
    with pytest.raises(NotRegularFileError) as info:
        cache.admit(captured.pack.sha256, captured.pack.size_bytes)
    assert info.value.rule == "regular-file" and info.value.exit_code == 4
    assert cache.object_path(captured.pack.sha256).is_dir()


# --- files the verifier reads ------------------------------------------------------------------------------


def test_folder_at_the_blob_path_is_not_reported_as_truncated(captured) -> None:
    """A folder at ``weights.blob``: NotRegularFileError from the verifier and from hydration, where
    ``os.stat`` gave the folder's 4096 bytes and the verifier said ``residual-size`` (truncated, exit 1)."""
    capsule_dir = captured.artifact_dir / "workers" / "worker-0-of-1"
    blob = capsule_dir / "weights.blob"
    residual = read_capsule(capsule_dir).native.residual
    blob.unlink()
    blob.mkdir()
    with pytest.raises(NotRegularFileError, match="residual blob is not a regular file"):
        verify_blob_file(blob, residual)
    with pytest.raises(NotRegularFileError):
        hydrate_captured(captured, PayloadCache(captured.capture_root))


@pytest.mark.parametrize("link", [False, True], ids=["fifo", "link-to-fifo"])
def test_a_named_pipe_at_the_blob_path_is_refused_without_blocking_the_restore(captured, tmp_path: Path, link: bool) -> None:
    """A named pipe at ``weights.blob``, or a symbolic link to one: hydration refuses it at once as not a regular
    file (rule regular-file, exit 4, naming the blob), so ``auto`` falls back. Fails if the blob is opened blocking
    before its type is checked (the restore waited for a writer for ever and wrote no outcome line)."""
    blob = captured.artifact_dir / "workers" / "worker-0-of-1" / "weights.blob"
    fifo = tmp_path / "pipe" if link else blob
    blob.unlink()
    os.mkfifo(fifo)
    if link:
        blob.symlink_to(fifo)
    error = raised_without_blocking(lambda: hydrate_captured(captured, PayloadCache(captured.capture_root)), fifo)
    assert isinstance(error, NotRegularFileError), error
    assert (error.rule, error.exit_code, error.file) == ("regular-file", 4, str(blob))


def test_cli_verify_folder_at_the_blob_path_exits_4(captured, capsys) -> None:
    """``coldsnap verify`` with a folder at ``weights.blob``: exit 4, rule regular-file (was exit 1)."""
    blob = captured.artifact_dir / "workers" / "worker-0-of-1" / "weights.blob"
    blob.unlink()
    blob.mkdir()
    assert coldsnap("verify", captured.artifact_dir, "--state-root", captured.capture_root) == 4
    assert "rule regular-file failed" in capsys.readouterr().err


def test_unreadable_files_are_typed(captured, tmp_path: Path) -> None:
    """A blob and a pack behind a symbolic link loop (ELOOP) and a pack path whose folder is a file
    (ENOTDIR): FileAccessError (rule io) and MissingObjectError, not bare OSErrors."""
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    residual = captured.manifest.residual
    with pytest.raises(FileAccessError, match="symbolic links"):
        verify_blob_file(loop, residual)
    with pytest.raises(FileAccessError):
        verify_pack_file(loop, captured.pack)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(MissingObjectError):
        verify_pack_file(blocker / "x.pack", captured.pack)


# --- the CLI's last line of defence ---------------------------------------------------------------------------


def test_cli_reports_an_unexpected_oserror_as_rule_io(captured, capsys, monkeypatch) -> None:
    """An ``OSError`` that no layer typed (the descriptor reader swapped for a plain ``read_bytes`` of
    the artifact folder, which raises a real ``IsADirectoryError``) is printed as
    ``rule io failed: ... [file=...]`` with exit 4, where the CLI printed the bare
    ``[Errno 21] ...`` with no rule."""
    import coldsnap_core.cli.stage_cmd as stage_cmd

    monkeypatch.setattr(stage_cmd, "read_descriptor", lambda path: Path(path).read_bytes())
    assert coldsnap("stage", captured.artifact_dir, "--state-root", captured.capture_root) == 4
    err = capsys.readouterr().err
    assert "rule io failed: unexpected I/O error: Is a directory" in err
    assert f"file={captured.artifact_dir}" in err


def test_unexpected_os_error_names_both_files_and_keeps_the_cause() -> None:
    """The CLI's and the loaders' last line of defence: an OSError with two file names (rename,
    link) names both, and keeps the OSError as its cause."""
    from coldsnap_core._io import unexpected_os_error

    cause = OSError(18, "Invalid cross-device link", "/a/x.partial", None, b"/b/x.pack")
    error = unexpected_os_error(cause)
    assert isinstance(error, FileAccessError) and error.__cause__ is cause
    assert error.file == "/a/x.partial" and "second file: /b/x.pack" in error.detail
    assert str(error).startswith("rule io failed: unexpected I/O error: Invalid cross-device link")


# --- locks ---------------------------------------------------------------------------------------------


def test_a_pull_whose_lock_file_cannot_be_created_fails_at_once_naming_it(
    captured, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``coldsnap pull REF /proc/x``: the lock file beside DIR cannot be created (``/proc`` takes no new file:
    ``ENOENT`` in an existing folder, which ``filelock`` retries as a holder's removed file): exit 4 at once with
    rule ``io`` naming the lock file, the errno and one remedy. Fails if such a pull waits out
    ``COLDSNAP_LOCK_TIMEOUT`` and then blames "another pull" (rule ``lock-timeout``, which the 30 s here would
    give)."""
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc")
    store = LocalFolderStore(tmp_path / "store")
    publish_native([captured.artifact_dir], store, PayloadCache(captured.capture_root), name="tiny")
    monkeypatch.setenv("COLDSNAP_LOCK_TIMEOUT", "30")
    dest = Path("/proc") / f"coldsnap-pull-{os.getpid()}"
    assert coldsnap("pull", artifact_ref(str(tmp_path / "store"), store, "tiny"), dest, "--state-root", tmp_path / "s") == 4
    err = capsys.readouterr().err
    assert f"rule io failed: cannot create the lock file of this pull beside {dest.name} (ENOENT: " in err, err
    assert f"[file=/proc/.{dest.name}.lock]" in err and err.count("; remedy: ") == 1 and "lock-timeout" not in err
