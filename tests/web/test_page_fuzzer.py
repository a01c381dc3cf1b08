"""A fuzzer over every reviewer page (issue 16, TEST-MATRIX G11): odd query and form values,
as a logged-in reviewer, on SQLite and PostgreSQL — no answer is a 5xx, and a POST answered
400 wrote nothing.

The pages come from Django's URL resolver (`tests.security.matrix.all_routes`), never a typed
list, so a page added tomorrow is fuzzed without anyone remembering it. The fields each page
reads are found two ways: the forms the pages themselves render (crawled, with their real
values as the baseline every probe changes one field of) and the names the page's module
reads from `request.GET` / `request.POST`. Every field gets every odd value: NUL, huge and
negative integers, non-ASCII digits, over-long text, JSON of the wrong type, markup.

`HOLDPOINT_PAGE_FUZZ_ROUNDS` repeats the probes with random pairs of odd values per form
(seeded; the seed is printed) for a larger run; the default is one round, about 2,000 cases.
"""

from __future__ import annotations

import inspect
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.test import Client
from django.urls import Resolver404, resolve

from tests.conftest import Persona
from tests.security.matrix import Route, all_routes, changed_tables, db_state, sessions_of
from tests.security.world import World, build_world

pytestmark = pytest.mark.django_db

# Pages that are not a reviewer's tenant pages, each with why the fuzzer leaves it alone.
NOT_FUZZED = {
    "login": "the account's door: axes counts and locks it (tests/security/test_rate_limits.py)",
    "logout": "ends the very session the fuzzer drives",
    "password_change": "would change the reviewer's password mid-run (Django's own form)",
    "password_change_done": "a static confirmation page, reads no input",
    "healthz": "the operator's probe, not a page; reads no input",
    "readyz": "the operator's probe (503 until a worker runs, by design); reads no input",
}
ODD_VALUES = (
    "a\x00b",  # PostgreSQL text cannot hold NUL
    "\x00",
    "99999999999999999999999",  # past every integer column
    "9223372036854775808",  # 2**63: SQLite's overflow
    "-1",
    "0",
    "²",  # str.isdigit() says yes, int() says no
    "١٢",  # Arabic-Indic digits: int() accepts them
    "x" * 5000,  # over every max_length
    "[]",
    '{"a": 1}',
    "null",
    "1e309",
    "<script>alert(1)</script>",
    " ",
    "",
)
ROUNDS = int(os.environ.get("HOLDPOINT_PAGE_FUZZ_ROUNDS", "1"))
# The values that broke pages before (issue 16 L1) go into every field; the others rotate over
# the fields, so each is still tried on many. HOLDPOINT_PAGE_FUZZ_ALL=1 tries every value on
# every field (2,608 cases per database, ~3x the default's time).
ALWAYS = ("a\x00b", "99999999999999999999999", "9223372036854775808", "²", "x" * 5000)
ROTATING = tuple(v for v in ODD_VALUES if v not in ALWAYS)
ALL_VALUES = os.environ.get("HOLDPOINT_PAGE_FUZZ_ALL") == "1"


def first_round_values(index: int) -> tuple[str, ...]:
    if ALL_VALUES:
        return ODD_VALUES
    start = (index * 2) % len(ROTATING)
    return ALWAYS + (ROTATING + ROTATING)[start : start + 2]


SOURCE_READS = re.compile(r'(?:GET|POST|params|post)\.get\(\s*"([\w-]+)"')


@dataclass
class Form:
    action: str
    method: str
    fields: dict[str, str] = field(default_factory=dict)


