"""The declared public API of ``coldsnap_core`` and the runnable example that uses only it."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import coldsnap_core

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "restore_without_engine.py"


def test_all_is_honest() -> None:
    """``coldsnap_core.__all__`` lists exactly the names the package exports, each defined (not merely
    re-exported) by the module the package says, so ``from coldsnap_core import *`` and the README
    agree with the code. Fails if a name is added to one list but not the other, moved without
    updating the package, or renamed."""
    exports = coldsnap_core._EXPORTS
    assert coldsnap_core.__all__ == sorted(exports)
    for name, module in exports.items():
        value = getattr(importlib.import_module(module), name)
        assert getattr(coldsnap_core, name) is value
        assert getattr(value, "__module__", module) == module, (name, value.__module__, module)
    namespace: dict[str, object] = {}
    exec("from coldsnap_core import *", namespace)
    assert sorted(k for k in namespace if not k.startswith("__")) == coldsnap_core.__all__


def test_importing_the_package_loads_no_implementation() -> None:
    """``import coldsnap_core`` is cheap (the CLI and engine plugins import it first): names load on
    first use. Fails if the package imports torch or an implementation module eagerly."""
    code = "import sys, coldsnap_core; print(sorted(m for m in sys.modules if m.startswith(('torch', 'coldsnap_core.'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_readme_names_the_public_api() -> None:
    """The README's "Using it from Python" section names every public name and runs the example.
    Fails when the API grows a name the documentation does not mention."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Using it from Python", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in coldsnap_core.__all__ if not re.search(rf"\b{name}\b", section)]
    assert missing == []
    assert "examples/restore_without_engine.py" in section


@pytest.mark.slow  # about 10 s: the example runs as a script in a fresh interpreter
def test_example_restores_a_captured_worker_without_an_engine(tmp_path: Path) -> None:
    """``examples/restore_without_engine.py`` runs as a user would run it (a fresh interpreter, the
    public API only), captures a worker, verifies the artifact and restores a fresh model byte for byte.
    Fails if the public API cannot do a restore without an engine plugin, or the example rots."""
    tree = ast.parse(EXAMPLE.read_text())
    private = sorted(
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("coldsnap_core")
    )
    assert private == []  # `import coldsnap_core` only
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert "ok: every parameter and buffer of the restored model equals the loaded one" in done.stdout
    assert list((tmp_path / "state" / "model-payloads" / "sha256").glob("*.pack"))
