"""Payload stores: where packs come from when the node-local cache lacks them, and go on publication.

Configuration (:func:`from_settings`, :func:`from_env`; parsed by :class:`coldsnap_core.settings.StoreSettings`,
also settable by the engine plugins' extra-config keys ``payload_dir``, ``payload_repo``, ``payload_repo_type``):

* ``COLDSNAP_PAYLOAD_DIR=/path``: a local or shared folder (:class:`LocalFolderStore`);
* ``COLDSNAP_PAYLOAD_REPO=s3://bucket[/prefix]``: an S3-compatible bucket
  (:class:`coldsnap_core.stores.s3.S3PayloadStore`; endpoint and credentials from the AWS variables);
* ``COLDSNAP_PAYLOAD_REPO=oci://HOST[:PORT]/NAMESPACE/NAME[:TAG]``: an OCI registry
  (:class:`coldsnap_core.stores.oci.OciPayloadStore`; credentials from the Docker config file);
* ``COLDSNAP_PAYLOAD_REPO=gs://bucket[/prefix]``: Google Cloud Storage
  (:class:`coldsnap_core.stores.gcs.GcsPayloadStore`; credentials as ``google-cloud-storage`` finds them);
* ``COLDSNAP_PAYLOAD_REPO=az://account/container[/prefix]`` or a connection string: Azure Blob
  (:class:`coldsnap_core.stores.azure.AzurePayloadStore`);
* ``COLDSNAP_PAYLOAD_REPO=org/name[@revision]``: a Hugging Face repository
  (:class:`coldsnap_core.stores.hf.HfPayloadStore`), with ``COLDSNAP_PAYLOAD_REPO_TYPE=model|dataset``
  (default ``model``); token and endpoint from ``HF_TOKEN``/``HF_ENDPOINT`` as ``huggingface_hub``
  reads them. A value that looks like a path (see :func:`parse_store_spec`) is a folder store, so
  ``COLDSNAP_PAYLOAD_REPO`` and ``coldsnap publish-native --repo`` accept the same syntax.

Setting both variables is a :class:`~coldsnap_core.errors.ConfigurationError`; setting neither
means "no store" (staging then uses the node-local cache only).
"""

from __future__ import annotations

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
from coldsnap_core.stores.base import PayloadStore, refused_character_message
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
_URL_SCHEMES = ("s3://", "oci://", "gs://", "az://")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
ACCEPTED_STORE_FORMS = (
    "s3://bucket[/prefix], gs://bucket[/prefix], az://account/container[/prefix], oci://HOST[:PORT]/NAMESPACE/NAME,"
    " hf://org/name[@revision] or org/name[@revision] (Hugging Face), a folder (/abs, ./rel, ~/p, file:///abs)"
)
"""Every spelling of a payload store, for the messages that refuse one (``docs/format.md`` §12)."""
_SPELL_THE_STORE = f"spell the store as one of: {ACCEPTED_STORE_FORMS}"


def _refuse_unknown_form(spec: str) -> None:
    """A value that starts like a URL with a scheme coldsnap does not read (``s3:/bucket``, ``S3://bucket``,
    ``oci:/x``, ``http://...``) or a bare word is refused here, before it could be taken for a Hugging Face
    repository id and sent to the Hub.

    Raises:
        ConfigurationError: names the scheme (and the scheme it resembles) or the bare word, and the accepted forms.
    """
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
    """An Azure Storage connection string (``DefaultEndpointsProtocol=...;AccountName=...;AccountKey=...``), with
    the container (and prefix) after a final ``;container=NAME[/prefix]``; see :mod:`coldsnap_core.stores.azure`.
    Any ``key=value`` list naming one of its keys counts, so a string that lacks ``Container=`` or is otherwise
    wrong is refused by the Azure parser (which never shows the key), not echoed by another one."""
    keys = {part.split("=", 1)[0].strip().lower() for part in spec.split(";") if "=" in part}
    return bool(keys & _AZURE_CONNECTION_KEYS)


