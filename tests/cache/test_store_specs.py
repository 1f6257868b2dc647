"""The ``--repo`` / ``COLDSNAP_PAYLOAD_REPO`` spellings of the GCS and Azure Blob stores (parsing only; the
stores themselves run the contract suite against fake-gcs-server and azurite)."""

from __future__ import annotations

import pytest

from coldsnap_core.errors import ConfigurationError
from coldsnap_core.stores import parse_store_spec
from coldsnap_core.stores.azure import AzurePayloadStore
from coldsnap_core.stores.gcs import GcsPayloadStore
from coldsnap_core.stores.oci import OciPayloadStore


def test_each_scheme_selects_its_store() -> None:
    """``oci://``, ``gs://``, ``az://`` and an Azure connection string each select their store, with the bucket,
    container, repository and prefix taken apart; a Hugging Face id still selects the Hub. Fails if a new scheme
    falls through to the Hugging Face fallback."""
    gcs = parse_store_spec("gs://fleet-payloads/prod/a")
    assert isinstance(gcs, GcsPayloadStore) and (gcs.bucket_name, gcs.prefix) == ("fleet-payloads", "prod/a")
    az = parse_store_spec("az://fleetacct/payloads/prod")
    assert isinstance(az, AzurePayloadStore) and (az.account, az.container, az.prefix) == ("fleetacct", "payloads", "prod")
    oci = parse_store_spec("oci://ghcr.io/org/models:v1")
    assert isinstance(oci, OciPayloadStore) and (oci.repository, oci.tag) == ("org/models", "v1")
    assert type(parse_store_spec("org/name")).__name__ == "HfPayloadStore"


def test_an_azure_connection_string_is_accepted_and_its_key_never_shown() -> None:
    """The connection string users already have, with ``;Container=NAME/prefix`` appended, selects the Azure store;
    the store's name and locations name the account, container and prefix but never the account key."""
    secret = "c2VjcmV0LWtleS1ieXRlcw=="
    spec = f"DefaultEndpointsProtocol=https;AccountName=fleetacct;AccountKey={secret};EndpointSuffix=core.windows.net;Container=payloads/prod"
    store = parse_store_spec(spec)
    assert isinstance(store, AzurePayloadStore)
    assert (store.account, store.container, store.prefix) == ("fleetacct", "payloads", "prod")
    digest = "a" * 64
    assert secret not in store.name + store.location(digest) + repr(store)
    assert store.location(digest) == f"az://fleetacct/payloads/prod/model-payloads/sha256/{digest}.pack"


@pytest.mark.parametrize(
    "spec",
    [
        "gs://ab",
        "gs://Upper-Case",
        "gs://bucket/a//b",
        "az://acct",
        "az://acct/UPPER",
        "az://acct/payloads/../x",
        "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=c2VjcmV0;Container=x",
    ],
)
def test_an_invalid_gcs_or_azure_spec_is_a_configuration_error(spec: str) -> None:
    """A bucket or container outside the service's naming rules, an empty container or a prefix with an empty or
    ``..`` segment is refused before any client is made (ConfigurationError, exit 4); a connection string's key is
    not repeated in the message."""
    with pytest.raises(ConfigurationError) as info:
        parse_store_spec(spec)
    assert "c2VjcmV0" not in str(info.value)


SECRET = "SECRETKEYSECRETKEYSECRETKEY0123456789abcdefABCDEF+/=="


@pytest.mark.parametrize(
    "spec",
    [
        # no ;Container= at the end: a connection string all the same, never a Hugging Face id to echo
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={SECRET};BlobEndpoint=http://127.0.0.1:1/x",
        f"AccountKey={SECRET};Container=cont",
        f"garbage;AccountKey={SECRET};Container=cont",
        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={SECRET};Container=Bad_Name",
        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={SECRET};Container=cont/../x",
        f"DefaultEndpointsProtocol=https;AccountName=acct;SharedAccessSignature=sv=1&sig={SECRET};Container=Bad_Name",
    ],
)
def test_a_wrong_azure_connection_string_is_refused_without_showing_its_key(spec: str, monkeypatch) -> None:
    """A connection string that is wrong in any way (no ``Container=``, a bad container name or prefix) is refused
    with a ConfigurationError, through ``--repo`` and through ``COLDSNAP_PAYLOAD_REPO`` (which the message names),
    and neither the message nor any exception it chains shows the account key or the SAS signature. Fails if
    the string falls through to another parser that echoes it, or if the error quotes the setting's raw value
    (the key would reach engine logs in the ``auto`` fallback WARNING)."""
    from coldsnap_core.stores import from_env

    for attempt in (lambda: parse_store_spec(spec), lambda: from_env({"COLDSNAP_PAYLOAD_REPO": spec})):
        with pytest.raises(ConfigurationError) as raised:
            attempt()
        chain, exc = [], raised.value
        while exc is not None:
            chain.append(str(exc))
            exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        assert all(SECRET not in text for text in chain), chain
    assert "COLDSNAP_PAYLOAD_REPO" in str(raised.value)


def test_a_password_in_an_oci_url_is_never_shown() -> None:
    """``oci://user:password@host/...`` is refused (credentials come from the Docker config), and the message
    shows the URL with its user information replaced by ``***``."""
    with pytest.raises(ConfigurationError) as raised:
        parse_store_spec("oci://user:hunter2@127.0.0.1:5055/models/tiny")
    assert "hunter2" not in str(raised.value) and "***@" in str(raised.value)


@pytest.mark.parametrize("value", ["true", "yes", "2", "on"])
def test_coldsnap_oci_plain_http_takes_only_0_or_1(value: str, monkeypatch) -> None:
    """``COLDSNAP_OCI_PLAIN_HTTP`` other than empty, ``0`` or ``1`` is a ConfigurationError naming the variable and
    the value (it used to mean "off", so ``true`` silently spoke HTTPS to a plain-HTTP registry)."""
    monkeypatch.setenv("COLDSNAP_OCI_PLAIN_HTTP", value)
    with pytest.raises(ConfigurationError, match=f"COLDSNAP_OCI_PLAIN_HTTP='{value}' is not 0 or 1"):
        parse_store_spec("oci://registry.example:5000/models/tiny")
