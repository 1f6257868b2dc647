"""File edits the tests use to produce corruption (one flipped byte of a read-only pack or blob), a
command prefix under which file modes are enforced even for root, and a check that a call does not
block on a named pipe."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path


def flip_byte(path: Path, offset: int) -> None:
    """XOR the byte at ``offset`` of ``path`` with 0x01 (the smallest change a digest must notice);
    the file is made writable for the edit and left read-only (mode 0444), as the cache keeps packs."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))
    os.chmod(path, 0o444)


def permissions_enforced(command: list[str]) -> list[str]:
    """``command`` as it must run for a mode-000 file to give ``EACCES``: unchanged for a user; for root
    (CI runs as root), under ``setpriv`` with ``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH`` dropped
    from the bounding and inheritable sets, so the new process checks file modes like any user.
    Raises ``AssertionError`` when root has no ``setpriv`` (util-linux)."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE for this check"
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}", *command]


def raised_without_blocking(
    call: Callable[[], object], fifo: Path, *, stop: threading.Event | None = None
) -> BaseException | None:
    """Run ``call`` on a thread and return what it raised (``None`` if nothing).

    If it still runs after 60 s it is taken as blocked opening the named pipe ``fifo`` (waiting for a
    writer, fifo(7)): ``stop`` is set, and a writer end of ``fifo`` is opened and closed until the call
    returns, so the test fails saying so (``AssertionError``) instead of hanging."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            raised.append(exc)
        else:
            raised.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    blocked = thread.is_alive()
    if stop is not None and blocked:
        stop.set()
    while thread.is_alive():
        with contextlib.suppress(OSError):  # ENXIO: nobody has it open for reading at this moment
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(0.5)
    assert not blocked, f"blocked opening the named pipe {fifo}"
    return raised[0]