def _redacted(exc: ColdsnapError) -> ColdsnapError:
    """``exc`` with :func:`redact_store_spec` applied to its detail (same type, file and position)."""
    exc.detail = redact_store_spec(exc.detail)
    exc.args = (exc._compose(),)
    return exc


def parse_store_spec(spec: str, *, repo_type: str = "model", client: StoreClientSettings | None = None) -> PayloadStore:
    """See :func:`_parse_store_spec`; every error it raises has the setting's secrets redacted
    (:func:`redact_store_spec`)."""
    try:
        return _parse_store_spec(spec, repo_type=repo_type, client=client or StoreClientSettings())
    except ColdsnapError as exc:
        raise _redacted(exc) from None


def _file_url_path(spec: str) -> str:
    """The path of a folder spec: ``file:///abs/path`` and ``file://localhost/abs/path`` name ``/abs/path``
    (RFC 8089); any other spec is already a path.

    Raises:
        ConfigurationError: a ``file://`` URL with another host (``file://nas/exports`` is a remote host, not the
            relative folder ``./nas/exports``), with a ``user:password@``, or without an absolute path
            (``file://`` alone); the message never quotes the host part.
    """
    if not spec.startswith("file://"):
        return spec
    host, slash, path = spec[len("file://") :].partition("/")
    if host not in ("", "localhost") or not slash:
        raise ConfigurationError(
            "a file:// payload store must be file:///absolute/path (no host other than localhost, no user or"
            " password): coldsnap reads folders on this machine only; mount a remote share and give its path"
        )
    return "/" + path


def _check_url(spec: str) -> None:
    """The rules every ``s3://``, ``gs://``, ``az://`` and ``oci://`` URL follows before its own parser runs:
    no ``user:password@`` (credentials come from the store's own variables or files, never the URL) and none of
    the characters of :data:`coldsnap_core.stores.base.URL_REFUSED_CHARACTERS`. Messages quote the URL, redacted by
    :func:`parse_store_spec` (user information, query string and fragment masked).

    Raises:
        ConfigurationError: ``user:password@`` (rule: no credentials in a store URL), or a refused character
            (names it and its position).
    """
    scheme, _, rest = spec.partition("://")
    if "@" in rest.partition("/")[0] and scheme != "oci":  # oci's own parser refuses it with its own words
        raise ConfigurationError(
            f"{spec!r}: the {scheme}:// payload store URL must not hold a user or password ('user:password@'):"
            " credentials come from the store's own variables or files"
        )
    refused = refused_character_message(f"{spec!r}: the {scheme}:// payload store URL", spec)
    if refused:
        raise ConfigurationError(refused)


