"""The SGLang stand-in (``fake_sglang``) as ``sglang``, for the tests that ask for the ``fake_sglang`` fixture."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch):
    """A fresh stand-in per test, and a fresh ``coldsnap_sglang`` registration state."""
    for name in [n for n in sys.modules if n == "sglang" or n.startswith(("sglang.", "coldsnap_sglang"))]:
        monkeypatch.delitem(sys.modules, name)
    import fake_sglang as stand_in

    stand_in.LOAD_FORMAT_CHOICES[:] = ["auto", "pt", "safetensors", "npcache", "dummy"]
    stand_in.HookRegistry.applied.clear()
    original = stand_in.LoadConfig.__dict__["_verify_load_format"]
    stand_in.install()
    yield stand_in
    stand_in.LoadConfig._verify_load_format = original
    for name in [n for n in sys.modules if n == "sglang" or n.startswith(("sglang.", "coldsnap_sglang"))]:
        del sys.modules[name]


SHARED_MEMORY = "/dev/shm"
SGLANG_SHARED_MEMORY_PREFIXES = ("sglang_loads_", "sgl_shm_mq_")
"""Shared-memory segments that SGLang 0.5.23 engines create and leave behind when they exit (its load
bookkeeping and its scheduler's message queues), one set per engine start."""


def _sglang_segments() -> set[str]:
    """This user's SGLang segments in ``/dev/shm`` (another user's are never touched)."""
    try:
        names = [name for name in os.listdir(SHARED_MEMORY) if name.startswith(SGLANG_SHARED_MEMORY_PREFIXES)]
    except OSError:
        return set()
    owned = set()
    for name in names:
        with contextlib.suppress(OSError):
            if os.lstat(os.path.join(SHARED_MEMORY, name)).st_uid == os.getuid():
                owned.add(name)
    return owned


@pytest.fixture(scope="module", autouse=True)
def remove_sglang_shared_memory():
    """Remove the ``/dev/shm`` segments the engines of this module left (each engine start leaves a
    few; a suite run used to leave about 40 on the node). Only this user's segments that appeared while
    the module ran are removed; its engines run one at a time and have exited by then (a second SGLang
    run of the same user on the node at the same time could lose its segments: the suite does not do that)."""
    before = _sglang_segments()
    yield
    for name in sorted(_sglang_segments() - before):
        with contextlib.suppress(OSError):  # gone already, or not removable: never fail a test module for it
            os.unlink(os.path.join(SHARED_MEMORY, name))
