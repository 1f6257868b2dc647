"""Engine plugin settings (coldsnap_core.settings): environment variables, extra-config overrides, and every parsing error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from coldsnap_core.errors import ConfigurationError
from coldsnap_core.settings import COMMAND_SETTINGS, KEYS, ColdsnapSettings

ENGINE_FORMATS = ("safetensors", "instanttensor")
"""The inner load formats a test engine's default loader serves (each adapter passes its own)."""


def _command(environ: dict[str, str], **flags: object) -> ColdsnapSettings:
    """The settings as the ``coldsnap`` command resolves them: its rows, its options named as their keys."""
    return ColdsnapSettings.resolve(environ, flags=flags, rows=COMMAND_SETTINGS)[0]


def test_defaults_without_configuration() -> None:
    """Nothing set: no export, no artifact, ``auto`` restore, ``async`` materialization, the
    ``~/.cache/coldsnap`` state root, no extent re-hash, platform inner loader, converted copies
    model extents; unknown keys pass through untouched."""
    settings, rest = ColdsnapSettings.resolve({}, {"enable_multithread_load": True})
    assert settings == ColdsnapSettings(state_root=Path("~/.cache/coldsnap").expanduser().absolute())
    assert rest == {"enable_multithread_load": True}


def test_environment_variables(tmp_path: Path) -> None:
    """Every variable is read, values are normalized (case, ``~``, relative paths made absolute)."""
    env = {
        "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1",
        "COLDSNAP_ARTIFACT_DIR": str(tmp_path / "artifact"),
        "COLDSNAP_STATE_ROOT": str(tmp_path / "state"),
        "COLDSNAP_RESTORE": "NATIVE",
        "COLDSNAP_MATERIALIZE": "required",
        "COLDSNAP_VERIFY_EXTENTS": "true",
        "COLDSNAP_INNER_LOAD_FORMAT": "instanttensor",
    }
    settings, rest = ColdsnapSettings.resolve(env, None, inner_load_formats=ENGINE_FORMATS)
    assert settings == ColdsnapSettings(
        export_model_payload=True,
        artifact_dir=tmp_path / "artifact",
        state_root=tmp_path / "state",
        restore="native",
        materialize="required",
        verify_extents=True,
        inner_load_format="instanttensor",
    )
    assert rest == {}


def test_extra_config_keys_override_and_are_removed(tmp_path: Path) -> None:
    """A ``--model-loader-extra-config`` key wins over its variable, and every coldsnap key is removed
    before vLLM's DefaultModelLoader sees the dict (it rejects unknown keys)."""
    env = {"COLDSNAP_RESTORE": "native", "COLDSNAP_ARTIFACT_DIR": "/nowhere", "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"}
    extra = {
        "restore": "auto",
        "artifact_dir": str(tmp_path),
        "export_model_payload": False,
        "verify_extents": True,
        "converted_copies": "Residual",
        "num_threads": 4,
    }
    settings, rest = ColdsnapSettings.resolve(env, extra)
    assert (settings.restore, settings.artifact_dir, settings.export_model_payload) == ("auto", tmp_path, False)
    assert (settings.verify_extents, settings.converted_copies) == (True, "residual")
    assert rest == {"num_threads": 4}
    assert not set(rest) & set(KEYS)


def test_relative_artifact_dir_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings, _ = ColdsnapSettings.resolve({"COLDSNAP_ARTIFACT_DIR": "art"}, None)
    assert settings.artifact_dir == tmp_path / "art"


