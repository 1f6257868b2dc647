"""What an operator sees of a start in the engine's log: one banner per worker process, and one ``coldsnap:`` ERROR
line per refusal, also written to the termination log and said again last, after the engine's own tracebacks."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path

from coldsnap_core._version import __version__
from coldsnap_core.errors import redact_store_spec
from coldsnap_core.settings import ColdsnapSettings

__all__ = ["LAST_WORDS_ENV", "banner", "install_last_words", "refuse"]

logger = logging.getLogger(__name__)

LAST_WORDS_ENV = "COLDSNAP_LAST_WORDS"
"""``<pid>:<file>``: where the children of the first process of a start append their refusal lines (not a setting)."""

_bannered = False


def banner(settings: ColdsnapSettings, engine_label: str, log: logging.Logger) -> None:
    """Log the INFO banner of this worker process once (the payload store's secrets redacted)."""
    global _bannered
    if _bannered:
        return
    _bannered = True
    store = settings.store.payload_repo or settings.store.payload_dir
    artifact = settings.artifact_ref or settings.artifact_dir
    mode = "export (COLDSNAP_EXPORT_MODEL_PAYLOAD=1)" if settings.export_model_payload else settings.restore
    log.info(
        "coldsnap %s active in %s: artifact %s, state root %s, restore mode %s, store %s",
        __version__,
        engine_label,
        "none (COLDSNAP_ARTIFACT_DIR is not set)" if artifact is None else artifact,
        settings.state_root,
        mode,
        "none" if store is None else redact_store_spec(store),
    )


def refuse(line: str, settings: ColdsnapSettings, log: logging.Logger, *, cause: str | None = None) -> None:
    """The one report of a refused start: ``line`` at ERROR in ``log``, in the termination log when that file exists,
    and again at the start's first process's exit and after the engine's ERROR quoting ``cause``. Never raises."""
    log.error("%s", line)
    path = settings.termination_log
    if path.exists():
        try:
            with open(path, "w", encoding="utf-8") as f:  # Kubernetes shows the last 4096 bytes
                f.write(line + "\n")
        except OSError as exc:
            log.debug("coldsnap: cannot write the termination log %s: %s", path, exc)
    owner, words = _last_words()
    if words and owner != os.getpid() and _is_ancestor(owner):
        with contextlib.suppress(OSError), open(words, "a", encoding="utf-8") as f:
            f.write(line.replace("\n", " ") + "\n")
    if cause:
        logging.getLogger().addHandler(_RepeatAfterEngineError(line, cause, log))


class _RepeatAfterEngineError(logging.Handler):
    """Says a refusal once more right after the engine's ERROR record that quotes ``cause``: SGLang's launcher then
    kills the process tree (``kill_process_tree`` in ``sglang/srt/utils``), so no exit hook runs."""

    def __init__(self, line: str, cause: str, log: logging.Logger) -> None:
        super().__init__(logging.ERROR)
        self.line, self.cause, self.log = line, cause, log

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.line in message:
            return  # the refusal line itself (or its repeat), not the engine's record
        quoted = record.exc_info is not None and record.exc_info[1] is not None and self.cause in str(record.exc_info[1])
        if quoted or self.cause in message:
            logging.getLogger().removeHandler(self)
            self.log.error("%s", self.line)


def install_last_words() -> None:
    """In the first process of a start: repeat its child processes' refusals at its exit; a child does nothing."""
    owner, words = _last_words()
    if words and (owner == os.getpid() or _is_ancestor(owner)):
        return
    try:
        fd, path = tempfile.mkstemp(prefix="coldsnap-last-words-", suffix=".log")
    except OSError:
        return
    os.close(fd)
    os.environ[LAST_WORDS_ENV] = f"{os.getpid()}:{path}"
    atexit.register(_say_last_words, os.getpid(), Path(path))


def _last_words() -> tuple[int, str]:
    """:data:`LAST_WORDS_ENV` as ``(owner pid, file)``; ``(0, "")`` when unset or malformed."""
    owner, _, words = os.environ.get(LAST_WORDS_ENV, "").partition(":")
    return (int(owner), words) if owner.isdigit() and words else (0, "")


def _is_ancestor(pid: int) -> bool:
    """Whether ``pid`` started this process (directly or not), by the parent links of ``/proc``."""
    current = os.getppid()
    for _ in range(64):
        if current == pid:
            return True
        if current <= 1:
            return False
        try:
            current = int(Path(f"/proc/{current}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _say_last_words(owner: int, path: Path) -> None:
    """At the exit of the process that installed it: the refusal lines its children appended, at ERROR."""
    if os.getpid() != owner:  # a forked child inherited the hook
        return
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        path.unlink()
    except OSError:
        return
    for line in dict.fromkeys(lines):  # each worker of a start may refuse with the same line
        logger.error("%s", line)
    sys.stderr.flush()
