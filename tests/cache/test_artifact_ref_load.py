"""``COLDSNAP_ARTIFACT_DIR`` given the REF of a published artifact (``docs/format.md`` §12.9): the load pulls it into
``<state-root>/artifacts/sha256/<digest>/`` and restores from there, staging the packs from the REF's store. Run
through the fake engine's adapter (``tests/conformance/fake_adapter.py``: the engine contract every plugin shares)
against real stores on 127.0.0.1, so no engine starts."""

from __future__ import annotations

import hashlib
import logging

import pytest

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.errors import PayloadUnavailableError
from coldsnap_core.stores import artifact_ref
from coldsnap_core.stores.publish import artifact_listing, publish_native
from tests.conformance import fake_adapter, fake_engine  # noqa: F401 (fake_adapter registers the coldsnap loader)
from tests.support.outcome_lines import appended_lines


@pytest.fixture
def published(any_store, tmp_path):
    """The fake engine's checkpoint, its artifact exported and published to ``any_store`` as ``fake``: ``(model
    folder, artifact folder, REF)``."""
    model = fake_engine.write_checkpoint(tmp_path / "checkpoint")
    artifact, state = tmp_path / "artifact", tmp_path / "export-state"
    keys = {"artifact_dir": str(artifact), "state_root": str(state), "materialize": "off"}
    fake_engine.start(model, "coldsnap", {**keys, "export_model_payload": "1"})
    publish_native([artifact], any_store.store, PayloadCache(state), name="fake")
    return model, artifact, artifact_ref(any_store.spec, any_store.store, "fake")


@pytest.mark.parametrize("any_store", ["s3", "oci"], indirect=True)
def test_a_ref_is_pulled_into_the_state_root_and_restored(published, tmp_path) -> None:
    """A fresh node (its own state root, no payload store configured) starts with ``artifact_dir`` = the REF and
    ``restore=native``: the artifact is pulled to ``<state-root>/artifacts/sha256/<SHA-256 of artifact.json>/`` byte
    for byte, the pack staged from the REF's store, and the outcome line says ``restored`` from that folder; a second
    start restores from the same folder. Fails if a REF is read as a folder path, the pull lands elsewhere, or the
    packs are not fetched from the REF's store."""
    model, artifact, ref = published
    node = tmp_path / "node"
    digest = hashlib.sha256((artifact / "artifact.json").read_bytes()).hexdigest()
    pulled = node / "artifacts" / "sha256" / digest
    for _ in range(2):
        with appended_lines(node / "load-outcomes.jsonl") as lines:
            fake_engine.start(
                model, "coldsnap", {"artifact_dir": ref, "state_root": str(node), "restore": "native", "materialize": "off"}
            )
        (line,) = lines
        assert (line["outcome"], line["artifact_dir"]) == ("restored", str(pulled))
    for file in artifact_listing(artifact).files:
        assert (pulled / file.path).read_bytes() == (artifact / file.path).read_bytes()


@pytest.mark.parametrize("any_store", ["s3"], indirect=True)
def test_a_ref_that_names_nothing_falls_back_under_auto_and_stops_under_native(published, tmp_path, caplog) -> None:
    """A REF naming no published artifact: under ``auto`` one WARNING naming the REF and a checkpoint load (outcome
    ``fell-back`` with rule ``payload-available``); under ``native`` the start stops with PayloadUnavailableError and a
    ``refused`` line. Fails if a failed pull crashes the start, serves silently, or ``native`` falls back."""
    model, _, ref = published
    missing = ref.rsplit("/", 1)[0] + "/nobody"
    node = tmp_path / "node"
    keys = {"artifact_dir": missing, "state_root": str(node), "materialize": "off"}
    with caplog.at_level(logging.WARNING), appended_lines(node / "load-outcomes.jsonl") as lines:
        fake_engine.start(model, "coldsnap", keys)
    (line,) = lines
    assert (line["outcome"], line["rule"]) == ("fell-back", "payload-available")
    assert [r for r in caplog.records if missing in r.getMessage() and r.levelno == logging.WARNING]
    with appended_lines(node / "load-outcomes.jsonl") as lines, pytest.raises(PayloadUnavailableError, match="nobody"):
        fake_engine.start(model, "coldsnap", {**keys, "restore": "native"})
    assert [line["outcome"] for line in lines] == ["refused"]
    assert not (node / "artifacts" / "sha256").exists() or list((node / "artifacts" / "sha256").iterdir()) == []
