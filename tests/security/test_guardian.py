"""django-guardian pitfalls (TEST-MATRIX E5; NOTES.md "django-guardian").

Who may decide a hold point is an object permission on the policy, read by
`approvals.policies.may_decide` straight from the direct foreign-key tables, only for an
active member of the policy's tenant with a deciding role. These tests prove that reading
has none of guardian's leaks:

- it answers exactly what `get_objects_for_user(..., accept_global_perms=False,
  with_superuser=False)` plus the tenant filter answers, for every persona × policy, while
  guardian's defaults would hand a superuser or a holder of the global permission every
  tenant's policies;
- a global model permission (given to the user or through a group), staff and superuser
  status let nobody decide, or even see, another tenant's requests — API, pages and inbox;
- a superuser who is a member of tenant A sees nothing of tenant B on any page;
- a deleted policy's grants die with it (direct FK, ON DELETE CASCADE), so a new policy that
  gets the same primary key inherits nothing — on SQLite and PostgreSQL, the pk forced;
  the same steps through guardian's generic table do leak, which is why it is not used;
- no code reads permissions through guardian's or Django's leaky defaults.

tests/approvals/test_decisions.py::test_guardian_pitfalls_do_not_grant_decisions covers
`decide` itself for a global user permission and a superuser outsider; these extend it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from guardian.models import UserObjectPermission
from guardian.shortcuts import assign_perm, get_objects_for_user

from approvals.decisions import decide
from approvals.models import (
    ApprovalPolicy,
    ApprovalRequest,
    PolicyGroupPermission,
    PolicyUserPermission,
)
from approvals.policies import DECIDE, DECIDING_ROLES, grant, may_decide
from runtime.errors import NotPermitted
from runtime.models import Membership, Role, Tenant
from tests.api import (
    fresh_throttle,  # noqa: F401  (the rate limit must not leak between tests)
    grant_policy,
)
from tests.conftest import Persona, make_persona
from tests.security import matrix
from tests.security.conftest import csrf_client
from tests.security.world import World

pytestmark = pytest.mark.django_db
PERM = f"approvals.{DECIDE}"
User = get_user_model()


def guardian_reading(user: Any, policy: ApprovalPolicy) -> bool:
    """The safe way to ask guardian: both leaky defaults off, plus the tenant filter."""
    if not user.is_active:
        return False
    tenants = Membership.objects.filter(
        user=user, role__in=DECIDING_ROLES, tenant__active=True
    ).values("tenant")
    allowed = get_objects_for_user(
        user,
        PERM,
        ApprovalPolicy.objects.filter(tenant__in=tenants),
        accept_global_perms=False,
        with_superuser=False,
    )
    return allowed.filter(pk=policy.pk).exists()


def _global_deciders() -> Group:
    group = Group.objects.create(name="global-deciders")
    group.permissions.add(Permission.objects.get(codename=DECIDE))
    for codename in ("view_approvalrequest", "change_approvalrequest", "view_approvalpolicy"):
        group.permissions.add(Permission.objects.get(codename=codename))
    return group


def test_may_decide_reads_like_guardian_with_both_leaky_defaults_off(
    tenant_a: Tenant,
    tenant_b: Tenant,
    reviewer_a: Persona,
    viewer_a: Persona,
    outsider_b: Persona,
) -> None:
    policy_a = grant_policy(tenant_a, tool="tasks.close")
    policy_b = grant_policy(tenant_b, tool="tasks.close")
    spare_a = ApprovalPolicy.objects.create(tenant=tenant_a, name="ungranted", tool="x")
    carol = make_persona(tenant_a, "carol", Role.VIEWER).user  # granted directly, but a viewer
    assign_perm(DECIDE, carol, policy_a)
    dave = make_persona(tenant_a, "dave", Role.ADMIN).user  # granted directly, may decide
    assign_perm(DECIDE, dave, policy_a)
    mallory = make_persona(tenant_b, "mallory", Role.REVIEWER).user  # a grant across tenants
    assign_perm(DECIDE, mallory, policy_a)
    root = User.objects.create_superuser("root", password="pw-root")
    Membership.objects.create(tenant=tenant_a, user=root, role=Role.REVIEWER)
    glob = make_persona(tenant_a, "glob", Role.REVIEWER).user
    glob.groups.remove(Group.objects.get(name="acme-reviewers"))
    glob.groups.add(_global_deciders())
    glob.user_permissions.add(Permission.objects.get(codename=DECIDE))
    gone = make_persona(tenant_a, "gone", Role.REVIEWER).user
    gone.is_active = False
    gone.save()
    users = [
        reviewer_a.user,
        viewer_a.user,
        outsider_b.user,
        carol,
        dave,
        mallory,
        root,
        glob,
        gone,
    ]

    verdicts = {}
    for user in users:
        for policy in (policy_a, policy_b, spare_a):
            ours = may_decide(user, policy)
            assert ours == guardian_reading(user, policy), (user.username, policy.name)
            verdicts[(user.username, policy.tenant.slug, policy.name)] = ours
    granted = {key for key, allowed in verdicts.items() if allowed}
    assert granted == {
        ("alice", "acme", "tasks.close needs review"),
        ("dave", "acme", "tasks.close needs review"),
        ("bob", "globex", "tasks.close needs review"),
        ("mallory", "globex", "tasks.close needs review"),  # B's reviewer, in B
    }
    # What guardian's defaults would have said: the superuser and the holder of the global
    # permission get every tenant's policies.
    assert set(get_objects_for_user(root, PERM, ApprovalPolicy)) == {policy_a, policy_b, spare_a}
    assert policy_b in get_objects_for_user(glob, PERM, ApprovalPolicy)
    matrix.record("guardian", personas=len(users), policies=3, verdicts=len(verdicts))


def test_a_global_permission_neither_decides_nor_shows_another_tenants_requests(
    worlds: tuple[World, World], viewer_a: Persona
) -> None:
    a, b = worlds
    bob = b.reviewer.user
    bob.groups.add(_global_deciders())
    bob.user_permissions.add(Permission.objects.get(codename=DECIDE))
    bob.is_staff = True
    bob.save()
    victor = viewer_a.user
    victor.groups.add(Group.objects.get(name="global-deciders"))
    request = ApprovalRequest.objects.get(pk=a.approval_id)

    for user in (bob, victor):
        assert not may_decide(user, a.policy)
        with pytest.raises(NotPermitted):
            decide(request.pk, user, "approve", request.action_hash)

    client, _ = csrf_client(bob, api=True)
    client.raise_request_exception = False
    listed = client.get("/api/v1/approvals/").json()["results"]
    assert {item["id"] for item in listed} == set(b.ids("approval"))
    for url in (f"/api/v1/approvals/{a.approval_id}/", f"/approvals/{a.approval_id}/"):
        assert client.get(url).status_code == 404, url
    body = {"decision": "approve", "action_hash": request.action_hash}
    decided = client.post(
        f"/api/v1/approvals/{a.approval_id}/decision/",
        body,
        format="json",
        HTTP_X_CSRFTOKEN=client.cookies["csrftoken"].value,
    )
    assert decided.status_code == 404
    for url in ("/inbox/", "/inbox/history/", "/runs/", "/audit/"):
        page = client.get(url)
        assert page.status_code == 200, url
        assert not matrix.markers_in(page.content, a.markers), url
    # Victor may look at A's request (A's viewer) but not decide it, global perm or not.
    viewer, token = csrf_client(victor)
    viewer.raise_request_exception = False
    refused = viewer.post(
        f"/approvals/{a.approval_id}/decide/",
        {"decision": "approve", "action_hash": request.action_hash, "csrfmiddlewaretoken": token},
    )
    assert refused.status_code == 403
    assert ApprovalRequest.objects.get(pk=a.approval_id).status == "pending"


def test_a_superuser_of_tenant_a_sees_nothing_of_tenant_b_on_pages(
    worlds: tuple[World, World],
) -> None:
    a, b = worlds
    root = User.objects.create_superuser("root", password="pw-root", is_staff=True)
    Membership.objects.create(tenant=a.tenant, user=root, role=Role.ADMIN)
    client, _ = csrf_client(root)
    client.raise_request_exception = False
    pages = [
        "/inbox/",
        "/inbox/list/",
        "/inbox/history/",
        "/runs/",
        f"/runs/?thread_id=thread-of-{b.slug}",
        "/reconcile/",
        "/audit/",
        "/audit/export.csv",
        "/audit/export.jsonl",
        "/api/v1/runs/",
        "/api/v1/actions/",
        "/api/v1/approvals/",
    ]
    for url in pages:
        response = client.get(url)
        assert response.status_code == 200, url
        echo = [m for m in b.markers if m in url]
        found = matrix.markers_in(matrix.body_of(response), [m for m in b.markers if m not in echo])
        assert not found, (url, found)
    own = client.get("/inbox/")
    assert a.approval_id.encode() in own.content
    for kind, prefix in (("run", "/runs/"), ("approval", "/approvals/"), ("action", "/reconcile/")):
        for pk in b.ids(kind):
            assert client.get(f"{prefix}{pk}/").status_code == 404, (kind, pk)
    # Superuser status grants no decision either, in A or in B.
    assert not may_decide(root, a.policy) and not may_decide(root, b.policy)


@pytest.mark.parametrize("grantee", ["group", "user"])
def test_a_deleted_policys_grants_do_not_pass_to_a_new_policy_with_its_pk(
    grantee: str, tenant_a: Tenant, reviewer_a: Persona
) -> None:
    alice = reviewer_a.user
    policy = ApprovalPolicy.objects.create(tenant=tenant_a, name="old", tool="tasks.close")
    if grantee == "group":
        grant(policy, Group.objects.get(name="acme-reviewers"))
    else:
        assign_perm(DECIDE, alice, policy)
    assert may_decide(alice, policy)
    pk = policy.pk
    policy.delete()
    assert not PolicyGroupPermission.objects.filter(content_object_id=pk).exists()
    assert not PolicyUserPermission.objects.filter(content_object_id=pk).exists()

    # The same primary key again, forced (SQLite would reuse it anyway; PostgreSQL's sequence
    # would not, but a restore or a manual insert can), in the same tenant, for a member who
    # held the old grant.
    reborn = ApprovalPolicy.objects.create(pk=pk, tenant=tenant_a, name="new", tool="tasks.close")
    assert not may_decide(alice, reborn)
    assert not guardian_reading(alice, reborn)


def test_the_generic_permission_table_would_leak_to_a_reused_pk(reviewer_a: Persona) -> None:
    """The control: guardian's generic table keys objects by (content type, text pk) with no
    foreign key, so a grant outlives its object and attaches to the next row with that pk.
    This is what the direct-FK tables above prevent."""
    alice = reviewer_a.user
    group = Group.objects.create(name="doomed")
    assign_perm("auth.change_group", alice, group)
    pk = group.pk
    group.delete()
    assert UserObjectPermission.objects.filter(object_pk=str(pk)).exists()  # the orphan
    reborn = Group.objects.create(pk=pk, name="reborn")
    assert alice.has_perm("auth.change_group", reborn)  # inherited: the pitfall


# --- no code asks with the leaky defaults -------------------------------------------------------

PROJECT = Path(settings.BASE_DIR)
PACKAGES = ("runtime", "approvals", "audit", "config")
# `User.has_perm(perm, obj)` answers True for any superuser, for any object of any tenant;
# guardian's ObjectPermissionChecker and get_perms do too, and get_objects_for_user does by
# default. Object permissions are read in approvals.policies only.
LEAKY_CALLS = {"get_perms", "ObjectPermissionChecker"}
OBJECT_CHECKS = {"has_perm", "has_perms"}  # leaky when given an object


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def test_no_code_reads_object_permissions_through_leaky_defaults() -> None:
    offending = []
    scanned = 0
    for package in PACKAGES:
        for path in sorted((PROJECT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            scanned += 1
            for call in _calls(ast.parse(path.read_text(), str(path))):
                name = _name(call)
                where = f"{path.relative_to(PROJECT)}:{call.lineno}"
                with_object = len(call.args) > 1 or any(k.arg == "obj" for k in call.keywords)
                if name in LEAKY_CALLS or (name in OBJECT_CHECKS and with_object):
                    offending.append(f"{where}: {name}()")
                if name in ("get_objects_for_user", "get_objects_for_group"):
                    flags = {k.arg: getattr(k.value, "value", None) for k in call.keywords}
                    wanted = {"accept_global_perms": False, "with_superuser": False}
                    if name == "get_objects_for_group":
                        wanted = {"accept_global_perms": False}
                    if any(flags.get(k, True) is not False for k in wanted):
                        offending.append(f"{where}: {name}() without {wanted}")
    assert scanned > 20
    assert not offending, offending
