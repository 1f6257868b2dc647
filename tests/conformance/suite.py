"""The engine contract's conformance suite: the same cases, run against every engine adapter.

:class:`EngineConformance` holds the cases; each adapter's tests subclass it and supply the fixture ``runs``, an
:class:`EngineRuns` of the starts the cases read (in the manner of the payload-store contract,
``tests/cache/test_store_contract.py``). The subclasses:

* the fake engine, ``tests/conformance/test_fake_engine_conformance.py`` (in process, a second or two);
* vLLM, ``TestVllmConformance`` in ``tests/vllm/test_vllm_engine.py``;
* SGLang, ``TestSglangConformance`` in ``tests/sglang/test_sglang_engine.py``.

The real engines' runs are the ones their engine tests make anyway (shared fixtures of those modules and the
session's ``vllm_two_layer``), so the suite starts no engine of its own. A start is read by what every adapter
leaves whatever the engine (:class:`Start`): whether the engine served, the outcome log lines it appended
(``docs/format.md`` §10.3), its coldsnap log lines, and its weights' digests before any post-processing or after it
(compared only with the same engine's plain load).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap_core.artifact.capsules import read_capsule, read_descriptor
from coldsnap_core.cache.overlays import list_overlays

FALLBACK_WARNING = "coldsnap: could not restore "
"""The start of the one WARNING an ``auto`` fallback logs (:func:`coldsnap_core.restore.pipeline.restore_or_fall_back`)."""
REFUSAL = "coldsnap: "
"""How the one ERROR line of a refused start begins (``coldsnap: <engine> start refused for <worker> (...)``,
:func:`coldsnap_core.operator_log.refuse`)."""


@dataclass(frozen=True)
class Start:
    """What one engine start left.

    Attributes:
        served: whether the engine started and served (``False``: it stopped at start).
        lines: the load outcome log lines this start appended, in order.
        log: its log (the error that stopped it included), where the coldsnap lines are.
        weights: parameter or buffer name -> a digest of its bytes (the engine's own choice of digest and moment);
            empty when it did not serve.
    """

    served: bool
    lines: tuple[dict, ...]
    log: str
    weights: Mapping[str, object] = field(default_factory=dict)

    @property
    def line(self) -> dict:
        """The one outcome line of this start (fails naming them when there is not exactly one)."""
        assert len(self.lines) == 1, self.lines
        return self.lines[0]

    def fallback_warnings(self) -> list[str]:
        return [text for text in self.log.splitlines() if FALLBACK_WARNING in text]

    def refusal_lines(self) -> list[str]:
        """The ``coldsnap:`` refusal lines of this start's log, from ``coldsnap:`` on (an engine's log prefix cut)."""
        return [text[text.index(REFUSAL) :] for text in self.log.splitlines() if REFUSAL in text and " start refused " in text]


@dataclass(frozen=True)
class EngineRuns:
    """The starts of one engine the cases read, all of one checkpoint with one worker.

    Attributes:
        engine: the engine name its capsules' ``target.json`` and its outcome lines record.
        engine_label: its name in coldsnap's messages (:attr:`coldsnap_core.load_policy.LoadPolicy.engine_label`).
        plain: the engine's own load of the checkpoint, without coldsnap (the reference weights).
        capture: a start with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1`` into :attr:`artifact`.
        artifact: the artifact folder the capture wrote.
        restore: a ``native`` restore of that artifact.
        fallback: an ``auto`` start whose restore fails verification: it serves the checkpoint load.
        refusal: a ``native`` start whose restore fails: it stops.
        upgraded: an ``auto`` start after the target changed (another engine version recorded or installed): it
            falls back and captures a target-local overlay under :attr:`overlay_state`.
        through_overlay: the next start on that node, restored through the overlay.
        overlay_state: the state root of those two.
        unhonoured: a start with a setting the engine cannot honour.
        unhonoured_setting: how the error of that start names the setting.
    """

    engine: str
    engine_label: str
    plain: Start
    capture: Start
    artifact: Path
    restore: Start
    fallback: Start
    refusal: Start
    upgraded: Start
    through_overlay: Start
    overlay_state: Path
    unhonoured: Start
    unhonoured_setting: str


class EngineConformance:
    """The cases; a subclass named ``Test...`` supplies the fixture ``runs`` (an :class:`EngineRuns`)."""

    def test_capture_writes_the_artifact_and_says_captured(self, runs: EngineRuns) -> None:
        """Fails if an adapter's export serves nothing, writes no capsule of this engine, or logs another outcome or
        another pack than the artifact names."""
        assert runs.capture.served, runs.capture.log[-5000:]
        (entry,) = read_descriptor(runs.artifact).workers
        line = runs.capture.line
        assert (line["outcome"], line["engine"], line["pack_sha256"]) == ("captured", runs.engine, entry.payload.sha256)
        assert read_capsule(runs.artifact / entry.capsule).target.engine == runs.engine
        assert runs.capture.weights == runs.plain.weights

    def test_restore_serves_the_plain_loads_bytes_without_a_fallback(self, runs: EngineRuns) -> None:
        """Fails if a ``native`` restore falls back, logs another outcome or pack, or serves other bytes than the
        engine's own load of the checkpoint."""
        assert runs.restore.served, runs.restore.log[-5000:]
        assert (runs.restore.line["outcome"], runs.restore.line["pack_sha256"]) == ("restored", runs.capture.line["pack_sha256"])
        assert runs.restore.fallback_warnings() == []
        assert runs.restore.weights == runs.plain.weights

    def test_auto_falls_back_with_one_warning_and_serves_the_checkpoint(self, runs: EngineRuns) -> None:
        """Fails if ``auto`` stops the engine, falls back silently (no WARNING, or no rule in the outcome line), warns
        more than once, or serves other bytes than the checkpoint's."""
        assert runs.fallback.served, runs.fallback.log[-5000:]
        line = runs.fallback.line
        assert line["outcome"] == "fell-back" and line["rule"] is not None
        (warning,) = runs.fallback.fallback_warnings()
        assert f"rule {line['rule']} failed" in warning and "; remedy: " in warning
        assert runs.fallback.weights == runs.plain.weights

    def test_native_refuses_without_falling_back(self, runs: EngineRuns) -> None:
        """Fails if ``native`` serves after a failed restore, falls back, leaves no ``refused`` line naming the
        rule its error names, or does not say so in one ``coldsnap:`` line of its own (the same text wherever the
        engine repeats it) naming the engine, the worker, the rule and one remedy."""
        assert not runs.refusal.served
        line = runs.refusal.line
        assert line["outcome"] == "refused" and line["rule"] is not None
        assert f"rule {line['rule']} failed" in runs.refusal.log
        assert runs.refusal.fallback_warnings() == []
        (refusal,) = set(runs.refusal.refusal_lines())
        assert refusal.startswith(f"coldsnap: {runs.engine_label} start refused for worker-0-of-1 (COLDSNAP_RESTORE=native")
        assert f"rule {line['rule']} failed" in refusal and refusal.count("; remedy: ") == 1

    def test_a_target_change_falls_back_once_then_restores_through_an_overlay(self, runs: EngineRuns) -> None:
        """Fails if an adapter gets no target-local overlay after a fallback caused by the target (every later start
        would fall back), or its next start does not restore through it."""
        upgraded, through = runs.upgraded, runs.through_overlay
        assert upgraded.served and through.served, (upgraded.log[-3000:], through.log[-3000:])
        assert (upgraded.line["outcome"], upgraded.line["rule"]) == ("fell-back", "target-qualification")
        assert len(upgraded.fallback_warnings()) == 1
        assert [overlay.status for overlay in list_overlays(runs.overlay_state)] == ["current"]
        assert (through.line["outcome"], through.line["rule"]) == ("restored", None)
        assert through.fallback_warnings() == []
        assert upgraded.weights == through.weights == runs.plain.weights

    def test_one_outcome_line_per_load(self, runs: EngineRuns) -> None:
        """Fails if a load of this engine appends no line or several (a fleet then miscounts its fallbacks), or a
        line names another engine or worker; a start stopped before any load by its settings appends one ``refused``
        line of rule ``configuration`` (its adapter builds the loader within ``LoadPolicy.refusing_settings``)."""
        starts = (runs.capture, runs.restore, runs.fallback, runs.refusal, runs.upgraded, runs.through_overlay)
        assert [[(d["engine"], d["worker"]) for d in s.lines] for s in starts] == [[(runs.engine, "worker-0-of-1")]] * 6
        assert [(d["engine"], d["outcome"], d["rule"]) for d in runs.unhonoured.lines] == [
            (runs.engine, "refused", "configuration")
        ]

    def test_a_setting_the_engine_cannot_honour_is_refused_at_start(self, runs: EngineRuns) -> None:
        """Fails if an engine starts (or loads anything) with a setting its adapter cannot honour, or the error does
        not name the setting."""
        assert not runs.unhonoured.served
        assert "ConfigurationError" in runs.unhonoured.log and runs.unhonoured_setting in runs.unhonoured.log
