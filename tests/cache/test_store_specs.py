"""The ``--repo`` / ``COLDSNAP_PAYLOAD_REPO`` spellings of the GCS and Azure Blob stores (parsing only; the
stores themselves run the contract suite against fake-gcs-server and azurite)."""

from __future__ import annotations

import os

import pytest

from coldsnap_core.errors import ConfigurationError, PayloadUnavailableError, StoreError
from coldsnap_core.settings import ColdsnapSettings
from coldsnap_core.stores import from_env, parse_store_spec
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
    # the rule it breaks, not "a digest reference" (the '@' of the user information is no digest)
    assert "credentials do not go in the URL; they come from the Docker config" in str(raised.value)


@pytest.mark.parametrize(
    ("value", "plain"), [("true", True), ("Yes", True), ("on", True), ("1", True), ("off", False), ("", False)]
)
def test_coldsnap_oci_plain_http_is_spelled_as_every_coldsnap_boolean(value: str, plain: bool, monkeypatch) -> None:
    """``COLDSNAP_OCI_PLAIN_HTTP`` takes what every coldsnap boolean takes (1/0, true/false, yes/no, on/off).
    Fails if it accepts only 0/1 again (``true`` was refused) or reads ``true`` as off."""
    monkeypatch.setenv("COLDSNAP_OCI_PLAIN_HTTP", value)
    monkeypatch.setenv("COLDSNAP_PAYLOAD_REPO", "oci://registry.example:5000/models/tiny")
    assert from_env().base_url.startswith("http://" if plain else "https://")


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_coldsnap_oci_plain_http_that_is_no_boolean_is_refused(value: str, monkeypatch) -> None:
    """Anything else is a ConfigurationError naming the variable and the value (it used to mean "off", so a typo
    silently spoke HTTPS to a plain-HTTP registry)."""
    monkeypatch.setenv("COLDSNAP_OCI_PLAIN_HTTP", value)
    monkeypatch.setenv("COLDSNAP_PAYLOAD_REPO", "oci://registry.example:5000/models/tiny")
    with pytest.raises(ConfigurationError, match=f"COLDSNAP_OCI_PLAIN_HTTP='{value}' is not a boolean"):
        from_env()


@pytest.mark.parametrize(
    ("spec", "prefix"),
    [
        ("gs://bucket//pfx", "'/pfx'"),
        ("az://acct/cont//pfx", "'/pfx'"),
        ("s3://bucket//pfx", "'/pfx'"),
        ("gs://bucket/a/", None),
        ("az://acct/cont/a/", None),
        ("gs://bucket//", "'/'"),
        ("az://acct//cont", None),
    ],
)
def test_a_prefix_with_an_empty_segment_anywhere_is_refused(spec: str, prefix: str | None) -> None:
    """An empty segment first in the prefix (``gs://bucket//pfx``) is refused like one in the middle, naming the
    rule; a single trailing ``/`` is not a segment. Fails if the leading ``/`` is stripped and the store silently
    reads ``pfx`` (another set of objects than the URL names)."""
    if prefix is None and spec.endswith("/"):
        assert parse_store_spec(spec).prefix == "a"
        return
    with pytest.raises(ConfigurationError) as raised:
        parse_store_spec(spec)
    if prefix is not None:
        assert f"prefix {prefix} has an empty, '.' or '..' segment" in str(raised.value)


@pytest.mark.parametrize("scheme", ["gs://bucket", "s3://bucket", "az://acct/cont"])
def test_a_prefix_too_long_for_an_object_name_is_refused(scheme: str) -> None:
    """A prefix that leaves no room in the services' 1024-byte object names for ``/model-payloads/sha256/<digest>.pack``
    is refused up front (ConfigurationError naming the limit); the longest that fits is accepted. Fails if it is
    only found by the service's 400 at the first upload."""
    from coldsnap_core.stores.base import OBJECT_NAME_MAX_BYTES, PACK_NAME_BYTES

    longest = "p" * (OBJECT_NAME_MAX_BYTES - PACK_NAME_BYTES)
    store = parse_store_spec(f"{scheme}/{longest}")
    assert len(store.key("ab" * 32).encode()) == OBJECT_NAME_MAX_BYTES
    with pytest.raises(ConfigurationError, match="1024-byte object name limit"):
        parse_store_spec(f"{scheme}/{longest}p")


