"""OpenTelemetry traces (issue 21): the span tree of one approved action end to end, the
send span's `traceparent` at the real tracker (the sandbox process lists what it received),
an agent's `traceparent` on the API as the parent, and nothing at all while tracing is off.

The spans are read from the SDK's in-memory exporter, so the executor runs in this process
(`advance_run`, as the other runtime tests drive runs); the two `test_a_worker_…` tests run a
real `qcluster` configured by `OTEL_*` variables alone: the README's console line, and OTLP
over HTTP to a collector socket (the otlp extra)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, Tracer

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest
from holdpoint_client import AsyncClient, Client
from runtime import tracing
from runtime.context import StepContext
from runtime.executor import advance_run
from runtime.graphs import Complete, Graph, Next, Outcome, register
from runtime.lifecycle import create_run
from runtime.models import Action, Run, RunStatus, Tenant
from tests import procs
from tests.api import API, new_run, ok, post, take_lease
from tests.conftest import Persona, issue_token_for
from tests.httpservers import Behaviour, Server
from tests.sandbox import Sandbox
from tests.tooldefs import define_tickets

Factory = Callable[[str], Sandbox]
README = Path(__file__).resolve().parents[2] / "README.md"

traced = Graph("traced", version="1", tools=("tickets.create",))


@traced.step(start=True)
def gather(ctx: StepContext) -> Outcome:
    doc = ctx.record("doc:spec", lambda: {"text": "the spec"})
    summary = ctx.model("summarise", lambda: "Summary: " + doc["text"])
    ticket = ctx.act("tickets.create", {"title": summary}, reason="file the summary")
    return Next("done", update={"ticket": ticket.external_id})


@traced.step
def done(ctx: StepContext) -> Outcome:
    return Complete(update={"reported": ctx.state["ticket"]})


register(traced)


class Spans:
    def __init__(self, exporter: InMemorySpanExporter, tracer: Tracer) -> None:
        self.exporter, self.tracer = exporter, tracer

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        [span] = self.named(name)
        return span


@pytest.fixture
def spans() -> Iterator[Spans]:
    """Tracing on, into memory, for one test (the process-wide provider is never set)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield Spans(exporter, provider.get_tracer("test"))
    finally:
        tracing.uninstall()


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _context(span: ReadableSpan) -> SpanContext:
    assert span.context is not None
    return span.context


def traceparent_of(span: ReadableSpan) -> str:
    ctx = _context(span)
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def _held(tenant: Tenant, url: str) -> None:
    """tickets.create at the sandbox: a tenant write tool no policy names waits for review."""
    define_tickets(tenant, url)


