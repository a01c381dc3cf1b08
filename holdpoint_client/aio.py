"""The asyncio face of the client: `AsyncClient` (httpx.AsyncClient) and `AsyncExecutor`.

Same calls, same retry policy, same executor logic as the blocking ones — built from
`holdpoint_client.calls` (what each request is) and `holdpoint_client.flow` (what an
executor does), so only the waiting differs. A `perform`, `lookup` or recorded function may
be an `async def`; a plain one runs on a thread, so the heartbeat task goes on meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar, Unpack

import httpx
from httpx_sse import EventSource

from holdpoint_client import calls
from holdpoint_client.calls import Call, ClientSettings, Configured
from holdpoint_client.errors import ExecutorError, LeaseLost, StaleFence
from holdpoint_client.executor import ActOptions, ExecutorCore
from holdpoint_client.flow import adrive
from holdpoint_client.models import (
    Action,
    Approval,
    Checkpoint,
    JournalEntry,
    LeaseGrant,
    Page,
    Run,
)
from holdpoint_client.toolcall import Perform

T = TypeVar("T")


class AsyncClient(Configured):
    """`Client` for asyncio: the same calls, awaited (see holdpoint_client.client), the
    same keyword arguments (`calls.ClientSettings`; `transport` an httpx async one)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        **settings: Unpack[ClientSettings],
    ) -> None:
        super().__init__(base_url, token, **settings)
        self._http = httpx.AsyncClient(transport=transport, **self._http_options)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def send(self, call: Call[T]) -> T:
        """One logical call: the same request (same Idempotency-Key) until an answer."""
        attempt = 0
        while True:
            try:
                response = await self._http.request(**call.request(self.timeout))
            except calls.NO_ANSWER as exc:
                delay = self.policy.pause(call, attempt, error=exc)
            else:
                if response.is_success:
                    return call.answer(response)
                delay = self.policy.pause(call, attempt, response=response)
            await asyncio.sleep(delay)
            attempt += 1

    async def events(
        self, run_id: str, *, after: int = 0, follow: bool = False
    ) -> AsyncIterator[JournalEntry]:
        """As `Client.events`: `follow` streams live to the run's final entry."""
        if not follow:
            while True:
                entries = await self.send(calls.events_after(run_id, after))
                if not entries:
                    return
                for entry in entries:
                    yield entry
                after = entries[-1].seq
        feed = calls.EventFeed(run_id, after)
        attempt = 0
        while True:
            try:
                async with self._http.stream(**feed.request(self.timeout)) as response:
                    if not response.is_success:
                        await response.aread()
                        await asyncio.sleep(
                            self.policy.pause(feed.call(), attempt, response=response)
                        )
                        attempt += 1
                        continue
                    async for sse in EventSource(response).aiter_sse():
                        taken = feed.take(sse.data)
                        if taken is not None:
                            attempt = 0
                            yield taken
                if feed.ended((await self.get_run(run_id)).status):
                    return
                await asyncio.sleep(feed.pause(self.policy))
            except calls.NO_ANSWER as exc:
                await asyncio.sleep(self.policy.pause(feed.call(), attempt, error=exc))
                attempt += 1

    async def _iterate(self, page: Callable[[str | None], Call[Page[T]]]) -> AsyncIterator[T]:
        cursor: str | None = None
        while True:
            found = await self.send(page(cursor))
            for item in found.results:
                yield item
            if not found.next_cursor:
                return
            cursor = found.next_cursor

    # --- the calls (documented on Client) ------------------------------------------------

    async def create_run(
        self,
        graph: str,
        goal: Any,
        *,
        thread_id: str | None = None,
        graph_version: str | None = None,
        idempotency_key: str | None = None,
        external: bool = False,
    ) -> Run:
        call = calls.create_run(
            graph,
            goal,
            thread_id=thread_id,
            graph_version=graph_version,
            idempotency_key=idempotency_key,
            external=external,
        )
        return await self.send(call)

    async def get_run(self, run_id: str, *, wait: float | None = None) -> Run:
        return await self.send(calls.get_run(run_id, wait))

    def list_runs(
        self, *, status: str | None = None, thread_id: str | None = None, graph: str | None = None
    ) -> AsyncIterator[Run]:
        return self._iterate(
            lambda cursor: calls.runs_page(
                status=status, thread_id=thread_id, graph=graph, cursor=cursor
            )
        )

    async def runs_page(
        self,
        *,
        cursor: str | None = None,
        status: str | None = None,
        thread_id: str | None = None,
        graph: str | None = None,
    ) -> Page[Run]:
        return await self.send(
            calls.runs_page(status=status, thread_id=thread_id, graph=graph, cursor=cursor)
        )

    async def revise(self, run_id: str, goal: Any, *, expected_goal_rev: int) -> Run:
        return await self.send(calls.revise(run_id, goal, expected_goal_rev=expected_goal_rev))

    async def provide_input(self, run_id: str, data: Any, *, expected_rev: int) -> Run:
        return await self.send(calls.provide_input(run_id, data, expected_rev=expected_rev))

    async def cancel(self, run_id: str, reason: str = "") -> Run:
        return await self.send(calls.cancel(run_id, reason))

    async def resume(self, run_id: str, *, expected_rev: int | None = None) -> Run:
        return await self.send(calls.resume(run_id, expected_rev=expected_rev))

    def checkpoints(self, run_id: str) -> AsyncIterator[Checkpoint]:
        return self._iterate(lambda cursor: calls.checkpoints_page(run_id, cursor=cursor))

    async def get_checkpoint(self, run_id: str, rev: int, *, inline: bool = False) -> Checkpoint:
        return await self.send(calls.get_checkpoint(run_id, rev, inline=inline))

    def run_actions(self, run_id: str) -> AsyncIterator[Action]:
        return self._iterate(lambda cursor: calls.run_actions_page(run_id, cursor=cursor))

    async def lease(self, run_id: str, owner: str, ttl_seconds: int) -> LeaseGrant:
        return await self.send(calls.lease(run_id, owner, ttl_seconds))

    async def heartbeat(
        self, run_id: str, fence: int, *, ttl_seconds: float | None = None
    ) -> datetime | None:
        return await self.send(calls.heartbeat(run_id, fence, ttl_seconds))

    async def release(self, run_id: str, fence: int) -> None:
        await self.send(calls.release(run_id, fence))

    async def write_checkpoint(
        self,
        run_id: str,
        *,
        fence: int,
        expected_rev: int,
        state: Mapping[str, Any],
        next_step: str,
        status: str = "running",
        idempotency_key: str | None = None,
        prompt: str = "",
    ) -> Checkpoint:
        call = calls.write_checkpoint(
            run_id,
            fence=fence,
            expected_rev=expected_rev,
            state=state,
            next_step=next_step,
            status=status,
            idempotency_key=idempotency_key,
            prompt=prompt,
        )
        return await self.send(call)

    async def prepare_action(
        self,
        run_id: str,
        *,
        fence: int,
        tool: str,
        params: Mapping[str, Any],
        reason: str = "",
        target: str = "",
        idempotency_key: str | None = None,
        expected_goal_rev: int | None = None,
    ) -> Action:
        call = calls.prepare_action(
            run_id,
            fence=fence,
            tool=tool,
            params=params,
            reason=reason,
            target=target,
            idempotency_key=idempotency_key,
            expected_goal_rev=expected_goal_rev,
        )
        return await self.send(call)

    async def get_action(self, action_id: str) -> Action:
        return await self.send(calls.get_action(action_id))

    async def dispatch(self, action_id: str, fence: int) -> Action:
        return await self.send(calls.dispatch(action_id, fence))

    async def record_outcome(
        self,
        action_id: str,
        *,
        fence: int,
        outcome: str,
        external_id: str = "",
        result: Any = None,
    ) -> Action:
        call = calls.record_outcome(
            action_id, fence=fence, outcome=outcome, external_id=external_id, result=result
        )
        return await self.send(call)

    async def find_actions(
        self,
        *,
        idempotency_key: str | None = None,
        status: str | None = None,
        tool: str | None = None,
    ) -> list[Action]:
        def page(cursor: str | None) -> Call[Page[Action]]:
            return calls.actions_page(
                idempotency_key=idempotency_key, status=status, tool=tool, cursor=cursor
            )

        return [action async for action in self._iterate(page)]

    def approvals(self, *, status: str | None = None) -> AsyncIterator[Approval]:
        return self._iterate(lambda cursor: calls.approvals_page(status=status, cursor=cursor))

    async def get_approval(self, approval_id: str, *, wait: float | None = None) -> Approval:
        return await self.send(calls.get_approval(approval_id, wait))

    async def decide(
        self,
        approval_id: str,
        decision: str,
        *,
        action_hash: str,
        reason: str = "",
        edits: Mapping[str, Any] | None = None,
    ) -> Approval:
        call = calls.decide(
            approval_id, decision, action_hash=action_hash, reason=reason, edits=edits
        )
        return await self.send(call)

    async def resolve(
        self, action_id: str, outcome: str, *, external_id: str = "", note: str = ""
    ) -> Action:
        return await self.send(
            calls.resolve(action_id, outcome, external_id=external_id, note=note)
        )


class AsyncExecutor(ExecutorCore[AsyncClient]):
    """`Executor` on the event loop: `async with AsyncExecutor(client, run_id, owner) as ex:
    await ex.act(...)`; a task heartbeats."""

    _beats: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncExecutor:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def acquire(self) -> LeaseGrant:
        return await adrive(self._acquire_flow(), self.client)

    async def close(self) -> None:
        await adrive(self._close_flow(), self.client)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            if not await adrive(self._beat_flow(), self.client):
                return

    def _start_beats(self) -> None:
        self._beats = asyncio.get_running_loop().create_task(self._heartbeat())

    def _lose(self, exc: StaleFence) -> LeaseLost:
        if self._beats is not None and self._beats is not asyncio.current_task():
            self._beats.cancel()  # as the blocking executor's thread stops: at once
        return super()._lose(exc)

    async def _stop_beats(self) -> None:
        beats, self._beats = self._beats, None
        if beats is not None and beats is not asyncio.current_task():
            beats.cancel()
            try:
                await beats
            except asyncio.CancelledError:
                pass

    @property
    def run(self) -> Run:
        """The run as last read (on taking the lease, or by `refresh`)."""
        if self._run is None:
            raise ExecutorError("no lease: use the executor as an async context manager")
        return self._run

    @property
    def goal(self) -> Any:
        return self.run.goal

    async def refresh(self) -> Run:
        return await adrive(self._refresh_flow(), self.client)

    async def load(self) -> dict[str, Any]:
        return await adrive(self._load_flow(), self.client)

    async def checkpoint(
        self, state: Mapping[str, Any], next_step: str, status: str = "running", prompt: str = ""
    ) -> Checkpoint:
        return await adrive(self._checkpoint_flow(state, next_step, status, prompt), self.client)

    async def act(
        self,
        tool: str,
        params: Mapping[str, Any],
        *,
        call: str,
        perform: Perform | None,
        **options: Unpack[ActOptions],
    ) -> Action:
        """Executor.act, awaited; `perform` and `lookup` may be `async def`."""
        flow = self._act_flow(tool, params, call=call, perform=perform, **options)
        return await adrive(flow, self.client)