def _parse_store_spec(spec: str, *, repo_type: str, client: StoreClientSettings) -> PayloadStore:
    """A store from a ``--repo`` / ``COLDSNAP_PAYLOAD_REPO`` value.

    * ``file:///abs/path``, ``/abs/path``, ``./rel``, ``../rel``, ``~/path``, ``.``: a folder store;
    * ``s3://bucket`` or ``s3://bucket/prefix``: an S3-compatible bucket (boto3, the ``s3`` extra);
    * ``oci://HOST[:PORT]/NAMESPACE/NAME[:TAG]``: a repository of an OCI registry (httpx, the ``oci`` extra);
    * ``gs://bucket[/prefix]``: a Google Cloud Storage bucket (``google-cloud-storage``, the ``gcs`` extra);
    * ``az://account/container[/prefix]``, or an Azure Storage connection string ending in
      ``;Container=NAME[/prefix]``: an Azure Blob container (``azure-storage-blob``, the ``azure`` extra);
    * ``hf://org/name[@revision]``, or ``org/name`` or ``org/name@revision`` (revision: branch, tag or commit; it may
      contain ``/``): a Hugging Face repository of type ``repo_type`` (``hf://name`` for one without an
      organization).

    Anything else that starts ``word:`` (``s3:/bucket``, ``S3://bucket``, ``http://...``) and a bare word are refused
    naming the scheme or the word and the accepted forms, so a typo never becomes a Hub repository id.

    ``client`` (timeouts, retries) goes to the S3, OCI, GCS and Azure stores; the Hugging Face store's client is
    ``huggingface_hub``'s, configured by its own variables (``HF_HUB_ETAG_TIMEOUT``, ``HF_HUB_DOWNLOAD_TIMEOUT``).

    Raises:
        ConfigurationError: empty value, empty revision, an invalid repository id or type, an unknown or mis-cased
            scheme, or a bare word.
    """
    spec = spec.strip()
    if not spec:
        raise ConfigurationError("the payload store is empty; give a folder path or a Hugging Face repository id")
    if _looks_like_path(spec):
        return LocalFolderStore(expand_path(_file_url_path(spec), "the payload store"))
    explicit_hub = spec.startswith(HF_REF_SCHEME)
    if explicit_hub:
        spec = spec[len(HF_REF_SCHEME) :]
    elif not _looks_like_azure_connection_string(spec) and not spec.startswith(_URL_SCHEMES):
        _refuse_unknown_form(spec)
    if spec.startswith(_URL_SCHEMES):
        _check_url(spec)
    if spec.startswith("s3://"):
        from coldsnap_core.stores.s3 import S3PayloadStore

        return S3PayloadStore.from_url(spec, client_settings=client)
    if spec.startswith("oci://"):
        from coldsnap_core.stores.oci import OciPayloadStore

        return OciPayloadStore.from_url(spec, client_settings=client)
    if spec.startswith("gs://"):
        from coldsnap_core.stores.gcs import GcsPayloadStore

        return GcsPayloadStore.from_url(spec, client_settings=client)
    if spec.startswith("az://") or _looks_like_azure_connection_string(spec):
        from coldsnap_core.stores.azure import AzurePayloadStore

        return AzurePayloadStore.from_url(spec, client_settings=client)
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
    """The store and the artifact name a REF designates (``docs/format.md`` §12.9): ``oci://HOST/NS/REPO:TAG`` (the
    tag is the name), else ``STORE/NAME`` where STORE is any ``--repo`` value (``s3://bucket/prefix``, ``gs://...``,
    ``az://...``, a folder path, ``hf://org/name[@revision]`` or the bare Hub form) and NAME its last ``/`` segment.

    Raises:
        ConfigurationError: an OCI REF without a tag, a REF without a name, or a store part :func:`parse_store_spec`
            refuses (redacted).
    """
    from coldsnap_core.stores.base import check_artifact_name

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
    """The REF that :func:`parse_artifact_ref` reads back for the artifact published as ``name`` to ``store`` (given
    as ``spec``): ``oci://HOST/NS/REPO:TAG`` (the store's tag, else ``name``), ``hf://org/name[@revision]/NAME``, or
    ``SPEC/NAME``."""
    spec = spec.strip().rstrip("/")
    if spec.startswith("oci://"):
        from coldsnap_core.stores.oci import OciPayloadStore

        assert isinstance(store, OciPayloadStore)
        return f"oci://{store.registry}/{store.repository}:{store.tag or name}"
    hub = not (_looks_like_path(spec) or spec.startswith((*_URL_SCHEMES, HF_REF_SCHEME)))
    hub = hub and not _looks_like_azure_connection_string(spec)
    return f"{HF_REF_SCHEME if hub else ''}{spec}/{name}"


def from_settings(settings: StoreSettings) -> PayloadStore | None:
    """The payload store ``settings`` configure, or ``None``.

    Raises:
        ConfigurationError: a repository value is invalid (names the variables).
    """
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
    """The payload store configured by ``COLDSNAP_PAYLOAD_DIR`` or ``COLDSNAP_PAYLOAD_REPO`` (and the store client
    variables), or ``None``: the environment resolved as the ``coldsnap`` command resolves it.

    Raises:
        ConfigurationError: both are set, or a value is invalid (names the variable).
    """
    return from_settings(ColdsnapSettings.resolve(environ, rows=COMMAND_SETTINGS)[0].store)