@pytest.mark.parametrize("value", ["S3://models/llama", "s3:/models/llama", "OCI://registry/ns/repo:v1", "hf:/org/name/a"])
def test_an_artifact_ref_with_a_misspelled_scheme_is_refused_not_read_as_a_folder(value: str) -> None:
    """Catches ``COLDSNAP_ARTIFACT_DIR=S3://...`` (or ``s3:/...``) read as a relative folder named ``S3:`` and then
    reported as a missing artifact: a REF scheme in another case or without its ``//`` is refused naming it, with
    the remedy; a folder whose name merely holds a colon is still a folder."""
    with pytest.raises(ConfigurationError, match="misspelled") as refused:
        ColdsnapSettings.resolve({"COLDSNAP_ARTIFACT_DIR": value}, None)
    assert value.partition(":")[0] in str(refused.value) and "remedy: spell the REF's scheme" in str(refused.value)
    settings, _ = ColdsnapSettings.resolve({"COLDSNAP_ARTIFACT_DIR": "/models/llama:v1"}, None)
    assert settings.artifact_dir == Path("/models/llama:v1")


@pytest.mark.parametrize(
    ("env", "extra", "names"),
    [
        ({"COLDSNAP_RESTORE": "sometimes"}, {}, ["COLDSNAP_RESTORE", "'sometimes'", "auto, native"]),
        ({"COLDSNAP_MATERIALIZE": "later"}, {}, ["COLDSNAP_MATERIALIZE", "'later'", "async, required, off"]),
        ({"COLDSNAP_EXPORT_MODEL_PAYLOAD": "maybe"}, {}, ["COLDSNAP_EXPORT_MODEL_PAYLOAD", "'maybe'"]),
        ({"COLDSNAP_VERIFY_EXTENTS": "2"}, {}, ["COLDSNAP_VERIFY_EXTENTS", "'2'"]),
        ({"COLDSNAP_INNER_LOAD_FORMAT": "coldsnap"}, {}, ["COLDSNAP_INNER_LOAD_FORMAT", "'coldsnap'", "default loader"]),
        ({"COLDSNAP_INNER_LOAD_FORMAT": "tensorizer"}, {}, ["'tensorizer'"]),
        ({}, {"converted_copies": "sometimes"}, ["extra-config key 'converted_copies'", "residual, model"]),
        ({}, {"restore": 1}, ["extra-config key 'restore'", "must be a string"]),
        ({}, {"verify_extents": 3}, ["extra-config key 'verify_extents'", "not a boolean"]),
        ({}, {"artifact_dir": ["a"]}, ["extra-config key 'artifact_dir'", "must be a string"]),
    ],
)
def test_invalid_values_name_the_setting_and_the_value(env: dict, extra: dict, names: list[str]) -> None:
    """Each bad value raises ConfigurationError whose message names where it came from, the value
    and what is allowed. Fails if a typo silently falls back to a default."""
    with pytest.raises(ConfigurationError) as raised:
        ColdsnapSettings.resolve(env, extra)
    for name in names:
        assert name in str(raised.value)
    assert raised.value.rule == "configuration"


def test_export_without_artifact_dir_is_refused() -> None:
    """Export needs to know where the capsule goes; refusing beats writing a pack nobody can find."""
    with pytest.raises(ConfigurationError, match="COLDSNAP_EXPORT_MODEL_PAYLOAD=1 needs an artifact folder"):
        ColdsnapSettings.resolve({"COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"}, None)


def test_native_restore_without_artifact_dir_is_refused() -> None:
    """``native`` must restore from a payload; with no artifact folder it cannot, so it fails closed."""
    with pytest.raises(ConfigurationError, match="COLDSNAP_RESTORE=native needs an artifact folder"):
        ColdsnapSettings.resolve({"COLDSNAP_RESTORE": "native"}, None)


def test_no_setting_names_a_pack() -> None:
    """Recipes cannot choose the pack's name: it is always derived from its SHA-256 (``docs/format.md`` §1). A
    key such as ``pack_name`` is not coldsnap's, so it is passed on to vLLM's DefaultModelLoader,
    which rejects unknown keys (checked with the real loader in test_vllm_loader_unit.py)."""
    assert not [key for key in KEYS if "pack" in key or "digest" in key]
    assert ColdsnapSettings.resolve({}, {"pack_name": "x"})[1] == {"pack_name": "x"}


