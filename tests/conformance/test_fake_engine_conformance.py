"""The conformance suite (``tests/conformance/suite.py``) against the fake engine (``fake_engine.py``) and its
adapter (``fake_adapter.py``): a third engine's adapter, written only against the engine contract, passes the
cases vLLM's and SGLang's pass. Every start runs in this process on a tiny checkpoint (about a second in all)."""

from __future__ import annotations

import hashlib
import io
import logging
import shutil
from pathlib import Path

import pytest
import torch

from coldsnap_core.artifact.capsules import read_capsule, read_descriptor
from coldsnap_core.errors import ColdsnapError
from tests.conformance import fake_adapter, fake_engine
from tests.conformance.suite import EngineConformance, EngineRuns, Start
from tests.support.files import flip_byte
from tests.support.outcome_lines import appended_lines


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _start(model: Path, load_format: str, state: Path | None = None, **extra: str) -> Start:
    """One fake engine start with coldsnap's extra-config keys ``extra`` (and ``state_root=state``), read as a
    :class:`Start`: its WARNING and ERROR lines and the error that stopped it are its log."""
    if state is not None:
        extra["state_root"] = str(state)
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    served, weights = False, {}
    try:
        with appended_lines(None if state is None else state / "load-outcomes.jsonl") as lines:
            loaded = fake_engine.start(model, load_format, extra)
        served = True
        weights = {name: _digest(t) for name, t in [*loaded.named_parameters(), *loaded.named_buffers()]}
    except ColdsnapError as exc:
        text.write(f"{type(exc).__name__}: {exc}\n")
    finally:
        logging.getLogger().removeHandler(handler)
    return Start(served, tuple(lines), text.getvalue(), weights)


def _flipped_copy(state: Path, artifact: Path, target: Path) -> Path:
    """A copy of the state root ``state`` with one byte of the artifact's pack flipped inside a model extent."""
    shutil.copytree(state, target)
    (entry,) = read_descriptor(artifact).workers
    extent = read_capsule(artifact / entry.capsule).native.model_extents[0]
    flip_byte(target / "model-payloads" / "sha256" / f"{entry.payload.sha256}.pack", extent.pack_offset_bytes)
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> EngineRuns:
    work = tmp_path_factory.mktemp("fake-engine")
    model = fake_engine.write_checkpoint(work / "checkpoint")
    artifact, state = work / "artifact", work / "state"
    keys = {"artifact_dir": str(artifact), "materialize": "off"}
    plain = _start(model, "safetensors")
    capture = _start(model, "coldsnap", state, **keys, export_model_payload="1")
    restore = _start(model, "coldsnap", state, **keys, restore="native")
    fallback = _start(model, "coldsnap", _flipped_copy(state, artifact, work / "flipped-auto"), **keys)
    refusal = _start(model, "coldsnap", _flipped_copy(state, artifact, work / "flipped-native"), **keys, restore="native")
    upgrade = shutil.copytree(state, work / "upgraded")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fake_engine, "VERSION", "1.1")  # the engine upgraded on this node
        upgraded = _start(model, "coldsnap", upgrade, **keys)
        through_overlay = _start(model, "coldsnap", upgrade, **keys, restore="native")
    unhonoured = _start(model, "coldsnap", work / "unhonoured", **keys, inner_load_format="pt")
    return EngineRuns(
        engine=fake_adapter.ENGINE,
        engine_label="FakeEngine",
        plain=plain,
        capture=capture,
        artifact=artifact,
        restore=restore,
        fallback=fallback,
        refusal=refusal,
        upgraded=upgraded,
        through_overlay=through_overlay,
        overlay_state=upgrade,
        unhonoured=unhonoured,
        unhonoured_setting="'inner_load_format'='pt'",
    )


class TestFakeEngineConformance(EngineConformance):
    """The cases on the fake engine's starts (:func:`runs`)."""
