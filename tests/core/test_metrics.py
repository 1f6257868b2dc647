"""Prometheus metrics (``coldsnap_core.metrics``): what each load records in its process's registry, through the
engine-neutral load template (the fake engine of the conformance suite, in this process, on its tiny checkpoint),
and the node's view ``coldsnap status --format prometheus`` read back by ``prometheus_client``'s own parser of the
text format. The real engines' ``/metrics`` are scraped in ``tests/vllm/test_vllm_serve.py``,
``tests/vllm/test_vllm_data_parallel.py`` and ``tests/sglang/test_sglang_engine.py``."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from coldsnap_core.artifact.capsules import read_capsule, read_descriptor
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli.main import main
from coldsnap_core.errors import ColdsnapError, ExtentDigestMismatchError
from coldsnap_core.metrics import record_load
from coldsnap_core.outcomes import LoadOutcomeLine, append_outcome
from coldsnap_core.stores.local import LocalFolderStore
from coldsnap_core.stores.publish import publish_native
from tests.conformance import fake_adapter, fake_engine
from tests.support.files import flip_byte

README = Path(__file__).resolve().parents[2] / "README.md"
ENGINE = fake_adapter.ENGINE


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _samples() -> dict[tuple[str, tuple], float]:
    """Every ``coldsnap_*`` sample of this process's default registry, by name and labels (``_created``, a series'
    creation time, left out)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in REGISTRY.collect()
        if family.name.startswith("coldsnap_")
        for s in family.samples
        if not s.name.endswith("_created")
    }


def _recorded(start) -> dict[tuple[str, tuple], float]:
    """What ``start()`` (one engine start) added to the ``coldsnap_*`` samples: name and labels -> increase."""
    before = _samples()
    with contextlib.suppress(ColdsnapError):  # a refusal stops the start
        start()
    after = _samples()
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key, 0.0)}


def _start(model: Path, state: Path, **extra: str) -> None:
    fake_engine.start(model, "coldsnap", {"state_root": str(state), "materialize": "off", **extra})


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A capture of the fake engine's checkpoint: ``model``, ``artifact``, ``state`` (holding the pack), ``pack``."""
    work = tmp_path_factory.mktemp("metrics")
    model = fake_engine.write_checkpoint(work / "checkpoint")
    artifact, state = work / "artifact", work / "state"
    _start(model, state, artifact_dir=str(artifact), export_model_payload="1")
    (entry,) = read_descriptor(artifact).workers
    return {"work": work, "model": model, "artifact": artifact, "state": state, "entry": entry}


def test_each_load_records_its_outcome_rule_seconds_and_hydrated_bytes(captured: dict, tmp_path: Path) -> None:
    """One native restore, one ``auto`` fallback and one ``native`` refusal over a flipped pack byte, each counted
    once in ``coldsnap_load_total`` with its outcome and rule (empty without one) and observed once in
    ``coldsnap_load_seconds``; the restore adds its pack and residual bytes to ``coldsnap_hydrated_bytes_total``,
    the others nothing. Fails if a load is not counted, counted twice, under another outcome or rule, if a refusal
    (an exception) goes uncounted, or if hydrated bytes are counted for a load that hydrated nothing."""
    model, artifact, entry = captured["model"], captured["artifact"], captured["entry"]
    keys = {"artifact_dir": str(artifact)}
    native = read_capsule(artifact / entry.capsule).native
    flipped = shutil.copytree(captured["state"], tmp_path / "flipped")
    flip_byte(flipped / "model-payloads" / "sha256" / f"{entry.payload.sha256}.pack", native.model_extents[0].pack_offset_bytes)

    restored = _recorded(lambda: _start(model, captured["state"], **keys, restore="native"))
    fell_back = _recorded(lambda: _start(model, shutil.copytree(flipped, tmp_path / "auto"), **keys))
    refused = _recorded(lambda: _start(model, shutil.copytree(flipped, tmp_path / "native"), **keys, restore="native"))

    def counted(increase: dict, outcome: str, rule: str) -> None:
        labels = (("engine", ENGINE), ("outcome", outcome), ("rule", rule))
        assert increase.pop(("coldsnap_load_total", labels)) == 1, increase
        seconds = (("engine", ENGINE), ("outcome", outcome))
        assert increase.pop(("coldsnap_load_seconds_count", seconds)) == 1
        assert increase.pop(("coldsnap_load_seconds_sum", seconds)) > 0
        buckets = {k: v for k, v in increase.items() if k[0] == "coldsnap_load_seconds_bucket"}
        assert buckets and set(buckets.values()) == {1}  # the +Inf bucket at least: one observation
        for key in buckets:
            del increase[key]

    counted(restored, "restored", "")
    pack_and_residual = native.model_bytes + native.residual_bytes  # one destination per extent here
    assert restored == {("coldsnap_hydrated_bytes_total", (("engine", ENGINE),)): pack_and_residual}
    counted(fell_back, "fell-back", "extent-sha256")
    assert fell_back == {}
    counted(refused, "refused", "extent-sha256")
    assert refused == {}


