"""A restore reads each thing once: the pack's padding is scanned once per admission (``docs/format.md`` §7,
the ``hydrate`` entries), on the engine-free tiny model of ``test_worker_restore``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.copy.torch_allocations import enumerate_allocations
from coldsnap_core.restore import hydrate as hydrate_module
from tests.restore.test_worker_restore import TinyModel, capture, restorer
from tests.support.observer_support import write_checkpoint


def test_a_first_use_admission_scans_the_padding_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore of a pack without a validation record admits it by checking it against the manifest's layout,
    which reads every padding byte; hydration then does not read the padding again (the record follows on a
    background thread). A restore whose
    admission trusted the record (a new cache object, the record the first restore wrote) reads it once, in
    hydration. Fails if a first-use restore scans the padding twice (once in admission, once in hydration),
    or if a trusted admission skips the padding check."""
    folder = tmp_path / "model"
    folder.mkdir()
    checkpoint = write_checkpoint(folder)
    loaded = TinyModel()
    result = capture(loaded, checkpoint, tmp_path / "artifact", tmp_path / "state")
    record = PayloadCache(tmp_path / "state").record_path(result.manifest.pack.sha256)
    os.chmod(record, 0o644)
    os.unlink(record)
    scans: list[str] = []
    real = hydrate_module.check_pack_padding

    def counted(path, layout):  # the real check, counted
        scans.append(str(path))
        return real(path, layout)

    monkeypatch.setattr(hydrate_module, "check_pack_padding", counted)
    first = TinyModel()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state")
    attempt.run(enumerate_allocations(first), HostCopyBackend())
    assert first.snapshot() == loaded.snapshot()
    assert scans == [], "the first-use admission read the padding already"
    assert attempt.cache.wait_for_records(30.0)
    assert os.path.exists(record), "the whole-file hash after the first use wrote no validation record"

    second = TinyModel()
    restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(second), HostCopyBackend())
    assert second.snapshot() == loaded.snapshot()
    assert len(scans) == 1, "an admission on a trusted record must have its padding read by hydration"
