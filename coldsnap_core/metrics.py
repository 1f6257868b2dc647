"""Prometheus metrics of coldsnap: what each load did (in the loading process) and the node's view (from its files).

**Loads.** :func:`record_load` counts one worker load in ``prometheus_client``'s default registry of the process
that loaded the weights; :meth:`coldsnap_core.load_policy.LoadPolicy.load` calls it once per load, with the outcome
line (``docs/format.md`` §10.3), so both engine plugins record the same families: ``coldsnap_load_total{engine,
outcome, rule}``, the histograms ``coldsnap_load_seconds{engine, outcome}`` and ``coldsnap_stage_seconds{engine}``,
``coldsnap_hydrated_bytes_total{engine}`` and ``coldsnap_fetched_bytes_total{engine}`` (their help texts below).

An engine's ``/metrics`` shows them when it collects the loading process's samples, which the engines do through
``prometheus_client``'s multiprocess mode: every process started with ``PROMETHEUS_MULTIPROC_DIR`` set writes its
samples to files in that folder, which the server's ``MultiProcessCollector`` reads. vLLM 0.32
(``vllm/v1/metrics/prometheus.py``) collects that folder when the variable is set: by the operator, or by
``vllm serve`` itself with more than one API server (``vllm/entrypoints/cli/serve.py``, ``run_multi_api_server``;
data parallel starts one per replica). With one API server and no variable, vLLM's ``/metrics`` is the API
server's own registry, which no engine-core or worker process reaches (vLLM's own engine statistics travel to it
over its engine-client socket, which takes no plugin's samples). SGLang 0.5 sets the variable before it spawns its
scheduler processes, which load the model, when started with ``--enable-metrics``
(``sglang/srt/entrypoints/engine.py``, ``sglang/srt/utils/common.py`` ``add_prometheus_middleware``).

**The node.** :func:`node_exposition` (``coldsnap status --format prometheus``) writes, for a node exporter's
textfile collector, the loads the outcome log holds by artifact, engine, outcome and rule, and the node-local
cache's objects, bytes and the age of each object's last full verification (its validation record, §11).
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections import Counter as Tally
from collections.abc import Iterable
from typing import Any, NamedTuple

from coldsnap_core._io import refuse_symlink
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import last_full_verification
from coldsnap_core.outcomes import LoadOutcomeLine

logger = logging.getLogger(__name__)

__all__ = ["node_exposition", "record_load"]

SECONDS_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Histogram buckets (seconds): a restore of a small model takes well under a second, a stage of a large pack
over a slow link tens of minutes."""


class _LoadMetrics(NamedTuple):
    loads: Any
    load_seconds: Any
    stage_seconds: Any
    hydrated_bytes: Any
    fetched_bytes: Any


@functools.cache
def _load_metrics() -> _LoadMetrics:
    """The load families in the default registry, made at the first load of the process. ``prometheus_client`` is
    imported only then: it picks its multiprocess mode from ``PROMETHEUS_MULTIPROC_DIR`` when first imported, and
    SGLang's launcher sets that variable after it loads its plugins (``sglang/srt/utils/common.py``,
    ``set_prometheus_multiproc_dir``: "we need to set this before importing prometheus_client")."""
    from prometheus_client import Counter, Histogram

    return _LoadMetrics(
        Counter(
            "coldsnap_load",
            "Worker weight loads through coldsnap, by outcome and by the rule of a fallback or refusal (empty: none)",
            ("engine", "outcome", "rule"),
        ),
        Histogram(
            "coldsnap_load_seconds",
            "Wall time of a worker's weight load: a restore, or a checkpoint load with what preceded it",
            ("engine", "outcome"),
            buckets=SECONDS_BUCKETS,
        ),
        Histogram(
            "coldsnap_stage_seconds",
            "Wall time of staging a pack the node-local cache lacked from the payload store during a load",
            ("engine",),
            buckets=SECONDS_BUCKETS,
        ),
        Counter("coldsnap_hydrated_bytes", "Bytes restores copied into models from packs and residuals", ("engine",)),
        Counter("coldsnap_fetched_bytes", "Bytes loads fetched from the payload store", ("engine",)),
    )


