"""The import layers of ``coldsnap_core``: every import goes down (or sideways within a layer), and no
two modules import each other, directly or through others.

The check is static (the AST of every module, function-local and ``TYPE_CHECKING`` imports included),
so an import hidden inside a function to dodge a cycle is found as well. Layers, bottom to top (README
"Layout" lists the same table, checked by ``tests/core/test_readme_layout.py``):

====  ======================================================================================
rank  modules
====  ======================================================================================
0     ``errors``
1     ``settings``, ``digests``, ``_io`` (the one durable-I/O and ``OSError`` module), ``_progress``, the
      ``PayloadStore`` Protocol, ``identity.hub_commit``, ``identity.config_digest``
2     ``format.*`` (the byte-level documents, the safetensors header)
3     ``format.verify``, the ``CopyBackend`` Protocol and the copy backends, ``copy.torch_allocations``,
      ``identity.target`` (this worker's target identity; the qualification rule), ``identity.fingerprint``,
      ``identity.model_folder`` (a model folder's non-weight files), ``capture.checkpoint_sources``,
      ``capture.model_records``
4     ``cache.records``, ``cache.locks``, ``cache.partials``, ``cache.garbage``, ``identity.checkpoint_records``,
      ``identity.model_identity`` (produced and checked)
5     ``cache.payload_cache`` (admission and quarantine), ``artifact.*`` (the documents of capsules, overlays and
      derived-cache seeds), ``outcomes``
6     ``stores.*``, ``cache.overlays`` (list and gc), ``capture.derived_cache``,
      ``restore.overlay`` (which capsule a restore uses), ``restore.derived_cache`` (seed placement),
      ``metrics`` (Prometheus metrics)
7     ``capture.payload`` (the capture core), ``restore.staging``, ``restore.hydrate``, ``restore.audit``,
      ``stores.publish``
8     ``capture.worker``, ``capture.materialize``, ``capture.overlay``, ``capture.sleep`` (every capture, on the
      core), ``restore.pipeline``, ``capture.observer``, ``capture.load_session``
9     ``load_policy`` (the engine contract, the load policy every plugin runs), ``cli``
10    the package (``coldsnap_core/__init__.py``: the public API re-exports)
====  ======================================================================================

A package's ``__init__`` sits at the layer of its lowest module. A new module must be placed in :data:`LAYERS`;
the test says so rather than guessing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import coldsnap_core

PACKAGE_DIR = Path(coldsnap_core.__file__).parent

LAYERS: dict[str, int] = {
    "errors": 0,
    "_version": 0,
    "settings": 1,
    "digests": 1,
    "_io": 1,
    "operator_log": 1,
    "_progress": 1,
    "stores.base": 1,
    "identity": 1,
    "identity.hub_commit": 1,
    "identity.config_digest": 1,
    "format": 2,
    "format._strict": 2,
    "format.allocation": 2,
    "format.extents": 2,
    "format.pack_layout": 2,
    "format.manifest": 2,
    "format.descriptor": 2,
    "format.content_ref": 2,
    "format.target": 2,
    "format.safetensors_header": 2,
    "format.verify": 3,
    "copy": 3,
    "copy.base": 3,
    "copy.host": 3,
    "copy.cuda": 3,
    "copy.select": 3,
    "copy.torch_allocations": 3,
    "identity.target": 3,
    "identity.fingerprint": 3,
    "identity.model_folder": 3,
    "capture": 3,
    "capture.checkpoint_sources": 3,
    "capture.model_records": 3,
    "cache": 4,
    "cache.records": 4,
    "cache.locks": 4,
    "cache.partials": 4,
    "cache.garbage": 4,
    "identity.checkpoint_records": 4,
    "identity.model_identity": 4,
    "cache.payload_cache": 5,
    "cache.pack_use": 5,
    "artifact": 5,
    "artifact.capsules": 5,
    "artifact.residual": 5,
    "artifact.sleep_capsules": 5,
    "artifact.overlay": 5,
    "artifact.derived_cache": 5,
    "artifact.model_files": 5,
    "outcomes": 5,
    "stores": 6,
    "stores._copy": 6,
    "stores.local": 6,
    "stores.hf": 6,
    "stores.s3": 6,
    "stores._ranged": 6,
    "stores.oci": 6,
    "stores.gcs": 6,
    "stores.azure": 6,
    "cache.overlays": 6,
    "stores.pull": 6,
    "stores._references": 6,
    "capture.derived_cache": 6,
    "metrics": 6,
    "restore": 6,
    "restore.overlay": 6,
    "restore.derived_cache": 6,
    "capture.payload": 7,
    "restore.staging": 7,
    "restore.hydrate": 7,
    "stores.publish": 7,
    "restore.audit": 7,
    "capture.worker": 8,
    "capture.materialize": 8,
    "capture.overlay": 8,
    "capture.sleep": 8,
    "restore.pipeline": 8,
    "capture.observer": 8,
    "capture.load_session": 8,
    "load_policy": 9,
    "cli": 9,
    "": 10,
}
"""Module (relative to ``coldsnap_core``, ``""`` for the package itself) -> layer; ``cli.*`` is layer 9."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _layer(module: str) -> int | None:
    if module.startswith("cli.") or module == "cli":
        return LAYERS["cli"]
    return LAYERS.get(module)


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The ``coldsnap_core`` modules ``module`` imports (relative names), wherever the import statement is."""
    found = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["coldsnap_core", *package][: len(package) + 2 - node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            targets = [name] + [f"{name}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target != "coldsnap_core" and not target.startswith("coldsnap_core."):
                continue
            relative = target.removeprefix("coldsnap_core").removeprefix(".")
            while relative and relative not in known:
                relative = relative.rpartition(".")[0]
            if relative != module:
                found.add(relative)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def test_every_module_has_a_layer() -> None:
    """Fails when a module is added to ``coldsnap_core`` without being placed in a layer (so the
    layering below cannot silently skip it)."""
    unplaced = sorted(m for m in _modules() if _layer(m) is None)
    assert unplaced == [], f"place these coldsnap_core modules in tests/core/test_layering.py LAYERS: {unplaced}"


def test_imports_only_go_down() -> None:
    """No module imports one of a higher layer (e.g. ``records`` importing ``cache``, ``settings``
    importing an implementation module, the cache importing staging). Fails on the first upward import
    and names it."""
    upward = [
        f"{importer or 'coldsnap_core'} (layer {_layer(importer)}) imports {imported or 'coldsnap_core'} (layer {_layer(imported)})"
        for importer, imports in sorted(_graph().items())
        for imported in sorted(imports)
        if _layer(importer) is not None and _layer(imported) is not None and _layer(imported) > _layer(importer)  # type: ignore[operator]
    ]
    assert upward == []


def test_no_import_cycle() -> None:
    """No two ``coldsnap_core`` modules import each other, directly or through others (Tarjan's
    strongly connected components over the static import graph). Fails on a cycle such as the one
    ``cache`` and ``records`` once had through function-local imports, and names its members."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []
