"""A tenant's worth of objects, made the way users make them (the API with the agent's
token, decisions through `decide`, reconciliation through the reconciler), so the isolation
tests probe real rows of every kind: runs, checkpoints, actions (prepared, held, parked in
manual review), approval requests (pending and decided), journal entries of the run and
tenant streams, a policy with its guardian grant, a webhook with a delivery.

Every identifying string of a tenant carries its slug, so "tenant B's data on tenant A's
page" is a plain text search (`World.markers`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest, TenantWebhook, WebhookDelivery
from audit.models import JournalEntry
from runtime import tooldefs
from runtime.models import Action, ActionStatus, Checkpoint, Tenant, ToolCredential
from tests.api import grant_policy, new_run, ok, post, prepare, take_lease
from tests.conftest import Persona


@dataclass
class World:
    tenant: Tenant
    agent: Persona
    reviewer: Persona
    policy: ApprovalPolicy
    run_id: str  # leased by the agent, checkpoint rev 1
    fence: int
    other_run_id: str  # an `asker` run on the same thread
    parked_run_id: str
    action_id: str  # prepared tasks.create
    held_action_id: str  # awaiting approval
    parked_id: str  # manual_review
    approval_id: str  # pending
    approval_hash: str
    decided_id: str  # rejected by the tenant's reviewer
    webhook: TenantWebhook
    delivery: WebhookDelivery
    credential: ToolCredential
    idempotency_key: str
    tool_name: str  # the tenant's own tool definition (tools/{name}/)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return self.tenant.slug

    def ids(self, kind: str) -> list[str]:
        """The ids of every object of a kind, as they go into URLs."""
        return {
            "run": [self.run_id, self.other_run_id, self.parked_run_id],
            "action": [self.action_id, self.held_action_id, self.parked_id],
            "approval": [self.approval_id, self.decided_id],
            "tool": [self.tool_name],
        }[kind]

    def checkpoints(self) -> list[dict[str, Any]]:
        rows = Checkpoint.objects.filter(tenant=self.tenant).values_list("run_id", "rev")
        return [{"run_id": str(run_id), "rev": rev} for run_id, rev in rows]

    def journal_ids(self) -> set[int]:
        return set(
            JournalEntry.objects.filter(tenant_id=self.tenant.pk).values_list("pk", flat=True)
        )

    @property
    def markers(self) -> list[str]:
        """Strings that identify this tenant's data and nothing of any other tenant."""
        uuids = [
            *self.ids("run"),
            *self.ids("action"),
            *self.ids("approval"),
        ]
        return [
            self.slug,
            self.tenant.name,
            self.agent.user.get_username(),
            self.reviewer.user.get_username(),
            self.idempotency_key,
            f"target-of-{self.slug}",
            f"reason-of-{self.slug}",
            f"thread-of-{self.slug}",
            self.webhook.url,
            self.delivery.message_id,
            self.credential.service,
            *uuids,
        ]


def build_world(agent: Persona, reviewer: Persona) -> World:
    """Needs settings.HOLDPOINT_TASKS_DEDUP = "none" (set by the `worlds` fixture), so the
    server hands an unknown outcome of the agent's tracker tool to a human at once."""
    slug = agent.tenant.slug
    policy = grant_policy(agent.tenant, tool="tasks.close")
    client = agent.api()
    mark = {"target": f"target-of-{slug}", "reason": f"reason-of-{slug}"}

    run = new_run(client, thread_id=f"thread-of-{slug}")
    fence = take_lease(client, run["run_id"], owner=f"executor-of-{slug}")
    checkpoint = {"fence": fence, "expected_rev": 0, "state": {"of": slug}, "next_step": "n"}
    ok(post(client, f"runs/{run['run_id']}/checkpoints/", checkpoint), 201)
    key = f"key-of-{slug}"
    action = ok(prepare(client, run["run_id"], fence, idempotency_key=key, **mark), 201)
    held = ok(prepare(client, run["run_id"], fence, "tasks.close", {"task_id": f"T-{slug}-1"}), 201)
    second = ok(
        prepare(client, run["run_id"], fence, "tasks.close", {"task_id": f"T-{slug}-2"}), 201
    )
    decided = ApprovalRequest.objects.get(pk=second["approval"])
    decide(decided.pk, reviewer.user, "reject", decided.action_hash, reason=f"reason-of-{slug}")

    other = new_run(client, graph="asker", goal={}, thread_id=f"thread-of-{slug}")
    parked_run = new_run(client, thread_id=f"thread-of-{slug}")
    parked_fence = take_lease(client, parked_run["run_id"], owner=f"executor-of-{slug}")
    parked = ok(prepare(client, parked_run["run_id"], parked_fence, **mark), 201)
    ok(post(client, f"actions/{parked['action_id']}/dispatch/", {"fence": parked_fence}))
    outcome = {"fence": parked_fence, "outcome": "unknown"}
    ok(post(client, f"actions/{parked['action_id']}/outcome/", outcome))
    # The service can neither deduplicate nor be looked up: the unknown outcome is a person's.
    assert Action.objects.get(pk=parked["action_id"]).status == ActionStatus.MANUAL_REVIEW

    webhook = TenantWebhook.objects.create(
        tenant=agent.tenant, url=f"https://{slug}.example/hook-of-{slug}"
    )
    delivery = WebhookDelivery.objects.create(
        webhook=webhook, event_type="approval.requested", message_id=f"msg-of-{slug}", attempt=1
    )
    credential = ToolCredential(tenant=agent.tenant, service=f"service-of-{slug}")
    credential.set_secret(f"secret-of-{slug}", actor="test:world")
    credential.save()
    tool = tooldefs.define(agent.tenant, tool_of(slug), "test:world").definition
    approval = ApprovalRequest.objects.get(pk=held["approval"])
    return World(
        tenant=agent.tenant,
        agent=agent,
        reviewer=reviewer,
        policy=policy,
        run_id=run["run_id"],
        fence=fence,
        other_run_id=other["run_id"],
        parked_run_id=parked_run["run_id"],
        action_id=action["action_id"],
        held_action_id=held["action_id"],
        parked_id=parked["action_id"],
        approval_id=str(approval.pk),
        approval_hash=approval.action_hash,
        decided_id=str(decided.pk),
        webhook=webhook,
        delivery=delivery,
        credential=credential,
        idempotency_key=key,
        tool_name=tool.name,
    )


def tool_of(slug: str) -> dict[str, Any]:
    """A tenant's tool definition, named after the tenant (its name is one of its markers)."""
    return {
        "name": f"tool-of-{slug}",
        "effect": "write",
        "schema": {"type": "object", "properties": {"title": {"type": "string"}}},
        "request": {"method": "POST", "url": "http://127.0.0.1:8765/tasks"},
        "dedup": {"mode": "key"},
    }


def random_ids() -> dict[str, Any]:
    """Ids that name nothing, of every kind a URL can carry."""
    return {
        "run_id": uuid.uuid4(),
        "action_id": uuid.uuid4(),
        "request_id": uuid.uuid4(),
        "approval_id": uuid.uuid4(),
        "rev": 1,
        "name": f"no-such.tool-{uuid.uuid4().hex}",
    }
