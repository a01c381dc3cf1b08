"""`manage.py tools import|export|list --tenant SLUG`: files of definitions, all or nothing;
an export imports again unchanged. Run as the operator runs it: a real process."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from audit.models import JournalEntry
from runtime.models import Tenant, ToolDefinition
from tests import procs

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str, **changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "effect": "write",
        "schema": {
            "type": "object",
            "properties": {"title": {"type": "string"}, "ticket_id": {"type": "string"}},
        },
        "request": {"method": "POST", "url": "http://127.0.0.1:8765/tickets"},
        "dedup": {"mode": "key"},
    }
    spec.update(changes)
    return spec


FILE = [
    tool("tickets.create", compensation="tickets.close", compensation_param="ticket_id"),
    tool(
        "tickets.close",
        request={"method": "POST", "url": "http://127.0.0.1:8765/tickets/{ticket_id}/close"},
    ),
]


def run(*args: str) -> tuple[int, str, str]:
    """`manage.py tools ARGS` in process: exit status, stdout, stderr (with the error)."""
    stdout, stderr = StringIO(), StringIO()
    try:
        call_command("tools", *args, stdout=stdout, stderr=stderr)
    except CommandError as exc:
        return exc.returncode, stdout.getvalue(), f"{stderr.getvalue()}\n{exc}"
    return 0, stdout.getvalue(), stderr.getvalue()


def test_import_creates_then_leaves_unchanged(tenant_a: Tenant, tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    path.write_text(json.dumps(FILE))
    code, out, _ = run("import", str(path), "--tenant", "acme")
    assert code == 0
    assert out.splitlines() == ["tickets.create: created v1", "tickets.close: created v1"]
    code, out, _ = run("import", str(path), "--tenant", "acme")
    assert out.splitlines() == ["tickets.create: unchanged v1", "tickets.close: unchanged v1"]
    FILE[1]["timeout_seconds"] = 9
    path.write_text(json.dumps(FILE[1]))  # one object, not a list
    try:
        assert run("import", str(path), "--tenant", "acme")[1] == "tickets.close: created v2\n"
    finally:
        del FILE[1]["timeout_seconds"]
    assert ToolDefinition.objects.filter(tenant=tenant_a).count() == 3
    assert JournalEntry.objects.filter(type="tool_defined").count() == 3


def test_a_bad_file_prints_every_error_and_stores_nothing(tenant_a: Tenant, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    bad = [
        tool("ok.one"),
        tool("bad.mode", dedup={"mode": "maybe"}),
        tool("bad.path", result={"external_id": "$[?"}),
        tool("bad.host", request={"method": "POST", "url": "https://elsewhere.example/t"}),
        tool("bad.inject", request={"method": "POST", "url": "http://{title}/t"}),
        tool("bad.schema", schema={"type": "object", "properties": 3}),
    ]
    path.write_text(json.dumps(bad))
    code, out, err = run("import", str(path), "--tenant", "acme")
    assert code != 0 and out == ""
    for where in (
        "bad.mode: dedup.mode:",
        "bad.path: result:",
        "bad.host: request.url:",
        "bad.inject: request.url:",
        "bad.schema: schema:",
    ):
        assert where in err, (where, err)
    assert "nothing was stored" in err
    assert ToolDefinition.objects.count() == 0
    assert JournalEntry.objects.filter(type="tool_defined").count() == 0


def test_only_a_host_not_allowed_is_its_own_code(tenant_a: Tenant, tmp_path: Path) -> None:
    path = tmp_path / "host.json"
    path.write_text(json.dumps(tool("far.away", request={"url": "https://far.example/x"})))
    code, _, err = run("import", str(path), "--tenant", "acme")
    assert code != 0 and "host_not_allowed" in err and "far.away: request.url:" in err
    assert ToolDefinition.objects.count() == 0


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "is not JSON"),
        ("[]", "file: empty list"),
        ("[1]", "#1: tool:"),
        # Parsed as the API parses: a traceback (RecursionError) and a silent last-key-wins
        # before.
        ("[" * 5_000 + "]" * 5_000, "nested deeper than 64 levels"),
        ('{"name": "a.b", "name": "c.d"}', "duplicate key"),
    ],
)
def test_what_is_not_a_definition_is_refused(
    tenant_a: Tenant, tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "x.json"
    path.write_text(content)
    code, _, err = run("import", str(path), "--tenant", "acme")
    assert code != 0 and expected in err, err
    assert ToolDefinition.objects.count() == 0


def test_a_file_not_in_utf_8_is_refused_with_a_sentence(tenant_a: Tenant, tmp_path: Path) -> None:
    """A file saved as Latin-1 (an editor's default): UnicodeDecodeError is no OSError, so
    it escaped the command as a traceback."""
    path = tmp_path / "latin1.json"
    path.write_bytes(
        json.dumps(tool("cafe.open", description="Café"), ensure_ascii=False).encode("latin-1")
    )
    code, _, err = run("import", str(path), "--tenant", "acme")
    assert code != 0 and "is not UTF-8" in err, err
    assert ToolDefinition.objects.count() == 0


def test_a_name_twice_in_one_file_is_refused(tenant_a: Tenant, tmp_path: Path) -> None:
    path = tmp_path / "twice.json"
    path.write_text(json.dumps([tool("same.name"), tool("same.name", effect="read")]))
    code, _, err = run("import", str(path), "--tenant", "acme")
    assert code != 0 and "same.name: name: defined more than once" in err
    assert ToolDefinition.objects.count() == 0


def test_unknown_tenant_or_file(tenant_a: Tenant, tmp_path: Path) -> None:
    assert "no tenant 'nope'" in run("list", "--tenant", "nope")[2]
    assert "cannot read" in run("import", str(tmp_path / "missing.json"), "--tenant", "acme")[2]


def test_export_imports_again_unchanged(tenant_a: Tenant, tenant_b: Tenant, tmp_path: Path) -> None:
    source = tmp_path / "in.json"
    source.write_text(json.dumps(FILE))
    run("import", str(source), "--tenant", "acme")
    run("import", str(source), "--tenant", "acme")
    exported = tmp_path / "out.json"
    code, out, _ = run("export", "--tenant", "acme", "--output", str(exported))
    assert code == 0 and "2 tool(s)" in out
    items = json.loads(exported.read_text())
    assert [item["name"] for item in items] == ["tickets.close", "tickets.create"]
    assert run("export", "--tenant", "acme")[1].strip() == exported.read_text().strip()
    # The same file into the same tenant: nothing new; into another tenant: the same tools.
    assert run("import", str(exported), "--tenant", "acme")[1].splitlines() == [
        "tickets.close: unchanged v1",
        "tickets.create: unchanged v1",
    ]
    run("import", str(exported), "--tenant", "globex")
    ours = {r.name: r.digest for r in ToolDefinition.objects.filter(tenant=tenant_a)}
    theirs = {r.name: r.digest for r in ToolDefinition.objects.filter(tenant=tenant_b)}
    assert ours == theirs and ToolDefinition.objects.count() == 4
    assert json.loads(run("export", "--tenant", "globex")[1]) == items


def test_list_names_built_ins_and_the_tenants(tenant_a: Tenant, tmp_path: Path) -> None:
    source = tmp_path / "in.json"
    source.write_text(json.dumps(FILE))
    run("import", str(source), "--tenant", "acme")
    lines = run("list", "--tenant", "acme")[1].splitlines()
    assert any(line.startswith("tasks.create  built-in  write  http") for line in lines)
    assert any(
        line.startswith("tickets.create  v1  write  http  dedup=key")
        and line.endswith("needs approval by default")
        for line in lines
    )


@pytest.mark.django_db(transaction=True)
def test_the_command_as_a_process(tmp_path: Path) -> None:
    """The README's commands, in a real process against the same database."""
    Tenant.objects.create(slug="acme", name="Acme")
    source = tmp_path / "tickets.json"
    source.write_text(json.dumps(FILE))
    manage = [sys.executable, str(ROOT / "manage.py"), "tools"]
    env = procs.child_env()
    done = subprocess.run(
        [*manage, "import", str(source), "--tenant", "acme"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "tickets.create: created v1" in done.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(tool("bad.mode", dedup={"mode": "maybe"})))
    refused = subprocess.run(
        [*manage, "import", str(bad), "--tenant", "acme"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 1 and "bad.mode: dedup.mode:" in refused.stderr
    assert set(ToolDefinition.objects.values_list("name", flat=True)) == {
        "tickets.create",
        "tickets.close",
    }


def test_the_readmes_commands_work_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each `manage.py tools` line of the README's "Tools as data", run from a copy of the
    repository's layout (the example file; `var/` not there yet, as on a fresh checkout)."""
    Tenant.objects.create(slug="demo", name="Demo")
    section = (ROOT / "README.md").read_text().split("## Tools as data", 1)[1].split("\n## ", 1)[0]
    lines = re.findall(r"^\s*\.venv/bin/python manage\.py (tools .+)$", section, re.M)
    assert len(lines) == 3, lines
    (tmp_path / "examples" / "tools").mkdir(parents=True)
    example = ROOT / "examples" / "tools" / "tickets.json"
    (tmp_path / "examples" / "tools" / "tickets.json").write_text(example.read_text())
    monkeypatch.chdir(tmp_path)
    outputs = []
    for line in lines:
        code, out, err = run(*shlex.split(line)[1:])
        assert code == 0, (line, err)
        outputs.append(out)
    assert outputs[0].splitlines() == ["tickets.create: created v1", "tickets.close: created v1"]
    assert "tickets.create  v1  write  http  dedup=key" in outputs[1]
    exported = json.loads((tmp_path / "var" / "demo-tools.json").read_text())
    assert {item["name"] for item in exported} >= {"tickets.create", "tickets.close"}
