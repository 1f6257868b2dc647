#!/usr/bin/env python3
"""Capture a worker and restore it into a fresh model with ``coldsnap_core`` alone: no engine, no plugin.

What an engine plugin does, with a small torch model standing in for the engine's model:

1. write a real safetensors checkpoint (``safetensors.torch.save_file``);
2. build the model, load the checkpoint into it under :class:`coldsnap_core.WriteObserver` (each tensor
   registered as a checkpoint source, the way an engine's weights iterator yields them), and capture it
   with :func:`coldsnap_core.capture_worker`: the pack goes to the node-local cache, the residual blob and
   manifests to the artifact's capsule;
3. check the artifact with :func:`coldsnap_core.verify_artifact` (every rule over every byte);
4. build a fresh model and restore it with :func:`coldsnap_core.restore_or_fall_back`: layout, model
   identity and manifest checked once each, the pack admitted once, every allocation filled from the pack
   and the residual blob; no checkpoint byte is read;
5. compare every parameter and buffer with the loaded model.

Usage::

    python examples/restore_without_engine.py [--workdir DIR]

``--workdir`` (default: a temporary folder, removed at the end) holds the checkpoint, the artifact and the
state root, so nothing is written to ``~/.cache/coldsnap``. Exits with status 1 if the restored model
differs from the loaded one.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import coldsnap_core


class TinyModel(torch.nn.Module):
    """An embedding, one fused q/k/v projection (filled from three checkpoint tensors, as vLLM's
    ``QKVParallelLinear`` is), an output projection and a computed buffer (rotary-like, not in the
    checkpoint: it comes back from the residual blob)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.empty(32, 16, dtype=torch.bfloat16), requires_grad=False)
        self.qkv = torch.nn.Parameter(torch.empty(48, 16, dtype=torch.bfloat16), requires_grad=False)
        self.o = torch.nn.Parameter(torch.empty(16, 16, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))


def write_checkpoint(folder: Path) -> Path:
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    names = {"embed.weight": (32, 16), "q.weight": (16, 16), "k.weight": (16, 16), "v.weight": (16, 16), "o.weight": (16, 16)}
    path = folder / "model.safetensors"
    save_file({name: tensor(*shape) for name, shape in names.items()}, str(path), metadata={"format": "pt"})
    return path


def load_observed(model: TinyModel, checkpoint: Path) -> coldsnap_core.WriteObserver:
    """The model's weight loading, watched: every copy from a registered checkpoint tensor is recorded."""
    sources = coldsnap_core.CheckpointSources()
    header = coldsnap_core.read_header(checkpoint)
    with safe_open(str(checkpoint), framework="pt") as f, torch.no_grad():
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        for name, t in tensors.items():
            sources.register(t, header[name], checkpoint.name)
        with coldsnap_core.WriteObserver(sources) as observer:
            model.embed.copy_(tensors["embed.weight"])
            for i, shard in enumerate(("q.weight", "k.weight", "v.weight")):
                model.qkv.narrow(0, 16 * i, 16).copy_(tensors[shard])
            model.o.copy_(tensors["o.weight"])
    return observer


def snapshot(model: torch.nn.Module) -> dict[str, bytes]:
    return {
        name: t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }


def run(workdir: Path) -> int:
    checkpoint_dir = workdir / "checkpoint"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = write_checkpoint(checkpoint_dir)
    artifact_dir, state_root = workdir / "artifact", workdir / "state"
    worker = coldsnap_core.WorkerIdentity("worker", 0, 1, 0, 1)  # rank 0 of 1, tensor parallel rank 0 of 1
    cache = coldsnap_core.PayloadCache(state_root)

    loaded = TinyModel()
    observer = load_observed(loaded, checkpoint)
    allocations = coldsnap_core.enumerate_allocations(loaded)
    model_ranges, _ = coldsnap_core.map_to_allocations(observer.model_records(), allocations)
    identity = coldsnap_core.identify_checkpoint(
        [checkpoint],
        source=str(checkpoint_dir),
        root=checkpoint_dir,
        records=coldsnap_core.CheckpointRecords(state_root),
    )
    captured = coldsnap_core.capture_worker(
        allocation_map=allocations.allocation_map,
        allocations=allocations.live,
        model_ranges=model_ranges,
        worker=worker,
        capture_point="portable",
        model=identity,
        cache=cache,
        artifact_dir=artifact_dir,
        backend=coldsnap_core.copy_backend_for(allocations.device),
    )
    print(
        f"captured {worker.capsule_name}: pack {captured.manifest.pack.sha256[:12]} ({captured.manifest.model_bytes} model"
        f" bytes), residual blob {captured.manifest.residual_bytes} bytes"
    )
    for verified in coldsnap_core.verify_artifact(artifact_dir, cache=cache):
        print(
            f"verified {verified.worker.capsule_name}: pack {verified.pack.sha256[:12]}, {verified.model_extents} model extents"
        )

    fresh = TinyModel()
    settings, _ = coldsnap_core.ColdsnapSettings.resolve(
        {}, {"artifact_dir": str(artifact_dir), "state_root": str(state_root), "restore": "native"}
    )
    result = coldsnap_core.restore_or_fall_back(
        fresh, settings, worker, coldsnap_core.LoadedModel.from_config(str(checkpoint_dir), None)
    )
    assert result.restored and result.report is not None
    print(
        f"restored {worker.capsule_name}: {result.report.model_bytes} bytes from the pack, {result.report.residual_bytes} from the blob"
    )
    if snapshot(fresh) != snapshot(loaded):
        print("the restored model differs from the loaded one", file=sys.stderr)
        return 1
    print("ok: every parameter and buffer of the restored model equals the loaded one")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.workdir is not None:
        return run(args.workdir)
    with tempfile.TemporaryDirectory(prefix="coldsnap-example-") as folder:
        return run(Path(folder))


if __name__ == "__main__":
    sys.exit(main())
