"""Derived-cache seeds without an engine (``coldsnap_core.artifact.derived_cache``, ``docs/format.md`` §17): a real
capture of the 2-layer checkpoint, a seed of real files attached to its capsule, and placement into empty
cache folders. Each test names the regression it catches; the vLLM round trip is
``tests/vllm/test_vllm_derived_cache.py``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from core_support import WORKER, Captured, copy_capture, edit_json, flip_byte, run_cli

from coldsnap_core.artifact.derived_cache import SEED_ARCHIVE_FILENAME, SEED_DOCUMENT_FILENAME, SeedQualification
from coldsnap_core.capture.derived_cache import attach_seed, collect_files
from coldsnap_core.errors import ManifestMismatchError, ManifestValueError
from coldsnap_core.format.descriptor import ArtifactDescriptor
from coldsnap_core.identity.target import collect_target
from coldsnap_core.restore.derived_cache import place_seed

FLAGS = ("avx", "avx2", "fma", "sse4_2")
CACHE_FILES = {
    "torch_compile_cache/torch_aot_compile/0123abcd/rank_0_0/model": b"aot function " * 100,
    "torch_compile_cache/torch_aot_compile/0123abcd/inductor_cache/ab/cabc.main.so": os.urandom(5000),
    "torch_compile_cache/torch_aot_compile/0123abcd/inductor_cache/ab/cabc.main.cpp": b"// kernel\n" * 50,
    "torch_compile_cache/torch_aot_compile/0123abcd/inductor_cache/aotautograd/aaa/bbb": b"graph",
}
LEFT_OUT = (
    "torch_compile_cache/torch_aot_compile/0123abcd/inductor_cache/locks/cabc.lock",
    "torch_compile_cache/torch_aot_compile/0123abcd/rank_0_0/.model.123.tmp",
)


def qualification(**changes) -> SeedQualification:
    q = SeedQualification.for_target(
        collect_target("vllm", "0.32.0+cpu"), model_config_sha256="1" * 64, compilation_sha256="2" * 64, cpu_isa_flags=FLAGS
    )
    return msgspec.structs.replace(q, **changes)


def compiled_cache(root: Path) -> Path:
    """A vLLM cache root as an export's start leaves it (real files, one lock file and one temporary)."""
    for relative, data in CACHE_FILES.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    for relative in LEFT_OUT:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(b"")
    return root


def seeded(captured_2layer: Captured, tmp_path: Path, recorded: SeedQualification | None = None) -> Captured:
    """A copy of the 2-layer capture whose capsule got a seed of :func:`compiled_cache`."""
    c = copy_capture(captured_2layer, tmp_path / "capture", copy_pack=False)
    roots = {"vllm-cache": compiled_cache(tmp_path / "export-cache"), "inductor-cache": tmp_path / "unused"}
    files = collect_files(roots, [("vllm-cache", "torch_compile_cache/torch_aot_compile/0123abcd")])
    attach_seed(c.artifact_dir, WORKER, c.result.manifest.pack.sha256, recorded or qualification(), files)
    return c


def entry(c: Captured):
    (e,) = ArtifactDescriptor.read(c.artifact_dir / "artifact.json").workers
    return e


def place(c: Captured, cache: Path, current: SeedQualification | None = None):
    roots = {"vllm-cache": cache, "inductor-cache": cache.parent / "inductor"}
    return place_seed(c.capsule_dir, entry(c).capsule_files, current or qualification(), roots)


def test_a_seed_round_trip_places_exactly_the_captured_files(captured_2layer: Captured, tmp_path: Path) -> None:
    """Capture pins both seed files in artifact.json (six capsule files) and placement into an empty cache
    writes every compiled file byte for byte, and no lock file or temporary. Fails if the seed is not
    pinned, a file is lost, or lock files travel."""
    c = seeded(captured_2layer, tmp_path)
    names = [p.name for p in entry(c).capsule_files]
    assert SEED_DOCUMENT_FILENAME in names and SEED_ARCHIVE_FILENAME in names and len(names) == 6
    cache = tmp_path / "fresh-cache"
    placement = place(c, cache)
    assert (placement.status, placement.reason, placement.placed_files, placement.present_files) == ("used", None, 4, 0)
    placed = {p.relative_to(cache).as_posix(): p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    assert placed == CACHE_FILES


def test_entries_already_in_the_cache_are_never_replaced(captured_2layer: Captured, tmp_path: Path) -> None:
    """A file the node already has keeps its bytes (counted as present). Fails if placement overwrites."""
    c = seeded(captured_2layer, tmp_path)
    cache = tmp_path / "cache"
    mine = cache / "torch_compile_cache/torch_aot_compile/0123abcd/rank_0_0/model"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"this node's own")
    placement = place(c, cache)
    assert (placement.status, placement.placed_files, placement.present_files) == ("used", 3, 1)
    assert mine.read_bytes() == b"this node's own"


