"""``coldsnap export -- COMMAND...``: a one-shot export that exits, for a CI or Kubernetes Job (exit codes:
``docs/format.md`` §8). It waits for a ``captured`` outcome line (§10.3) of every worker of the world the first one
names (all must write to the outcome log this node reads), then for ``--ready-url`` (vLLM attaches its derived-cache
seed, §17, before it is ready); then stops the engine and verifies the artifact."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from coldsnap_core.artifact.capsules import read_descriptor
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli._output import add_command_options, add_outcome_log_option, byte_bar, positive_seconds, report
from coldsnap_core.cli.verify_cmd import workers_json
from coldsnap_core.errors import ConfigurationError, ExportError, ManifestMismatchError
from coldsnap_core.format.manifest import CAPSULE_NAME_RE
from coldsnap_core.outcomes import OUTCOME_KIND
from coldsnap_core.restore.audit import verify_artifact
from coldsnap_core.settings import SETTINGS, ColdsnapSettings

PROGRESS_INTERVAL_SECONDS = 10.0
"""How often a wait says what it waits for."""
POLL_SECONDS = 0.2
OUTPUT_LINES_KEPT = 20
"""The engine's last lines of output an :class:`ExportError` quotes."""


class _OutcomeTail:
    """The lines appended to the outcome log at ``path`` since this object was made (across a rotation to ``<path>.1``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._inode, self._offset = self._stat()
        self._partial = b""

    def _stat(self) -> tuple[int | None, int]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None, 0
        return st.st_ino, st.st_size

    def _read(self, path: Path, offset: int) -> tuple[bytes, int]:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return b"", offset
        return data, offset + len(data)

    def new_lines(self) -> Iterator[dict]:
        inode, _ = self._stat()
        if inode != self._inode:  # rotated (or created): the old file's rest, then the new file from its start
            if self._inode is not None:
                rest, _ = self._read(Path(f"{self.path}.1"), self._offset)
                self._partial += rest
            self._inode, self._offset = inode, 0
        data, self._offset = self._read(self.path, self._offset)
        *complete, self._partial = (self._partial + data).split(b"\n")
        for raw in complete:
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("format") == OUTCOME_KIND:
                yield doc


class _Engine:
    """The engine's process group: started with ``env``, its output passed to stderr and its last lines kept."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.last_lines: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES_KEPT)
        try:
            self.process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise ExportError(f"cannot start the engine command {command}: {exc}") from exc
        self._pump = threading.Thread(target=self._pass_output, daemon=True)
        self._pump.start()

    def _pass_output(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace")
            self.last_lines.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    def exited(self) -> int | None:
        """The engine's exit status once it exited (its output read within 5 s), else ``None``."""
        returncode = self.process.poll()
        if returncode is not None:
            self._pump.join(timeout=5)
        return returncode

    def output_tail(self) -> str:
        lines = "\n".join(f"  {line}" for line in self.last_lines)
        return f"; the engine's last lines of output:\n{lines}" if lines else "; the engine wrote no output"

    def stop(self, grace_seconds: float) -> int:
        """SIGTERM to the group, SIGKILL to what is left of it after ``grace_seconds``; the engine's exit status."""
        deadline = time.monotonic() + grace_seconds
        self._signal(signal.SIGTERM)
        while self._alive() and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        if self._alive():
            print(f"coldsnap export: the engine did not stop within {grace_seconds:g} s of SIGTERM; killing it", file=sys.stderr)
            self._signal(signal.SIGKILL)
        returncode = self.process.wait()
        self._pump.join(timeout=5)
        return returncode

    def _alive(self) -> bool:
        self.process.poll()  # reaps the leader: a zombie would keep the group alive
        return self._signal(0)

    def _signal(self, signum: int) -> bool:
        """Send ``signum`` to the engine's process group; whether the group still exists."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            return False
        return True


def _world(capsule_name: str) -> tuple[str, ...] | None:
    """Every capsule name of the world ``capsule_name`` belongs to, or ``None`` for a name of no world."""
    match = CAPSULE_NAME_RE.fullmatch(capsule_name)
    if match is None:
        return None
    role, world_size, replicas = match["role"], int(match["world_size"]), int(match["data_parallel_size"] or 1)
    suffixes = [f"-dp-{d}-of-{replicas}" for d in range(replicas)] if replicas > 1 else [""]
    return tuple(f"{role}-{rank}-of-{world_size}{suffix}" for suffix in suffixes for rank in range(world_size))


class _Wait:
    """The wait for every worker's ``captured`` line, then for ``--ready-url``."""

    def __init__(self, engine: _Engine, tail: _OutcomeTail, artifact_dir: Path, timeout_seconds: float) -> None:
        self.engine, self.tail, self.artifact_dir = engine, tail, str(artifact_dir)
        self.started = time.monotonic()
        self.deadline = self.started + timeout_seconds
        self.timeout_seconds = timeout_seconds
        self.captured: dict[str, str] = {}  # capsule name -> pack digest
        self.world: tuple[str, ...] | None = None
        self._said = self.started

    def waiting_for(self) -> str:
        if self.world is None:
            return f"the first worker's capture into {self.artifact_dir}"
        missing = [name for name in self.world if name not in self.captured]
        return f"the capture of {', '.join(missing)} ({len(self.captured)} of {len(self.world)} captured)"

    def tick(self, what: str, exited: int | None) -> None:
        """Between polls: fail when the engine had ``exited`` before the last read or the time is up; say what is awaited."""
        if exited is not None:
            raise ExportError(f"the engine exited with {exited} before {what}{self.engine.output_tail()}")
        now = time.monotonic()
        if now > self.deadline:
            raise ExportError(
                f"timed out after --timeout {self.timeout_seconds:g} s waiting for {what}{self.engine.output_tail()}"
            )
        if now - self._said >= PROGRESS_INTERVAL_SECONDS:
            self._said = now
            print(
                f"coldsnap export: waiting for {what}; {now - self.started:.0f} s of --timeout {self.timeout_seconds:g} s",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(POLL_SECONDS)

    def captures(self) -> dict[str, str]:
        while True:
            exited = self.engine.exited()  # before the read: a line written before the exit is still read
            for line in self.tail.new_lines():
                if line.get("artifact_dir") == self.artifact_dir:
                    self._take(line)
            if self.world is not None and set(self.world) <= set(self.captured):
                return self.captured
            self.tick(self.waiting_for(), exited)

    def _take(self, line: dict) -> None:
        worker, outcome = str(line.get("worker")), line.get("outcome")
        if outcome != "captured":
            rule = f" (rule {line.get('rule')}: {line.get('detail')})" if line.get("rule") else ""
            raise ExportError(f"{worker}'s load was {outcome}, not captured{rule}{self.engine.output_tail()}")
        world = _world(worker)
        if world is None or (self.world is not None and world != self.world):
            raise ExportError(f"{worker} is not a worker of the world {self.world or 'of a capsule name'}")
        self.world = world
        self.captured[worker] = str(line.get("pack_sha256"))

    def ready(self, url: str) -> None:
        while True:
            with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
            self.tick(f"{url} to answer 200 (the engine ready)", self.engine.exited())


def _capture(args: argparse.Namespace, command: list[str], artifact_dir: Path) -> tuple[dict[str, str], int]:
    """Run the engine with the export on: ``(capsule name -> captured pack digest, the engine's exit status)``."""
    settings: ColdsnapSettings = args.settings
    tail = _OutcomeTail(settings.outcome_log_path)
    env = {**os.environ, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1", "COLDSNAP_ARTIFACT_DIR": str(artifact_dir)}
    env["COLDSNAP_STATE_ROOT"] = str(settings.state_root)
    if settings.outcome_log is not None:
        env["COLDSNAP_OUTCOME_LOG"] = str(settings.outcome_log)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: stop the engine, exit as interrupted
    engine = _Engine(command, env)
    try:
        wait = _Wait(engine, tail, artifact_dir, args.timeout)
        captured = wait.captures()
        if args.ready_url:
            wait.ready(args.ready_url)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
        returncode = engine.stop(args.grace)
        signal.signal(signal.SIGTERM, previous)
    return captured, returncode


def run(args: argparse.Namespace) -> int:
    command = args.engine_command[1:] if args.engine_command[:1] == ["--"] else args.engine_command
    if not command:
        raise ConfigurationError("coldsnap export needs the engine's command after --: coldsnap export -- vllm serve MODEL ...")
    row = tuple(s for s in SETTINGS if s.key == "artifact_dir")
    artifact_dir = ColdsnapSettings.resolve(flags={"artifact_dir": args.artifact_dir}, rows=row)[0].artifact_dir
    if artifact_dir is None:
        raise ConfigurationError("coldsnap export needs the artifact folder: set COLDSNAP_ARTIFACT_DIR or pass --artifact-dir")
    captured, returncode = _capture(args, command, artifact_dir)
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    verified = verify_artifact(
        artifact_dir, cache=cache, progress_for=lambda pack: byte_bar(f"verify {pack.sha256[:12]}", pack.size_bytes)
    )
    named = {w.worker.capsule_name: w.pack.sha256 for w in verified}
    if named != captured:
        raise ManifestMismatchError(
            f"artifact.json names the packs {named}, the engine's outcome lines say it captured {captured}: another"
            " capture wrote the artifact meanwhile",
            file=artifact_dir / "artifact.json",
        )
    model_files = read_descriptor(artifact_dir).pinned_model_files
    doc = {
        "artifact_dir": str(artifact_dir),
        "workers": workers_json(verified),
        "distinct_payloads": sorted(set(named.values())),
        "model_files": [pin.to_json() for pin in model_files],
        "engine_returncode": returncode,
    }
    lines = [f"{w.worker.capsule_name}: captured and verified pack {w.pack.sha256} ({w.pack.size_bytes} bytes)" for w in verified]
    done = f"ok: exported {artifact_dir}: {len(verified)} worker(s), {len(model_files)} model file(s); the engine stopped"
    return report(args, doc, lines, f"{done} with {returncode}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="one-shot export: start the engine with the export on, wait for every worker's capture, stop it, verify",
        description=(
            "Start COMMAND (the engine's start command, e.g. vllm serve MODEL --load-format coldsnap) with"
            " COLDSNAP_EXPORT_MODEL_PAYLOAD=1, wait for the capture of every worker (its load outcome lines), stop the"
            " engine (SIGTERM to its process group, SIGKILL after --grace), verify the artifact as coldsnap verify does."
            " Exit 0 when the artifact and its packs are written and verified; 4 (rule export) when the engine exited,"
            " a worker refused or --timeout passed, naming it with the engine's last lines of output."
        ),
    )
    p.add_argument("engine_command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the engine's start command")
    p.add_argument("--artifact-dir", help="the artifact folder (default: $COLDSNAP_ARTIFACT_DIR)")
    add_outcome_log_option(p, "the load outcome log the engine appends to")
    p.add_argument("--timeout", type=positive_seconds, default=3600.0, help="seconds to wait for every capture (default 3600)")
    p.add_argument(
        "--grace",
        type=positive_seconds,
        default=30.0,
        help="seconds from SIGTERM to SIGKILL when stopping the engine (default 30)",
    )
    p.add_argument(
        "--ready-url",
        help="after the captures, wait until this URL answers 200 (the engine's /health: vLLM attaches its compile cache"
        " as a derived-cache seed before it is ready)",
    )
    add_command_options(p, run, "where packs go")