def test_lenient_forms_are_normalized(tmp_path: Path) -> None:
    """Documented leniency, and nothing more: choices are case-insensitive and trimmed, an integer 1/0
    from JSON extra config is a boolean, a path is trimmed before it is made absolute. Fails if
    ``' /tmp/x '`` becomes a relative path under the working directory (QA defect) or if
    ``{"export_model_payload": 1}`` is refused."""
    settings, _ = ColdsnapSettings.resolve(
        {"COLDSNAP_RESTORE": " Native ", "COLDSNAP_MATERIALIZE": "REQUIRED", "COLDSNAP_ARTIFACT_DIR": f"  {tmp_path}/a  "},
        {"export_model_payload": 1, "verify_extents": 0},
    )
    assert (settings.restore, settings.materialize) == ("native", "required")
    assert settings.artifact_dir == tmp_path / "a"
    assert settings.export_model_payload is True and settings.verify_extents is False
    with pytest.raises(ConfigurationError, match="is not a boolean"):
        ColdsnapSettings.resolve({}, {"export_model_payload": 2, "artifact_dir": str(tmp_path)})


def test_payload_store_is_a_setting_like_the_others(tmp_path: Path) -> None:
    """The payload store is parsed with every other setting (``COLDSNAP_PAYLOAD_DIR``,
    ``COLDSNAP_PAYLOAD_REPO``, ``COLDSNAP_PAYLOAD_REPO_TYPE``) and can come from the engine's extra
    config instead (``payload_dir``, ...), which wins over the environment and never reaches the
    engine's loader. Fails if the store is read from the environment behind the settings' back (an
    extra-config store was then ignored) or if both kinds of store may be set at once."""
    from coldsnap_core.settings import StoreSettings
    from coldsnap_core.stores import LocalFolderStore, from_settings

    assert ColdsnapSettings.resolve({})[0].store == StoreSettings() and not StoreSettings().configured
    env = {"COLDSNAP_PAYLOAD_REPO": " org/name@v1 ", "COLDSNAP_PAYLOAD_REPO_TYPE": "dataset"}
    # a blank key is as if absent (the variable would apply), so the repository variable is left out here
    type_only = {"COLDSNAP_PAYLOAD_REPO_TYPE": "dataset"}
    settings, rest = ColdsnapSettings.resolve(type_only, {"payload_dir": str(tmp_path), "payload_repo": "", "other": 1})
    assert settings.store == StoreSettings(payload_dir=str(tmp_path), repo_type="dataset") and rest == {"other": 1}
    store = from_settings(settings.store)
    assert isinstance(store, LocalFolderStore)
    assert ColdsnapSettings.resolve(env)[0].store == StoreSettings(payload_repo="org/name@v1", repo_type="dataset")
    with pytest.raises(ConfigurationError, match=r"extra-config key 'payload_dir'.*COLDSNAP_PAYLOAD_REPO"):
        ColdsnapSettings.resolve(env, {"payload_dir": str(tmp_path)})
    with pytest.raises(ConfigurationError, match=r"COLDSNAP_PAYLOAD_DIR.*COLDSNAP_PAYLOAD_REPO"):
        _command({"COLDSNAP_PAYLOAD_DIR": "/x", "COLDSNAP_PAYLOAD_REPO": "org/name"})


@pytest.mark.parametrize("value", ["1_000", "١٠", "１０", "inf", "nan", "1e3", "-1", "abc", "0x10"])
def test_the_lock_timeout_takes_only_plain_ascii_seconds(value: str) -> None:
    """``COLDSNAP_LOCK_TIMEOUT`` is seconds in ASCII decimal digits with an optional fraction; anything
    ``float()`` would also take (digit separators, any Unicode digit, exponents, ``inf``) is refused with a
    ``ConfigurationError`` naming the variable and the value. Fails if ``1_000`` waits 1000 s."""
    with pytest.raises(ConfigurationError, match=r"COLDSNAP_LOCK_TIMEOUT="):
        _command({"COLDSNAP_LOCK_TIMEOUT": value})
    assert _command({"COLDSNAP_LOCK_TIMEOUT": " 2.5 "}).lock_timeout_s == 2.5
    assert _command({"COLDSNAP_LOCK_TIMEOUT": "0"}).lock_timeout_s == 0.0


