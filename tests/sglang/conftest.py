"""The SGLang stand-in (``fake_sglang``) as ``sglang``, for the tests that ask for the ``fake_sglang`` fixture."""

from __future__ import annotations

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