_warned = False


def record_load(
    line: LoadOutcomeLine, *, stage_seconds: float | None = None, hydrated_bytes: int = 0, fetched_bytes: int = 0
) -> None:
    """Count the load ``line`` describes (its engine, outcome, rule and seconds) in this process's registry.

    Args:
        line: the load's outcome line.
        stage_seconds: seconds spent staging its pack from the payload store, ``None`` when the store was not
            contacted.
        hydrated_bytes: bytes the restore copied from the pack and the residual blob.
        fetched_bytes: bytes fetched from the payload store.

    Never raises for the metrics themselves (a metric never fails a load): in multiprocess mode each sample is
    written to a file in ``PROMETHEUS_MULTIPROC_DIR``, and a file that cannot be written, or a ``prometheus_client``
    that cannot be imported, is one WARNING per process.
    """
    global _warned
    engine = line.engine
    try:
        metrics = _load_metrics()
        metrics.loads.labels(engine, line.outcome, "" if line.error is None else line.error.rule).inc()
        metrics.load_seconds.labels(engine, line.outcome).observe(line.seconds)
        if stage_seconds is not None:
            metrics.stage_seconds.labels(engine).observe(stage_seconds)
        metrics.hydrated_bytes.labels(engine).inc(hydrated_bytes)
        metrics.fetched_bytes.labels(engine).inc(fetched_bytes)
    except (OSError, ImportError) as exc:
        if not _warned:
            _warned = True
            logger.warning("coldsnap: cannot record load metrics (%s); this process's loads go uncounted", exc)


class _NodeView:
    """A ``prometheus_client`` collector of the node's view (:func:`node_exposition`)."""

    def __init__(self, lines: Iterable[dict[str, object]], cache: PayloadCache, now: datetime.datetime) -> None:
        self.lines, self.cache, self.now = lines, cache, now

    def collect(self) -> Iterable[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        loads = CounterMetricFamily(
            "coldsnap_outcome_log_loads",
            "Loads the outcome log holds, by artifact folder (empty: none), engine, outcome and rule (empty: none)",
            labels=("artifact", "engine", "outcome", "rule"),
        )
        tally = Tally(
            tuple("" if doc.get(key) is None else str(doc[key]) for key in ("artifact_dir", "engine", "outcome", "rule"))
            for doc in self.lines
        )
        for labels, count in sorted(tally.items()):
            loads.add_metric(labels, count)
        yield loads
        digests = self.cache.digests()
        sizes = [st.st_size for st in (refuse_symlink(self.cache.object_path(d)) for d in digests) if st is not None]
        yield GaugeMetricFamily("coldsnap_cache_objects", "Packs in the node-local cache", value=len(sizes))
        yield GaugeMetricFamily("coldsnap_cache_bytes", "Bytes of the packs in the node-local cache", value=sum(sizes))
        ages = GaugeMetricFamily(
            "coldsnap_cache_full_verification_age_seconds",
            "Seconds since each cached pack with a trusted validation record was last hashed in full",
            labels=("digest",),
        )
        for digest in digests:
            verified = last_full_verification(self.cache, digest)
            if verified is not None:
                ages.add_metric((digest,), (self.now - verified).total_seconds())
        yield ages


def node_exposition(lines: Iterable[dict[str, object]], cache: PayloadCache, *, now: datetime.datetime | None = None) -> str:
    """The node's view in the Prometheus text format (version 0.0.4): ``coldsnap_outcome_log_loads_total`` of the
    outcome ``lines`` (:func:`coldsnap_core.outcomes.read_outcomes`), ``coldsnap_cache_objects``,
    ``coldsnap_cache_bytes`` and ``coldsnap_cache_full_verification_age_seconds`` of ``cache`` at ``now`` (UTC).

    Raises:
        UnsafePathError, NotRegularFileError: a cache object path is a symbolic link or not a regular file.
        FileAccessError: a cache object cannot be examined.
    """
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_NodeView(lines, cache, now or datetime.datetime.now(datetime.UTC)))  # type: ignore[arg-type]
    return generate_latest(registry).decode()
