"""Registering agent graphs: named steps, the tools they may use, and how to evolve them.

An agent author writes steps — plain functions of a `StepContext` — and decorates them:

    graph = Graph("triage", version="2", max_failures=3)

    @graph.step(start=True)
    def read(ctx):
        doc = ctx.record("doc:" + ctx.goal["url"], lambda: fetch(ctx.goal["url"]))
        return Next("summarise", update={"doc_size": len(doc)})

    register(graph)

Everything durable — checkpoints, leases, retries, recording — is the runtime's job.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, overload

from audit.canonical import CanonicalError, canonical_bytes
from runtime.errors import UnknownGraph

if TYPE_CHECKING:
    from runtime.context import StepContext


@dataclass(frozen=True)
class Next:
    """Continue with `step`, after merging `update` into the state."""

    step: str
    update: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Wait:
    """Park the run until something outside happens, then continue with `then`.

    kind: "input" (a client posts data), "approval" (a hold point), or "timer" (`until`).
    """

    kind: str
    then: str
    update: dict[str, Any] = field(default_factory=dict)
    prompt: str = ""
    until: datetime | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in {"input", "approval", "timer"}:
            raise ValueError(f"unknown wait kind {self.kind!r}")
        if self.kind == "timer" and self.until is None:
            raise ValueError("a timer wait needs `until`")


@dataclass(frozen=True)
class Complete:
    """The run is done; `update` is merged into the final state."""

    update: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fail:
    """The run cannot succeed (a permanent failure, not retried)."""

    reason: str
    update: dict[str, Any] = field(default_factory=dict)


Outcome = Next | Wait | Complete | Fail
Step = Callable[["StepContext"], Outcome]
# (old_state, old_goal, new_goal) -> (state to keep, step to continue with)
RevisionHook = Callable[[dict[str, Any], Any, Any], tuple[dict[str, Any], str]]
Migration = Callable[[dict[str, Any]], dict[str, Any]]


class NotStorable(ValueError):
    """What a step returned cannot be stored: it names where (`$.when: datetime is not a JSON
    value`). A step failure like any other — counted, retried, then escalated — since a step
    may return something else the next time."""


def unstorable(outcome: Outcome, exc: Exception) -> Exception:
    """The error to report for an outcome whose commit failed: where its first value that
    is not JSON is, if that is why (the encoder saw the value alone, not where it was), else
    the commit's own error."""
    if not isinstance(exc, CanonicalError):
        return exc
    parts: list[tuple[str, Any]] = [("$", outcome.update)]
    if isinstance(outcome, Wait):
        parts.append(("waiting_for", {"prompt": outcome.prompt, **outcome.detail}))
    for name, value in parts:
        try:
            canonical_bytes(value)
        except CanonicalError as found:
            reason = str(found).partition(": ")[2] or str(found)
            where = "" if found.path == "$" else found.path
            joint = "" if not where or where.startswith("[") else "."
            return NotStorable(f"{name}{joint}{where}: {reason}")
    return NotStorable(f"the step's result cannot be stored: {exc}")


@dataclass
class Graph:
    name: str
    version: str
    state_version: int = 1
    tools: tuple[str, ...] = ()
    max_failures: int = 3
    step_timeout: float = 60.0
    retry_base: float = 1.0
    retry_max: float = 300.0
    description: str = ""
    default_goal: Any = None
    steps: dict[str, Step] = field(default_factory=dict)
    start: str = ""
    revision_hook: RevisionHook | None = None
    # Whether a hold point that expires for the last time (the re-request policy's second
    # expiry, approvals.expiry) makes the run need a person. False for a graph whose client
    # is handed that rejection as its answer (an MCP session: REJECTED): it goes on, as after
    # a reviewer's rejection.
    final_expiry_needs_attention: bool = True

    @overload
    def step(self, fn: Step, *, start: bool = False, name: str = "") -> Step: ...
    @overload
    def step(
        self, fn: None = None, *, start: bool = False, name: str = ""
    ) -> Callable[[Step], Step]: ...
    def step(
        self, fn: Step | None = None, *, start: bool = False, name: str = ""
    ) -> Step | Callable[[Step], Step]:
        """Decorator registering a step (by function name unless `name` is given)."""

        def register_step(func: Step) -> Step:
            step_name = name or func.__name__
            if step_name in self.steps:
                raise ValueError(f"step {step_name!r} registered twice in {self.name}")
            self.steps[step_name] = func
            if start or not self.start:
                self.start = step_name
            return func

        return register_step(fn) if fn is not None else register_step

    def on_revision(self, hook: RevisionHook) -> RevisionHook:
        """Decorator: decide which evidence stays valid when the goal is revised."""
        self.revision_hook = hook
        return hook

    def revise(
        self, old_state: dict[str, Any], old_goal: Any, new_goal: Any
    ) -> tuple[dict[str, Any], str]:
        """Default: keep nothing but recorded calls (which live outside the state); restart."""
        if self.revision_hook is None:
            return {}, self.start
        state, step = self.revision_hook(old_state, old_goal, new_goal)
        if step not in self.steps:
            raise ValueError(f"revision hook chose unknown step {step!r}")
        return state, step


class Registry:
    def __init__(self) -> None:
        self.graphs: dict[tuple[str, str], Graph] = {}
        self.migrations: dict[tuple[str, str], tuple[str, Migration]] = {}

    def register(self, graph: Graph) -> Graph:
        if not graph.steps:
            raise ValueError(f"graph {graph.name} has no steps")
        self.graphs[(graph.name, graph.version)] = graph
        return graph

    def unregister(self, name: str, version: str) -> None:
        self.graphs.pop((name, version), None)

    def register_migration(
        self, name: str, from_version: str, to_version: str, migrate: Migration
    ) -> None:
        self.migrations[(name, from_version)] = (to_version, migrate)

    def get(self, name: str, version: str) -> Graph | None:
        return self.graphs.get((name, version))

    def latest(self, name: str) -> Graph:
        versions = [g for (n, _), g in self.graphs.items() if n == name]
        if not versions:
            raise UnknownGraph(f"no graph named {name!r} is registered")
        return max(versions, key=lambda g: _version_key(g.version))

    def migration_path(self, name: str, version: str) -> list[tuple[str, str, Migration]]:
        """Migrations leading from `version` to a registered version, or [] if none does."""
        path: list[tuple[str, str, Migration]] = []
        seen = {version}
        current = version
        while (name, current) in self.migrations:
            target, migrate = self.migrations[(name, current)]
            path.append((current, target, migrate))
            if self.get(name, target) is not None:
                return path
            if target in seen:
                return []
            seen.add(target)
            current = target
        return []

    def names(self) -> list[str]:
        return sorted({name for name, _ in self.graphs})


def _version_key(version: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in version.split("."))


registry = Registry()
register = registry.register


def load_graph_modules(modules: list[str]) -> None:
    """Import the modules that register graphs (HOLDPOINT_GRAPH_MODULES)."""
    for module in modules:
        importlib.import_module(module)
