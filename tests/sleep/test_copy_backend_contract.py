"""The ``CopyBackend`` contract (``coldsnap_core.copy.base``), run by every implementation: the host
backend, and the CUDA backend driven on CPU through ``FakeDeviceOps`` (CUDA's asynchronous contract
over host memory). A new backend joins :data:`BACKENDS` and must pass every test here."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from sleep_fakes import FakeDeviceOps

from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.copy.cuda import CudaCopyBackend
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import CopyBackendError
from coldsnap_core.format.allocation import LiveAllocation

CHUNK_BYTES = 4096  # the CUDA backend reads in multiples of 4096 bytes
SIZE_BYTES = 4 * CHUNK_BYTES

BACKENDS: dict[str, Callable[[], CopyBackend]] = {
    "host": lambda: HostCopyBackend(chunk_bytes=CHUNK_BYTES),
    "cuda-on-fake-device": lambda: CudaCopyBackend(ops=FakeDeviceOps(), read_chunk_bytes=CHUNK_BYTES),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> CopyBackend:
    return BACKENDS[request.param]()


@pytest.fixture
def allocation() -> tuple[LiveAllocation, np.ndarray]:
    array = (np.arange(SIZE_BYTES) % 251).astype(np.uint8)
    return LiveAllocation(7, array.ctypes.data, array.nbytes), array


def test_read_chunks_yields_exactly_the_range_in_bounded_chunks(backend: CopyBackend, allocation) -> None:
    """Catches a backend that reads the wrong bytes, drops or repeats a chunk, or ignores its chunk
    size (capture hashes and writes what ``read_chunks`` yields)."""
    live, array = allocation
    chunks = [bytes(c) for c in backend.read_chunks(live, 100, SIZE_BYTES - 100)]
    assert b"".join(chunks) == array[100:].tobytes()
    assert [len(c) for c in chunks] == [4096, 4096, 4096, 3996]
    assert [bytes(c) for c in backend.read_chunks(live, SIZE_BYTES - 1, 1)] == [array[-1:].tobytes()]
    assert list(backend.read_chunks(live, SIZE_BYTES, 0)) == []


@pytest.mark.parametrize(
    ("offset_bytes", "size_bytes"), [(SIZE_BYTES - 5, 10), (-1, 5), (0, SIZE_BYTES + 1), (10, -5), (SIZE_BYTES, 1)]
)
def test_read_chunks_refuses_ranges_outside_the_allocation(
    backend: CopyBackend, allocation, offset_bytes: int, size_bytes: int
) -> None:
    """Catches reads outside an allocation (raw addresses: that would read another object's memory)
    or a negative size taken as an empty read: a ``CopyBackendError`` naming the allocation and the
    offset, before any byte is read."""
    live, _ = allocation
    with pytest.raises(CopyBackendError) as info:
        list(backend.read_chunks(live, offset_bytes, size_bytes))
    assert (info.value.allocation, info.value.offset_bytes) == (7, offset_bytes)
    assert "outside the allocation" in str(info.value)
