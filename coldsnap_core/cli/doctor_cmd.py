"""``coldsnap doctor ARTIFACT``: will this node restore ARTIFACT? One line per check with a remedy (the checks and their
exit codes: ``docs/format.md`` §8); what this installation lacks to tell (torch, the engine) is a warning. Nothing is
written, but a checkpoint file whose checkpoint record is stale is hashed again and recorded, as a start would."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import pwd
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from coldsnap_core._io import lstat_or_none, refuse_symlink, unexpected_os_error
from coldsnap_core.artifact.capsules import Capsule, read_descriptor, read_worker_capsule
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state
from coldsnap_core.cli._output import EXTRA_OF_MODULE, add_command_options, byte_bar, missing_dependency, report
from coldsnap_core.cli._targets import artifact_folder, restore_here
from coldsnap_core.cli.stage_cmd import add_host_options, add_repo_option, store_of, this_host_entries
from coldsnap_core.errors import ColdsnapError, ConfigurationError, IntegrityError
from coldsnap_core.format.descriptor import MODEL_DIRNAME, ArtifactDescriptor
from coldsnap_core.format.manifest import PackRef
from coldsnap_core.format.verify import verify_blob_file, verify_pack_file
from coldsnap_core.identity.checkpoint_records import CheckpointRecords
from coldsnap_core.identity.model_folder import holds_weight_files
from coldsnap_core.identity.model_identity import LoadedModel, check_model_identity
from coldsnap_core.identity.target import ENGINE_NONE, engine_version
from coldsnap_core.settings import SETTINGS, ColdsnapSettings
from coldsnap_core.stores.base import PayloadStore

CHECK_EXIT_CODES = {"plugin": 10, "state-root": 11, "store": 12, "target": 13, "model": 14, "packs": 15}
"""Each check's exit code when it fails (the first failed check's, in this order)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EnginePlugin:
    """How an engine finds coldsnap: the entry-point group it loads plugins from and the variable that restricts them
    (vLLM ``vllm/plugins/__init__.py``: ``VLLM_PLUGINS`` split on ``,``, set means only those; SGLang
    ``sglang/srt/plugins/__init__.py``: ``SGLANG_PLUGINS`` split on ``,`` and stripped, empty means all)."""

    label: str
    group: str
    allow_list: str
    strips: bool

    def allowed(self, value: str | None) -> set[str] | None:
        """The plugin names ``value`` of :attr:`allow_list` lets the engine load (``None``: all of them)."""
        if value is None or (self.strips and not value.strip()):
            return None
        return {n.strip() for n in value.split(",")} if self.strips else set(value.split(","))


ENGINE_PLUGINS = {
    "vllm": EnginePlugin("vLLM", "vllm.general_plugins", "VLLM_PLUGINS", strips=False),
    "sglang": EnginePlugin("SGLang", "sglang.srt.plugins", "SGLANG_PLUGINS", strips=True),
}
PLUGIN_NAME = "coldsnap"
"""The name of coldsnap's entry point in each engine's group (``pyproject.toml``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    """One line of the report: ``check`` (a key of :data:`CHECK_EXIT_CODES`), ``status`` and what to do."""

    check: str
    status: Literal["ok", "warning", "failed"]
    message: str
    remedy: str | None = None

    def line(self) -> str:
        head = {"ok": "ok     ", "warning": "warning", "failed": "FAILED "}[self.status]
        return f"{head} {self.check}: {self.message}" + (f"; remedy: {self.remedy}" if self.remedy else "")


def _without_remedy(exc: ColdsnapError) -> str:
    """``exc``'s message without its ``; remedy: ...`` (a check says its own)."""
    return str(exc).removesuffix(f"; remedy: {exc.remedy}") if exc.remedy else str(exc)