@pytest.mark.parametrize(
    ("spec", "rule"),
    [
        ("oci://127.0.0.1:0/models/tiny", "outside 1-65535"),
        ("oci://127.0.0.1:65536/models/tiny", "outside 1-65535"),
        ("oci://registry.example:99999/models/tiny", "outside 1-65535"),
        ("oci://registry.example/" + "/".join(["n" * 50] * 5), "limit it to 255"),
    ],
)
def test_an_oci_port_or_name_outside_the_distribution_limits_is_refused(spec: str, rule: str) -> None:
    """A port outside 1-65535 and a ``HOST/NAME`` over the 255 characters the distribution spec lets clients impose
    are refused when the URL is parsed. Fails if they are only found by a connection error or by a client that
    cannot pull what was pushed."""
    with pytest.raises(ConfigurationError, match=rule):
        parse_store_spec(spec)
    assert parse_store_spec("oci://127.0.0.1:65535/models/tiny").registry == "127.0.0.1:65535"


@pytest.mark.parametrize(
    ("entry", "rule"),
    [
        ("dXNlcjpwYXNz", "is a str, not an object"),
        ({"auth": "bm9jb2xvbg=="}, "no 'user:password'"),  # base64 of "nocolon"
        ({"username": ["u"], "password": "p"}, "username is a list, not a string"),
    ],
)
def test_a_malformed_docker_config_entry_for_the_registry_is_refused_before_any_request(
    entry: object, rule: str, tmp_path, monkeypatch
) -> None:
    """The Docker config's ``auths`` entry for the store's registry that is not an object, has a non-string field or
    an ``auth`` without ``user:password`` is a ConfigurationError naming the file and the entry, raised before the
    first request (nothing listens on the port: a request would be a StoreError). Fails if the entry is skipped
    (anonymous requests, then a confusing 401) or read as a user name without a password."""
    import json

    config = tmp_path / "docker-config"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"auths": {"127.0.0.1:9": entry, "other.example": "ignored"}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    store = parse_store_spec("oci://127.0.0.1:9/models/tiny")
    with pytest.raises(ConfigurationError, match=rule) as raised:
        store.has("ab" * 32)
    assert raised.value.file == str(config / "config.json")


@pytest.mark.parametrize(
    ("spec", "secret"),
    [
        ("s3://AKIAXX:SeCrEt1@bucket/p", "SeCrEt1"),
        ("gs://user:SeCrEt6@bkt/p", "SeCrEt6"),
        ("az://acct:SeCrEt9@host/cont", "SeCrEt9"),
        ("s3://AKIAXX:Se@Crt2@bucket/p", "Crt2"),  # an '@' inside the password: the whole user information goes
    ],
)
def test_a_user_or_password_in_an_s3_gs_or_az_url_is_refused_and_never_shown(spec: str, secret: str, monkeypatch) -> None:
    """``user:password@`` in an s3/gs/az URL is refused up front, naming the rule, and neither the message nor its
    causes quote it (``--repo`` and ``COLDSNAP_PAYLOAD_REPO`` alike). Fails if the bucket/account check quotes the
    unmasked first segment again."""
    with pytest.raises(ConfigurationError) as raised:
        parse_store_spec(spec)
    assert "must not hold a user or password" in str(raised.value)
    assert secret not in str(raised.value) and raised.value.__cause__ is None
    monkeypatch.setenv("COLDSNAP_PAYLOAD_REPO", spec)
    with pytest.raises(ConfigurationError) as raised:
        from_env()
    assert secret not in str(raised.value) and "COLDSNAP_PAYLOAD_REPO='" in str(raised.value)


def test_both_store_variables_set_never_show_a_connection_string_key(monkeypatch, tmp_path) -> None:
    """``COLDSNAP_PAYLOAD_DIR`` with an Azure connection string in ``COLDSNAP_PAYLOAD_REPO`` is refused naming both
    variables with the account key masked, from the environment and from the engines' extra config. Fails if
    ``StoreSettings`` quotes the repository unredacted."""
    repo = "DefaultEndpointsProtocol=http;AccountName=a;AccountKey=SeCrEtK1;Container=cont"
    monkeypatch.setenv("COLDSNAP_PAYLOAD_DIR", str(tmp_path))
    monkeypatch.setenv("COLDSNAP_PAYLOAD_REPO", repo)
    with pytest.raises(ConfigurationError, match="set only one of COLDSNAP_PAYLOAD_DIR") as raised:
        from_env()
    assert "SeCrEtK1" not in str(raised.value) and "AccountKey=***" in str(raised.value)
    with pytest.raises(ConfigurationError, match="set only one of") as raised:
        ColdsnapSettings.resolve({}, {"payload_dir": str(tmp_path), "payload_repo": repo})
    assert "SeCrEtK1" not in str(raised.value) and "AccountKey=***" in str(raised.value)