def test_one_approved_action_is_one_span_tree_and_the_tracker_gets_the_send_span(
    spans: Spans, tenant_a: Tenant, reviewer_a: Persona, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("key")
    _held(tenant_a, box.url)
    with spans.tracer.start_as_current_span("agent") as agent:
        run = create_run(tenant_a, "traced", {}, actor="user:starter")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run)
    with spans.tracer.start_as_current_span("reviewer") as reviewer:
        decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")
    assert advance_run(run.run_id, "w1").outcome == "completed"

    action = Action.objects.get(run=run)
    root = agent.get_span_context()
    first, second = spans.named("holdpoint.run.advance")
    step1, step2, step3 = spans.named("holdpoint.step")
    prepare, decision = spans.one("holdpoint.action.prepare"), spans.one("holdpoint.decision")
    send, outcome = spans.one("holdpoint.action.send"), spans.one("holdpoint.action.outcome")
    every = spans.exporter.get_finished_spans()
    assert {_context(s).trace_id for s in every if s.name != "reviewer"} == {root.trace_id}
    # The tree: the run's trace hangs off the request that created it; each advance has its
    # steps; the first step prepares and parks, the decision joins the same trace (linked to
    # the reviewer's own request), the re-run step sends and records the outcome.
    assert _parent(first) == _parent(second) == _parent(decision) == root.span_id
    assert _parent(step1) == _context(first).span_id
    assert _parent(step2) == _parent(step3) == _context(second).span_id
    assert _parent(prepare) == _context(step1).span_id
    assert [link.context.span_id for link in decision.links] == [
        reviewer.get_span_context().span_id
    ]
    assert _parent(send) == _parent(outcome) == _context(step2).span_id
    assert send.end_time is not None and outcome.start_time is not None
    assert send.end_time <= outcome.start_time  # the request, then what it said is written
    assert step1.attributes is not None and step1.attributes["holdpoint.stopped_by"] == "Park"
    # Recorded calls: paid in the first visit, answered from the record when it re-runs.
    record1, record2 = spans.named("holdpoint.record")
    model1, model2 = spans.named("holdpoint.model")
    assert _parent(record1) == _parent(model1) == _context(step1).span_id
    assert [s.attributes and s.attributes["holdpoint.call.reused"] for s in (record1, record2)] == [
        False,
        True,
    ]
    assert model2.attributes is not None and model2.attributes["holdpoint.call.reused"] is True
    expected = {
        "holdpoint.run_id": str(run.run_id),
        "holdpoint.tenant": "acme",
        "holdpoint.action_id": str(action.action_id),
        "holdpoint.idempotency_key": action.idempotency_key,
        "holdpoint.tool": "tickets.create",
    }
    for span in (prepare, decision, send, outcome):
        assert span.attributes is not None
        assert {k: span.attributes.get(k) for k in expected} == expected, span.name
    for span in (first, second, step1, step2, record1):
        assert span.attributes is not None
        assert span.attributes["holdpoint.run_id"] == str(run.run_id)
        assert span.attributes["holdpoint.tenant"] == "acme"
    assert (
        decision.attributes is not None and decision.attributes["holdpoint.decision"] == "approve"
    )
    # The tracker received the send span's context: its trace id and the send span's id.
    [create] = [r for r in box.requests() if r["method"] == "POST" and r["path"] == "/tasks"]
    assert create["traceparent"] == traceparent_of(send)
    assert create["idempotency_key"] == action.idempotency_key
    [task] = box.tasks()
    assert task["traceparent"] == traceparent_of(send) and task["id"] == action.external_id


