"""Every benchmark script and command-line tool still starts: ``python SCRIPT --help`` exits 0 with its usage.

Catches a script that no longer imports. Benchmarks are run by hand, not by the suite, so nothing else
notices: when the test support moved to ``tests/support``, ``benchmarks/vllm_load.py`` (through
``tests/vllm/engine_support.py``) could no longer import ``tests.support``, because only ``benchmarks/``,
``tools/`` and ``tests/vllm/`` were on its ``sys.path`` (fixed in commit 3759da1: ``benchmarks/_common.py``
puts the repository root on ``sys.path``).

Each script runs in a fresh interpreter with the repository root as working directory. The project's
packages are importable the way an installed project provides them (``coldsnap_core``, ``coldsnap_vllm``,
``coldsnap_sglang`` only, from this checkout), and a ``PYTHONPATH`` entry naming the repository root is
dropped, so a developer's ``PYTHONPATH`` cannot make ``tests`` importable and hide a missing ``sys.path``
entry. ``--help`` is argparse's: it parses nothing else, starts no engine and writes no file.

``benchmarks/peers.py`` also has ``--dry-run``, which prints the order of its engine loads and starts nothing: its
tests check that order and that an unknown ``--formats`` name is refused before anything starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("coldsnap_core", "coldsnap_vllm", "coldsnap_sglang")
#: The scripts with an argparse command line; ``tools/slabs.py`` is a library without one.
SCRIPTS = sorted(
    [p.relative_to(REPO).as_posix() for p in (REPO / "benchmarks").glob("*.py") if p.name != "_common.py"]
    + ["tools/smollm2_fixture.py", "tools/synthetic_llama.py"]
)


@pytest.fixture(scope="module")
def installed_like_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment for the scripts: ``PYTHONPATH`` = a folder of links to this checkout's packages,
    then the caller's entries except the repository root."""
    packages = tmp_path_factory.mktemp("packages")
    for name in PACKAGES:
        (packages / name).symlink_to(REPO / name, target_is_directory=True)
    kept = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and Path(entry).resolve() != REPO]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(packages), *kept])}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs(script: str, installed_like_env: dict[str, str]) -> None:
    """Catches a benchmark or tool that fails to import (a moved module, a missing ``sys.path`` entry, a
    renamed name in ``coldsnap_core``): its ``--help`` must exit 0 and print the argparse usage line."""
    run = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=REPO,
        env=installed_like_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"{script} --help exited {run.returncode}:\n{run.stderr[-4000:]}"
    assert run.stdout.startswith(f"usage: {Path(script).name} "), run.stdout[:500]


def _peers(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/peers.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_peers_interleaves_the_formats(installed_like_env: dict[str, str]) -> None:
    """Catches ``benchmarks/peers.py`` running one format's loads back to back (A A B B instead of A B A B): load
    from the machine's other work would then fall on some formats more than on others, and their ratios would
    mean nothing. ``--dry-run`` prints every load in the order the engines would start."""
    run = _peers(["--dry-run", "--repetitions", "2", "--formats", "safetensors,coldsnap_warm,runai_streamer"], installed_like_env)
    assert run.returncode == 0, run.stderr[-4000:]
    loads = [line.split(": ", 1)[1].split(" (")[0] for line in run.stdout.splitlines()]
    assert loads == ["safetensors", "coldsnap_warm", "runai_streamer"] * 2, run.stdout


def test_peers_refuses_an_unknown_format(installed_like_env: dict[str, str]) -> None:
    """Catches ``benchmarks/peers.py`` ignoring a misspelt ``--formats`` name (a table that silently lacks the format
    asked for, after an hour of engines): it must exit 2 at once, naming the name and the formats it knows."""
    run = _peers(["--dry-run", "--formats", "safetensors,runai_streamr"], installed_like_env)
    assert run.returncode == 2, run.stdout[-2000:]
    assert "unknown ['runai_streamr']" in run.stderr and "runai_streamer_s3" in run.stderr, run.stderr[-2000:]