def _cannot_tell(check: str, engine: str, what: str) -> Check:
    label = ENGINE_PLUGINS[engine].label if engine in ENGINE_PLUGINS else engine  # a third engine's capture
    return Check(check, "warning", f"cannot tell without {label} ({what})", EXTRA_OF_MODULE.get(engine))


def plugin_check(engine: str) -> Check:
    """Whether ``engine`` (a capsule's ``target.json`` engine) will load coldsnap and is a version it supports."""
    if engine == ENGINE_NONE:
        return Check("plugin", "ok", "captured without an engine (the Python API restores it): no engine plugin is needed")
    plugin = ENGINE_PLUGINS.get(engine)
    if plugin is None:
        return Check(
            "plugin", "failed", f"captured by {engine!r}, an engine coldsnap has no plugin for", "capture with vLLM or SGLang"
        )
    version = engine_version(engine)
    if version is None:
        return _cannot_tell("plugin", engine, f"{plugin.label} is not installed in this environment, {sys.prefix}")
    found = [ep for ep in importlib.metadata.entry_points(group=plugin.group) if ep.name == PLUGIN_NAME]
    if not found:
        return Check(
            "plugin",
            "failed",
            f"no {PLUGIN_NAME!r} entry point in {plugin.group} in this environment ({sys.prefix}): {plugin.label}"
            f" {version} will not load coldsnap, and --load-format coldsnap is unknown to it",
            f"install coldsnap into the environment that runs {plugin.label}: {EXTRA_OF_MODULE[engine]}",
        )
    allowed = plugin.allowed(os.environ.get(plugin.allow_list))
    if allowed is not None and PLUGIN_NAME not in allowed:
        return Check(
            "plugin",
            "failed",
            f"{plugin.allow_list}={os.environ[plugin.allow_list]!r} leaves {PLUGIN_NAME!r} out: {plugin.label} loads only"
            " the plugins it names",
            f"add {PLUGIN_NAME} to {plugin.allow_list}, or unset it",
        )
    supported = _supported_versions(found[0], engine)
    if supported is not None and not _within(version, supported):
        return Check(
            "plugin",
            "failed",
            f"{plugin.label} {version} is outside the versions this coldsnap supports ({supported})",
            f"install {plugin.label} {supported}, or a coldsnap release that supports {plugin.label} {version}",
        )
    return Check(
        "plugin",
        "ok",
        f"{plugin.label} {version} (supported: {supported or 'no range declared'}) loads {found[0].value} from"
        f" {plugin.group}" + (f" ({plugin.allow_list} names it)" if allowed is not None else ""),
    )


def _supported_versions(entry_point: importlib.metadata.EntryPoint, engine: str) -> str | None:
    """The range ``entry_point``'s distribution requires of ``engine`` in its extra of that name (``pyproject.toml``)."""
    for text in (entry_point.dist.requires if entry_point.dist else None) or []:
        requirement = Requirement(text)
        if requirement.name == engine and requirement.marker is not None and requirement.marker.evaluate({"extra": engine}):
            return str(requirement.specifier)
    return None


def _within(version: str, supported: str) -> bool:
    try:
        return SpecifierSet(supported).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def state_root_check(cache: PayloadCache, uid: int) -> Check:
    """The state root and the cache folders below it: folders, no symbolic links, owned by ``uid``, writable by it."""
    folders = (cache.state_root, *cache.folders())
    try:
        cache.check_dirs()  # a symbolic link or a file where a cache folder belongs
        present = [(folder, st) for folder in folders if (st := lstat_or_none(folder)) is not None]
    except ColdsnapError as exc:
        return Check(
            "state-root", "failed", _without_remedy(exc), "replace the link or file by a real folder owned by the engine's user"
        )
    if not present:
        parent = next(p for p in cache.state_root.parents if lstat_or_none(p) is not None)
        return Check(
            "state-root",
            "warning",
            f"{cache.state_root} does not exist (nothing is staged here; a restore creates it below {parent})",
            "check --state-root / $COLDSNAP_STATE_ROOT, then coldsnap stage ARTIFACT",
        )
    for folder, st in present:
        if st.st_uid != uid:
            return Check(
                "state-root",
                "failed",
                f"{folder} belongs to uid {st.st_uid}, the engine runs as uid {uid} ({_user_name(uid)}): it trusts no"
                " validation record written by another user and may not write there",
                f"chown -R {uid} {cache.state_root}, or run the engine (and coldsnap doctor --user) as uid {st.st_uid}",
            )
        if st.st_mode & stat.S_IRWXU != stat.S_IRWXU:
            return Check(
                "state-root",
                "failed",
                f"{folder} has mode {stat.filemode(st.st_mode)}: its owner cannot read, write and enter it",
                f"chmod u+rwx {folder}",
            )
    return Check("state-root", "ok", f"{cache.state_root} belongs to uid {uid} ({_user_name(uid)}) and is writable by it")


