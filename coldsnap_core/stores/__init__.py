"""Payload stores: where packs come from when the node-local cache lacks them, and go on publication.

Configured by ``COLDSNAP_PAYLOAD_DIR=/path`` (:class:`LocalFolderStore`) or ``COLDSNAP_PAYLOAD_REPO=<spec>``
(:func:`parse_store_spec`), ``docs/format.md`` §12; neither means the node-local cache only.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping

from coldsnap_core.errors import ColdsnapError, ConfigurationError, redact_store_spec
from coldsnap_core.settings import (
    COMMAND_SETTINGS,
    HF_REF_SCHEME,
    PAYLOAD_DIR_ENV,
    PAYLOAD_REPO_ENV,
    PAYLOAD_REPO_TYPE_ENV,
    ColdsnapSettings,
    StoreClientSettings,
    StoreSettings,
    expand_path,
)
from coldsnap_core.stores.base import PayloadStore, check_artifact_name, refused_character_message
from coldsnap_core.stores.local import LocalFolderStore

__all__ = [
    "PAYLOAD_DIR_ENV",
    "PAYLOAD_REPO_ENV",
    "PAYLOAD_REPO_TYPE_ENV",
    "LocalFolderStore",
    "PayloadStore",
    "artifact_ref",
    "from_env",
    "from_settings",
    "parse_artifact_ref",
    "parse_store_spec",
]


def _looks_like_path(spec: str) -> bool:
    return spec in (".", "..") or spec.startswith(("/", "./", "../", "~", "file://"))


_AZURE_CONNECTION_KEYS = frozenset(
    {
        "accountname",
        "accountkey",
        "sharedaccesssignature",
        "blobendpoint",
        "defaultendpointsprotocol",
        "endpointsuffix",
        "usedevelopmentstorage",
    }
)
_URL_STORES = {
    "s3://": ("s3", "S3PayloadStore"),
    "oci://": ("oci", "OciPayloadStore"),
    "gs://": ("gcs", "GcsPayloadStore"),
    "az://": ("azure", "AzurePayloadStore"),
}
"""The store class of each URL scheme (imported when used: each needs its own client library)."""
_URL_SCHEMES = tuple(_URL_STORES)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
ACCEPTED_STORE_FORMS = (
    "s3://bucket[/prefix], gs://bucket[/prefix], az://account/container[/prefix], oci://HOST[:PORT]/NAMESPACE/NAME,"
    " hf://org/name[@revision] or org/name[@revision] (Hugging Face), a folder (/abs, ./rel, ~/p, file:///abs)"
)
"""Every spelling of a payload store, for the messages that refuse one (``docs/format.md`` §12)."""
_SPELL_THE_STORE = f"spell the store as one of: {ACCEPTED_STORE_FORMS}"


def _refuse_unknown_form(spec: str) -> None:
    """``ConfigurationError`` for an unknown or mis-spelled scheme (``s3:/b``, ``S3://b``, ``http://``) or a bare
    word, before it could be sent to the Hub as a repository id."""
    scheme = _SCHEME.match(spec)
    if scheme is not None:
        name = scheme.group(1)
        known = next((s for s in (*_URL_SCHEMES, HF_REF_SCHEME, "file://") if s[:-3] == name.lower()), None)
        if known is not None and name != known[:-3]:
            why = f"the scheme {name!r} is spelled {known!r} (lower case)"
        elif known is not None:
            why = f"the scheme {name!r} must be followed by '//' ({known}...)"
        else:
            why = f"the scheme {name!r} is not one coldsnap reads"
        raise ConfigurationError(f"payload store {spec!r}: {why}", remedy=_SPELL_THE_STORE)
    if "/" not in spec.partition("@")[0]:
        # a folder of that name here is what the operator most likely meant (a folder store is /abs, ./rel or ~/x)
        here = os.path.isdir(spec)
        raise ConfigurationError(
            f"payload store {spec!r} is neither a URL, a folder nor a Hugging Face repository (org/name): coldsnap"
            " does not send a bare word to the Hub (a Hub repository without an organization is hf://name)"
            + (f"; a folder {spec!r} exists here" if here else ""),
            remedy=f"write the folder as ./{spec}" if here else _SPELL_THE_STORE,
        )


def _looks_like_azure_connection_string(spec: str) -> bool:
    """Any ``key=value`` list naming an Azure connection string's key (the Azure parser refuses a wrong one)."""
    keys = {part.split("=", 1)[0].strip().lower() for part in spec.split(";") if "=" in part}
    return bool(keys & _AZURE_CONNECTION_KEYS)


def parse_store_spec(spec: str, *, repo_type: str = "model", client: StoreClientSettings | None = None) -> PayloadStore:
    """:func:`_parse_store_spec`, every error's detail redacted (:func:`redact_store_spec`)."""
    try:
        return _parse_store_spec(spec, repo_type=repo_type, client=client or StoreClientSettings())
    except ColdsnapError as exc:
        exc.detail = redact_store_spec(exc.detail)
        exc.args = (exc._compose(),)
        raise exc from None


def _file_url_path(spec: str) -> str:
    """The path of a folder spec: ``file:///abs`` and ``file://localhost/abs`` name ``/abs`` (RFC 8089);
    ``ConfigurationError`` for another host, a ``user:password@`` or no absolute path (never quoting the host)."""
    if not spec.startswith("file://"):
        return spec
    host, slash, path = spec[len("file://") :].partition("/")
    if host not in ("", "localhost") or not slash:
        raise ConfigurationError(
            "a file:// payload store must be file:///absolute/path (no host other than localhost, no user or"
            " password): coldsnap reads folders on this machine only; mount a remote share and give its path"
        )
    return "/" + path


def _parse_store_spec(spec: str, *, repo_type: str, client: StoreClientSettings) -> PayloadStore:
    """A store from a ``--repo`` / ``COLDSNAP_PAYLOAD_REPO`` value (the table of ``docs/format.md`` §12); raises
    ``ConfigurationError`` for an empty value or revision, a bad repository id or type, scheme, URL, or a bare word."""
    spec = spec.strip()
    if not spec:
        raise ConfigurationError("the payload store is empty; give a folder path or a Hugging Face repository id")
    if _looks_like_path(spec):
        return LocalFolderStore(expand_path(_file_url_path(spec), "the payload store"))
    if spec.startswith(HF_REF_SCHEME):
        spec = spec[len(HF_REF_SCHEME) :]
    elif not _looks_like_azure_connection_string(spec) and not spec.startswith(_URL_SCHEMES):
        _refuse_unknown_form(spec)
    scheme = next((s for s in _URL_SCHEMES if spec.startswith(s)), None)
    if scheme is not None:  # a user:password@ or a refused character, before the store's parser
        if "@" in spec[len(scheme) :].partition("/")[0] and scheme != "oci://":  # oci's parser refuses it in its own words
            raise ConfigurationError(
                f"{spec!r}: the {scheme} payload store URL must not hold a user or password ('user:password@'):"
                " credentials come from the store's own variables or files"
            )
        if refused := refused_character_message(f"{spec!r}: the {scheme} payload store URL", spec):
            raise ConfigurationError(refused)
    if scheme is not None or _looks_like_azure_connection_string(spec):
        module, cls = _URL_STORES[scheme or "az://"]
        store_class = getattr(importlib.import_module(f"coldsnap_core.stores.{module}"), cls)
        return store_class.from_url(spec, client_settings=client)
    try:
        from coldsnap_core.stores.hf import HfPayloadStore
    except ValueError as exc:  # huggingface_hub parses HF_ENDPOINT when it is imported
        raise ConfigurationError(
            f"HF_ENDPOINT={os.environ.get('HF_ENDPOINT', '')!r} is not a URL huggingface_hub accepts: {exc}"
        ) from exc
    repo_id, at, revision = spec.partition("@")
    if at and not revision:
        raise ConfigurationError(f"payload repository {spec!r} has an empty revision after '@'")
    return HfPayloadStore(repo_id, revision=revision or None, repo_type=repo_type)


def parse_artifact_ref(ref: str, *, client: StoreClientSettings | None = None) -> tuple[PayloadStore, str]:
    """The store and the artifact name a REF designates: ``oci://HOST/NS/REPO:TAG``, else ``STORE/NAME``
    (``docs/format.md`` §12.9); ``ConfigurationError`` for a REF without a tag or name, or a refused store part."""
    ref = ref.strip()
    if ref.startswith("oci://"):
        store = parse_store_spec(ref, client=client)
        tag = getattr(store, "tag", None)
        if tag is None:
            raise ConfigurationError(f"{redact_store_spec(ref)!r} names no artifact: an OCI REF ends in :TAG")
        return store, tag
    spec, slash, name = ref.removeprefix(HF_REF_SCHEME).rstrip("/").rpartition("/")
    if not slash or not name:
        raise ConfigurationError(f"{redact_store_spec(ref)!r} names no artifact: a REF is STORE/NAME (or oci://HOST/NS/REPO:TAG)")
    return parse_store_spec(spec or "/", client=client), check_artifact_name(name)


def artifact_ref(spec: str, store: PayloadStore, name: str) -> str:
    """The REF :func:`parse_artifact_ref` reads back for ``name`` published to ``store`` (given as ``spec``)."""
    spec = spec.strip().rstrip("/")
    if spec.startswith("oci://"):
        from coldsnap_core.stores.oci import OciPayloadStore

        assert isinstance(store, OciPayloadStore)
        return f"oci://{store.registry}/{store.repository}:{store.tag or name}"
    hub = not (_looks_like_path(spec) or spec.startswith((*_URL_SCHEMES, HF_REF_SCHEME)))
    hub = hub and not _looks_like_azure_connection_string(spec)
    return f"{HF_REF_SCHEME if hub else ''}{spec}/{name}"


def from_settings(settings: StoreSettings) -> PayloadStore | None:
    """The payload store ``settings`` configure, or ``None``; ``ConfigurationError`` naming the variable."""
    if settings.payload_dir is not None:
        return LocalFolderStore(expand_path(settings.payload_dir, PAYLOAD_DIR_ENV))
    if settings.payload_repo is not None:
        try:
            return parse_store_spec(settings.payload_repo, repo_type=settings.repo_type, client=settings.client)
        except ConfigurationError as exc:
            shown = redact_store_spec(repr(settings.payload_repo))
            raise ConfigurationError(
                f"{settings.repo_where}={shown} (repository type {settings.repo_type!r}): {exc.detail}",
                remedy=exc.remedy,
            ) from None  # the cause would quote the unredacted value again
    return None


def from_env(environ: Mapping[str, str] | None = None) -> PayloadStore | None:
    """The payload store the environment configures (as ``coldsnap`` resolves it), or ``None`` (``ConfigurationError``)."""
    return from_settings(ColdsnapSettings.resolve(environ, rows=COMMAND_SETTINGS)[0].store)