def test_a_restore_that_stages_its_pack_records_the_stage_seconds_and_the_fetched_bytes(captured: dict, tmp_path: Path) -> None:
    """A restore on a node whose cache lacks the pack stages it from a folder store: ``coldsnap_stage_seconds``
    gets one observation and ``coldsnap_fetched_bytes_total`` the pack's size; the next restore there (the pack is
    cached) contacts no store and records neither, nor does a fallback on a node without a store. Fails if staging is
    not timed, if fetched bytes are miscounted (a fetch reports each byte once as fetched), or if a cached pack or a
    missing store is counted as a stage."""
    store = tmp_path / "store"
    publish_native([captured["artifact"]], LocalFolderStore(store), PayloadCache(captured["state"]))
    keys = {"artifact_dir": str(captured["artifact"]), "payload_dir": str(store), "restore": "native"}
    node = tmp_path / "node"
    first = _recorded(lambda: _start(captured["model"], node, **keys))
    again = _recorded(lambda: _start(captured["model"], node, **keys))
    storeless = _recorded(lambda: _start(captured["model"], tmp_path / "bare", artifact_dir=str(captured["artifact"])))

    engine = (("engine", ENGINE),)
    assert first[("coldsnap_stage_seconds_count", engine)] == 1 and first[("coldsnap_stage_seconds_sum", engine)] > 0
    assert first[("coldsnap_fetched_bytes_total", engine)] == captured["entry"].payload.size_bytes
    assert again[("coldsnap_load_total", (*engine, ("outcome", "restored"), ("rule", "")))] == 1
    for nothing_staged in (again, storeless):  # the pack cached; no store configured (a fallback)
        assert not [k for k in nothing_staged if k[0].startswith(("coldsnap_stage_seconds", "coldsnap_fetched_bytes"))]
    assert storeless[("coldsnap_load_total", (*engine, ("outcome", "fell-back"), ("rule", "payload-available")))] == 1


def test_a_metrics_file_that_cannot_be_written_is_one_warning(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """In multiprocess mode a sample is a write to a file in ``PROMETHEUS_MULTIPROC_DIR``; an ``OSError`` there is
    one WARNING per process and never reaches the load (a metric must not fail a start). Fails if it raises or
    warns twice."""
    from coldsnap_core import metrics

    class Unwritable:
        def labels(self, *labels):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics, "_load_metrics", lambda: metrics._LoadMetrics(*[Unwritable()] * 5))
    monkeypatch.setattr(metrics, "_warned", False)
    for _ in range(2):
        record_load(LoadOutcomeLine("restored", "vllm", "worker-0-of-1", "/a", 1.0))
    warnings = [r.getMessage() for r in caplog.records if "cannot record load metrics" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]


