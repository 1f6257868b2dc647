"""What ``coldsnap pull`` says when the destination or the name is wrong: one remedy each, and never a remedy that
leads back to the same refusal. Published with the fake engine's artifact (``tests/conformance/fake_engine.py``) to a
real folder store and the OCI registry on 127.0.0.1."""

from __future__ import annotations

import pytest

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli.main import main
from coldsnap_core.errors import ArtifactError, CapsulePinMismatchError, ConfigurationError, PayloadUnavailableError
from coldsnap_core.stores import artifact_ref, parse_artifact_ref, parse_store_spec
from coldsnap_core.stores.publish import publish_native
from coldsnap_core.stores.pull import pull_artifact
from tests.conformance import fake_adapter, fake_engine  # noqa: F401 (fake_adapter registers the coldsnap loader)


@pytest.fixture
def published(any_store, tmp_path):
    """The fake engine's artifact published to ``any_store`` as ``fake``: ``(store, REF)``."""
    model = fake_engine.write_checkpoint(tmp_path / "checkpoint")
    artifact, state = tmp_path / "artifact", tmp_path / "export-state"
    keys = {"artifact_dir": str(artifact), "state_root": str(state), "materialize": "off"}
    fake_engine.start(model, "coldsnap", {**keys, "export_model_payload": "1"})
    publish_native([artifact], any_store.store, PayloadCache(state), name="fake")
    return any_store.store, artifact_ref(any_store.spec, any_store.store, "fake")


@pytest.mark.parametrize("any_store", ["folder"], indirect=True)
def test_a_pull_into_a_folder_that_is_no_artifact_says_to_pick_another(published, tmp_path) -> None:
    """Catches the looping remedy: a DIR that exists with other files was refused as "artifact descriptor does not
    exist" with the remedy to run the same ``coldsnap pull REF DIR``. Now an ArtifactError names DIR, says it is not an
    artifact folder and gives one remedy (a new folder, or remove it); DIR's files are untouched."""
    store, _ = published
    dest = tmp_path / "notes"
    dest.mkdir()
    (dest / "README").write_text("mine")
    with pytest.raises(ArtifactError) as refused:
        pull_artifact(store, "fake", dest)
    message = str(refused.value)
    assert "is not an artifact folder" in message and str(dest) in message
    assert message.count("remedy:") == 1 and "coldsnap pull REF DIR" not in message
    assert "pull into a new folder, or remove this one" in message
    assert [p.name for p in dest.iterdir()] == ["README"]


@pytest.mark.parametrize("any_store", ["folder"], indirect=True)
def test_a_changed_file_in_a_pulled_folder_says_to_remove_it_not_to_pull_again(published, tmp_path) -> None:
    """Catches the second looping remedy: a pinned file changed in a folder a pull already wrote was refused with
    "pull it again", which finds the same folder and refuses again. The remedy now says to remove DIR first."""
    store, _ = published
    dest = tmp_path / "pulled"
    pull_artifact(store, "fake", dest)
    capsule = next(p for p in (dest / "workers").rglob("*") if p.is_file())
    capsule.write_bytes(capsule.read_bytes() + b" ")
    with pytest.raises(CapsulePinMismatchError) as refused:
        pull_artifact(store, "fake", dest)
    message = str(refused.value)
    assert f"remedy: remove {dest} and pull again" in message and message.count("remedy:") == 1


@pytest.mark.parametrize("any_store", ["folder"], indirect=True)
def test_an_empty_destination_is_refused_not_read_as_the_current_folder(published, tmp_path, monkeypatch, capsys) -> None:
    """Catches ``coldsnap pull REF ""`` (an unset variable in a script) pulling into the current folder, through the
    API and the CLI."""
    store, ref = published
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigurationError, match="folder to pull into is empty"):
        pull_artifact(store, "fake", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # the CLI too (it turned "" into Path(""), the current folder, before the check could see it)
    assert main(["pull", ref, ""]) == ConfigurationError.exit_code
    assert "folder to pull into is empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("any_store", ["folder", "oci"], indirect=True)
def test_a_name_the_store_does_not_record_names_the_name_not_a_pack(published) -> None:
    """Catches the missing-pack remedy ("stage the pack ... COLDSNAP_PAYLOAD_REPO") on a mistyped artifact name, in a
    folder store (``refs/<name>.json``) and in a registry (a tag): the remedy now points at the name in REF and
    publish-native."""
    _, ref = published
    store, _ = parse_artifact_ref(ref)
    with pytest.raises(PayloadUnavailableError) as refused:
        pull_artifact(store, "nobody", "unused")
    message = str(refused.value)
    assert "nobody" in message and "check the name in REF" in message and "coldsnap stage" not in message


def test_a_bare_word_that_is_a_folder_here_is_refused_with_the_spelling_that_works(tmp_path, monkeypatch) -> None:
    """Catches a relative folder store written without ``./`` (``store``) refused with only the list of accepted forms:
    with a folder of that name in the current folder the remedy is ``./store``; without one, the accepted forms."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match="remedy: spell the store as one of"):
        parse_store_spec("store")
    (tmp_path / "store").mkdir()
    with pytest.raises(ConfigurationError) as refused:
        parse_store_spec("store")
    assert "a folder 'store' exists here" in str(refused.value) and "remedy: write the folder as ./store" in str(refused.value)