def test_a_negative_zero_lock_timeout_is_refused() -> None:
    """``lock_timeout: -0.0`` in a JSON extra config compares equal to 0 but is no time to wait: a
    ConfigurationError naming the key. Fails if it is accepted (``0 <= -0.0`` is true)."""
    with pytest.raises(ConfigurationError, match=r"extra-config key 'lock_timeout'=-0\.0 is not a number of seconds"):
        ColdsnapSettings.resolve({}, {"lock_timeout": -0.0})
    assert ColdsnapSettings.resolve({}, {"lock_timeout": 0.0})[0].lock_timeout_s == 0.0


@pytest.mark.parametrize("key", ["artifact_dir", "state_root", "outcome_log"])
def test_a_nul_in_a_path_key_is_a_configuration_error_naming_the_key(key: str, tmp_path: Path) -> None:
    """A NUL in an extra-config path (no system call takes one) is refused when the settings resolve, naming the
    key. Fails if it is accepted and ``ValueError: embedded null byte`` later escapes the restore."""
    with pytest.raises(ConfigurationError, match=rf"extra-config key '{key}'=.* holds a NUL character"):
        ColdsnapSettings.resolve({}, {key: f"{tmp_path}/a\0b"})


OTHER_UID = 54321
"""A uid without a passwd entry (the tests run as root, which may switch to it)."""


