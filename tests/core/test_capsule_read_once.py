"""A capsule's two manifests share the allocation map and the residual map (``docs/format.md`` §9): a capsule
read holds them once, and the recovery manifest's copy is still held to the strict rules."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from coldsnap_core.artifact.capsules import read_capsule
from coldsnap_core.errors import ManifestError
from coldsnap_core.format.manifest import RECOVERY_MANIFEST_FILENAME
from tests.restore.test_worker_restore import TinyModel, capture
from tests.support.observer_support import write_checkpoint


@pytest.fixture
def capsule_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    return capture(TinyModel(), write_checkpoint(folder), tmp_path / "artifact", tmp_path / "state").capsule_dir


def test_the_shared_maps_are_parsed_once(capsule_dir: Path) -> None:
    """Fails if a capsule read keeps the recovery manifest's allocation map or residual map as a second copy
    (equal copies, not the native manifest's values)."""
    capsule = read_capsule(capsule_dir)
    assert capsule.recovery.allocations is capsule.native.allocations
    assert capsule.recovery.residual_extents is capsule.native.residual_extents


def test_a_recovery_map_equal_only_as_numbers_is_refused(capsule_dir: Path) -> None:
    """The recovery manifest writes an allocation size as ``4096.0`` where the native manifest has ``4096``:
    equal as Python numbers, but not an integer, so the strict parse refuses it. Fails if the shared map is
    taken on Python equality (which would accept the float)."""
    path = capsule_dir / RECOVERY_MANIFEST_FILENAME
    document = json.loads(path.read_text())
    document["allocations"][0]["size_bytes"] = float(document["allocations"][0]["size_bytes"])
    os.chmod(path, 0o644)
    path.write_text(json.dumps(document))
    with pytest.raises(ManifestError, match=r"allocations\[0\]\.size_bytes"):
        read_capsule(capsule_dir)


@pytest.mark.parametrize(
    ("where", "value"),
    [("allocations", False), ("allocations", True), ("residual_extents", False)],
    ids=["allocation-false", "allocation-true", "residual-extent-false"],
)
def test_a_recovery_map_equal_only_as_booleans_is_refused(capsule_dir: Path, where: str, value: bool) -> None:
    """The recovery manifest writes ``false`` (or ``true``) where the native manifest has ``0`` (or ``1``): equal
    in Python (``0 == False``), not in JSON. Fails if the shared maps are compared with ``==`` in a document that
    holds a boolean."""
    path = capsule_dir / RECOVERY_MANIFEST_FILENAME
    document = json.loads(path.read_text())
    index, key = next(
        (i, k) for i, item in enumerate(document[where]) for k, v in item.items() if type(v) is int and v == int(value)
    )
    document[where][index][key] = value
    os.chmod(path, 0o644)
    path.write_text(json.dumps(document))
    with pytest.raises(ManifestError, match=rf"{where}\[{index}\]\.{key} must be an integer"):
        read_capsule(capsule_dir)
