"""The rule that every test which starts an engine process carries the ``engine`` marker.

``scripts/test.sh --fast`` runs ``-m "not engine and not slow"``: a test that starts vLLM or SGLang
without the marker would make the fast tier as slow as the engine suite. ``tests/conftest.py`` records
before each test's set-up (its fixtures included) whether the test carries ``engine``; the helpers
that start engines (``run_engine``, ``serve_completion``, ``run_sglang``, ``launch_sglang_server``) call
:func:`require_engine_marker` first.
"""

from __future__ import annotations

_current: dict[str, object] = {"test": None, "engine": True}


def set_current_test(nodeid: str | None, *, engine: bool) -> None:
    """Called by ``pytest_runtest_setup``: the test about to be set up, and whether it has ``engine``."""
    _current["test"], _current["engine"] = nodeid, engine


def require_engine_marker(what: str) -> None:
    """Raise ``AssertionError`` when the current test (or a fixture it set up) starts ``what`` without
    carrying the ``engine`` marker. Outside pytest (a benchmark script) there is no current test."""
    if not _current["engine"]:
        raise AssertionError(
            f"{_current['test']} starts {what} but is not marked engine: add pytest.mark.engine"
            " (scripts/test.sh --fast leaves engine tests out by that marker)"
        )
