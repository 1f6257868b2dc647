"""Store timeouts and retries come from the settings (``COLDSNAP_STORE_CONNECT_TIMEOUT``,
``COLDSNAP_STORE_READ_TIMEOUT``, ``COLDSNAP_STORE_RETRIES``; ``docs/format.md`` §12): each remote store's real
client, configured through the environment the CLI and the engine plugins read, against a real server on
127.0.0.1 that accepts and then never answers (:class:`store_servers.StallingEndpoint`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_processes import AZURITE_KEY
from store_servers import StallingEndpoint, client_environment

from coldsnap_core.errors import ConfigurationError, StoreError
from coldsnap_core.settings import COMMAND_SETTINGS, ColdsnapSettings, StoreClientSettings, StoreSettings
from coldsnap_core.stores import from_env, from_settings

DIGEST = "ab" * 32


ATTEMPTS_WITH_ONE_RETRY = {"s3": 2, "oci": 1, "gcs": 2, "azure": 2}
"""Requests a stalled lookup makes with ``COLDSNAP_STORE_RETRIES=1``: the retry policies of boto3, google-cloud-storage
and azure-storage-blob retry a read timeout; httpx's transport (OCI) retries only a connection that failed."""


@pytest.mark.parametrize("kind", ["s3", "oci", "gcs", "azure"])
def test_a_stalled_store_fails_after_the_configured_read_timeout_and_retries(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that accepts the connection and never answers fails the lookup as a StoreError naming the store,
    the read timeout and its variable, after exactly the attempts ``COLDSNAP_STORE_RETRIES`` allows. Fails if a
    store keeps its own fixed timeout (the lookup then runs 20 s per attempt and the test's server sees the
    client's default attempt count), if a retry policy ignores the setting (Azure's default made 4 attempts with
    15-24 s back-off in between), or if a timeout is reported without what expired."""
    with StallingEndpoint() as endpoint:
        spec, client_env = client_environment(kind, endpoint.url, tmp_path)
        for name, value in {
            **client_env,
            "COLDSNAP_PAYLOAD_REPO": spec,
            "COLDSNAP_STORE_READ_TIMEOUT": "0.5",
            "COLDSNAP_STORE_CONNECT_TIMEOUT": "0.5",
            "COLDSNAP_STORE_RETRIES": "1",
        }.items():
            monkeypatch.setenv(name, value)
        store = from_env()
        with pytest.raises(StoreError) as raised:
            store.has(DIGEST)
        attempts = endpoint.requests_naming(DIGEST)
    message = str(raised.value)
    assert store.name in message and store.location(DIGEST) in message
    assert "read timeout of 0.5 s, COLDSNAP_STORE_READ_TIMEOUT" in message, message
    assert "at most 2 attempt(s), COLDSNAP_STORE_RETRIES" in message, message
    assert len(attempts) == ATTEMPTS_WITH_ONE_RETRY[kind], attempts


@pytest.mark.parametrize("kind", ["s3", "oci", "gcs", "azure"])
def test_a_refused_connection_is_not_called_a_timeout(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose host refuses the connection at once (a closed port on 127.0.0.1) fails the lookup naming the
    refusal and the remedy (check the endpoint and that the store runs). Fails if it is blamed on the connect timeout
    (urllib3 reports a refused connection as a subclass of its connect timeout error, so S3 and GCS said "no
    connection within the connect timeout of 10 s")."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec, client_env = client_environment(kind, f"http://127.0.0.1:{port}", tmp_path)
    for name, value in {**client_env, "COLDSNAP_PAYLOAD_REPO": spec, "COLDSNAP_STORE_RETRIES": "0"}.items():
        monkeypatch.setenv(name, value)
    store = from_env()
    with pytest.raises(StoreError) as raised:
        store.has(DIGEST)
    message = str(raised.value)
    assert store.name in message and "the connection was refused at once" in message, message
    assert "timeout" not in message and "remedy: check the store's endpoint and port" in message, message


def test_azure_retries_wait_at_most_the_capped_back_off_between_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Azure client's retry policy takes ``COLDSNAP_STORE_RETRIES`` for every kind of retry and waits at most
    ``RETRY_BACKOFF_MAX_S`` between attempts, so a hanging account fails after ``retries + 1`` read timeouts plus
    at most ``retries`` capped waits. Fails if azure-storage-blob's own ``ExponentialRetry`` is left in place (15 s,
    then 18 s, 24 s, 42 s, ... between attempts: about 170 s until a hanging account failed)."""
    from coldsnap_core.stores.azure import RETRY_BACKOFF_MAX_S

    monkeypatch.setenv("AZURE_STORAGE_BLOB_ENDPOINT", "http://127.0.0.1:9/devstoreaccount1")
    monkeypatch.setenv("AZURE_STORAGE_KEY", AZURITE_KEY)
    settings = StoreSettings(payload_repo="az://devstoreaccount1/payloads", client=StoreClientSettings(retries=7))
    policy = from_settings(settings).service._config.retry_policy
    assert (policy.total_retries, policy.connect_retries, policy.read_retries, policy.status_retries) == (7, 7, 7, 7)
    waits = [policy.get_backoff_time({"count": count}) for count in range(8) for _ in range(20)]
    assert max(waits) <= RETRY_BACKOFF_MAX_S <= 5


def test_store_client_settings_reach_every_remote_store_from_the_engine_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extra-config keys (``store_connect_timeout``, ``store_read_timeout``, ``store_retries``) resolve into the
    store settings and reach the store :func:`from_settings` builds. Fails if a store is built with its module's
    own constants instead of the resolved settings."""
    expected = StoreClientSettings(connect_timeout_s=1.5, read_timeout_s=2.0, retries=4)
    for spec in ("s3://payloads/p", "oci://127.0.0.1:5000/a/b", "gs://payloads/p", "az://acct/payloads/p"):
        settings, _ = ColdsnapSettings.resolve(
            {"COLDSNAP_PAYLOAD_REPO": spec, "COLDSNAP_STORE_RETRIES": "9"},
            {"store_connect_timeout": 1.5, "store_read_timeout": "2", "store_retries": 4},
        )
        assert settings.store.client == expected
        assert from_settings(settings.store).client_settings == expected
    # the clients the stores build carry them (the message of a timeout names the setting, not the client's value)
    oci = from_settings(StoreSettings(payload_repo="oci://127.0.0.1:5000/a/b", client=expected))
    assert (oci.client.timeout.connect, oci.client.timeout.read) == (1.5, 2.0)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    s3 = from_settings(StoreSettings(payload_repo="s3://payloads/p", client=expected))
    config = s3.client.meta.config
    assert (config.connect_timeout, config.read_timeout, config.retries["total_max_attempts"]) == (1.5, 2.0, 5)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "1_000", "\u0661\u0660", "ten", "1e3"])
def test_a_store_timeout_that_is_not_a_positive_number_of_seconds_is_refused(value: str) -> None:
    """``COLDSNAP_STORE_READ_TIMEOUT`` (and the connect timeout) take a finite number of seconds > 0 in ASCII
    decimals; anything else is a ConfigurationError naming the variable and the value, from the engine settings and
    from the CLI's store settings alike."""
    for variable in ("COLDSNAP_STORE_READ_TIMEOUT", "COLDSNAP_STORE_CONNECT_TIMEOUT"):
        with pytest.raises(ConfigurationError, match=f"{variable}={value!r} is not a number of seconds > 0"):
            ColdsnapSettings.resolve({variable: value})
        with pytest.raises(ConfigurationError, match=variable):
            ColdsnapSettings.resolve({variable: value}, rows=COMMAND_SETTINGS)


@pytest.mark.parametrize("value", ["-1", "21", "1.5", "two", "\u0662"])
def test_a_store_retry_count_outside_0_to_20_is_refused(value: str) -> None:
    """``COLDSNAP_STORE_RETRIES`` takes a whole number from 0 to 20; anything else is a ConfigurationError naming
    the variable and the value."""
    with pytest.raises(ConfigurationError, match=f"COLDSNAP_STORE_RETRIES={value!r} is not a whole number of retries"):
        ColdsnapSettings.resolve({"COLDSNAP_STORE_RETRIES": value})


@pytest.mark.parametrize("kind", ["oci", "gcs", "azure"])
def test_a_frozen_store_server_fails_staging_within_the_configured_read_timeout(
    kind: str, captured_once, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real server (the distribution registry, fake-gcs-server, azurite) holding the pack, stopped with SIGSTOP:
    it accepts connections and answers nothing. Staging on a node whose store client has a 0.5 s read timeout and
    one retry fails as a StoreError naming the store object and that timeout, and keeps nothing; once the server
    runs again the same client stages the pack. Fails if the client waits with another timeout than the configured
    one (the message names what expired) or if a stalled fetch leaves anything eligible."""
    from cache_support import eligible_objects, sha256_of
    from store_servers import store_under_test

    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.restore.staging import stage_payload
    from coldsnap_core.stores.publish import publish_native

    target = store_under_test(kind, request, tmp_path, monkeypatch)
    publish_native([captured_once.artifact_dir], target.store, PayloadCache(captured_once.capture_root))
    client = StoreClientSettings(connect_timeout_s=0.5, read_timeout_s=0.5, retries=1)
    node_store = target.new_store_with(chunk_size_bytes=target.extra["chunk_size_bytes"], client_settings=client)
    cache = PayloadCache(tmp_path / "node")
    pack = captured_once.pack
    with target.server.frozen(), pytest.raises(StoreError) as raised:
        stage_payload(pack, cache=cache, store=node_store)
    assert raised.value.file == node_store.location(pack.sha256)
    assert "read timeout of 0.5 s, COLDSNAP_STORE_READ_TIMEOUT" in str(raised.value), str(raised.value)
    assert eligible_objects(tmp_path / "node") == {} and cache.temporaries() == []
    assert sha256_of(stage_payload(pack, cache=cache, store=node_store)) == pack.sha256


@pytest.mark.parametrize("value", ["10000000000", "86400.5", "100000"])
def test_a_store_timeout_over_one_day_is_refused_naming_the_variable(value: str) -> None:
    """A store timeout over 86400 s (1 day) is a ConfigurationError naming the variable, the value and the bound,
    from the engine settings and the CLI's store settings. Fails if it is accepted (``10000000000`` then made the
    OCI client crash with an uncaught ``OverflowError`` and the other clients report a store failure)."""
    for variable in ("COLDSNAP_STORE_READ_TIMEOUT", "COLDSNAP_STORE_CONNECT_TIMEOUT"):
        with pytest.raises(ConfigurationError, match=f"{variable}={value!r} is not .* at most 86400"):
            ColdsnapSettings.resolve({variable: value})
        with pytest.raises(ConfigurationError, match=f"{variable}={value!r}"):
            ColdsnapSettings.resolve({variable: value}, rows=COMMAND_SETTINGS)
    assert ColdsnapSettings.resolve({"COLDSNAP_STORE_READ_TIMEOUT": "86400"})[0].store.client.read_timeout_s == 86400


@pytest.mark.parametrize("key", ["store_read_timeout", "store_connect_timeout", "lock_timeout"])
def test_a_json_number_too_large_for_a_float_is_a_configuration_error_naming_the_key(key: str) -> None:
    """An extra-config integer beyond a float (``10**400``) is a ConfigurationError naming the key. Fails if
    ``float()``'s OverflowError escapes untyped."""
    with pytest.raises(ConfigurationError, match=f"extra-config key {key!r}="):
        ColdsnapSettings.resolve({}, {key: 10**400})


def test_a_clock_overflow_in_the_oci_client_is_a_payload_store_error(tmp_path: Path) -> None:
    """A deadline past the clock's range inside the OCI client (a timeout built around the settings' bound) is a
    StoreError naming the store, never an untyped OverflowError (the CLI exited 1 with a traceback). The registry is a
    real listening socket on 127.0.0.1 (the kernel completes the connection; nothing answers)."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        host = f"127.0.0.1:{listener.getsockname()[1]}"
        store = from_settings(
            StoreSettings(payload_repo=f"oci://{host}/coldsnap/payloads", client=StoreClientSettings(read_timeout_s=1e10))
        )
        with pytest.raises(StoreError, match="OverflowError") as raised:
            store.has(DIGEST)
    assert store.name in str(raised.value)


def test_an_s3_timeout_names_aws_max_attempts_when_it_decided_the_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``AWS_MAX_ATTEMPTS`` set, botocore makes that many attempts, and the timeout error says so and names the
    variable. Fails if it names ``COLDSNAP_STORE_RETRIES``' attempts that were not the ones made."""
    with StallingEndpoint() as endpoint:
        spec, client_env = client_environment("s3", endpoint.url, tmp_path)
        for name, value in {
            **client_env,
            "COLDSNAP_PAYLOAD_REPO": spec,
            "COLDSNAP_STORE_READ_TIMEOUT": "0.5",
            "COLDSNAP_STORE_CONNECT_TIMEOUT": "0.5",
            "AWS_MAX_ATTEMPTS": "1",
        }.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(StoreError) as raised:
            from_env().has(DIGEST)
        attempts = endpoint.requests_naming(DIGEST)
    assert "at most 1 attempt(s), AWS_MAX_ATTEMPTS=1)" in str(raised.value), str(raised.value)
    assert len(attempts) == 1


@pytest.mark.parametrize(
    "variable", ["COLDSNAP_STORE_READ_TIMEOUT", "COLDSNAP_STORE_CONNECT_TIMEOUT", "COLDSNAP_STORE_RANGE_DEADLINE"]
)
def test_a_store_timeout_under_the_minimum_is_refused_not_floored(variable: str) -> None:
    """``0.0000001`` s (a timeout every request misses) is a ConfigurationError naming the variable, the value, the
    minimum (0.1 s) and that it is refused, not floored, from the engine settings and the CLI's store settings; 0.1
    itself is taken. Fails if any positive number is accepted."""
    for value in ("0.0000001", "0.09"):
        with pytest.raises(
            ConfigurationError, match=rf"{variable}='{value}' is under the minimum of 0.1 s: refused, not floored"
        ):
            ColdsnapSettings.resolve({variable: value})
        with pytest.raises(ConfigurationError, match=variable):
            ColdsnapSettings.resolve({variable: value}, rows=COMMAND_SETTINGS)
    field = {"COLDSNAP_STORE_READ_TIMEOUT": "read_timeout_s", "COLDSNAP_STORE_CONNECT_TIMEOUT": "connect_timeout_s"}.get(
        variable, "range_deadline_s"
    )
    assert getattr(ColdsnapSettings.resolve({variable: "0.1"})[0].store.client, field) == 0.1


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "1e6", "fast", "\u0661"])
def test_a_store_minimum_rate_that_is_not_a_number_of_bytes_per_second_is_refused(value: str) -> None:
    """``COLDSNAP_STORE_MIN_RATE`` takes bytes per second >= 0 in ASCII decimals (0 turns the floor off); anything else
    is a ConfigurationError naming the variable and the value. The rate and the range deadline resolve into the store
    client settings (extra-config keys ``store_min_rate``, ``store_range_deadline``)."""
    with pytest.raises(ConfigurationError, match=f"COLDSNAP_STORE_MIN_RATE={value!r} is not a number of bytes per second"):
        ColdsnapSettings.resolve({"COLDSNAP_STORE_MIN_RATE": value})
    settings, _ = ColdsnapSettings.resolve({"COLDSNAP_STORE_MIN_RATE": "0"}, {"store_range_deadline": 30})
    assert (settings.store.client.min_rate_bytes_per_s, settings.store.client.range_deadline_s) == (0, 30)
    command, _ = ColdsnapSettings.resolve({"COLDSNAP_STORE_MIN_RATE": "1000.5"}, rows=COMMAND_SETTINGS)
    assert command.store.client.min_rate_bytes_per_s == 1000.5
