"""The model identity on real files: the configuration digest and the node-local checkpoint records.

The configuration digest is computed from the real SmolLM2 ``config.json`` as ``transformers``
loads it; checkpoint records are written by hashing the real 2-layer checkpoint (QA defects 2, 3, 5).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import transformers

from coldsnap_core.errors import UnsafePathError
from coldsnap_core.model_identity import (
    CheckpointRecords,
    RecordState,
    canonical_model_config,
    identify_checkpoint,
    model_config_sha256,
)


@pytest.fixture(scope="module")
def hf_config(smollm2_2layer: Path) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.from_pretrained(smollm2_2layer)


def test_config_digest_sees_values_the_layout_cannot(hf_config, smollm2_2layer: Path, tmp_path: Path) -> None:
    """QA defect 2: another ``rope_theta`` (through ``rope_parameters``, or an overriding attribute as
    vLLM's ``--hf-overrides`` sets it), another dtype or quantization changes the digest; the same config read
    from another path (``_name_or_path``) or written by another transformers version does not."""
    base = model_config_sha256(hf_config, dtype="bfloat16")
    copy_dir = tmp_path / "elsewhere"
    shutil.copytree(smollm2_2layer, copy_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    moved = transformers.AutoConfig.from_pretrained(copy_dir)
    assert moved._name_or_path != hf_config._name_or_path
    moved.transformers_version = "0.0.1"
    assert model_config_sha256(moved, dtype="bfloat16") == base

    rope = transformers.AutoConfig.from_pretrained(smollm2_2layer)
    rope.rope_parameters = {**rope.rope_parameters, "rope_theta": 5000.0}
    overridden = transformers.AutoConfig.from_pretrained(smollm2_2layer)
    overridden.rope_theta = 5000.0  # what vLLM's --hf-overrides '{"rope_theta": 5000}' does
    digests = {
        model_config_sha256(rope, dtype="bfloat16"),
        model_config_sha256(overridden, dtype="bfloat16"),
        model_config_sha256(hf_config, dtype="float32"),
        model_config_sha256(hf_config, dtype="bfloat16", quantization="fp8"),
    }
    assert len(digests) == 4 and base not in digests


def test_config_digest_is_canonical(hf_config) -> None:
    """Catches a digest that depends on attribute order, a torch dtype's spelling or memory addresses:
    a mapping with the same content in another order, and the ``torch.bfloat16`` object, give the
    same canonical JSON; an object without a stable ``repr`` is written by its type name."""
    import torch

    as_mapping = dict(reversed(list(vars(hf_config).items())))
    assert canonical_model_config(as_mapping, dtype=torch.bfloat16) == canonical_model_config(hf_config, dtype="bfloat16")
    assert '"dtype":"bfloat16"' in canonical_model_config(hf_config, dtype=torch.bfloat16)
    assert "0x" not in canonical_model_config({"hook": object()}, dtype="bfloat16")


def test_identify_checkpoint_normalizes_the_folder_and_records_each_file(smollm2_2layer: Path, tmp_path: Path) -> None:
    """QA defects 3 and 5: the identity names a local folder by its real path (``$M/`` and a link to
    ``$M`` give the same identity) and writes one trusted checkpoint record per file, bound to its
    ``stat``, so that a later restore on this node knows the files' digests without reading them."""
    link = tmp_path / "link"
    link.symlink_to(smollm2_2layer)
    records = CheckpointRecords(tmp_path / "state")
    files = [link / "model.safetensors"]
    a = identify_checkpoint(files, source=f"{smollm2_2layer}/", root=link, records=records)
    b = identify_checkpoint(files, source=str(link), root=link)
    assert a == b and a.source == os.path.realpath(smollm2_2layer)
    lookup = records.lookup(link / "model.safetensors")
    assert lookup.state is RecordState.TRUSTED and lookup.sha256 == a.files[0].sha256
    assert oct(os.stat(records.folder).st_mode & 0o777) == "0o700"


def test_a_rewritten_file_makes_its_record_stale(tmp_path: Path) -> None:
    """QA defect 3: a file rewritten with other bytes of the same size no longer matches its record
    (``stat`` changed), so restore cannot take the recorded digest for it; a record that is not
    trusted (group-writable, or another file's) counts as absent; a linked records folder is refused."""
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"a" * 4096)
    records = CheckpointRecords(tmp_path / "state")
    identify_checkpoint([checkpoint], source=str(tmp_path), records=records)
    assert records.lookup(checkpoint).state is RecordState.TRUSTED
    checkpoint.write_bytes(b"b" * 4096)
    stale = records.lookup(checkpoint)
    assert stale.state is RecordState.STALE and "changed since it was hashed" in stale.reason

    record = records.record_path(os.path.realpath(checkpoint))
    os.chmod(record, 0o664)
    assert records.lookup(checkpoint).state is RecordState.ABSENT
    os.chmod(record, 0o444)
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"b" * 4096)
    shutil.copy2(record, records.record_path(os.path.realpath(other)))
    assert records.lookup(other).state is RecordState.ABSENT

    moved = tmp_path / "moved-records"
    os.rename(records.folder, moved)
    records.folder.symlink_to(moved)
    with pytest.raises(UnsafePathError):
        records.lookup(checkpoint)
