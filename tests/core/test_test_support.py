"""The suite's own rules about engines: the shared-memory entries engine processes leave are removed
(only this user's, only new ones, never one a live process holds), a test that starts an engine
without the ``engine`` marker is stopped before the engine starts, the long files run first, and a test
that needs what ``scripts/test.sh`` builds in the background waits for it and fails if that build failed."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.background_setup import wait_for_setup
from tests.support.engine_marker import require_engine_marker, set_current_test
from tests.support.file_order import FILE_SECONDS, SGLANG_AFTER_SECONDS, file_order
from tests.support.shared_memory import SHARED_MEMORY, engine_entries, inodes_in_use, remove_left_entries


def test_only_new_entries_that_no_process_holds_are_removed(tmp_path: Path) -> None:
    """Fails if the clean-up removes an entry that was there before the run, an entry a live process
    still maps (a concurrent engine of the same user), a name without an engine prefix, or if it
    leaves a stale new one behind."""
    old, stale, held, other = "sem.mp-old", "sem.mp-stale", "sgl_shm_mq_held", "unrelated_segment"
    tp_buffer = "vllm_dist_90acce26-tp:0-[0-1]-cpushm_0"  # vLLM's CPU tensor parallel communicator
    for name in (old, stale, held, other, tp_buffer):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    before = {old}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 4096); f.close();"
            " print('mapped', flush=True); time.sleep(60)",
            str(tmp_path / held),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert os.stat(tmp_path / held).st_ino in inodes_in_use(tmp_path)
        assert engine_entries(tmp_path) == {old, stale, held, tp_buffer}
        assert sorted(remove_left_entries(before, tmp_path)) == sorted([stale, tp_buffer])
    finally:
        holder.kill()
        holder.wait()
    assert sorted(os.listdir(tmp_path)) == sorted([old, held, other])
    assert remove_left_entries(before, tmp_path) == [held]  # its holder has exited now


def test_a_live_named_semaphore_is_kept() -> None:
    """Fails if the clean-up removes a ``multiprocessing`` semaphore that a live process holds (here this
    one): glibc maps it under a temporary name, so a name match finds no holder and the clean-up of one run
    used to unlink the semaphores of a concurrent engine start, whose spawned workers then failed with
    ``FileNotFoundError`` in ``SemLock._rebuild``."""
    lock = multiprocessing.get_context("spawn").Lock()  # spawn: the name stays linked until the tracker unlinks it
    name = "sem." + lock._semlock.name.lstrip("/")
    assert name in engine_entries()
    before = engine_entries() - {name}
    assert name not in remove_left_entries(before)
    assert (SHARED_MEMORY / name).exists()


def test_an_engine_start_without_the_engine_marker_is_refused() -> None:
    """Fails if a test without ``pytest.mark.engine`` can start an engine (the fast tier would then run it)."""
    set_current_test("tests/x.py::test_y", engine=False)
    try:
        with pytest.raises(AssertionError, match=r"tests/x.py::test_y starts a vLLM engine but is not marked engine"):
            require_engine_marker("a vLLM engine")
    finally:
        set_current_test(None, engine=True)
    require_engine_marker("a vLLM engine")  # outside a test (a benchmark script): allowed


def test_this_test_is_recorded_as_not_marked_engine(request: pytest.FixtureRequest) -> None:
    """Fails if ``tests/conftest.py`` stops recording the running test's marker before its set-up."""
    with pytest.raises(AssertionError, match=request.node.name):
        require_engine_marker("an SGLang engine")


def test_the_longest_files_run_first_and_the_others_by_test_count() -> None:
    """Fails if the files are ordered by test count alone (pytest-xdist's own reordering): the one-test engine
    files, the longest of the suite, would then be handed out last."""
    counts = {
        "tests/core/test_few.py": 3,
        "tests/vllm/test_vllm_data_parallel.py": 1,
        "tests/core/test_many.py": 82,
        "tests/vllm/test_vllm_engine.py": 10,
        "tests/sglang/test_sglang_engine.py": 10,
    }
    assert file_order(counts) == [
        "tests/sglang/test_sglang_engine.py",
        "tests/vllm/test_vllm_engine.py",
        "tests/vllm/test_vllm_data_parallel.py",
        "tests/core/test_many.py",
        "tests/core/test_few.py",
    ]