class FormParser(HTMLParser):
    """The forms of a page: action, method and each named field with its rendered value."""

    def __init__(self, page_url: str) -> None:
        super().__init__()
        self.page_url = page_url
        self.forms: list[Form] = []
        self.current: Form | None = None
        self.select: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            action = urlsplit(a.get("action") or self.page_url).path or self.page_url
            self.current = Form(action, (a.get("method") or "get").upper())
            self.forms.append(self.current)
            return
        if self.current is None or not a.get("name"):
            if tag == "option" and self.current is not None and self.select:
                self.current.fields.setdefault(self.select, a.get("value", ""))
            return
        name = a["name"]
        if tag == "select":
            self.select = name
            self.current.fields.setdefault(name, "")
        elif tag == "input" and a.get("type") in ("checkbox", "radio"):
            self.current.fields.setdefault(name, a.get("value", "on"))
        elif tag in ("input", "textarea", "button"):
            self.current.fields.setdefault(name, a.get("value", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self.current = None
        elif tag == "select":
            self.select = None


def route_of(path: str) -> str | None:
    try:
        return resolve(path).url_name
    except Resolver404:
        return None


def source_names(route: Route) -> set[str]:
    """The query and form names the page's module reads (`request.GET.get("x")` and kin)."""
    module = sys.modules[inspect.unwrap(route.callback).__module__]
    return set(SOURCE_READS.findall(Path(inspect.getfile(module)).read_text()))


def fuzzed_routes() -> list[Route]:
    pages = [r for r in all_routes() if r.area == "page" and r.key not in NOT_FUZZED]
    assert {r.key for r in pages} >= {"inbox", "runs", "run", "approval-page-decide"}
    return pages


def url_values(world: World) -> dict[str, str]:
    return {"run_id": world.run_id, "action_id": world.parked_id, "request_id": world.approval_id}


@dataclass
class Tally:
    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    per_route: Counter[str] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    written_on_400: list[str] = field(default_factory=list)
    seconds: Counter[str] = field(default_factory=Counter)

    def note(self, route: str, what: str, response: Any) -> None:
        self.cases += 1
        self.per_route[route] += 1
        self.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.server_errors.append(f"{response.status_code} {what}")


def crawl(client: Client, routes: list[Route], values: dict[str, str]) -> dict[str, list[Form]]:
    """Every form the fuzzed pages render, keyed by the route the form posts to."""
    forms: dict[str, list[Form]] = {}
    for route in routes:
        url = route.url(values)
        response = client.get(url)
        if response.status_code != 200 or "html" not in response.get("Content-Type", ""):
            continue
        parser = FormParser(url)
        parser.feed(response.content.decode())
        for form in parser.forms:
            target = route_of(form.action)
            if target is not None:
                forms.setdefault(target, []).append(form)
    return forms


class Prober:
    """Sends the probes and keeps the database snapshot a POST's 400 is compared with.

    A snapshot of every table is most of a probe's cost, so one is taken only when the last
    one may be stale: after an answer that may have written (not a 400) — GETs are sent
    first, and the only GETs that write (the exports' `audit_exported` entry) are refused
    with 400 before they write, or are followed by a fresh snapshot.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.tally = Tally()
        self.state: dict[str, Any] | None = None
        self.own = sessions_of(client)

    def send(self, route: Route, url: str, method: str, data: dict[str, str]) -> None:
        what = f"{method} {url} {sorted((k, v[:20]) for k, v in data.items())!r}"
        started = time.perf_counter()
        if method == "GET":
            response = self.client.get(url, data)
            self.state = None
        else:
            before = self.state if self.state is not None else db_state(self.own)
            response = self.client.post(url, data)
            self.state = None
            if response.status_code == 400:
                self.state = db_state(self.own)
                changed = changed_tables(before, self.state)
                if changed:
                    self.tally.written_on_400.append(f"{what}: {changed}")
        self.tally.note(route.key, what, response)
        self.tally.seconds[route.key] += time.perf_counter() - started


def methods_of(client: Client, url: str) -> set[str]:
    """What the page answers, from its 405's Allow header (OPTIONS writes nothing); a view
    that answers OPTIONS itself (the root's redirect) is probed both ways."""
    response = client.options(url)
    if response.status_code != 405:
        return {"GET", "POST"}
    return {m.strip() for m in response["Allow"].split(",")} & {"GET", "POST"}


def cases_of(route: Route, forms: list[Form]) -> list[tuple[str, dict[str, str], str]]:
    """(method, baseline, field) for every field of the page: its forms' fields with their
    rendered values as the baseline, then the names its module reads, alone, both ways."""
    cases: list[tuple[str, dict[str, str], str]] = []
    known: set[str] = set()
    for form in forms:
        for name in form.fields:
            cases.append((form.method, dict(form.fields), name))
            known.add(name)
    for name in sorted(source_names(route) - known):
        cases += [("GET", {}, name), ("POST", {}, name)]
    if not cases:
        cases = [("GET", {}, "q"), ("POST", {}, "q")]
    return cases


@pytest.fixture
def world(settings: Any, agent_a: Persona, reviewer_a: Persona) -> World:
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    return build_world(agent_a, reviewer_a)


@pytest.mark.ci_database("postgresql")
def test_no_reviewer_page_answers_5xx_to_odd_input(settings: Any, world: World) -> None:
    """CI runs it on PostgreSQL (tests/ci_pair.py): it is the database that refuses odd values
    late (text cannot hold NUL), so a 500 a page let through shows there; SQLite stores them."""
    settings.HOLDPOINT_DECISION_RATE = "100000/min"  # probe the decision, not the limiter
    client = Client(raise_request_exception=False)
    client.force_login(world.reviewer.user)
    routes = fuzzed_routes()
    values = url_values(world)
    forms = crawl(client, routes, values)
    seed = int(os.environ.get("HOLDPOINT_PAGE_FUZZ_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    prober = Prober(client)
    plan = []
    for route in routes:
        url = route.url(values)
        allowed = methods_of(client, url)
        for method, baseline, name in cases_of(route, forms.get(route.key, [])):
            if method in allowed:
                plan.append((method != "GET", route, url, method, baseline, name))
    plan.sort(key=lambda case: case[0])  # every GET before the first POST
    for round_ in range(ROUNDS):
        for index, (_, route, url, method, baseline, name) in enumerate(plan):
            odd = first_round_values(index) if round_ == 0 else rng.sample(ODD_VALUES, 3)
            for value in odd:
                data = {**baseline, name: value}
                if round_ and len(baseline) > 1:  # a second odd field beside the first
                    other = rng.choice([k for k in baseline if k != name])
                    data[other] = rng.choice(ODD_VALUES)
                prober.send(route, url, method, data)
    tally = prober.tally
    print(
        f"\npage fuzzer ({world.tenant.slug}, seed {seed}, rounds {ROUNDS}): "
        f"{tally.cases} cases over {len(tally.per_route)} pages; statuses "
        f"{dict(sorted(tally.statuses.items()))}; 5xx {len(tally.server_errors)}; "
        f"written on 400 {len(tally.written_on_400)}"
    )
    slowest = sorted(tally.seconds.items(), key=lambda kv: -kv[1])[:5]
    print("slowest pages (s):", [(k, round(v, 1)) for k, v in slowest])
    assert {r.key for r in routes} == set(tally.per_route), "a page was never probed"
    assert tally.server_errors == [], tally.server_errors[:20]
    assert tally.written_on_400 == [], tally.written_on_400[:20]
