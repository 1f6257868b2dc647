"""``coldsnap stage`` stages this host's workers: ``--rank``, else node rank x workers per node (flags or
torchrun's NODE_RANK/GROUP_RANK and LOCAL_WORLD_SIZE), else every worker of the artifact."""

from __future__ import annotations

import pytest

from coldsnap_core.cli.stage_cmd import host_workers
from coldsnap_core.errors import ConfigurationError, MissingObjectError
from coldsnap_core.format.manifest import WorkerIdentity

WORKERS = [WorkerIdentity("worker", r, 4, r, 4) for r in range(4)]


def ranks(workers) -> list[int]:
    return [w.rank for w in workers]


def test_default_is_every_worker_of_a_single_host_artifact() -> None:
    """No rank, no node information: every worker in artifact.json (one host runs them all)."""
    assert ranks(host_workers(WORKERS, environ={})) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "environ", "expected"),
    [
        ({}, {"NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, [2, 3]),
        ({}, {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, [0, 1]),
        ({"node_rank": 1, "workers_per_node": 3}, {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, [3]),
        ({"ranks": [2]}, {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, [2]),
    ],
)
def test_this_hosts_ranks(kwargs, environ, expected) -> None:
    """Node K with W workers per node runs ranks K*W..K*W+W-1 (flags win over torchrun's variables;
    ``--rank`` wins over both). Fails if stage goes back to staging every worker on every host."""
    assert ranks(host_workers(WORKERS, environ=environ, **kwargs)) == expected


@pytest.mark.parametrize(
    ("kwargs", "environ", "error"),
    [
        ({}, {"NODE_RANK": "1"}, ConfigurationError),
        ({}, {"LOCAL_WORLD_SIZE": "2"}, ConfigurationError),
        ({}, {"NODE_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, ConfigurationError),
        ({}, {"NODE_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, MissingObjectError),
        ({"ranks": [7]}, {}, MissingObjectError),
    ],
)
def test_host_rule_errors(kwargs, environ, error) -> None:
    """Half the node information, a non-integer, a node with no worker, an unknown rank: typed errors."""
    with pytest.raises(error):
        host_workers(WORKERS, environ=environ, **kwargs)


def test_cli_stage_uses_the_node_rank(captured, tmp_path, capsys) -> None:
    """``coldsnap stage --node-rank 1 --workers-per-node 1`` on a one-worker artifact: node 1 runs no
    worker of it, exit 3 naming the ranks; node 0 stages the pack."""
    from coldsnap_core.cli.main import main

    args = ["stage", str(captured.artifact_dir), "--repo", str(tmp_path / "none"), "--workers-per-node", "1"]
    assert main([*args, "--node-rank", "1", "--state-root", str(captured.capture_root)]) == 3
    assert "runs ranks 1-1" in capsys.readouterr().err
    assert main([*args, "--node-rank", "0", "--state-root", str(captured.capture_root)]) == 0
