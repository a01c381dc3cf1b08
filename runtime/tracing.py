"""OpenTelemetry traces: a span per run advance, step, recorded call, action phase and
decision, and the W3C `traceparent` carried across every hop (agent → API → worker → tool).

Off by default and free when off: until `configure()` finds `OTEL_TRACES_EXPORTER` (or a
test calls `install()`), no SDK provider exists, `_on` is False and every helper here returns
a shared no-op context manager or calls the wrapped function straight away — no span object,
no attribute dict, no header is built. Call sites change by a line: the decorators
(`action_phase`) and context managers (`advance`, `step`, `call`, `decision`) take the
objects, not their attributes, so nothing is computed unless a span records.

One trace per run: the request that creates a run stores its span's `traceparent` on the
run (`Run.trace_context`); every later advance — in a worker, hours later — and every
decision on its actions start as children of it, so the agent's trace reaches the tracker
(`inject` puts the send span's context on the tool's request, `runtime.wire.send`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager
from importlib.metadata import entry_points
from typing import Any, ParamSpec, TypeVar

from django.http import HttpRequest, HttpResponse
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer

from runtime.errors import Park

P = ParamSpec("P")
R = TypeVar("R")

_NOOP: AbstractContextManager[Span] = contextlib.nullcontext(trace.INVALID_SPAN)
_tracer: Tracer = trace.NoOpTracer()
_on = False

# Attribute names (issue 21): the same five on every span that has them.
RUN_ID, TENANT = "holdpoint.run_id", "holdpoint.tenant"
ACTION_ID, KEY, TOOL = "holdpoint.action_id", "holdpoint.idempotency_key", "holdpoint.tool"


def enabled() -> bool:
    return _on


def install(provider: Any) -> None:
    """Record spans through `provider` (an SDK TracerProvider) from now on."""
    global _tracer, _on
    _tracer, _on = provider.get_tracer("holdpoint"), True


def uninstall() -> None:
    """Back to the no-op: nothing is recorded, nothing propagated."""
    global _tracer, _on
    _tracer, _on = trace.NoOpTracer(), False


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on when `OTEL_TRACES_EXPORTER` names exporters (`otlp`, `console`, any
    installed `opentelemetry_traces_exporter` entry point); unset, `none` or
    `OTEL_SDK_DISABLED=true` leaves it off. Everything else is the SDK's own reading of the
    standard variables: `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` (the resource),
    `OTEL_EXPORTER_OTLP_*` (the exporter), `OTEL_BSP_*` (batching), `OTEL_TRACES_SAMPLER`."""
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or names in ([], ["none"]):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES); "holdpoint" only
    # where neither names the service (the SDK would say "unknown_service").
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "holdpoint"}))
    provider = TracerProvider(resource=resource)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, environ)))
    trace.set_tracer_provider(provider)
    install(provider)
    return True


def _exporter(name: str, environ: Mapping[str, str]) -> Any:
    """The exporter an `OTEL_TRACES_EXPORTER` name stands for, as the SDK's own start-up
    resolves it: `otlp` by `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` (http/protobuf unless grpc),
    any other name as an installed entry point. A name nothing provides stops the process
    (the `otlp` extra, `pip install -e ".[otlp]"` in the checkout, brings the OTLP exporter;
    `pip install "holdpoint[otlp]"` would fetch an unrelated PyPI project of that name)."""
    if name == "otlp":
        protocol = environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
        )
        name = "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        hint = {
            "otlp_proto_http": ' (the otlp extra: pip install -e ".[otlp]" in the checkout)',
            "otlp_proto_grpc": " (the otlp extra is http/protobuf: pip install "
            "opentelemetry-exporter-otlp-proto-grpc, or unset OTEL_EXPORTER_OTLP_PROTOCOL)",
        }.get(name, "")
        raise RuntimeError(f"OTEL_TRACES_EXPORTER: no exporter {name!r} is installed{hint}")
    return next(iter(found)).load()()


# --- propagation ---------------------------------------------------------------------------


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's `traceparent` (and `tracestate`) to an outgoing request."""
    if _on:
        propagate.inject(headers)


def current_traceparent() -> str:
    """The current span's `traceparent`, to be stored with what outlives this request ("":
    tracing is off or no span is current)."""
    if not _on:
        return ""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def _stored(traceparent: str) -> otel_context.Context | None:
    """The context a stored `traceparent` continues (None: nothing stored, use the current)."""
    return propagate.extract({"traceparent": traceparent}) if traceparent else None


# --- spans ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _span(
    name: str,
    attributes: dict[str, Any],
    *,
    parent: otel_context.Context | None = None,
    links: list[Link] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    quiet: tuple[type[BaseException], ...] = (),
) -> Iterator[Span]:
    """A span that is current inside the block. An exception of a `quiet` type is how the
    code stops on purpose (a run parks for an approval): noted, not an error."""
    with _tracer.start_as_current_span(
        name,
        context=parent,
        kind=kind,
        attributes=attributes,
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except quiet as exc:
            span.set_attribute("holdpoint.stopped_by", type(exc).__name__)
            raise
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))
            raise


def _run_attributes(run_id: Any, tenant_id: int) -> dict[str, Any]:
    return {RUN_ID: str(run_id), TENANT: tenant_slug(tenant_id)}


def _action_attributes(action: Any) -> dict[str, Any]:
    return {
        **_run_attributes(action.run_id, action.tenant_id),
        ACTION_ID: str(action.action_id),
        KEY: action.idempotency_key,
        TOOL: action.tool,
    }