def test_while_sglang_is_being_built_its_files_start_after_the_long_vllm_files() -> None:
    """Fails if the SGLang engine files keep their place at the front while their environment is still being
    built (a worker would wait for the build instead of running vLLM files), or if they move behind the short
    files (they would end long after the other worker)."""
    counts = {path: 1 for path in FILE_SECONDS} | {"tests/core/test_short.py": 50}
    waiting = frozenset(path for path in FILE_SECONDS if path.startswith("tests/sglang/"))
    order = file_order(counts, waiting_for_sglang=waiting)
    first = min(order.index(path) for path in waiting)
    assert order[first : first + len(waiting)] == sorted(waiting, key=lambda path: -FILE_SECONDS[path])
    before = [FILE_SECONDS[path] for path in order[:first]]
    assert sum(before) >= SGLANG_AFTER_SECONDS > sum(before[:-1])
    assert order.index("tests/core/test_short.py") > first
    assert file_order(counts)[0] == "tests/sglang/test_sglang_engine.py" != order[0]  # first once it is built


def test_a_test_waits_for_the_background_setup_and_goes_on_when_it_succeeded(tmp_path: Path) -> None:
    """Fails if the wait returns before the step has written its status, or does not return once it wrote 0."""
    status = tmp_path / "setup.status"

    def finish() -> None:
        (tmp_path / "setup.status.part").write_text("0\n")
        (tmp_path / "setup.status.part").rename(status)

    timer = threading.Timer(0.3, finish)
    timer.start()
    try:
        wait_for_setup("setup.sh", status, None, timeout_s=30, poll_s=0.05)
        # the status file itself, not an event the timer sets after the rename (the wait may return in between)
        assert status.read_text() == "0\n"
    finally:
        timer.cancel()


def test_a_failed_background_setup_fails_the_test_with_its_output(tmp_path: Path) -> None:
    """Fails if a failed build is taken as ready (the test would then run against a half-made environment, or
    skip as if there were none) or if its output is not shown."""
    status, log = tmp_path / "setup.status", tmp_path / "setup.log"
    status.write_text("1\n")
    log.write_text("setup-sglang-venv: installing sglang 0.5.23\nERROR: No matching distribution found\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)setup.sh failed \(exit status 1\).*No matching distribution"):
        wait_for_setup("setup.sh", status, log, timeout_s=30, poll_s=0.05)


def test_a_background_setup_that_never_ends_fails_the_test_after_the_timeout(tmp_path: Path) -> None:
    """Fails if the wait for a step that never writes its status never ends, or ends as if it had succeeded."""
    with pytest.raises(pytest.fail.Exception, match=r"setup.sh has not ended after 0 s"):
        wait_for_setup("setup.sh", tmp_path / "setup.status", None, timeout_s=0.2, poll_s=0.05)


def test_after_one_timed_out_wait_the_next_wait_for_that_setup_fails_at_once(tmp_path: Path, monkeypatch) -> None:
    """A hung background build: the first test that needs it waits the whole timeout, the next ones of that worker
    fail at once with the same message (no sleep at all). Fails if every test waits the timeout again (an hour each,
    for every SGLang test of a worker)."""
    from tests.support import background_setup

    status = tmp_path / "setup.status"
    with pytest.raises(pytest.fail.Exception, match="has not ended after"):
        wait_for_setup("setup.sh", status, None, timeout_s=0.2, poll_s=0.05)

    def no_second_wait(seconds: float) -> None:
        raise AssertionError("the second wait waited for the build again")

    monkeypatch.setattr(background_setup.time, "sleep", no_second_wait)
    with pytest.raises(pytest.fail.Exception, match="has not ended after 0 s"):
        wait_for_setup("setup.sh", status, None, timeout_s=3600, poll_s=0.05)