def test_the_agents_traceparent_on_the_api_is_the_parent_of_the_runs_spans(
    spans: Spans, tenant_a: Tenant, agent_a: Persona, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("key")
    _held(tenant_a, box.url)
    ApprovalPolicy.objects.create(
        tenant=tenant_a, name="tickets go", tool="tickets.create", required=False
    )
    agent_trace, agent_span = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    sent = f"00-{agent_trace:032x}-{agent_span:016x}-01"
    client = agent_a.api()
    body = {"graph": "ticketing", "goal": {"title": "Fix login"}}
    created = ok(post(client, "runs/", body, HTTP_TRACEPARENT=sent), 201)
    assert advance_run(created["run_id"], "w1").outcome == "completed"

    server = spans.one("POST /api/v1/runs/")
    assert _context(server).trace_id == agent_trace and _parent(server) == agent_span
    assert server.attributes is not None and server.attributes["http.response.status_code"] == 201
    stored = Run.objects.get(pk=created["run_id"]).trace_context
    assert stored == traceparent_of(server)
    advance, send = spans.one("holdpoint.run.advance"), spans.one("holdpoint.action.send")
    assert _parent(advance) == _context(server).span_id
    assert _context(send).trace_id == agent_trace
    [task] = box.tasks()
    assert task["traceparent"] == traceparent_of(send)


@pytest.mark.django_db(transaction=True)
def test_the_python_client_carries_the_agents_current_span(
    spans: Spans, tenant_a: Tenant, agent_a: Persona, live_server: Any
) -> None:
    """An agent using the client inside its own span needs no header of its own: the run it
    creates, and every call it makes, sit in its trace (sync and async clients alike)."""
    token = agent_a.token or issue_token_for(agent_a.user)
    with (
        spans.tracer.start_as_current_span("agent") as agent,
        Client(live_server.url, token) as client,
    ):
        created = client.create_run("chain", {"steps": 1})
        client.get_run(created.run_id)

        async def read() -> None:
            async with AsyncClient(live_server.url, token) as aclient:
                await aclient.get_run(created.run_id)

        asyncio.run(read())
    root = agent.get_span_context()
    create = spans.one("POST /api/v1/runs/")
    reads = [s for s in spans.exporter.get_finished_spans() if s.name.startswith("GET /api/")]
    assert len(reads) == 2, [s.name for s in spans.exporter.get_finished_spans()]
    for server in (create, *reads):
        assert _context(server).trace_id == root.trace_id and _parent(server) == root.span_id
    assert Run.objects.get(pk=created.run_id).trace_context == traceparent_of(create)
    # Outside any span the client sends none, and the server starts a trace of its own.
    with Client(live_server.url, token) as client:
        client.get_run(created.run_id)
    last = [s for s in spans.exporter.get_finished_spans() if s.name.startswith("GET /api/")][-1]
    assert _context(last).trace_id != root.trace_id and _parent(last) is None


def test_an_external_agents_dispatch_sends_in_the_agents_trace(
    spans: Spans, tenant_a: Tenant, agent_a: Persona, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("key")
    _held(tenant_a, box.url)
    ApprovalPolicy.objects.create(
        tenant=tenant_a, name="tickets go", tool="tickets.create", required=False
    )
    client = agent_a.api()
    run = new_run(client, "ticketing", {"title": "x"})
    fence = take_lease(client, run["run_id"])
    prepared = ok(
        post(
            client,
            f"runs/{run['run_id']}/actions/",
            {"fence": fence, "tool": "tickets.create", "params": {"title": "Fix"}, "reason": "r"},
        ),
        201,
    )
    agent_trace, agent_span = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    sent = f"00-{agent_trace:032x}-{agent_span:016x}-01"
    url = f"{API}actions/{prepared['action_id']}/dispatch/"
    dispatched = ok(post(client, url, {"fence": fence}, HTTP_TRACEPARENT=sent))
    assert dispatched["status"] == "confirmed"

    server = spans.one("POST /api/v1/actions/<uuid:action_id>/dispatch/")
    send = spans.one("holdpoint.action.send")
    assert _parent(server) == agent_span and _parent(send) == _context(server).span_id
    assert _context(send).trace_id == agent_trace
    assert send.attributes is not None
    assert send.attributes["holdpoint.action_id"] == prepared["action_id"]
    [create] = [r for r in box.requests() if r["path"] == "/tasks"]
    assert create["traceparent"] == traceparent_of(send)


def test_off_by_default_nothing_is_traced_or_sent(
    tenant_a: Tenant, agent_a: Persona, sandbox_factory: Factory
) -> None:
    assert not tracing.enabled()
    box = sandbox_factory("key")
    _held(tenant_a, box.url)
    ApprovalPolicy.objects.create(
        tenant=tenant_a, name="tickets go", tool="tickets.create", required=False
    )
    sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    created = ok(
        post(
            agent_a.api(),
            "runs/",
            {"graph": "ticketing", "goal": {"title": "a"}},
            HTTP_TRACEPARENT=sent,
        ),
        201,
    )
    assert advance_run(created["run_id"], "w1").outcome == "completed"
    assert Run.objects.get(pk=created["run_id"]).trace_context == ""
    [create] = [r for r in box.requests() if r["path"] == "/tasks"]
    assert create["traceparent"] is None and box.tasks()[0]["traceparent"] == ""


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_configure_leaves_tracing_off_without_an_exporter(
    environ: dict[str, str], on: bool
) -> None:
    assert tracing.configure(environ) is on
    assert not tracing.enabled()


def test_a_grpc_protocol_without_the_grpc_exporter_says_what_to_install() -> None:
    environ = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with pytest.raises(
        RuntimeError, match="'otlp_proto_grpc'.*opentelemetry-exporter-otlp-proto-grpc"
    ):
        tracing.configure(environ)
    assert not tracing.enabled()


SERVICE_NAME = (
    "import django; django.setup(); from opentelemetry import trace; "
    "print(trace.get_tracer_provider().resource.attributes['service.name'])"
)


@pytest.mark.parametrize(
    ("environ", "service"),
    [
        ({}, "holdpoint"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes"}, "from-attributes"),
        (
            {"OTEL_RESOURCE_ATTRIBUTES": "service.name=attrs", "OTEL_SERVICE_NAME": "svc"},
            "svc",
        ),
    ],
)
def test_the_service_name_is_the_sdks_reading_of_the_variables(
    environ: dict[str, str], service: str
) -> None:
    """A process started with an exporter (console) names its service as the SDK reads the
    standard variables; "holdpoint" only when none names it (OTEL_RESOURCE_ATTRIBUTES'
    service.name was overridden by "holdpoint" before)."""
    env = procs.child_env(OTEL_TRACES_EXPORTER="console")
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        env.pop(name, None)  # only the case's own
    env.update(environ)
    done = subprocess.run(
        [sys.executable, "-c", SERVICE_NAME],
        cwd=procs.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == service


def test_configure_names_an_exporter_that_is_not_installed() -> None:
    with pytest.raises(RuntimeError, match="no exporter 'zipkin-nope' is installed"):
        tracing.configure({"OTEL_TRACES_EXPORTER": "zipkin-nope"})
    assert not tracing.enabled()


def readme_worker_line() -> dict[str, str]:
    """The variables of the README's "Traces" console line (`VAR=value … python manage.py
    qcluster`): the worker test starts its qcluster with exactly those."""
    section = README.read_text().split("## Traces", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)\n```", section, re.S)
    assert match, "the README's Traces example is gone"
    *assignments, python, manage, command = match.group(1).split()
    assert (python, manage, command) == ("python", "manage.py", "qcluster")
    return dict(a.split("=", 1) for a in assignments)


def _hosted_run_in_a_worker(
    tenant: Tenant, agent: Persona, box: Sandbox, log: Path, done: Callable[[], bool], **env: str
) -> tuple[str, int, dict[str, Any]]:
    """An agent creates a hosted run with its own traceparent; a real `qcluster`, tracing
    turned on by the `OTEL_*` variables `env` alone, runs it until `done()` (its spans are
    out). Returns the run id, the agent's trace id and the tracker's record of the create."""
    _held(tenant, box.url)
    ApprovalPolicy.objects.create(
        tenant=tenant, name="tickets go", tool="tickets.create", required=False
    )
    agent_trace = 0x5B8EFFF798038103D269B633813FC60C
    sent = f"00-{agent_trace:032x}-{0xEEE19B7EC3C1B174:016x}-01"
    body = {"graph": "ticketing", "goal": {"title": "w"}}
    created = ok(post(agent.api(), "runs/", body, HTTP_TRACEPARENT=sent), 201)
    worker = procs.start(
        ["qcluster"], procs.child_env(OTEL_BSP_SCHEDULE_DELAY="100", **env, **box.env()), log=log
    )
    try:

        def finished() -> bool:
            return Run.objects.get(pk=created["run_id"]).status == RunStatus.COMPLETED

        procs.wait_for(finished, timeout=90, every=0.3)
        procs.wait_for(done, timeout=30)  # the batch processor exports every 0.1 s
    finally:
        procs.kill(worker)
    [create] = [r for r in box.requests() if r["path"] == "/tasks"]
    assert create["traceparent"].split("-")[1] == f"{agent_trace:032x}"
    return created["run_id"], agent_trace, create


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_process_continues_the_agents_trace(
    spans: Spans, tenant_a: Tenant, agent_a: Persona, sandbox_factory: Factory, tmp_path: Path
) -> None:
    """A hosted run: the agent's request stores the trace, a real worker started as the
    README's console line says sends in it, hours later if need be."""
    log = tmp_path / "worker.log"
    variables = readme_worker_line()
    assert variables["OTEL_TRACES_EXPORTER"] == "console"
    run_id, agent_trace, create = _hosted_run_in_a_worker(
        tenant_a,
        agent_a,
        sandbox_factory("key"),
        log,
        # The console exporter prints each finished span as JSON: wait for the send span.
        lambda: '"holdpoint.action.send"' in log.read_text(),
        **variables,
    )
    exported = _console_spans(log.read_text())
    [send] = [s for s in exported if s["name"] == "holdpoint.action.send"]
    assert send["context"]["trace_id"] == f"0x{agent_trace:032x}"
    assert create["traceparent"].split("-")[2] == send["context"]["span_id"][2:]
    assert send["resource"]["attributes"]["service.name"] == variables["OTEL_SERVICE_NAME"]
    assert send["attributes"]["holdpoint.run_id"] == run_id


def _otlp_ok(handler: BaseHTTPRequestHandler, server: Server) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "application/x-protobuf")
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def _otlp_spans(server: Server) -> list[dict[str, Any]]:
    """Every span the collector was sent (OTLP/HTTP protobuf), with its resource's name."""
    found = []
    for request in list(server.requests):
        if request["path"] != "/v1/traces":
            continue
        export = ExportTraceServiceRequest.FromString(request["body"])
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    found.append(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": {a.key: a.value.string_value for a in span.attributes},
                            "service": resource.get("service.name"),
                        }
                    )
    return found


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_exports_over_otlp_to_the_collector_the_variables_name(
    spans: Spans,
    tenant_a: Tenant,
    agent_a: Persona,
    sandbox_factory: Factory,
    serve: Callable[[Behaviour], Server],
    tmp_path: Path,
) -> None:
    """The otlp extra: OTEL_TRACES_EXPORTER=otlp and OTEL_EXPORTER_OTLP_ENDPOINT send the
    worker's spans to a real HTTP collector (here a socket in the test), as protobuf."""
    collector = serve(_otlp_ok)
    run_id, agent_trace, create = _hosted_run_in_a_worker(
        tenant_a,
        agent_a,
        sandbox_factory("key"),
        tmp_path / "worker.log",
        # The advance span ends after the send's, and may come in a later export batch.
        lambda: (
            {"holdpoint.action.send", "holdpoint.run.advance"}
            <= {s["name"] for s in _otlp_spans(collector)}
        ),
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        OTEL_SERVICE_NAME="holdpoint-otlp-test",
    )
    exported = _otlp_spans(collector)
    [send] = [s for s in exported if s["name"] == "holdpoint.action.send"]
    assert send["trace_id"] == f"{agent_trace:032x}" and send["service"] == "holdpoint-otlp-test"
    assert create["traceparent"] == f"00-{send['trace_id']}-{send['span_id']}-01"
    assert send["attributes"]["holdpoint.run_id"] == run_id
    assert send["attributes"]["holdpoint.tool"] == "tickets.create"
    [advance] = [s for s in exported if s["name"] == "holdpoint.run.advance"]
    step_ids = {s["span_id"] for s in exported if s["name"] == "holdpoint.step"}
    assert advance["trace_id"] == send["trace_id"] and send["parent_span_id"] in step_ids


def _console_spans(text: str) -> list[dict[str, Any]]:
    """The JSON objects the SDK's ConsoleSpanExporter printed among the worker's log lines."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while (at := text.find('{\n    "name"', at)) >= 0:
        value, end = decoder.raw_decode(text, at)
        found.append(value)
        at = end
    return found


def test_the_sandbox_lists_requests_with_their_traceparent(sandbox_factory: Factory) -> None:
    box = sandbox_factory("key")
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    httpx.post(box.url + "/tasks", json={"title": "t"}, headers={"traceparent": parent})
    httpx.get(box.url + "/tasks")
    assert [(r["method"], r["path"], r["traceparent"]) for r in box.requests()] == [
        ("POST", "/tasks", parent),
        ("GET", "/tasks", None),
    ]
    assert box.tasks()[0]["traceparent"] == parent