def advance(run: Any) -> AbstractContextManager[Span]:
    """One executor's turn on a run, a child of the request that created the run."""
    if not _on:
        return _NOOP
    attributes = _run_attributes(run.run_id, run.tenant_id)
    return _span("holdpoint.run.advance", attributes, parent=_stored(run.trace_context))


def step(ctx: Any, quiet: tuple[type[BaseException], ...] = ()) -> AbstractContextManager[Span]:
    """One execution of a graph step (`ctx`: its StepContext)."""
    if not _on:
        return _NOOP
    attributes = {**_run_attributes(ctx.run_id, ctx.tenant_id), "holdpoint.step": ctx.step}
    return _span("holdpoint.step", attributes, quiet=quiet)


def call(ctx: Any, key: str, kind: str) -> AbstractContextManager[Span]:
    """One `ctx.record` / `ctx.model` call; `reused(span)` marks one answered from the record."""
    if not _on:
        return _NOOP
    attributes = {
        **_run_attributes(ctx.run_id, ctx.tenant_id),
        "holdpoint.step": ctx.step,
        "holdpoint.call.key": key,
        "holdpoint.call.kind": kind,
    }
    return _span(f"holdpoint.{kind}", attributes)


def send(action: Any) -> AbstractContextManager[Span]:
    """The request for `action` to its tool: current while the call is made, so the tool's
    HTTP request carries this span's `traceparent` (`inject`)."""
    if not _on:
        return _NOOP
    return _span("holdpoint.action.send", _action_attributes(action), kind=SpanKind.CLIENT)


def reused(span: Span, value: bool) -> None:
    if span.is_recording():
        span.set_attribute("holdpoint.call.reused", value)


def decision(request: Any, action: Any, run: Any, verdict: str) -> AbstractContextManager[Span]:
    """A reviewer's vote, in the run's trace (a child of the request that created the run)
    and linked to the reviewer's own request."""
    if not _on:
        return _NOOP
    here = trace.get_current_span().get_span_context()
    attributes = {
        **_action_attributes(action),
        "holdpoint.approval_id": str(request.pk),
        "holdpoint.decision": verdict,
    }
    links = [Link(here)] if here.is_valid else None
    return _span("holdpoint.decision", attributes, parent=_stored(run.trace_context), links=links)


def action_phase(
    phase: str, subject: Callable[..., tuple[Any, Any, str]]
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate the function of one action phase (prepare / send / outcome / reconcile).
    `subject(*args, **kwargs)` gives (action or None, run or None, tool name or "") from the
    function's arguments — called only when tracing is on; an action the function returns
    (alone or first in a tuple) completes the attributes (a prepare creates its action)."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def traced(*args: P.args, **kwargs: P.kwargs) -> R:
            if not _on:
                return fn(*args, **kwargs)
            action, run, tool = subject(*args, **kwargs)
            if action is not None:
                attributes = _action_attributes(action)
            else:
                attributes = {**_run_attributes(run.run_id, run.tenant_id), TOOL: tool}
            with _span(f"holdpoint.action.{phase}", attributes, quiet=_quiet()) as span:
                result = fn(*args, **kwargs)
                made = result[0] if isinstance(result, tuple) and result else result
                if hasattr(made, "idempotency_key"):
                    span.set_attributes(_action_attributes(made))
                return result

        return traced

    return decorate


def _quiet() -> tuple[type[BaseException], ...]:
    """A phase that parks the run (waiting for approval, reconciling later) stops on purpose."""
    return (Park,)


# --- tenants -------------------------------------------------------------------------------


def tenant_slug(tenant_id: int) -> str:
    """`holdpoint.tenant`: the slug operators know, as the reader `name_tenants` installed
    says ("" until one is: this module sits below the models and reads none itself)."""
    return _tenant_names(tenant_id)


def name_tenants(reader: Callable[[int], str]) -> None:
    """Install what `tenant_slug` asks (runtime.apps does, with runtime.tenancy.slug_of)."""
    global _tenant_names
    _tenant_names = reader


def _unnamed(tenant_id: int) -> str:
    return ""


_tenant_names: Callable[[int], str] = _unnamed


# --- requests ------------------------------------------------------------------------------


class _MetaGetter(Getter[dict[str, Any]]):
    """Reads W3C trace headers from a Django request's META (`HTTP_TRACEPARENT`)."""

    def get(self, carrier: dict[str, Any], key: str) -> list[str] | None:
        value = carrier.get("HTTP_" + key.upper().replace("-", "_"))
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: dict[str, Any]) -> list[str]:
        return [k[5:].lower().replace("_", "-") for k in carrier if k.startswith("HTTP_")]


_META = _MetaGetter()


class TraceRequests:
    """A server span per request, the child of the agent's `traceparent` when it sends one:
    a run created here stores this span's context, so the agent's trace continues through
    the worker to the tracker. Off: the request passes through untouched."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not _on:
            return self.get_response(request)
        parent = propagate.extract(request.META, getter=_META)
        attributes = {"http.request.method": request.method or "", "url.path": request.path}
        with _span(request.method or "HTTP", attributes, parent=parent, kind=SpanKind.SERVER) as s:
            response = self.get_response(request)
            match = request.resolver_match
            if match is not None and match.route:
                s.update_name(f"{request.method} /{match.route}")
                s.set_attribute("http.route", "/" + match.route)
            s.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                s.set_status(Status(StatusCode.ERROR))
            return response