@pytest.mark.parametrize(
    ("spec", "secret", "character"),
    [
        ("az://acct/cont/p?sv=2020&sig=SeCrEt8", "SeCrEt8", "?"),
        ("s3://bkt/p?X-Amz-Signature=SeCrEt3", "SeCrEt3", "?"),
        ("gs://bkt/p?sig=SeCrEt4", "SeCrEt4", "?"),
        ("s3://bkt?X-Amz-Signature=SeCrEt5", "SeCrEt5", "?"),
        ("gs://bkt/p#SeCrEt7", "SeCrEt7", "#"),
        ("s3://bkt/p\\q", None, "\\"),
        ("gs://bkt/p q", None, " "),
        ("s3://bkt/p%2F..%2Fq", None, "%"),
        ("az://acct/cont/p\nq", None, "\n"),
        ("oci://registry.example/models/tiny?x=1", None, "?"),
        ("DefaultEndpointsProtocol=http;AccountName=a;AccountKey=K;Container=cont/p?sig=SeCrEt2", "SeCrEt2", "?"),
    ],
)
def test_a_query_fragment_or_odd_character_in_a_store_url_is_refused_redacted(
    spec: str, secret: str | None, character: str
) -> None:
    """A query string, fragment, percent-escape, backslash, whitespace or control character in a store URL (or a
    connection string's ``Container=`` prefix) is a ConfigurationError naming the character and the rule, and a
    signature it carried is not shown. Fails if it is kept as part of the key prefix (the old behaviour: later store
    errors then printed the signature)."""
    with pytest.raises(ConfigurationError) as raised:
        parse_store_spec(spec)
    assert f"must not hold {character!r} (character " in str(raised.value) and "no query string" in str(raised.value)
    if secret is not None:
        assert secret not in str(raised.value)


def test_a_store_error_never_shows_a_signature_its_store_name_carries() -> None:
    """Every ``payload-store`` and ``payload-available`` error redacts its detail and file (one place, the error
    classes), so a store whose name or location holds a signature never prints it. Fails if StoreError or
    PayloadUnavailableError composes its message from the raw text."""
    for exc in (
        StoreError("az://acct/cont/p?sig=SeCrEt8: GET failed", file="s3://AK:SeCrEt1@b/x.pack"),
        PayloadUnavailableError("az://acct/cont AccountKey=SeCrEt8 does not hold the pack", file="gs://b/p#SeCrEt1"),
    ):
        assert "SeCrEt8" not in str(exc) and "SeCrEt1" not in str(exc) and "***" in str(exc), str(exc)


