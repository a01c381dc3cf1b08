"""The model's answers in an OpenAI Agents SDK run, recorded in the Holdpoint run.

Why: a tool call's ledger key is built from the SDK's `call_id`, and a real model gives
every answer new call ids. Without a record, a process that died after a tool's effect (an
ungated call, or any call after a resumed pause) asks the model again when it restarts; the
model's new answer names a new call id, so the ledger sees a new action and the effect
happens twice — and the model is paid twice. With the record, the restarted run is given
the same answers in the same order: the same call ids, the same keys, one effect.

How: every agent of the run (its handoffs' agents too, found as the SDK finds them) is
cloned with its model wrapped; a wrapped model's n-th answer is `run.model("oa:<goal
rev>:<n>")`. The numbering restarts under a new goal revision (an old goal's answers are
never replayed into the new one) and goes on from the count kept beside a stored pause.
The SDK resolves the model and its settings once per turn (`get_model`,
`get_model_settings`, internal to openai-agents 0.24, which pyproject pins); the clone is
given the settings the original would have had, so wrapping changes nothing the model sees.
Not wrapped: agents run as tools (`Agent.as_tool`) and guardrail agents, which run in
runs of their own.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from agents import Agent, Handoff, Model, ModelResponse, RunConfig, RunContextWrapper
from agents.run_internal.turn_preparation import get_model, get_model_settings
from agents.usage import deserialize_usage, serialize_usage
from openai.types.responses import ResponseOutputItem
from pydantic import BaseModel, TypeAdapter

from holdpoint_client.agent import AsyncRunHandle
from holdpoint_client.errors import ExecutorError

_ITEM: TypeAdapter[Any] = TypeAdapter(ResponseOutputItem)


class Answers:
    """The run's model answers, numbered in the order the agent loop asks for them."""

    def __init__(self, run: AsyncRunHandle, goal_rev: int, taken: int = 0) -> None:
        self.run, self.goal_rev, self.taken = run, goal_rev, taken

    async def answer(self, ask: Callable[[], Awaitable[ModelResponse]]) -> ModelResponse:
        """The next answer: the recorded one, or `ask()`'s, recorded before it is used."""
        key = f"oa:{self.goal_rev}:{self.taken}"
        self.taken += 1

        async def asked() -> dict[str, Any]:
            return dump(await ask())

        return load(await self.run.model(key, asked))


class Recorded(Model):
    """One agent's model whose answers come from, and go to, the run's record."""

    def __init__(self, inner: Model, answers: Answers) -> None:
        self.inner, self.answers = inner, answers

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        return await self.answers.answer(lambda: self.inner.get_response(*args, **kwargs))

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise ExecutorError("run_agent runs the agent with Runner.run: a stream is not recorded")

    async def close(self) -> None:
        await self.inner.close()

    def get_retry_advice(self, request: Any) -> Any:
        return self.inner.get_retry_advice(request)


def recording(
    agent: Agent[Any], config: RunConfig, answers: Answers
) -> tuple[Agent[Any], RunConfig]:
    """`agent` (and every agent it hands off to) with its model's answers recorded, and the
    run config to run it with (a run-wide `model`, which overrides every agent's, wrapped
    likewise)."""
    shared = Recorded(get_model(agent, config), answers) if config.model is not None else None
    clone = _Cloner(config, answers, shared).agent(agent)
    return clone, config if shared is None else dataclasses.replace(config, model=shared)


class _Cloner:
    """Clones agents with recorded models, each once (handoffs may go round in circles)."""

    def __init__(self, config: RunConfig, answers: Answers, shared: Recorded | None) -> None:
        self.config, self.answers, self.shared = config, answers, shared
        self.seen: dict[int, Agent[Any]] = {}

    def agent(self, agent: Agent[Any]) -> Agent[Any]:
        if id(agent) in self.seen:
            return self.seen[id(agent)]
        # The clone's model is always a Model, so the SDK treats its settings as it treats
        # any Model's: the ones the original would have been given are set explicitly.
        model = self.shared or Recorded(get_model(agent, self.config), self.answers)
        clone = agent.clone(model=model, model_settings=get_model_settings(agent, self.config))
        self.seen[id(agent)] = clone
        clone.handoffs = [self.handoff(h) for h in agent.handoffs]
        return clone

    def handoff(self, handoff: Agent[Any] | Handoff[Any, Any]) -> Agent[Any] | Handoff[Any, Any]:
        if isinstance(handoff, Agent):
            return self.agent(handoff)
        invoke = handoff.on_invoke_handoff

        async def invoked(context: RunContextWrapper[Any], arguments: str) -> Agent[Any]:
            return self.agent(await invoke(context, arguments))

        wrapped = dataclasses.replace(handoff, on_invoke_handoff=invoked)
        # `replace` leaves out the target's weak reference (not an init field), by which the
        # SDK finds the agents of a stored RunState: point it at the target's clone (which
        # `seen` keeps alive as long as this cloner, held by `invoked`).
        target = handoff._agent_ref() if handoff._agent_ref is not None else None
        if isinstance(target, Agent):
            wrapped._agent_ref = weakref.ref(self.agent(target))
        return wrapped


def dump(response: ModelResponse) -> dict[str, Any]:
    """A model answer as JSON (what the record keeps)."""
    return {
        # As the model gave them: only the fields it set, under their wire names (`async`,
        # not `async_`), so each comes back equal to what it was (the SDK checks that).
        "output": [
            item.model_dump(mode="json", exclude_unset=True, by_alias=True, round_trip=True)
            if isinstance(item, BaseModel)
            else item
            for item in response.output
        ],
        "usage": serialize_usage(response.usage),
        "response_id": response.response_id,
        "request_id": response.request_id,
    }


def load(recorded: dict[str, Any]) -> ModelResponse:
    """The recorded answer as the SDK's ModelResponse."""
    return ModelResponse(
        output=[_ITEM.validate_python(item) for item in recorded["output"]],
        usage=deserialize_usage(recorded.get("usage") or {}),
        response_id=recorded.get("response_id"),
        request_id=recorded.get("request_id"),
    )
