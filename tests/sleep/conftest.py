"""Fixtures for the level-1 sleep backend tests: a fake CuMem allocator holding real SmolLM2 bytes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sleep_fakes import FakeCuMemAllocator, LoadedModel, load_checkpoint

from coldsnap_core.format.manifest import ModelIdentity
from coldsnap_core.identity.model_identity import identify_checkpoint


@pytest.fixture(scope="session")
def smollm2_identity(smollm2_2layer: Path) -> ModelIdentity:
    """The pinned identity of the 2-layer SmolLM2 checkpoint (every file's size and SHA-256)."""
    return identify_checkpoint(sorted(smollm2_2layer.glob("*.safetensors")), source=str(smollm2_2layer))


@pytest.fixture
def allocator() -> Iterator[FakeCuMemAllocator]:
    fake = FakeCuMemAllocator()
    yield fake
    fake.close()


@pytest.fixture
def loaded(allocator: FakeCuMemAllocator, smollm2_2layer: Path) -> LoadedModel:
    """SmolLM2 (2 layers, bf16) loaded into fake CuMem "weights" segments, with buffers and slack."""
    return load_checkpoint(allocator, smollm2_2layer)
