"""Fixtures of the coldsnap_core tests: the real SmolLM2 2-layer checkpoint staged into slabs and captured once."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_support import Captured, capture
from slabs import Slabs, checkpoint_files, stage_checkpoint

from coldsnap_core.format.manifest import ModelIdentity
from coldsnap_core.identity.model_identity import identify_checkpoint


@pytest.fixture(scope="session")
def smollm2_identity(smollm2_2layer: Path) -> ModelIdentity:
    """The pinned identity (file names, sizes, SHA-256) of the 2-layer checkpoint."""
    return identify_checkpoint(checkpoint_files(smollm2_2layer), source=str(smollm2_2layer))


@pytest.fixture(scope="session")
def staged_2layer(smollm2_2layer: Path) -> Slabs:
    """The 2-layer checkpoint in 4 slabs (default ``stage_checkpoint`` arguments). Read only: tests
    that change bytes stage their own."""
    return stage_checkpoint(smollm2_2layer)


@pytest.fixture(scope="session")
def captured_2layer(staged_2layer: Slabs, smollm2_identity: ModelIdentity, tmp_path_factory: pytest.TempPathFactory) -> Captured:
    """One capture of ``staged_2layer`` (pack, blob, manifests, artifact.json). Read only: tests that
    corrupt files work on :func:`core_support.copy_capture`."""
    root = tmp_path_factory.mktemp("captured-2layer")
    return capture(
        root, staged_2layer.allocation_map, staged_2layer.allocations, staged_2layer.model_ranges, model=smollm2_identity
    )