@pytest.mark.parametrize(
    "spec",
    ["file://nas.example.com/exports/payloads", "file://", "file://user:SeCrEt@host/x", "file://host"],
)
def test_a_file_url_with_a_host_or_without_an_absolute_path_is_refused(spec: str, tmp_path, monkeypatch) -> None:
    """Only ``file:///abs/path`` (empty or ``localhost`` host) is a folder store: ``file://nas/exports`` is a remote
    host, not the relative folder ``./nas/exports``, and ``file://`` alone is not the current folder. Fails if the
    scheme is stripped and the rest read as a (relative) path; the password is never shown."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=r"must be file:///absolute/path") as raised:
        parse_store_spec(spec)
    assert "SeCrEt" not in str(raised.value)
    assert list(tmp_path.iterdir()) == []
    assert parse_store_spec(f"file://{tmp_path}").name == parse_store_spec(f"file://localhost{tmp_path}").name


def test_a_docker_config_that_is_a_pipe_a_device_or_huge_is_refused_naming_it(tmp_path) -> None:
    """``$DOCKER_CONFIG/config.json`` that is a named pipe, a link to ``/dev/zero`` or larger than 4 MiB is a
    ConfigurationError naming the file, before any request; it is opened as documents are (regular files only,
    non-blocking, size cap). Fails if it is read with ``read_text`` again: the pipe then blocks the stage for ever
    and ``/dev/zero`` is read without bound (run in a child process with a 60 s bound so the old code fails, not
    hangs)."""
    import subprocess
    import sys

    cases = {}
    for name in ("fifo", "zero", "huge"):
        folder = tmp_path / name
        folder.mkdir()
        cases[name] = folder
    os.mkfifo(cases["fifo"] / "config.json")
    (cases["zero"] / "config.json").symlink_to("/dev/zero")
    with open(cases["huge"] / "config.json", "wb") as f:
        f.truncate(5 << 20)  # sparse: 5 MiB of zeros, over the cap
    script = (
        "import os, sys\n"
        "from coldsnap_core.errors import ConfigurationError\n"
        "from coldsnap_core.stores import parse_store_spec\n"
        "for folder in sys.argv[1:]:\n"
        "    os.environ['DOCKER_CONFIG'] = folder\n"
        "    try:\n"
        "        parse_store_spec('oci://127.0.0.1:9/models/tiny').has('ab' * 32)\n"
        "    except ConfigurationError as exc:\n"
        "        print(exc.file, '|', exc.detail)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *map(str, cases.values())], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert len(out) == 3, done.stdout
    for line, folder in zip(out, cases.values(), strict=True):
        assert line.startswith(f"{folder / 'config.json'} | the Docker config file cannot be read"), line
    assert "not a regular file" in out[0] and "not a regular file" in out[1] and "more than" in out[2]


def test_a_connection_string_store_without_an_account_name_is_named_by_its_endpoint() -> None:
    """A connection string with ``BlobEndpoint=`` and a SAS but no ``AccountName=`` names its store and locations by
    the endpoint's ``host:port/path``, never ``?`` and never the signature. Fails if the name is ``azure ?/cont``
    (a log or an outcome line then says nothing of which account failed)."""
    spec = "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;SharedAccessSignature=sv=2024&sig=SeCrEtSiG;Container=cont/fleet"
    store = parse_store_spec(spec)
    assert store.name == "azure 127.0.0.1:10000/devstoreaccount1/cont/fleet"
    assert store.location("a" * 64).startswith("az://127.0.0.1:10000/devstoreaccount1/cont/fleet/model-payloads/")
    assert "?" not in store.name + store.location("a" * 64) and "SeCrEtSiG" not in store.name + repr(store)


def test_an_s3_endpoint_password_never_appears_in_the_configuration_error(monkeypatch, captured, tmp_path, capsys) -> None:
    """``AWS_ENDPOINT_URL`` with ``user:password@`` in an environment no S3 client can be built from (an invalid
    addressing style): the ConfigurationError names the variables, the password masked, from the store and from
    ``coldsnap stage`` (whose text ``auto`` puts in its fallback WARNING and the outcome line). Fails if the message
    quotes the endpoint as set."""
    from coldsnap_core.cli.main import main

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://fleet:hunter2pw@127.0.0.1:9")
    monkeypatch.setenv("AWS_S3_ADDRESSING_STYLE", "sideways")
    with pytest.raises(ConfigurationError) as raised:
        parse_store_spec("s3://payloads/x").has("a" * 64)
    assert "AWS_ENDPOINT_URL=" in str(raised.value) and "AWS_S3_ADDRESSING_STYLE" in str(raised.value)
    assert "hunter2pw" not in str(raised.value)
    args = ["stage", str(captured.artifact_dir), "--repo", "s3://payloads/x", "--state-root", str(tmp_path / "node")]
    assert main(args) == 4
    err = capsys.readouterr().err
    assert "AWS_ENDPOINT_URL=" in err and "hunter2pw" not in err


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("s3:/bucket/p", "the scheme 's3' must be followed by '//'"),
        ("S3://bucket/p", "the scheme 'S3' is spelled 's3://' (lower case)"),
        ("oci:/x", "the scheme 'oci' must be followed by '//'"),
        ("Gs://bucket", "the scheme 'Gs' is spelled 'gs://'"),
        ("HF://org/name", "the scheme 'HF' is spelled 'hf://'"),
        ("https://example.com/payloads", "the scheme 'https' is not one coldsnap reads"),
        ("WRONG", "does not send a bare word to the Hub"),
        ("WRONG@main", "does not send a bare word to the Hub"),
    ],
)
def test_a_wrong_scheme_or_a_bare_word_is_refused_naming_it(spec: str, named: str, monkeypatch) -> None:
    """Catches a mistyped store taken for a Hugging Face repository id: ``s3:/bucket/p`` and ``S3://bucket/p`` were
    refused as bad Hub ids, and a bare word became a Hub id that left the network. Each is refused before any store
    is built, naming the scheme (and its right spelling) or the bare word, with the accepted forms as the remedy;
    ``COLDSNAP_PAYLOAD_REPO`` keeps the remedy."""
    with pytest.raises(ConfigurationError) as refused:
        parse_store_spec(spec)
    assert named in str(refused.value) and "Hugging Face repository id" not in str(refused.value)
    assert "remedy: spell the store as one of: s3://bucket[/prefix]" in str(refused.value)
    monkeypatch.setenv("COLDSNAP_PAYLOAD_REPO", spec)
    with pytest.raises(ConfigurationError, match=r"COLDSNAP_PAYLOAD_REPO.*remedy: spell the store"):
        from_env()


def test_the_explicit_hub_form_names_a_repository_with_or_without_an_organization() -> None:
    """Catches the explicit Hugging Face form not being a store: ``hf://org/name[@revision]`` (what a REF spells) and
    ``hf://name`` (a repository without an organization, which the bare form refuses) select the Hub store."""
    pinned = parse_store_spec("hf://org/name@" + "a" * 40)
    assert type(pinned).__name__ == "HfPayloadStore" and (pinned.repo_id, pinned.revision) == ("org/name", "a" * 40)
    assert parse_store_spec("hf://gpt2").repo_id == "gpt2"
