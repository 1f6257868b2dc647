"""Artifact names as small reference documents ``refs/<name>.json`` in every store but an OCI registry
(``docs/format.md`` §12.9)."""

from __future__ import annotations

from coldsnap_core.errors import PayloadUnavailableError
from coldsnap_core.format.descriptor import ArtifactReference
from coldsnap_core.stores.base import NO_SUCH_NAME_REMEDY, ArtifactListing, PublishedArtifact, StoreObject, reference_relpath


class ReferenceIndex:
    """The :class:`~coldsnap_core.stores.base.ArtifactIndex` of ``refs/<name>.json``; the store mixing it in gives
    ``name``, ``location``, ``put_reference`` (atomic for a reader) and ``get_reference`` (its bytes, or ``None``)."""

    record_kind = "name"

    def check_artifact(self, listing: ArtifactListing) -> None:
        """Nothing to refuse but a bad name: a name may move to another artifact."""
        reference_relpath(listing.name)

    def publish_artifact(self, listing: ArtifactListing) -> str:
        """Write ``refs/<name>.json`` naming ``listing``'s ``artifact.json``; returns where it is."""
        relpath = reference_relpath(listing.name)
        document = ArtifactReference(artifact_sha256=listing.artifact.sha256, size_bytes=listing.artifact.size_bytes)
        self.put_reference(relpath, document.dumps())  # type: ignore[attr-defined]
        return self.location(StoreObject(relpath, ""))  # type: ignore[attr-defined]

    def resolve_artifact(self, name: str) -> PublishedArtifact:
        """The artifact ``refs/<name>.json`` names; raises as :meth:`ArtifactIndex.resolve_artifact` (and for a bad name)."""
        relpath = reference_relpath(name)
        where = self.location(StoreObject(relpath, ""))  # type: ignore[attr-defined]
        data = self.get_reference(relpath, ArtifactReference.MAX_BYTES)  # type: ignore[attr-defined]
        if data is None:
            raise PayloadUnavailableError(
                f"{self.name} records no artifact named {name!r}",  # type: ignore[attr-defined]
                file=where,
                remedy=NO_SUCH_NAME_REMEDY,
            )
        reference = ArtifactReference.loads(data, file=where)
        return PublishedArtifact(reference.artifact_sha256, reference.size_bytes)