def _resolve_as_a_user_without_a_home(environments: list[dict[str, str]]) -> list[str]:
    """``ColdsnapSettings.resolve(env)`` for each environment in a forked child that switched to
    :data:`OTHER_UID` with no ``HOME``: the state root, or the error's type and message."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no HOME and no passwd entry, as a container run under an arbitrary uid
        try:
            os.close(read)
            os.setuid(OTHER_UID)
            os.environ.pop("HOME", None)
            results = []
            for env in environments:
                try:
                    results.append(str(ColdsnapSettings.resolve(env)[0].state_root))
                except Exception as exc:
                    results.append(f"{type(exc).__name__}: {exc}")
            os.write(write, json.dumps(results).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_without_a_home_folder_the_state_root_variable_is_enough(tmp_path: Path) -> None:
    """A process with no ``HOME`` and no passwd entry: with ``COLDSNAP_STATE_ROOT`` set the settings resolve;
    without it the default ``~/.cache/coldsnap`` cannot be expanded, a ConfigurationError naming the variable.
    Fails if the default is expanded even when the variable is set (pathlib's ``RuntimeError`` escaped, untyped)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to a uid without a passwd entry")
    state = tmp_path / "state"
    with_variable, without = _resolve_as_a_user_without_a_home([{"COLDSNAP_STATE_ROOT": str(state)}, {}])
    assert with_variable == str(state)
    assert without.startswith("ConfigurationError: ") and "COLDSNAP_STATE_ROOT" in without, without


NO_SUCH_USER = "~coldsnap-no-such-user-zz/folder"


@pytest.mark.parametrize(
    ("variable", "key"),
    [
        ("COLDSNAP_STATE_ROOT", "state_root"),
        ("COLDSNAP_ARTIFACT_DIR", "artifact_dir"),
        ("COLDSNAP_OUTCOME_LOG", "outcome_log"),
    ],
)
def test_a_home_folder_of_no_user_is_a_configuration_error_naming_the_setting(variable: str, key: str) -> None:
    """``~nosuchuser/...`` in a path setting: pathlib's ``RuntimeError`` escaped (a traceback, the engine
    died without naming the variable). Now a ``ConfigurationError`` naming the variable or the extra-config
    key and the value. Fails if the RuntimeError escapes or the message names neither."""
    with pytest.raises(ConfigurationError, match=rf"{variable}='{NO_SUCH_USER}'"):
        ColdsnapSettings.resolve({variable: NO_SUCH_USER}, {})
    with pytest.raises(ConfigurationError, match=rf"{key}.*{NO_SUCH_USER}"):
        ColdsnapSettings.resolve({}, {key: NO_SUCH_USER})


def test_a_home_folder_of_no_user_in_a_store_or_cli_path_is_named(tmp_path: Path, capsys) -> None:
    """The same for ``COLDSNAP_PAYLOAD_DIR``, a folder ``--repo`` and ``--state-root``: a typed error, and
    the CLI exits 4 with the option in its message instead of a traceback (exit 1)."""
    from coldsnap_core.cli.main import main
    from coldsnap_core.stores import from_env

    with pytest.raises(ConfigurationError, match=rf"COLDSNAP_PAYLOAD_DIR='{NO_SUCH_USER}'"):
        from_env({"COLDSNAP_PAYLOAD_DIR": NO_SUCH_USER})
    assert main(["status", "--state-root", NO_SUCH_USER]) == 4
    assert f"--state-root='{NO_SUCH_USER}'" in capsys.readouterr().err
    assert main(["stage", str(tmp_path), "--repo", NO_SUCH_USER]) == 4
    assert NO_SUCH_USER in capsys.readouterr().err


def test_an_hf_endpoint_that_is_no_url_is_a_configuration_error(tmp_path: Path) -> None:
    """``HF_ENDPOINT=http://[::1`` makes importing huggingface_hub raise ``ValueError``; ``coldsnap stage``
    with a Hugging Face ``--repo`` printed that traceback (exit 1). Now exit 4 naming ``HF_ENDPOINT``."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": "http://[::1"}
    command = [sys.executable, "-m", "coldsnap_core.cli.main", "stage", str(tmp_path), "--repo", "org/name"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 4, done.stderr[-2000:]
    assert "HF_ENDPOINT='http://[::1'" in done.stderr and "Traceback" not in done.stderr


def _readme_settings_rows() -> list[str]:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    start = readme.index("| variable | extra-config key | default | meaning |") + 2
    rows = []
    for line in readme[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_readme_settings_table_equals_the_settings_table() -> None:
    """README's settings table is the settings table (:data:`coldsnap_core.settings.SETTINGS`), row by row
    (variable, extra-config key, default, meaning), and ``resolve`` consumes every key of it. Fails if a setting is added, renamed or redocumented in one place only (README
    once had two ``COLDSNAP_VERIFY_CHECKPOINT`` rows and no extra-config key for the payload store)."""
    from coldsnap_core.settings import SETTINGS, settings_table_markdown

    readme, table = _readme_settings_rows(), settings_table_markdown()
    for index, (documented, declared) in enumerate(zip(readme, table, strict=False)):
        assert documented == declared, f"README settings row {index + 1} differs from SETTINGS"
    assert len(readme) == len(table) == len(SETTINGS)
    variables = [s.variable for s in SETTINGS if s.variable is not None]
    assert len(set(variables)) == len(variables) and len({s.key for s in SETTINGS}) == len(SETTINGS)
    for setting in SETTINGS:
        assert setting.key not in ColdsnapSettings.resolve({}, {setting.key: ""})[1]


@pytest.mark.parametrize("value", ["", "   ", "\t"])
def test_an_empty_or_blank_value_means_the_default_for_every_setting(value: str, tmp_path: Path, monkeypatch) -> None:
    """Every row of the settings table reads an empty or whitespace-only value as unset (the documented rule), from
    its variable and from its extra-config key, and so does the ``coldsnap`` command from its options (store
    settings, lock timeout, outcome log, state root). Fails if one parser gives blank another meaning (a refusal,
    the current folder as a path, 0 s as a timeout) than the others."""
    from coldsnap_core.settings import SETTINGS

    monkeypatch.chdir(tmp_path)
    unset, _ = ColdsnapSettings.resolve({}, None)
    for setting in SETTINGS:
        if setting.variable is not None:
            assert ColdsnapSettings.resolve({setting.variable: value}, None)[0] == unset, setting.variable
        assert ColdsnapSettings.resolve({}, {setting.key: value})[0] == unset, setting.key
    blank_env = {s.variable: value for s in SETTINGS if s.variable is not None}
    assert _command(blank_env).store == _command({}).store
    assert _command(blank_env).lock_timeout_s == _command({}).lock_timeout_s
    assert _command(blank_env, outcome_log=value).outcome_log is None
    assert _command(blank_env, state_root=value).state_root == _command({}).state_root


@pytest.mark.parametrize("blank", ["", "   "])
def test_a_blank_extra_config_key_lets_its_variable_apply_for_every_setting(blank: str, tmp_path: Path) -> None:
    """A blank extra-config key behaves exactly like an absent one (README: blank means "as unset"), so the
    variable applies: ``COLDSNAP_STORE_READ_TIMEOUT=5`` with ``store_read_timeout: ""`` is 5 s, for every row of the
    settings table that has a variable. Fails if a blank key still wins and gives the default (the old behaviour:
    20 s)."""
    from coldsnap_core.settings import SETTINGS

    samples = {
        "export_model_payload": "1",
        "artifact_dir": str(tmp_path / "other-artifact"),
        "state_root": str(tmp_path / "state"),
        "restore": "native",
        "materialize": "required",
        "verify_extents": "1",
        "verify_checkpoint": "1",
        "lock_timeout": "5",
        "outcome_log": str(tmp_path / "outcomes.jsonl"),
        "termination_log": str(tmp_path / "termination-log"),
        "inner_load_format": "safetensors",
        "overlay": "off",
        "payload_dir": str(tmp_path / "payloads"),
        "payload_repo": "org/name",
        "payload_repo_type": "dataset",
        "store_connect_timeout": "5",
        "store_read_timeout": "5",
        "store_retries": "3",
        "store_min_rate": "1000",
        "store_range_deadline": "30",
        "derived_cache": "off",
        "oci_plain_http": "1",
        "oci_mount_from": "models/base",
    }
    assert set(samples) == {s.key for s in SETTINGS if s.variable is not None}
    base = {"COLDSNAP_ARTIFACT_DIR": str(tmp_path / "artifact")}  # export and restore=native need one
    for setting in SETTINGS:
        if setting.variable is None:
            continue
        environ = {**base, setting.variable: samples[setting.key]}
        from_variable, _ = ColdsnapSettings.resolve(environ, {}, inner_load_formats=ENGINE_FORMATS)
        assert from_variable != ColdsnapSettings.resolve(base, {})[0], setting.key  # the sample is no default
        assert ColdsnapSettings.resolve(environ, {setting.key: blank}, inner_load_formats=ENGINE_FORMATS)[0] == from_variable, (
            setting.key
        )


def test_the_oci_client_settings_are_rows_with_extra_config_keys(tmp_path: Path) -> None:
    """``COLDSNAP_OCI_PLAIN_HTTP`` and ``COLDSNAP_OCI_MOUNT_FROM`` are rows of the table: their extra-config keys win
    over the variables, never reach the engine's loader, and reach the OCI store through the resolved settings (the
    store reads no variable itself). Fails if the store reads the environment behind the settings' back (the keys
    were then ignored) or a key is passed on to the engine."""
    from coldsnap_core.stores import from_settings

    env = {"COLDSNAP_OCI_PLAIN_HTTP": "0", "COLDSNAP_OCI_MOUNT_FROM": "models/other"}
    extra = {"oci_plain_http": True, "oci_mount_from": " models/base , ,team/base ", "payload_repo": "oci://reg.example/a/b"}
    settings, rest = ColdsnapSettings.resolve(env, extra)
    assert rest == {}
    assert (settings.store.client.oci_plain_http, settings.store.client.oci_mount_from) == (True, ("models/base", "team/base"))
    store = from_settings(settings.store)
    assert store.base_url == "http://reg.example" and store.mount_from == ("models/base", "team/base")
    assert from_settings(
        ColdsnapSettings.resolve({**env, "COLDSNAP_PAYLOAD_REPO": "oci://reg.example/a/b"})[0].store
    ).base_url == ("https://reg.example")


def test_an_oci_mount_source_that_is_no_repository_name_is_refused_naming_the_setting() -> None:
    """A ``COLDSNAP_OCI_MOUNT_FROM`` entry outside the distribution spec's repository grammar is a ConfigurationError
    naming the variable, its extra-config key and the entry, when the store is built (at start). Fails if it is
    accepted (every publication then tried a mount the registry refuses)."""
    from coldsnap_core.stores import from_env

    with pytest.raises(ConfigurationError, match=r"COLDSNAP_OCI_MOUNT_FROM \(extra-config key 'oci_mount_from'\): 'Bad/Name'"):
        from_env({"COLDSNAP_PAYLOAD_REPO": "oci://reg.example/a/b", "COLDSNAP_OCI_MOUNT_FROM": "models/ok,Bad/Name"})


def test_the_command_reads_its_rows_with_its_options_over_the_variables(tmp_path: Path) -> None:
    """The ``coldsnap`` command resolves the same table: ``--state-root`` and ``--outcome-log`` (options named as their
    keys) win over ``COLDSNAP_STATE_ROOT`` and ``COLDSNAP_OUTCOME_LOG``; a blank option lets the variable apply; a row
    only an engine plugin reads (``COLDSNAP_RESTORE``, ``COLDSNAP_INNER_LOAD_FORMAT``) never stops a command. Fails if
    the option loses to the variable, or a plugin-only value breaks ``coldsnap status``."""
    env = {
        "COLDSNAP_STATE_ROOT": str(tmp_path / "env-state"),
        "COLDSNAP_OUTCOME_LOG": str(tmp_path / "env.jsonl"),
        "COLDSNAP_RESTORE": "bogus",
        "COLDSNAP_INNER_LOAD_FORMAT": "anything",
        "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1",
    }
    chosen = _command(env, state_root=str(tmp_path / "option"), outcome_log=str(tmp_path / "option.jsonl"))
    assert (chosen.state_root, chosen.outcome_log_path) == (tmp_path / "option", tmp_path / "option.jsonl")
    blank = _command(env, state_root=" ", outcome_log="")
    assert (blank.state_root, blank.outcome_log_path) == (tmp_path / "env-state", tmp_path / "env.jsonl")
    with pytest.raises(ConfigurationError, match="--state-root must be a string"):
        _command({}, state_root=3)


def test_no_core_default_names_an_engine() -> None:
    """Without an engine's defaults the settings materialize nothing and accept no inner load format (an engine
    without an inner loader refuses the setting at start); each adapter passes its own. Fails if vLLM's defaults
    (``async``, its load formats) come back into the engine-free core."""
    assert ColdsnapSettings.resolve({})[0].materialize == "off"
    with pytest.raises(
        ConfigurationError, match=r"'safetensors' is not a load format served by the engine's default loader \(none\)"
    ):
        ColdsnapSettings.resolve({"COLDSNAP_INNER_LOAD_FORMAT": "safetensors"})
    settings, _ = ColdsnapSettings.resolve({}, materialize_default="async", inner_load_formats=ENGINE_FORMATS)
    assert settings.materialize == "async"
