"""The reviewer's card: who asked, what happens, where it lands, why, and what it costs.

A reviewer has about a minute per request. Everything on the card is read from data the
server already holds — the request's frozen `shown`, the run, and the tool's *definition*
(tools are data: the URL an http tool sends to, the MCP server a tool calls, the
compensating tool that undoes it) — so the card says where the effect lands (the host and
path the params resolve to), not the spec name the agent typed as its target.

Display only: nothing here decides. `approvals.decisions.decide` stays the authority; the
card only describes. The agent's reason is Markdown written by an agent (untrusted text),
rendered with raw HTML off and links limited to http(s)/mailto, so nothing it says can run
in the reviewer's browser.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any

from django.db.models import F
from django.utils.safestring import SafeString
from markdown_it import MarkdownIt

from approvals.models import ApprovalRequest, ApprovalStatus
from approvals.scoping import approvals_for
from approvals.wording import graph_of, then_phrase, undoes
from runtime import toolcatalog, urltemplates
from runtime.errors import InvalidParams
from runtime.models import Action, ActionStatus, Run, RunStatus
from runtime.tenancy import Principal
from runtime.tools import Effect, HttpTool, Sender, Tool, get_tool, tool_of

A = ApprovalStatus
SAFE_SCHEMES = ("http:", "https:", "mailto:")


# --- the reason, as safe Markdown ---------------------------------------------------------


def _markdown() -> MarkdownIt:
    """CommonMark with raw HTML off (`<script>` is shown as text) and links validated:
    markdown-it refuses javascript:/vbscript:/file:/data: itself; we narrow it further to
    http(s) and mailto, and every link leaves with rel="nofollow noopener noreferrer"."""
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
    md.enable("table")
    md.enable("strikethrough")
    default_validate = md.validateLink

    def validate(url: str) -> bool:
        lowered = url.strip().lower()
        relative = lowered.startswith(("/", "#")) and not lowered.startswith("//")
        return default_validate(url) and (relative or lowered.startswith(SAFE_SCHEMES))

    md.validateLink = validate  # type: ignore[method-assign]
    md.disable("image")  # an image would fetch from wherever the agent says: no

    def link_open(renderer: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        tokens[idx].attrSet("rel", "nofollow noopener noreferrer")
        rendered: str = renderer.renderToken(tokens, idx, options, env)
        return rendered

    md.add_render_rule("link_open", link_open)
    return md


_MD = _markdown()


def safe_markdown(text: str) -> SafeString:
    """The agent's Markdown as HTML a browser can show without running anything in it."""
    html: str = _MD.render(text or "")
    return SafeString(html)  # html off, links validated above: nothing here can run


# --- where the effect lands ---------------------------------------------------------------


@dataclass(frozen=True)
class Where:
    """Where the action's effect lands, as the tool's definition resolves it."""

    sender: str  # who performs the request, in words
    method: str = ""
    url: str = ""
    host: str = ""
    path: str = ""
    service: str = ""  # the tenant credential it sends (names the account on the other side)
    problem: str = ""  # the definition could not be resolved for these params


def where_of(tool: Tool, params: dict[str, Any]) -> Where:
    """The host, path and method an http tool's definition resolves to for these params;
    the MCP server and upstream tool of an mcp tool; for a client tool, that the agent's own
    executor performs it (Holdpoint never sees where)."""
    if isinstance(tool, HttpTool) and tool.url is not None:
        try:
            url = tool.url.render(params)
        except urltemplates.TemplateError as exc:
            return Where("Holdpoint sends it over HTTP", problem=str(exc))
        split = _split(url)
        return Where(
            "Holdpoint sends it over HTTP",
            method=tool.method,
            url=url,
            host=split[0],
            path=split[1],
            service=tool.credential,
        )
    if tool.executor == Sender.MCP:
        server = str(getattr(tool, "server", ""))
        upstream = str(getattr(tool, "upstream_tool", ""))
        return Where(
            f"Holdpoint calls the tool {upstream or tool.name!r} of the MCP server {server!r}",
            host=server,
            path=upstream,
            service=tool.credential,
        )
    if tool.executor == Sender.CLIENT:
        return Where(
            "The agent's own executor performs it (an external client); Holdpoint "
            "reconciles the outcome by the tool's dedup contract",
            service=tool.credential,
        )
    return Where(f"Performed by the {tool.executor} executor", service=tool.credential)


def _split(url: str) -> tuple[str, str]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return parts.netloc, path or "/"


# --- impact -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Impact:
    effect: str
    reversible: bool
    words: str
    compensation: str = ""
    compensation_description: str = ""


