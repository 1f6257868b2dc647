#!/usr/bin/env python3
"""Upload and fetch throughput of each payload store on loopback, against a plain file copy of the same bytes.

One pack-sized file of ``--size-mib`` MiB of random bytes (named by its SHA-256, as a pack is) is
moved ``--repetitions`` times per operation, medians printed side by side:

* ``file copy``: the reference, ``shutil.copyfile`` of the file to a new file on the same file system
  (what any store's upload or fetch must at least do, without a network or a server);
* ``folder``: :class:`LocalFolderStore` upload (copy, fsync, full SHA-256 of the copy, link) and fetch
  (kernel copy into a temporary file);
* ``s3``: :class:`S3PayloadStore` against ``moto_server`` in its own process on 127.0.0.1 (multipart
  with SHA-256 per 64 MiB part, 8 in flight; fetch as parallel ranged GETs), a fresh key each upload;
* ``hf``: :class:`HfPayloadStore` with the real ``huggingface_hub`` client against the tests' local Hub
  (``tests/cache/local_hub.py``) in its own process, a fresh repository each upload (LFS basic transfer,
  ``HF_HUB_DISABLE_XET=1``); fetch is ``hf_hub_download`` plus the kernel copy into the temporary;
* ``oci``: :class:`OciPayloadStore` against Debian's ``docker-registry`` (a Go process) on 127.0.0.1, a fresh
  repository each upload (64 MiB ``PATCH`` chunks and a closing ``PUT``; fetch as parallel ranged GETs);
* ``gcs``: :class:`GcsPayloadStore` with ``google-cloud-storage`` against ``fake-gcs-server`` (Go, filesystem
  backend), a fresh prefix each upload (resumable upload in 64 MiB chunks; fetch as parallel ranged reads);
* ``azure``: :class:`AzurePayloadStore` with ``azure-storage-blob`` against ``azurite`` (Node.js), a fresh prefix
  each upload (64 MiB blocks and ``Put Block List``; fetch as parallel ranged downloads).

The registry, fake-gcs-server and azurite are what ``scripts/setup-store-servers.sh`` installs for the tests.

Fetches write into a temporary file only; the cache's verification (one SHA-256 pass, measured by
``benchmarks/verify.py``) is not included. Both servers are Python test servers, so the figures bound
the client overhead from below, not what a real S3 or Hub would give. Nothing is asserted. Usage::

    .venv/bin/python benchmarks/stores.py [--size-mib 128] [--repetitions 3] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, MiB, machine_line, median_seconds, print_table, warm_page_cache

sys.path.insert(0, str(REPO / "tests" / "cache"))


def _fetch(store, digest: str, size: int, target: Path) -> None:
    target.unlink(missing_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        store.fetch(digest, size, fd, file=target)
    finally:
        os.close(fd)
    shutil.rmtree(target.with_name(target.name + ".d"), ignore_errors=True)


def _new_stores(work: Path, source: Path, digest: str, size: int, fetched: Path, repetitions: int, counter, procs) -> dict:
    """Upload and fetch medians of the OCI, GCS and Azure stores against their servers (started here)."""
    from store_processes import AZURITE_KEY, Azurite, FakeGcs, Registry

    from coldsnap_core.stores.azure import AzurePayloadStore
    from coldsnap_core.stores.gcs import GcsPayloadStore
    from coldsnap_core.stores.oci import OciPayloadStore

    times = {}
    registry = Registry(work / "registry")
    registry.start()
    procs.append(registry)
    repo = {"value": "bench/r0"}

    def oci_upload() -> None:
        repo["value"] = f"bench/r{next(counter)}"
        OciPayloadStore(registry.registry, repo["value"]).upload(source, digest, size)

    up = median_seconds(oci_upload, repetitions)
    down = median_seconds(lambda: _fetch(OciPayloadStore(registry.registry, repo["value"]), digest, size, fetched), repetitions)
    times["oci"] = (up, down)

    gcs = FakeGcs(work / "fake-gcs")
    gcs.start()
    procs.append(gcs)
    os.environ["STORAGE_EMULATOR_HOST"] = gcs.url
    from google.cloud import storage

    storage.Client().create_bucket("bench")
    prefix = {"value": "p0"}

    def gcs_upload() -> None:
        prefix["value"] = f"p{next(counter)}"
        GcsPayloadStore("bench", prefix["value"]).upload(source, digest, size)

    up = median_seconds(gcs_upload, repetitions)
    down = median_seconds(lambda: _fetch(GcsPayloadStore("bench", prefix["value"]), digest, size, fetched), repetitions)
    times["gcs"] = (up, down)

    azurite = Azurite(work / "azurite")
    azurite.start()
    procs.append(azurite)
    os.environ.update(AZURE_STORAGE_BLOB_ENDPOINT=azurite.endpoint, AZURE_STORAGE_KEY=AZURITE_KEY)
    from azure.storage.blob import BlobServiceClient

    BlobServiceClient.from_connection_string(azurite.connection_string).create_container("bench")

    def azure_upload() -> None:
        prefix["value"] = f"p{next(counter)}"
        AzurePayloadStore("bench", prefix["value"], account="devstoreaccount1").upload(source, digest, size)

    up = median_seconds(azure_upload, repetitions)
    down = median_seconds(
        lambda: _fetch(AzurePayloadStore("bench", prefix["value"], account="devstoreaccount1"), digest, size, fetched),
        repetitions,
    )
    times["azure"] = (up, down)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--tmp", type=Path, default=None, help="folder for the files (default: $TMPDIR)")
    args = parser.parse_args()
    os.environ.update(HF_HUB_DISABLE_XET="1", HF_HUB_OFFLINE="0", HF_HUB_DISABLE_PROGRESS_BARS="1")
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")

    from huggingface_hub import HfApi

    from coldsnap_core.stores.hf import HfPayloadStore
    from coldsnap_core.stores.local import LocalFolderStore
    from coldsnap_core.stores.s3 import S3PayloadStore, _default_client

    size = args.size_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="coldsnap-bench-stores-", dir=args.tmp))
    procs: list[subprocess.Popen] = []
    try:
        source = work / "pack"
        source.write_bytes(os.urandom(size))
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        warm_page_cache(source)
        fetched = work / "fetched.partial"
        times: dict[str, tuple[float, float]] = {}

        copy_target = work / "copy"
        copy_s = median_seconds(lambda: shutil.copyfile(source, copy_target), args.repetitions)
        copy_target.unlink()

        # folder
        counter = iter(range(10**6))
        folder_root = work / "folder"

        def folder_upload() -> None:
            shutil.rmtree(folder_root, ignore_errors=True)
            LocalFolderStore(folder_root).upload(source, digest, size)

        up = median_seconds(folder_upload, args.repetitions)
        down = median_seconds(lambda: _fetch(LocalFolderStore(folder_root), digest, size, fetched), args.repetitions)
        times["folder"] = (up, down)

        # s3: moto_server in its own process
        from store_processes import MotoProcess

        moto = MotoProcess(work / "moto")
        moto.start()
        procs.append(moto)
        os.environ["AWS_ENDPOINT_URL"] = moto.url
        client = _default_client()
        client.create_bucket(Bucket="bench")
        s3_prefix = {"value": "p0"}

        def s3_upload() -> None:
            s3_prefix["value"] = f"p{next(counter)}"
            S3PayloadStore("bench", s3_prefix["value"], client=client).upload(source, digest, size)

        up = median_seconds(s3_upload, args.repetitions)
        down = median_seconds(
            lambda: _fetch(S3PayloadStore("bench", s3_prefix["value"], client=client), digest, size, fetched), args.repetitions
        )
        times["s3"] = (up, down)

        # hf: the local Hub in its own process, a fresh repository per upload
        hub = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "cache" / "local_hub.py"), str(work / "hub")], stdout=subprocess.PIPE, text=True
        )
        procs.append(hub)
        url = hub.stdout.readline().strip()
        api = HfApi(endpoint=url)
        repo = {"value": "bench/r0"}

        def hf_upload() -> None:
            for blob in (work / "hub" / "lfs").glob(digest):
                blob.unlink()  # the Hub would otherwise answer "already present" and nothing would move
            repo["value"] = f"bench/r{next(counter)}"
            HfPayloadStore(repo["value"], api=api).upload(source, digest, size)

        up = median_seconds(hf_upload, args.repetitions)
        down = median_seconds(lambda: _fetch(HfPayloadStore(repo["value"], api=api), digest, size, fetched), args.repetitions)
        times["hf"] = (up, down)

        times.update(_new_stores(work, source, digest, size, fetched, args.repetitions, counter, procs))

        print(machine_line())
        print(f"{args.size_mib} MiB, median of {args.repetitions}; file copy {copy_s:.3f} s ({size / MiB / copy_s:.0f} MiB/s)")
        rows = [
            [
                "file copy",
                f"{copy_s:.3f}",
                f"{size / MiB / copy_s:.0f}",
                "1.00",
                f"{copy_s:.3f}",
                f"{size / MiB / copy_s:.0f}",
                "1.00",
            ]
        ]
        for name, (up, down) in times.items():
            rows.append(
                [
                    name,
                    f"{up:.3f}",
                    f"{size / MiB / up:.0f}",
                    f"{up / copy_s:.2f}",
                    f"{down:.3f}",
                    f"{size / MiB / down:.0f}",
                    f"{down / copy_s:.2f}",
                ]
            )
        print_table(["store", "upload s", "MiB/s", "x copy", "fetch s", "MiB/s", "x copy"], rows)
    finally:
        for proc in procs:
            if isinstance(proc, subprocess.Popen):
                proc.terminate()
                proc.wait(timeout=30)
            else:  # a store_processes server
                proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