def _user_name(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return pwd.getpwuid(uid).pw_name
    return "no passwd entry"


def store_check(
    store: PayloadStore | ColdsnapError | None, packs: Sequence[PackRef], states: dict[str, str]
) -> tuple[Check, set[str]]:
    """Whether the store (or the error its setting raised) answers and holds the packs; also the digests it holds."""
    if isinstance(store, ColdsnapError):
        return Check(
            "store", "failed", _without_remedy(store), "correct --repo, COLDSNAP_PAYLOAD_REPO or COLDSNAP_PAYLOAD_DIR"
        ), set()
    if store is None:
        return Check(
            "store",
            "ok",
            "no payload store configured (--repo, COLDSNAP_PAYLOAD_DIR, COLDSNAP_PAYLOAD_REPO): packs come from"
            " the node-local cache only",
        ), set()
    try:
        held = {p.sha256 for p in packs if store.has(p.sha256, p.size_bytes)}
    except ColdsnapError as exc:
        return Check(
            "store",
            "failed",
            f"{store.name} did not answer: {_without_remedy(exc)}",
            "check the store's address, credentials and network from this node (--repo, COLDSNAP_PAYLOAD_REPO,"
            " COLDSNAP_PAYLOAD_DIR)",
        ), set()
    missing = [p.sha256 for p in packs if p.sha256 not in held]
    if not missing:
        return Check("store", "ok", f"{store.name} answers and holds the {len(packs)} pack(s)"), held
    needed = [d for d in missing if states[d] != "trusted"]
    return Check(
        "store",
        "failed" if needed else "warning",
        f"{store.name} answers but does not hold pack(s) {', '.join(missing)}"
        + ("" if needed else " (staged here, so this node restores without it)"),
        "check the store's prefix, or publish the artifact to it: coldsnap publish-native ARTIFACT --repo STORE",
    ), held


def pack_check(pack: PackRef, state: str, store: PayloadStore | None, held: set[str], cache: PayloadCache) -> Check:
    """One distinct pack (its ``state`` in the cache): staged and trusted, untrusted, to be fetched, or unavailable."""
    subject = f"pack {pack.sha256} ({pack.size_bytes} bytes)"
    if state == "trusted":
        return Check("packs", "ok", f"{subject} is staged, with a trusted validation record")
    if state.startswith("untrusted"):
        return untrusted_pack_check(pack, state, store if store is not None and pack.sha256 in held else None, cache)
    if state.startswith("unusable"):  # a link or non-regular file where the pack belongs: a restore refuses it
        return Check("packs", "failed", f"{subject} is {state}", "remove what is there, then coldsnap stage ARTIFACT")
    if store is not None and pack.sha256 in held:
        return Check(
            "packs", "warning", f"{subject} is not staged: a restore fetches it from {store.name}", "coldsnap stage ARTIFACT"
        )
    where = "no payload store is configured" if store is None else f"{store.name} cannot provide it"
    return Check(
        "packs",
        "failed",
        f"{subject} is {state} in the node-local cache and {where}",
        "coldsnap stage ARTIFACT --repo STORE (a store that holds it), or publish it there first",
    )


def untrusted_pack_check(pack: PackRef, state: str, store: PayloadStore | None, cache: PayloadCache) -> Check:
    """A staged pack without a trusted validation record, hashed in full now as the restore will (nothing is written):
    intact is a warning; corrupt is a warning when ``store`` (one that holds it) provides it again, else failed."""
    subject = f"pack {pack.sha256} ({pack.size_bytes} bytes)"
    try:
        with byte_bar(f"verify {pack.sha256[:12]}", pack.size_bytes) as update:
            verify_pack_file(cache.object_path(pack.sha256), pack, progress=update)
    except IntegrityError as exc:
        found = f"{subject} is staged but corrupt ({_without_remedy(exc)}): a restore quarantines it"
        restage = "coldsnap stage ARTIFACT" + ("" if store is not None else " --repo STORE (a store that holds it)")
        remedy = f"{restage}: it quarantines the corrupt copy and fetches the pack again"
        if store is not None:
            return Check("packs", "warning", f"{found} and fetches it again from {store.name}", remedy)
        return Check("packs", "failed", f"{found} and no payload store provides it again", remedy)
    except ColdsnapError as exc:
        return Check(
            "packs", "failed", f"{subject} is staged but cannot be read: {_without_remedy(exc)}", "let the engine's user read it"
        )
    return Check(
        "packs",
        "warning",
        f"{subject} is staged and intact (hashed in full now), but its validation record is {state}: a restore checks"
        " it again first (every extent, on a pool of threads) and writes the record after its load",
        "coldsnap stage ARTIFACT as the engine's user (it writes the record)",
    )


def target_checks(
    artifact_dir: Path, descriptor: ArtifactDescriptor, capsules: Sequence[Capsule], state_root: Path
) -> list[Check]:
    """Which capsule a restore of each worker here would use (:func:`coldsnap_core.cli._targets.restore_here`)."""
    try:
        import torch  # noqa: F401  the target identity names torch's version and device
    except ModuleNotFoundError as exc:
        return [Check("target", "warning", f"cannot tell without torch: {missing_dependency(exc).detail}")]
    checks = []
    for capsule in capsules:
        name = capsule.native.worker.capsule_name
        engine = capsule.target.engine if capsule.target is not None else ENGINE_NONE
        if engine != ENGINE_NONE and engine_version(engine) is None:
            checks.append(_cannot_tell("target", engine, f"{name} was captured by {engine}"))
            continue
        here = restore_here(artifact_dir, descriptor, capsule, state_root)
        if here["capsule"] is None:
            checks.append(
                Check(
                    "target",
                    "failed",
                    f"{name}: {here['reason']}",
                    "capture the artifact on this target, or start once with COLDSNAP_RESTORE=auto: its checkpoint load"
                    " captures this node's overlay (docs/format.md §15)",
                )
            )
        else:
            # an overlay restores from its own blob, which the overlay's selection checked
            blob = None if here["capsule"] == "overlay" else _blob_check(name, capsule)
            checks.append(blob or Check("target", "ok", f"{name}: restores from the {here['capsule']} capsule: {here['reason']}"))
    return checks


def _blob_check(name: str, capsule: Capsule) -> Check | None:
    """The failed check of the residual blob a restore verifies first (``verify_blob_file``), or ``None`` when intact."""
    try:
        verify_blob_file(capsule.blob_path, capsule.native.residual)
    except ColdsnapError as exc:
        remedy = exc.remedy or "pull the artifact again (coldsnap pull REF DIR) or capture it again"
        return Check("target", "failed", f"{name}: {_without_remedy(exc)}", remedy)
    return None


def model_source(descriptor: ArtifactDescriptor, artifact_dir: Path, given: str | None) -> str:
    """The checkpoint the engine loads: ``--model``, else the recorded folder here, else ``model/`` (pulled), else the source."""
    if given:
        return os.path.expanduser(given)
    recorded = descriptor.model.source
    pulled = artifact_dir / MODEL_DIRNAME
    if not os.path.isdir(recorded) and pulled.is_dir():
        return str(pulled)
    return recorded


def model_check(
    descriptor: ArtifactDescriptor, source: str, revision: str | None, records: CheckpointRecords | None, file: Path
) -> Check:
    """``source`` against the artifact's model identity as a restore checks it (``docs/format.md`` §10.1) but its engine part."""
    recorded = descriptor.model
    remedy = "start the engine with the checkpoint the artifact was captured from (--model PATH here), or capture anew"
    if os.path.isabs(source) and not os.path.isdir(source):
        return Check(
            "model",
            "failed",
            f"the checkpoint folder {source} does not exist on this node (the artifact was captured from {recorded.source})",
            "mount the checkpoint there, or pass --model PATH where it is (the engine's --model)",
        )
    try:
        absent = os.path.isdir(source) and not holds_weight_files(Path(source))
        loaded = LoadedModel.from_config(source, revision, checkpoint_files=[] if absent else None)
        verify = ColdsnapSettings.resolve(rows=tuple(s for s in SETTINGS if s.key == "verify_checkpoint"))[0].verify_checkpoint
        check_model_identity(
            recorded, loaded, file=str(file), records=records, verify_checkpoint=verify, model_files=descriptor.pinned_model_files
        )
    except ColdsnapError as exc:
        return Check("model", "failed", _without_remedy(exc), remedy)
    except OSError as exc:  # a checkpoint file the engine's user cannot read, as the engine would fail on it
        return Check("model", "failed", _without_remedy(unexpected_os_error(exc)), "let the engine's user read the checkpoint")
    what = f"{len(recorded.files)} checkpoint file(s)" if loaded.folder is not None else f"commit {loaded.revision}"
    if loaded.checkpoint_absent:
        what = f"no checkpoint weights (every model byte from the pack); {len(descriptor.pinned_model_files)} model file(s)"
    return Check(
        "model",
        "ok",
        f"{source}: {what} match the artifact's model identity (the engine's configuration digest and file list are"
        " checked when it starts)",
    )


@contextlib.contextmanager
def as_user(user: str | None) -> Iterator[int]:
    """Run the block with ``user``'s effective uid, gid and groups (root only; ``None``: this user); yields its uid.
    A ``ConfigurationError`` refuses an unknown user name, or another user while not root."""
    uid = os.geteuid() if user is None else _uid_of(user)
    if uid == os.geteuid():
        yield uid
        return
    if os.geteuid() != 0:
        raise ConfigurationError(f"--user {user}: only root checks as another user; run coldsnap doctor as uid {uid} or as root")
    saved = (os.getegid(), os.getgroups())
    try:
        entry = pwd.getpwuid(uid)
        gid, groups = entry.pw_gid, os.getgrouplist(entry.pw_name, entry.pw_gid)
    except KeyError:  # a uid without a passwd entry (a container's arbitrary uid): its gid is taken to be the uid
        gid, groups = uid, [uid]
    os.setgroups(groups)
    os.setegid(gid)
    os.seteuid(uid)
    try:
        yield uid
    finally:
        os.seteuid(0)
        os.setegid(saved[0])
        os.setgroups(saved[1])


def _uid_of(user: str) -> int:
    if user.isascii() and user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise ConfigurationError(f"--user {user!r}: no such user") from None


def diagnose(args: argparse.Namespace, uid: int, store: PayloadStore | ColdsnapError | None) -> list[Check]:
    """Every check, in :data:`CHECK_EXIT_CODES` order (``store``: the one :func:`run` made, or the error making it)."""
    artifact_dir = artifact_folder(args.artifact)
    descriptor = read_descriptor(artifact_dir)
    entries = this_host_entries(args, artifact_dir)
    capsules = [read_worker_capsule(artifact_dir, e) for e in entries]
    packs = list({e.payload.sha256: e.payload for e in entries}.values())
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    plugins = [plugin_check(e) for e in sorted({c.target.engine if c.target else ENGINE_NONE for c in capsules})]
    state_root = state_root_check(cache, uid)
    states = {}  # each pack's: trusted, untrusted: why, absent or unusable: why
    for pack in packs:
        try:
            present = refuse_symlink(cache.object_path(pack.sha256)) is not None  # a restore refuses a link
            states[pack.sha256] = record_state(cache, pack.sha256) if present else "absent"
        except ColdsnapError as exc:
            states[pack.sha256] = f"unusable: {_without_remedy(exc)}"
    store_line, held = store_check(store, packs, states)
    # a checkpoint record is written (after hashing a changed file) only into a state root the engine's user owns
    records = CheckpointRecords(cache.state_root) if state_root.status == "ok" else None
    return [
        *plugins,
        state_root,
        store_line,
        *target_checks(artifact_dir, descriptor, capsules, cache.state_root),
        model_check(
            descriptor, model_source(descriptor, artifact_dir, args.model), args.revision, records, artifact_dir / "artifact.json"
        ),
        *(pack_check(p, states[p.sha256], None if isinstance(store, ColdsnapError) else store, held, cache) for p in packs),
    ]


def run(args: argparse.Namespace) -> int:
    # what the checks import, imported as this user: another user may not read this Python's files (a root-only
    # installation), although the engine's own Python would be readable by it
    with contextlib.suppress(ModuleNotFoundError):
        import torch  # noqa: F401
    try:
        store: PayloadStore | ColdsnapError | None = store_of(args)
    except ColdsnapError as exc:
        store = exc
    with as_user(args.user) as uid:
        checks = diagnose(args, uid, store)
    failed = [c for c in checks if c.status == "failed"]
    code = min((CHECK_EXIT_CODES[c.check] for c in failed), default=0)
    doc = {"artifact": str(artifact_folder(args.artifact)), "uid": uid, "checks": [dataclasses.asdict(c) for c in checks]}
    lines = [c.line() for c in checks]
    warnings = sum(c.status == "warning" for c in checks)
    if failed:
        lines.append(f"not ready: {', '.join(dict.fromkeys(c.check for c in failed))} failed (exit {code})")
    else:
        lines.append(f"ready: this node will restore {args.artifact}" + (f" ({warnings} warning(s))" if warnings else ""))
    return report(args, {**doc, "ready": not failed, "exit_code": code}, lines, code=code)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="will this node restore ARTIFACT? one line per check (plugin, state root, store, target, model, packs)",
        description=(
            "Check, as a start would, whether this node restores ARTIFACT: the engine plugin and its version, the state "
            "root's owner and permissions, the payload store, the target qualification of this host's capsules, the "
            "checkpoint against the artifact's model identity, and the staged packs. One line per check with a remedy. "
            "Exit codes: 0 no check failed (warnings allowed), 10 plugin, 11 state root, 12 store, 13 target, 14 model, "
            "15 packs (the first failed check), 2/3/4 ARTIFACT cannot be read."
        ),
    )
    p.add_argument("artifact", metavar="ARTIFACT", help="artifact folder (with artifact.json), or its artifact.json")
    p.add_argument(
        "--model",
        metavar="PATH",
        help="the checkpoint the engine loads: its --model, a folder or a repository id (default: the artifact's source"
        " folder when it is on this node, else the artifact's model/ folder, else its source)",
    )
    p.add_argument("--revision", help="the engine's --revision of a repository id (default: main)")
    p.add_argument("--user", help="the engine's user, a name or uid (default: this one; another needs root)")
    add_host_options(p, "check")
    add_repo_option(p)
    add_command_options(p, run, "the engine's state root")
