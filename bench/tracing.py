"""What OpenTelemetry tracing costs per step (issue 21: "tracing off costs < 2% per step").

A build without the tracing code cannot run beside this one in the same process, so the
cost of "off" is measured two ways, both inside the same run:

1. Interleaved rounds of the throughput benchmark's 50-step bench-noop run (Bench.holdpoint_once)
   in four modes, one of each per round, in a rotating order: `off` (the default: no provider,
   runtime.tracing's shared no-op), `noop` (tracing switched on with the API's
   NoOpTracerProvider: every hook builds its attributes and enters a non-recording span),
   `memory` (the SDK recording into an InMemorySpanExporter through a SimpleSpanProcessor),
   and the raw `BEGIN; INSERT; COMMIT` baseline (Bench.raw_once), so `off` ÷ raw can be set
   beside the throughput section's ratio. Each is a median of per-round ratios against `off`
   (the off figure moves 2× on a shared machine; a ratio within one round does not).
2. The hooks' own cost when off, timed in a tight loop: runtime.observe's per-step hooks as
   the executor calls them (a 50th of `advancing`, `step_begins` entered and left,
   `step_done`) against the same hooks with the tracing code taken out (bind the log
   context, read the clock, observe the histogram, as before tracing), in microseconds per
   step, set against the `off` step's median duration. Ratios of whole runs cannot resolve
   an overhead much below their noise (a few %); this measures it directly.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.common import log, summary

MODES = ("off", "noop", "memory", "raw")


class TracingBench:
    def __init__(self, bench: Any) -> None:
        self.bench = bench

    def once(self, mode: str) -> float:
        """Seconds per step of one run (raw: per commit) with tracing in `mode`."""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from runtime import tracing

        if mode == "raw":
            return float(self.bench.raw_once()["seconds"]) / self.bench.steps
        exporter = None
        if mode == "noop":
            tracing.install(trace.NoOpTracerProvider())
        elif mode == "memory":
            exporter = InMemorySpanExporter()
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            tracing.install(provider)
        try:
            seconds = float(self.bench.holdpoint_once()["seconds"]) / self.bench.steps
        finally:
            tracing.uninstall()
        if exporter is not None:
            spans = exporter.get_finished_spans()
            # One advance and one span per step: the run was traced, not skipped.
            if len(spans) != self.bench.steps + 1:
                raise RuntimeError(f"memory mode exported {len(spans)} spans")
        return seconds

    def hooks_off_us(self, loops: int = 100_000) -> dict[str, float]:
        """Microseconds the hooks of one no-op step take with tracing off, against the same
        hooks without tracing (what main's runtime.observe did before tracing: bind the log
        context, read the clock, observe the histogram) — the difference is what the
        tracing code costs a step when it is off."""
        from runtime import logs, metrics, observe, tracing
        from runtime.context import StepContext
        from runtime.models import Run

        assert not tracing.enabled()
        run = Run.objects.filter(tenant=self.bench.tenant).first()
        ctx = StepContext(
            run_id=run.run_id,
            tenant_id=run.tenant_id,
            step="tick",
            state={},
            goal={},
            goal_rev=1,
            checkpoint_rev=0,
            lease=None,  # type: ignore[arg-type]
        )
        quiet = (KeyError,)
        steps = self.bench.steps

        def with_tracing() -> None:  # this branch: what the executor calls per step
            with observe.advancing(run):
                for _ in range(steps):
                    watch = observe.step_begins(ctx, quiet)
                    with watch:
                        pass
                    observe.step_done(watch)

        def without_tracing() -> None:  # the same hooks with the tracing code taken out
            for _ in range(steps):
                logs.bind_action(None)
                began = metrics.clock()
                metrics.observe_step(began)

        def per_step(fn: Any) -> float:
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(loops // steps):
                    fn()
                best = min(best, (time.perf_counter() - t0) / (loops // steps * steps))
            return best * 1e6

        # The best of many interleaved repeats each: a tight loop's noise only ever adds.
        pairs = [(per_step(with_tracing), per_step(without_tracing)) for _ in range(7)]
        traced, bare = min(p[0] for p in pairs), min(p[1] for p in pairs)
        return {
            "hooks_with_tracing_off_us": traced,
            "hooks_without_tracing_us": bare,
            "per_step_us": traced - bare,  # below 0: within the loop's noise
        }

    def go(self, rounds: int) -> dict[str, Any]:
        for mode in MODES:  # warm-up: imports, the SDK, statement plans
            self.once(mode)
        per_round: list[dict[str, float]] = []
        for r in range(rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            seconds = {mode: self.once(mode) for mode in order}
            row = {f"{mode}_ms_per_step": s * 1000 for mode, s in seconds.items()}
            row["noop_over_off"] = seconds["noop"] / seconds["off"]
            row["memory_over_off"] = seconds["memory"] / seconds["off"]
            row["off_steps_over_raw_commits"] = seconds["raw"] / seconds["off"]
            per_round.append(row)
            log(
                f"[{self.bench.backend}] tracing round {r + 1}/{rounds}: off "
                f"{row['off_ms_per_step']:.3f} ms/step, noop ×{row['noop_over_off']:.3f}, "
                f"memory ×{row['memory_over_off']:.3f}, off÷raw "
                f"{row['off_steps_over_raw_commits']:.3f}"
            )
        hooks = self.hooks_off_us()
        off_ms = statistics.median(r["off_ms_per_step"] for r in per_round)
        out: dict[str, Any] = {
            "rounds": rounds,
            "steps_per_run": self.bench.steps,
            "per_round": per_round,
            "hooks_off": hooks,
            "off_hooks_share_of_step": hooks["per_step_us"] / (off_ms * 1000),
        }
        for key in per_round[0]:
            out[key] = summary([r[key] for r in per_round])
        log(
            f"[{self.bench.backend}] tracing: off hooks {hooks['per_step_us']:.3f} µs/step = "
            f"{out['off_hooks_share_of_step']:.5%} of a {off_ms:.3f} ms step; noop ×"
            f"{out['noop_over_off']['median']:.3f}, memory ×{out['memory_over_off']['median']:.3f}"
        )
        return out