def impact_of(tool: Tool, tenant_id: int) -> Impact:
    """Effect class, and whether something undoes it: the definition's `compensation`."""
    compensation = tool.compensation
    description = ""
    if compensation:
        try:
            description = get_tool(compensation, tenant_id).description
        except InvalidParams:
            description = "(the compensating tool is not defined for this tenant)"
    if tool.effect == Effect.READ:
        return Impact(tool.effect, True, "Reads only: nothing outside changes.")
    if tool.effect == Effect.IRREVERSIBLE:
        return Impact(
            tool.effect,
            False,
            "Irreversible: once sent it cannot be undone"
            + (f" ({compensation} only mitigates it)." if compensation else "."),
            compensation,
            description,
        )
    if compensation:
        return Impact(
            tool.effect,
            True,
            f"Changes something outside; reversible: {compensation} undoes it "
            f"(given the created item's id as {tool.compensation_param}).",
            compensation,
            description,
        )
    return Impact(
        tool.effect,
        False,
        "Changes something outside, and no compensating tool is defined: undoing it is manual.",
    )


# --- the params against the last similar approved action ----------------------------------


@dataclass(frozen=True)
class ParamRow:
    name: str
    before: str
    after: str
    change: str  # "same" | "changed" | "added" | "removed"
    lines: list[tuple[str, str]] = field(default_factory=list)  # ("+"|"-"|" ", text)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def param_diff(before: dict[str, Any], after: dict[str, Any]) -> list[ParamRow]:
    """Key by key, in `after`'s order then what only `before` had; a changed multi-line
    text also gets its lines diffed (difflib), so a changed body shows what changed."""
    rows: list[ParamRow] = []
    for name in [*after, *(k for k in before if k not in after)]:
        old, new = _text(before.get(name)), _text(after.get(name))
        if name not in before:
            change = "added"
        elif name not in after:
            change = "removed"
        else:
            change = "same" if before[name] == after[name] else "changed"
        lines: list[tuple[str, str]] = []
        if change == "changed" and ("\n" in old or "\n" in new):
            for line in difflib.ndiff(old.splitlines(), new.splitlines()):
                if line[:1] in ("+", "-", " "):
                    lines.append((line[:1], line[2:]))
        rows.append(ParamRow(name, old, new, change, lines))
    return rows


def last_similar_approved(principal: Principal, found: ApprovalRequest) -> ApprovalRequest | None:
    """The tenant's most recent approved request on the same tool (what a reviewer let
    through last time): the baseline the params are compared with."""
    return (
        approvals_for(principal)
        .filter(shown__tool=(found.shown or {}).get("tool", ""), status=A.APPROVED)
        .exclude(pk=found.pk)
        .order_by(F("decided_at").desc(nulls_last=True), "-created_at")
        .first()
    )


def params_of(request: ApprovalRequest) -> dict[str, Any]:
    params: dict[str, Any] = json.loads(request.edited_params or request.params)
    return params


# --- the policy ---------------------------------------------------------------------------


OP_WORDS = {
    "eq": "is",
    "ne": "is not",
    "gt": "is more than",
    "gte": "is at least",
    "lt": "is less than",
    "lte": "is at most",
    "contains": "contains",
    "matches": "matches",
}


def condition_words(condition: Any, tool: str) -> str:
    """The policy's condition (approvals.conditions' language) as a sentence."""
    if not condition:
        return f"every {tool} action"
    if isinstance(condition, dict) and "target_matches" in condition:
        return f"{tool} actions whose target matches {condition['target_matches']!r}"
    if isinstance(condition, dict) and "param" in condition:
        op = OP_WORDS.get(str(condition.get("op", "eq")), str(condition.get("op")))
        return f"{tool} actions whose {condition['param']} {op} {condition.get('value')!r}"
    return f"{tool} actions (condition {json.dumps(condition)})"


# --- what happens next, once decided ------------------------------------------------------


def next_words(found: ApprovalRequest, action: Action, run: Run) -> str:
    """After a decision: what the run does now, from where it actually is."""
    status = found.status
    step = action.step
    undo = undoes(found)
    if undo:
        return f"{_undo_next(found, action, undo)}. The run is now {_run_words(run)}."
    if status == A.REJECTED:
        head = (
            f"the action is cancelled and never sent; the run's step {step!r} is told it was "
            "rejected (ActionRejected) and decides what to do"
        )
    elif status == A.APPROVED:
        head = (
            "the run sends the action"
            if action.status in (ActionStatus.APPROVED, ActionStatus.PREPARED)
            else f"the action is {action.status}"
        )
    elif status == A.EXPIRED and action.status == ActionStatus.CANCELLED:
        head = (
            f"the request expired undecided and the action was rejected at expiry: it is "
            f"cancelled and never sent; the run's step {step!r} is told it was rejected"
        )
    elif status == A.EXPIRED:
        head = "the request expired undecided"
    elif lapsed(found):
        head = f"the approval no longer counts: {found.closed_reason}"
    else:
        head = f"the request is {status}"
    return f"{head}. The run is now {_run_words(run)}."


