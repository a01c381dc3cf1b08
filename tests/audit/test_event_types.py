"""The audit log's and the journal admin's type filters offer every type the code writes.

The lists were typed by hand beside the writers and fell behind them: `tool_defined`,
`credentials_reencrypted` and `token_rotated` entries were written but could not be picked,
so a reader looking for who defined a tool or re-encrypted the credentials had no filter
for it. The writers' calls are read here (their source, parsed), so a type written
anywhere and listed nowhere fails this test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from runtime.events import RunEvent
from tests.conftest import Persona

ROOT = Path(__file__).resolve().parents[2]
CODE = ("approvals", "audit", "gateway", "runtime", "config")
# The writers of journal entries and where their `type` argument sits.
WRITERS = {"append": 1, "record_tenant_act": 1, "_tenant_event": 1}


def _constants(node: ast.expr) -> set[str]:
    """The strings an argument can be: a literal, or either branch of `a if c else b`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _constants(node.body) | _constants(node.orelse)
    return set()


def written_types() -> set[str]:
    """Every literal type passed to a journal writer in the product's code."""
    found: set[str] = set()
    for folder in CODE:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "append" and not (
                    isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "journal"
                ):
                    continue  # list.append and the like
                at = WRITERS.get(name)
                if at is not None and len(node.args) > at:
                    found |= _constants(node.args[at])
    return found


def test_the_writers_are_found() -> None:
    written = written_types()
    assert {"tool_defined", "credentials_reencrypted", "policy_changed", "login"} <= written


@pytest.mark.django_db
def test_the_audit_log_offers_every_type_the_code_writes(
    client: Client, reviewer_a: Persona
) -> None:
    client.force_login(reviewer_a.user)
    page = client.get(reverse("audit-log"))
    assert page.status_code == 200
    select = re.search(r'<select id="filter-type".*?</select>', page.content.decode(), re.S)
    assert select is not None
    offered = set(re.findall(r'<option value="([^"]+)"', select.group(0)))
    missing = (written_types() | set(RunEvent.values)) - offered
    assert not missing, f"written but not offered: {sorted(missing)}"


@pytest.mark.django_db
def test_the_journal_admin_offers_every_type_the_code_writes(
    client: Client, admin_a: Persona
) -> None:
    admin_a.user.user_permissions.add(
        Permission.objects.get(content_type__app_label="audit", codename="view_journalentry")
    )
    client.force_login(admin_a.user)
    page = client.get("/admin/audit/journalentry/")
    assert page.status_code == 200
    offered = {
        choice["display"]
        for spec in page.context["cl"].filter_specs
        if getattr(spec, "parameter_name", "") == "type"
        for choice in spec.choices(page.context["cl"])
    }
    missing = (written_types() | set(RunEvent.values)) - offered
    assert not missing, f"written but not offered: {sorted(missing)}"