def test_a_flipped_byte_in_the_archive_skips_the_seed(captured_2layer: Captured, tmp_path: Path, caplog) -> None:
    """The archive's SHA-256 is checked before anything is placed: skipped, one INFO line naming the file
    and its pin, nothing written. Fails if a corrupt seed is placed or the check raises."""
    c = seeded(captured_2layer, tmp_path)
    flip_byte(c.capsule_dir / SEED_ARCHIVE_FILENAME, 1500)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="coldsnap_core.restore.derived_cache"):
        placement = place(c, cache)
    assert placement.status == "skipped"
    assert "derived-cache.tar" in placement.reason and "artifact.json pins" in placement.reason
    assert not cache.exists()
    (line,) = [r.getMessage() for r in caplog.records if "seed skipped" in r.getMessage()]
    assert placement.reason in line and r"worker-0-of-1" in line


def test_a_seed_of_another_torch_version_is_skipped(captured_2layer: Captured, tmp_path: Path) -> None:
    """A seed recorded under another torch is not placed; the reason names the field with both values.
    Fails if torch's version is not part of the qualification."""
    c = seeded(captured_2layer, tmp_path, qualification(torch_version="2.12.0+cpu"))
    cache = tmp_path / "cache"
    placement = place(c, cache)
    here = qualification().torch_version
    assert placement.status == "skipped" and f"torch_version: captured 2.12.0+cpu, here {here}" in placement.reason
    assert not cache.exists()


def test_a_seed_of_a_cpu_with_other_flags_is_skipped(captured_2layer: Captured, tmp_path: Path) -> None:
    """Inductor's C++ kernels are built for the capturing CPU's vector extensions: a seed recorded with one
    more flag (avx512f) than this CPU has is skipped, and the reason names that flag. Fails if the
    flags are not compared."""
    c = seeded(captured_2layer, tmp_path, qualification(cpu_isa_flags=tuple(sorted((*FLAGS, "avx512f")))))
    placement = place(c, tmp_path / "cache")
    assert placement.status == "skipped"
    assert "cpu_isa_flags: captured with ['avx512f'] more, here none more" in placement.reason


@pytest.mark.parametrize(
    "field, value",
    [("compilation_sha256", "3" * 64), ("model_config_sha256", "4" * 64), ("engine_version", "0.33.0+cpu")],
)
def test_other_compilation_settings_model_or_engine_skip_the_seed(
    captured_2layer: Captured, tmp_path: Path, field: str, value: str
) -> None:
    """Each qualification field beyond the target counts. Fails if one is dropped from the comparison."""
    c = seeded(captured_2layer, tmp_path)
    placement = place(c, tmp_path / "cache", qualification(**{field: value}))
    assert placement.status == "skipped" and placement.reason.count(field) == 1


def test_a_capsule_without_a_seed_is_absent(captured_2layer: Captured, tmp_path: Path) -> None:
    """Fails if a capsule without seed pins is reported as skipped or placed."""
    c = copy_capture(captured_2layer, tmp_path / "capture", copy_pack=False)
    assert place(c, tmp_path / "cache").status == "absent"


def test_a_symbolic_link_in_the_cache_path_skips_the_seed(captured_2layer: Captured, tmp_path: Path) -> None:
    """A link inside the cache (pointing elsewhere) is not written through. Fails if placement follows it."""
    c = seeded(captured_2layer, tmp_path)
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    (cache / "torch_compile_cache").mkdir(parents=True)
    elsewhere.mkdir()
    os.symlink(elsewhere, cache / "torch_compile_cache" / "torch_aot_compile")
    placement = place(c, cache)
    assert placement.status == "skipped" and "symbolic link" in placement.reason
    assert list(elsewhere.iterdir()) == []


def test_artifact_json_pins_both_seed_files_or_neither(captured_2layer: Captured, tmp_path: Path) -> None:
    """A descriptor pinning the seed's document without its archive is malformed. Fails if one pin may be
    dropped (the seed would then be read unpinned)."""
    c = seeded(captured_2layer, tmp_path)
    path = c.artifact_dir / "artifact.json"
    doc = json.loads(path.read_text())
    doc["workers"][0]["capsule_files"] = [p for p in doc["workers"][0]["capsule_files"] if p["name"] != SEED_ARCHIVE_FILENAME]
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestValueError, match="derived-cache seed's two"):
        ArtifactDescriptor.read(path)


