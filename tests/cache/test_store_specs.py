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