def test_prometheus_client_is_imported_at_the_first_load_not_before() -> None:
    """SGLang's launcher loads its plugins, then sets ``PROMETHEUS_MULTIPROC_DIR``, and ``prometheus_client`` picks its
    multiprocess mode when first imported; so importing what an engine plugin's loader and the command import must
    not import it (SGLang's own launcher metrics would then never reach its ``/metrics``). Fails if the load policy or
    the CLI imports ``prometheus_client`` at import time."""
    code = "import sys, coldsnap_core.load_policy, coldsnap_core.cli.main; print([m for m in sys.modules if 'prometheus' in m])"
    env = {**os.environ, "PYTHONPATH": str(README.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def _families(text: str) -> dict[str, list]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_status_format_prometheus_is_the_nodes_view_in_the_text_format(captured: dict, tmp_path: Path, capsys) -> None:
    """``coldsnap status --format prometheus`` over a real outcome log (two artifacts, a fallback with its rule, a
    malformed line) and a real cache (a copy of the capture's, its pack verified in full and the record's time set two hours back), parsed by
    ``prometheus_client.parser``: loads by artifact, engine, outcome and rule as a counter, the cache's objects and
    bytes, the age of the pack's last full verification. Fails if the output is not the text format, if a count
    is wrong or lands on another label set, if the cache is not read from the state root, or if the age is not
    taken from the record (a record verified now would say under two hours)."""
    state = shutil.copytree(captured["state"], tmp_path / "state")
    log = state / "load-outcomes.jsonl"
    log.unlink(missing_ok=True)
    error = ExtentDigestMismatchError("model extent 0 does not match its SHA-256")
    for outcome, artifact, err in [("restored", "/a", None), ("restored", "/a", None), ("fell-back", "/a", error)]:
        append_outcome(log, LoadOutcomeLine(outcome, "vllm", "worker-0-of-1", artifact, 2.5, error=err))  # type: ignore[arg-type]
    append_outcome(log, LoadOutcomeLine("checkpoint", "sglang", "worker-0-of-1", None, 4.0))
    with open(log, "a") as f:
        f.write("not json\n")
    digest = captured["entry"].payload.sha256
    assert main(["cache", "verify", "--full", "--state-root", str(state)]) == 0  # the copy's record (another inode)
    capsys.readouterr()
    record = state / "model-payloads" / "sha256" / f"{digest}.pack.record"
    doc = json.loads(record.read_text())
    doc["verified_at"] = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=2)).isoformat(timespec="seconds")
    os.chmod(record, 0o644)
    record.write_text(json.dumps(doc))
    os.chmod(record, 0o444)

    assert main(["status", "--state-root", str(state), "--format", "prometheus", "--last", "2"]) == 0
    assert len(_families(capsys.readouterr().out)["coldsnap_outcome_log_loads"].samples) == 1  # --last N when given
    assert main(["status", "--state-root", str(state), "--format", "prometheus"]) == 0
    families = _families(capsys.readouterr().out)

    loads = families["coldsnap_outcome_log_loads"]
    assert loads.type == "counter"
    counts = {(s.labels["artifact"], s.labels["engine"], s.labels["outcome"], s.labels["rule"]): s.value for s in loads.samples}
    assert counts == {
        ("/a", "vllm", "restored", ""): 2,
        ("/a", "vllm", "fell-back", "extent-sha256"): 1,
        ("", "sglang", "checkpoint", ""): 1,
    }
    assert [s.name for s in loads.samples] == ["coldsnap_outcome_log_loads_total"] * 3
    assert families["coldsnap_cache_objects"].samples[0].value == 1
    assert families["coldsnap_cache_bytes"].samples[0].value == captured["entry"].payload.size_bytes
    (age,) = families["coldsnap_cache_full_verification_age_seconds"].samples
    assert age.labels == {"digest": digest} and age.value >= 7200


def test_the_readme_names_every_metric(captured: dict, capsys) -> None:
    """Every ``coldsnap_*`` family the load metrics register and the node's view prints is named in the README (its
    Metrics section). Fails when a metric is added or renamed without the README."""
    from coldsnap_core.metrics import _load_metrics

    _load_metrics()  # the load families, made at a process's first load
    assert main(["status", "--state-root", str(captured["state"]), "--format", "prometheus"]) == 0
    families = [*REGISTRY.collect(), *text_string_to_metric_families(capsys.readouterr().out)]
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in families if f.name.startswith("coldsnap_")}
    readme = README.read_text(encoding="utf-8")
    readme = readme[readme.index("### Metrics") :]
    assert len(exposed) == 9 and not [n for n in sorted(exposed) if f"`{n}" not in readme], sorted(exposed)
