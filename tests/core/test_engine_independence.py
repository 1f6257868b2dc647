"""``coldsnap_core`` imports neither vLLM nor SGLang: the engine packages build on it, never the reverse."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import coldsnap_core


def test_importing_every_core_module_loads_no_engine() -> None:
    """Import every ``coldsnap_core`` module in a fresh interpreter and check that no ``vllm`` or
    ``sglang`` module was loaded. Fails if a core module grows an engine import (the core and its tests
    must run with neither engine installed)."""
    names = sorted(m.name for m in pkgutil.walk_packages(coldsnap_core.__path__, "coldsnap_core."))
    assert "coldsnap_core.restore.pipeline" in names and "coldsnap_core.settings" in names
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang'))\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