def test_a_seed_is_attached_only_to_the_capsule_this_process_captured(captured_2layer: Captured, tmp_path: Path) -> None:
    """A capsule replaced by another capture (another pack) gets no seed. Fails if attach_seed pins files
    into a capsule it did not capture."""
    c = copy_capture(captured_2layer, tmp_path / "capture", copy_pack=False)
    files = collect_files({"vllm-cache": compiled_cache(tmp_path / "cache")}, [("vllm-cache", "torch_compile_cache")])
    with pytest.raises(ManifestMismatchError, match="replaced meanwhile"):
        attach_seed(c.artifact_dir, WORKER, "f" * 64, qualification(), files)
    assert not (c.capsule_dir / SEED_ARCHIVE_FILENAME).exists()


def test_coldsnap_verify_checks_a_seed_against_its_pins(captured_2layer: Captured, tmp_path: Path) -> None:
    """``coldsnap verify`` reads the seed like every pinned capsule file: a seeded capsule verifies, one flipped
    byte in the archive is exit 1 naming derived-cache.tar (rule capsule-pin). Fails if verify ignores the
    seed's pins."""
    c = seeded(captured_2layer, tmp_path)
    ok = run_cli("verify", c.artifact_dir, "--state-root", c.state_root)
    assert ok.returncode == 0, ok.stderr
    flip_byte(c.capsule_dir / SEED_ARCHIVE_FILENAME, 1500)
    bad = run_cli("verify", c.artifact_dir, "--state-root", c.state_root)
    assert bad.returncode != 0 and "derived-cache.tar" in bad.stderr and "capsule-pin" in bad.stderr, bad.stderr


