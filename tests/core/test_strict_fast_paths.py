"""The fast paths of strict parsing (``from_plain``) agree with the strict parsers (``from_fields``).

A manifest's allocations, tensors and extents are read by ``from_plain`` first; only an item it does not
accept goes through ``from_fields``, which raises the error naming its JSON path. Both must decide alike:
``from_plain`` may decline what ``from_fields`` accepts (it then costs time), never accept what
``from_fields`` refuses, and what it accepts must be the very object ``from_fields`` builds. Every item of a
real SmolLM2 capture's manifests is checked, and each field of one item of every kind is replaced by every
value of another JSON type, a boundary number and an empty string.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from core_support import Captured

from coldsnap_core.errors import ManifestError
from coldsnap_core.format._strict import MAX_OFFSET_BYTES, Fields
from coldsnap_core.format.allocation import Allocation, TensorPlacement
from coldsnap_core.format.extents import ExtentProvenance, ModelExtent, ResidualExtent

KINDS: dict[str, tuple[type, Callable[[dict], list[Any]]]] = {
    "allocation": (Allocation, lambda doc: doc["allocations"]),
    "tensor": (TensorPlacement, lambda doc: [t for a in doc["allocations"] for t in a["tensors"]]),
    "model-extent": (ModelExtent, lambda doc: doc["model_extents"]),
    "provenance": (ExtentProvenance, lambda doc: [e["provenance"] for e in doc["model_extents"]]),
    "residual-extent": (ResidualExtent, lambda doc: doc["residual_extents"]),
}

REPLACEMENTS: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    1.0,
    MAX_OFFSET_BYTES,
    MAX_OFFSET_BYTES + 1,
    "",
    "x",
    "a" * 64,
    "bfloat16",
    [],
    [1, 2],
    [True],
    [-1],
    {},
]


def _strict(cls: type, raw: Any) -> Any:
    """``cls.from_fields`` on ``raw``, or the ``ManifestError`` it raises."""
    try:
        return cls.from_fields(Fields(raw, "item", "/capsule/native-manifest.json"))
    except ManifestError as exc:
        return exc


def _mutations(item: dict) -> list[dict]:
    """``item`` with one key removed, one unknown key added, or one value (or a list's first value) replaced."""
    out = [{**item, "unknown": 0}]
    for key, value in item.items():
        out.append({k: v for k, v in item.items() if k != key})
        for replacement in REPLACEMENTS:
            out.append({**item, key: replacement})
        if isinstance(value, list) and value:
            for replacement in REPLACEMENTS:
                out.append({**item, key: [replacement, *value[1:]]})
        if isinstance(value, dict):
            out.extend({**item, key: nested} for nested in _mutations(value))
        if isinstance(value, list) and value and isinstance(value[0], dict):
            out.extend({**item, key: [nested, *value[1:]]} for nested in _mutations(value[0]))
    return out


@pytest.fixture(scope="module")
def native_document(captured_2layer: Captured) -> dict:
    return json.loads(captured_2layer.manifest_path.read_text())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_real_item_takes_the_fast_path_to_the_same_object(native_document: dict, kind: str) -> None:
    """Fails if a fast path declines a valid item (the manifest is then parsed the slow way: the restore's time
    outside hydration grows) or builds a different object than the strict parser (a field swapped, a list kept
    as a list instead of a tuple)."""
    cls, items = KINDS[kind]
    real = items(native_document)
    assert real, f"the capture has no {kind}"
    for raw in real:
        fast = cls.from_plain(raw)
        assert fast is not None, f"{kind} {raw} took the slow path"
        strict = _strict(cls, raw)
        assert fast == strict and type(fast.to_json()) is dict
        if hasattr(fast, "shape"):
            assert type(fast.shape) is tuple and type(fast.stride) is tuple


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_fast_path_never_accepts_what_the_strict_parser_refuses(native_document: dict, kind: str) -> None:
    """Fails if a fast path is looser than its strict parser in any rule: a missing or unknown key, a boolean or
    float where an integer belongs, a negative or overflowing number, an empty string, an unknown dtype, a
    malformed digest, a shape and stride of different rank, a tensor beyond its allocation, a nested item it
    does not check."""
    cls, items = KINDS[kind]
    item = copy.deepcopy(items(native_document)[0])
    checked = refused = 0
    for mutated in _mutations(item):
        fast = cls.from_plain(mutated)
        strict = _strict(cls, mutated)
        if isinstance(strict, ManifestError):
            refused += 1
            assert fast is None, f"{kind}: the fast path accepted {mutated}, which the strict parser refuses: {strict}"
        elif fast is not None:
            assert fast == strict
        checked += 1
    assert refused > len(item), f"{kind}: only {refused} of {checked} mutations were refused; the mutations miss rules"