def lapsed(found: ApprovalRequest) -> bool:
    """An approval that stopped counting before its action was sent (superseded at dispatch,
    or withdrawn with its action: `approvals.requests.supersede_approval`): it keeps its
    decision, and its `closed_reason` says why it no longer counts."""
    return found.status in (A.SUPERSEDED, A.CANCELLED) and bool(
        found.closed_reason and found.decided_at
    )


def _undo_next(found: ApprovalRequest, action: Action, undo: dict[str, str]) -> str:
    """`next_words` for a compensation: no step waits for it, its own sender sends it once
    approved, and its original stays confirmed unless it is sent and confirmed."""
    original = f"{undo.get('tool')} {undo.get('idempotency_key')}"
    if action.status == ActionStatus.CANCELLED:
        when = " at expiry" if found.status == A.EXPIRED else ""
        return (
            f"the compensation was rejected{when}: it is cancelled and never sent, and "
            f"{original} stays confirmed"
        )
    if action.status == ActionStatus.CONFIRMED:
        return f"the compensation was sent and confirmed: {original} is compensated"
    if found.status == A.APPROVED and action.status in (
        ActionStatus.APPROVED,
        ActionStatus.PREPARED,
    ):
        return f"the compensation is being sent; {original} stays confirmed until it is"
    if lapsed(found):
        return f"the approval no longer counts: {found.closed_reason}"
    if found.status == A.APPROVED:
        return f"the compensation is {action.status}"
    return f"the request is {found.status}"


def _run_words(run: Run) -> str:
    if run.status == RunStatus.QUEUED:
        return "queued: it continues at its next step"
    if run.status == RunStatus.WAITING_APPROVAL:
        return "waiting for another approval"
    if run.status == RunStatus.COMPLETED:
        return "completed"
    return str(run.status).replace("_", " ")


# --- the card -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    what: str
    description: str
    where: Where
    about: str  # the agent's own target label
    why: SafeString
    impact: Impact
    asked_by: str
    on_behalf_of: str
    baseline: ApprovalRequest | None
    diff: list[ParamRow]
    policy: str
    policy_covers: str
    expiry_then: str
    next: str
    # A pending request's tool is an inactive MCP server's (runtime.toolcatalog.withheld):
    # approving it sends nothing until the server is active again. Its name, else "".
    server_off: str = ""


def server_off(found: ApprovalRequest, action: Action) -> str:
    """The inactive MCP server of a pending request's tool ("" otherwise): the reviewer
    should know that approving will not send it now — it waits, approved, for the server."""
    if found.status != A.PENDING:
        return ""
    return toolcatalog.withheld_by_name(found.tenant_id, [action.tool]).get(action.tool, "")


def card_for(principal: Principal, found: ApprovalRequest) -> Card:
    """Everything the reviewer's card shows for one request."""
    shown = found.shown or {}
    run = found.run
    action = found.action
    params = params_of(found)
    try:
        tool = tool_of(action)
    except InvalidParams:  # the definition is gone (deleted tenant tool): say so, no 500
        tool = Tool(name=action.tool, version=action.tool_version, executor="unknown")
    baseline = last_similar_approved(principal, found)
    executor = run.executor_account.get_username() if run.executor_account else ""
    graph = graph_of(found)
    undo = undoes(found)
    asked_by = f"the {graph} agent, in its step {action.step!r}" + (
        f", executed by {executor}" if executor else ""
    )
    if undo:  # no step asked: a tenant admin, on the run page
        asked_by = (
            f"{undo.get('asked_by')}, to undo {undo.get('tool')} {undo.get('idempotency_key')} "
            f"(a compensation: no step of the {graph} run waits for it)"
        )
    return Card(
        what=found.title,
        description=tool.description,
        where=where_of(tool, params),
        about=str(shown.get("target") or ""),
        why=safe_markdown(str(shown.get("reason") or "")),
        impact=impact_of(tool, found.tenant_id),
        asked_by=asked_by,
        on_behalf_of=str(shown.get("initiator") or run.created_by or "—"),
        baseline=baseline,
        diff=param_diff(params_of(baseline), params) if baseline else [],
        policy=found.policy.name,
        policy_covers=condition_words(found.policy.condition, found.policy.tool),
        expiry_then=then_phrase(
            found.policy.on_expiry, found.rerequest_count, graph, undo=bool(undo)
        ).removeprefix("then "),
        next=next_words(found, action, run) if found.status != A.PENDING else "",
        server_off=server_off(found, action),
    )