def _replace_archive(c: Captured, archive: Path, members: list[dict]) -> None:
    """Put ``archive`` in the capsule as its seed archive, list ``members`` in derived-cache.json and re-pin both
    in artifact.json: what an author who controls the artifact can do, so only the seed's own rules stand."""
    pins = {}
    (c.capsule_dir / SEED_ARCHIVE_FILENAME).write_bytes(archive.read_bytes())
    for name in (SEED_ARCHIVE_FILENAME, SEED_DOCUMENT_FILENAME):
        if name == SEED_DOCUMENT_FILENAME:
            edit_json(c.capsule_dir / name, lambda doc: doc.update(archive=pins[SEED_ARCHIVE_FILENAME], members=members))
        data = (c.capsule_dir / name).read_bytes()
        pins[name] = {"name": name, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    edit_json(
        c.artifact_dir / "artifact.json",
        lambda doc: [p.update(pins[p["name"]]) for e in doc["workers"] for p in e["capsule_files"] if p["name"] in pins],
    )


def test_a_sparse_archive_member_is_refused_before_it_is_read(captured_2layer: Captured, tmp_path: Path) -> None:
    """A 10 KB archive holding a sparse member of 1 GiB logical size, every pin matching: placement skips it
    and ``coldsnap verify`` refuses it (exit 2, rule capsule-pin), and neither reads the member. Fails if the
    member is read whole (the old code allocated its logical size and raised MemoryError out of the load)."""
    c = seeded(captured_2layer, tmp_path)
    source = tmp_path / "sparse" / "vllm-cache"
    source.mkdir(parents=True)
    with open(source / "big", "wb") as f:
        f.truncate(1 << 30)
    archive = tmp_path / "sparse.tar"
    subprocess.run(["tar", "-S", "--format=pax", "-cf", archive, "-C", source.parent, "vllm-cache/big"], check=True)
    assert archive.stat().st_size < 1 << 20
    _replace_archive(c, archive, [{"path": "vllm-cache/big", "size_bytes": 1 << 30, "sha256": "0" * 64}])
    placement = place(c, tmp_path / "cache")
    assert placement.status == "skipped" and "larger than the archive holds" in placement.reason
    result = run_cli("verify", c.artifact_dir, "--state-root", c.state_root)
    assert result.returncode == 2 and "larger than the archive holds" in result.stderr, result.stderr


def test_a_seed_archive_that_is_a_named_pipe_is_skipped_without_blocking(captured_2layer: Captured, tmp_path: Path) -> None:
    """A FIFO in place of derived-cache.tar: skipped at once as not a regular file. Fails if the archive is
    opened blocking (the old code waited for a writer for ever, inside ``load_weights``)."""
    c = seeded(captured_2layer, tmp_path)
    (c.capsule_dir / SEED_ARCHIVE_FILENAME).unlink()
    os.mkfifo(c.capsule_dir / SEED_ARCHIVE_FILENAME)
    placement = place(c, tmp_path / "cache")
    assert placement.status == "skipped" and "not a regular file" in placement.reason


def test_a_named_pipe_seed_archive_is_reported_as_not_a_regular_file(captured_2layer: Captured, tmp_path: Path) -> None:
    """A FIFO in place of derived-cache.tar: ``coldsnap verify`` exits 4 under rule ``regular-file`` naming the
    archive. Fails if it is reported under rule ``no-symlinks`` (it is no symbolic link)."""
    c = seeded(captured_2layer, tmp_path)
    (c.capsule_dir / SEED_ARCHIVE_FILENAME).unlink()
    os.mkfifo(c.capsule_dir / SEED_ARCHIVE_FILENAME)
    result = run_cli("verify", c.artifact_dir, "--state-root", c.state_root)
    assert result.returncode == 4 and "rule regular-file failed" in result.stderr, result.stderr
    assert str(c.capsule_dir / SEED_ARCHIVE_FILENAME) in result.stderr


def test_coldsnap_inspect_shows_the_seed_and_whether_a_start_would_skip_it(captured_2layer: Captured, tmp_path: Path) -> None:
    """``coldsnap inspect`` names each capsule's seed: its file count and what it was compiled for, ``none``
    without one, and ``refused`` with the rule when a flipped archive byte means a start would skip it; the
    JSON form carries the same. Fails if inspect hides the seed or shows a corrupt one as usable."""
    plain = copy_capture(captured_2layer, tmp_path / "plain", copy_pack=False)
    none = run_cli("inspect", plain.artifact_dir, "--state-root", plain.state_root)
    assert none.returncode == 0, none.stderr
    assert "derived-cache seed: none" in none.stdout
    c = seeded(captured_2layer, tmp_path)
    ok = run_cli("inspect", c.artifact_dir, "--state-root", c.state_root)
    assert ok.returncode == 0, ok.stderr
    assert f"derived-cache seed: {len(CACHE_FILES)} files" in ok.stdout and "compiled by vllm 0.32.0+cpu" in ok.stdout
    doc = json.loads(run_cli("inspect", c.artifact_dir, "--state-root", c.state_root, "--json").stdout)
    (worker,) = doc["workers"]
    assert worker["derived_cache"]["files"] == len(CACHE_FILES)
    assert worker["derived_cache"]["qualification"]["cpu_isa_flags"] == list(FLAGS)
    flip_byte(c.capsule_dir / SEED_ARCHIVE_FILENAME, 1500)
    bad = run_cli("inspect", c.artifact_dir, "--state-root", c.state_root)
    assert bad.returncode == 0, bad.stderr
    assert "derived-cache seed: refused" in bad.stdout and "capsule-pin" in bad.stdout, bad.stdout


def test_a_member_inside_another_member_is_refused(captured_2layer: Captured, tmp_path: Path) -> None:
    """A seed listing the file ``vllm-cache/a`` and the file ``vllm-cache/a/b``, every pin and digest matching: no
    cache folder can hold both. ``coldsnap verify`` refuses it (exit 2, naming both members) and placement skips it
    before writing anything. Fails if verify passes such a seed (placement then wrote one member and skipped the
    other, leaving a partial cache)."""
    import io
    import tarfile

    c = seeded(captured_2layer, tmp_path)
    archive = tmp_path / "nested.tar"
    members = []
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("vllm-cache/a", b"outer"), ("vllm-cache/a/b", b"inner")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            members.append({"path": name, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    _replace_archive(c, archive, members)
    result = run_cli("verify", c.artifact_dir, "--state-root", c.state_root)
    assert result.returncode == 2 and "'vllm-cache/a/b' lies inside member 'vllm-cache/a'" in result.stderr, result.stderr
    cache = tmp_path / "cache"
    placement = place(c, cache)
    assert placement.status == "skipped" and "lies inside member" in placement.reason
    assert not cache.exists() or not any(cache.rglob("*"))


def test_a_deep_member_path_does_not_hold_up_the_read(captured_2layer: Captured, tmp_path: Path) -> None:
    """A member 262,144 folders deep (a 512 KiB path the member rules allow, in a document far under its size cap):
    reading the document must take about as long as parsing it. The inside-another-member rule once rebuilt every
    prefix of every path (quadratic: 4 s for a 32 KB path, about 20 minutes for this one, in every start that reads
    the seed). The read runs in a subprocess given 120 s, a guard against that hang, not a timing. Fails if the rule
    goes quadratic again."""
    c = seeded(captured_2layer, tmp_path)
    document = json.loads((c.capsule_dir / SEED_DOCUMENT_FILENAME).read_text())
    deep = "vllm-cache" + "/a" * 262_144
    document["members"] = sorted(
        [*document["members"], {"path": deep, "size_bytes": 1, "sha256": "0" * 64}], key=lambda m: m["path"]
    )
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(document))
    script = (
        "import sys; from coldsnap_core.artifact.derived_cache import SeedDocument;"
        " d = SeedDocument.read(sys.argv[1]); print(max(len(m.name) for m in d.members))"
    )
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(deep)


def _seed_of(c: Captured, tmp_path: Path, files: dict[str, bytes]) -> None:
    """Make ``files`` (member path -> bytes) the capsule's whole seed, every pin matching."""
    import io
    import tarfile

    archive = tmp_path / "replaced.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    members = [{"path": n, "size_bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in sorted(files.items())]
    _replace_archive(c, archive, members)


@pytest.mark.parametrize(
    "member",
    [
        "vllm-cache/torch_compile_cache",
        "vllm-cache/torch_compile_cache/torch_aot_compile",
        "vllm-cache/modelinfos",
        "inductor-cache/fxgraph",
    ],
)
def test_a_member_in_the_place_of_a_shared_cache_folder_is_refused(
    captured_2layer: Captured, tmp_path: Path, member: str
) -> None:
    """A seed whose member is a file where vLLM's or inductor's cache keeps a folder every compiling start uses,
    every pin matching: ``coldsnap verify`` refuses it (exit 2, naming the member) and placement skips it, writing
    nothing. Fails if such a seed verifies and is placed: the file would break every later compiled start of any
    model on the node (vLLM could not create its cache folder)."""
    c = seeded(captured_2layer, tmp_path)
    _seed_of(c, tmp_path, {member: b"not a folder"})
    result = run_cli("verify", c.artifact_dir, "--state-root", c.state_root)
    assert result.returncode == 2 and f"member {member!r} is a file where" in result.stderr, result.stderr
    cache = tmp_path / "cache"
    placement = place(c, cache)
    assert placement.status == "skipped" and f"member {member!r}" in placement.reason
    assert not (tmp_path / "inductor").exists() and not cache.exists()


EXCHANGER = """
import ctypes, os, sys
renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
a, b = (os.fsencode(p) for p in sys.argv[1:3])
print("exchanging", flush=True)
while True:
    if renameat2(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE: both names always exist
        raise OSError(ctypes.get_errno(), "renameat2")
"""
"""Exchanges two paths for ever, atomically (``renameat2(RENAME_EXCHANGE)``, Linux 3.15)."""


def test_a_folder_swapped_for_a_link_never_leads_a_placement_out_of_the_cache(captured_2layer: Captured, tmp_path: Path) -> None:
    """A same-user process exchanges a cache folder (``torch_compile_cache/torch_aot_compile``) with a symbolic
    link to a folder outside the cache, atomically and without pause, while the seed is placed 300 times
    (the exchanger paused after each, to look and clean up): nothing is ever created outside the cache. Fails if
    placement checks each folder for a link and then writes by path: a folder that was real when checked is the
    link when written through (the old code created folders and files outside)."""
    import signal

    c = seeded(captured_2layer, tmp_path)
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    folder = cache / "torch_compile_cache" / "torch_aot_compile"
    folder.mkdir(parents=True)
    outside.mkdir()
    link = cache / "torch_compile_cache" / "elsewhere"
    link.symlink_to(outside)
    exchanger = subprocess.Popen([sys.executable, "-c", EXCHANGER, str(folder), str(link)], stdout=subprocess.PIPE, text=True)
    statuses: dict[str, int] = {}
    try:
        assert exchanger.stdout.readline() == "exchanging\n"
        for _ in range(300):
            status = place(c, cache).status
            statuses[status] = statuses.get(status, 0) + 1
            os.kill(exchanger.pid, signal.SIGSTOP)
            os.waitpid(exchanger.pid, os.WUNTRACED)
            escaped = sorted(p.relative_to(outside).as_posix() for p in outside.rglob("*"))
            assert escaped == [], f"placed outside the cache: {escaped} ({statuses})"
            for name in (folder, link):
                if not name.is_symlink():
                    shutil.rmtree(name / "0123abcd", ignore_errors=True)
            os.kill(exchanger.pid, signal.SIGCONT)
        assert exchanger.poll() is None, "the exchanger stopped: renameat2 failed"
    finally:
        exchanger.kill()
        exchanger.wait()
    assert statuses.get("used", 0) + statuses.get("skipped", 0) == 300, statuses
