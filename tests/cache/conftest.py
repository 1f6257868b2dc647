"""Fixtures for the node-local cache, staging, store, materialization and publication tests."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache_support import capture, make_checkpoint

from coldsnap_core.cache import PayloadCache


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2.3 MB safetensors checkpoint (5 tensors, one content duplicated), seed 0."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"), seed=0)


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another real checkpoint of the same shapes with other bytes (seed 1): another pack digest."""
    return make_checkpoint(tmp_path_factory.mktemp("other-checkpoint"), seed=1)


@dataclass(frozen=True)
class Captured:
    """One captured worker: its artifact, the state root the capture wrote its pack to, the result."""

    checkpoint: Path
    artifact_dir: Path
    capture_root: Path
    result: object

    @property
    def manifest(self):
        return self.result.manifest

    @property
    def pack(self):
        return self.result.manifest.pack

    @property
    def pack_path(self) -> Path:
        return self.result.pack_path


@pytest.fixture
def captured(tmp_path: Path, tiny_checkpoint: Path) -> Captured:
    """The tiny checkpoint captured as worker 0 of 1 into ``tmp_path/artifact`` (pack in ``tmp_path/capture-root``)."""
    artifact = tmp_path / "artifact"
    root = tmp_path / "capture-root"
    return Captured(tiny_checkpoint, artifact, root, capture(tiny_checkpoint, artifact, root))


@pytest.fixture
def cache(tmp_path: Path) -> PayloadCache:
    """An empty cache under ``tmp_path/state``."""
    return PayloadCache(tmp_path / "state")
