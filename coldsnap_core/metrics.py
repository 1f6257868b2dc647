"""Prometheus metrics of coldsnap: what each load did (in the loading process) and the node's view (from its files).
:func:`record_load` counts a load in the loading process's default registry, which an engine's ``/metrics`` shows in
``prometheus_client``'s multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``: set by ``vllm serve`` with more than one API
server, ``vllm/entrypoints/cli/serve.py``, or SGLang's ``--enable-metrics``, ``sglang/srt/utils/common.py``)."""

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
"""Histogram buckets (seconds)."""


class _LoadMetrics(NamedTuple):
    loads: Any
    load_seconds: Any
    stage_seconds: Any
    hydrated_bytes: Any
    fetched_bytes: Any


@functools.cache
def _load_metrics() -> _LoadMetrics:
    """The load families in the default registry, made at the first load; ``prometheus_client`` is imported only
    then (SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` after it loads its plugins: ``set_prometheus_multiproc_dir``)."""
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
    """Count the load ``line`` describes (``stage_seconds`` ``None``: no store contacted); never raises: one WARNING a process."""
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
    """The node's view in the Prometheus text format (version 0.0.4), for ``coldsnap status --format prometheus``:
    the loads of the outcome ``lines`` and the objects of ``cache`` at ``now`` (UTC); raises as :func:`refuse_symlink`."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_NodeView(lines, cache, now or datetime.datetime.now(datetime.UTC)))  # type: ignore[arg-type]
    return generate_latest(registry).decode()
