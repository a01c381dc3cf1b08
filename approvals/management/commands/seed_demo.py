"""Create the demo tenants and accounts (idempotent).

Running it twice changes nothing and prints no passwords the second time unless
HOLDPOINT_DEMO_PASSWORD is set: generated passwords are shown once, when the user is created.
It lives in the approvals app because it sets up both apps' demo rows (tenants and accounts,
and the hold point with its reviewer group); runtime does not import approvals.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.management.base import BaseCommand
from django.db import transaction

from approvals.models import ApprovalPolicy
from approvals.policies import grant
from approvals.requests import default_write_policy
from runtime import gates
from runtime.crypto import SecretUnreadable
from runtime.models import Membership, Role, Tenant, ToolCredential
from runtime.tooldefs import define_many
from runtime.tools import TRACKER_BASE, changes_something, tracker_definitions

User = get_user_model()

TENANTS = [("demo", "Demo Co"), ("other", "Other Inc")]
# username, tenant, role
ACCOUNTS = [
    ("demo-admin", "demo", Role.ADMIN),
    ("demo-reviewer", "demo", Role.REVIEWER),
    ("demo-viewer", "demo", Role.VIEWER),
    ("demo-agent", "demo", Role.AGENT),
    ("other-reviewer", "other", Role.REVIEWER),
    ("other-agent", "other", Role.AGENT),
]
TENANT_ADMIN_GROUP = "tenant-admins"
# What a tenant admin needs in Django admin; the admin classes narrow each to own tenants.
TENANT_ADMIN_PERMS = [
    ("runtime", "view_tenant"),
    ("runtime", "change_tenant"),
    ("runtime", "view_membership"),
    ("runtime", "add_membership"),
    ("runtime", "change_membership"),
    ("runtime", "delete_membership"),
    ("runtime", "view_agentaccount"),
    ("runtime", "add_agentaccount"),
    ("runtime", "change_agentaccount"),
    ("runtime", "view_agenttoken"),
    ("runtime", "add_agenttoken"),
    ("runtime", "change_agenttoken"),  # the revoke and rotate actions
    ("runtime", "view_toolcredential"),
    ("runtime", "add_toolcredential"),
    ("runtime", "change_toolcredential"),
    ("runtime", "delete_toolcredential"),
    ("runtime", "view_tooldefinition"),
    ("runtime", "add_tooldefinition"),
    ("runtime", "change_tooldefinition"),  # a change stores a new version, never edits one
    ("runtime", "view_mcpserver"),
    ("runtime", "add_mcpserver"),
    ("runtime", "change_mcpserver"),
    ("runtime", "delete_mcpserver"),
    ("approvals", "view_approvalpolicy"),
    ("approvals", "add_approvalpolicy"),
    ("approvals", "change_approvalpolicy"),
    ("approvals", "view_approvalrequest"),
    ("approvals", "change_approvalrequest"),  # admin actions: reassign, re-notify (no form)
    ("audit", "view_journalentry"),
    ("approvals", "view_tenantwebhook"),
    ("approvals", "add_tenantwebhook"),
    ("approvals", "change_tenantwebhook"),
    ("approvals", "delete_tenantwebhook"),
    ("approvals", "view_webhookdelivery"),
    ("approvals", "change_webhookdelivery"),  # admin action: redeliver (no form)
    ("runtime", "view_run"),
    ("runtime", "change_run"),  # admin actions: resume, cancel (no form)
]


def reviewer_group_name(tenant: Tenant) -> str:
    return f"{tenant.slug}-reviewers"


class Command(BaseCommand):
    help = "Create the demo tenants, users and agent accounts (safe to run again)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--tracker-url",
            default=TRACKER_BASE,
            help="Where the demo tenants' tasks.* tools send (make run's sandbox by default).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.tracker_url = options.get("tracker_url") or TRACKER_BASE
        created = self.seed()
        fixed = settings.HOLDPOINT_DEMO_PASSWORD
        if created:
            lines = [
                f"  {username:16} {role:9} password: "
                + (password if not fixed or role == Role.AGENT else "(HOLDPOINT_DEMO_PASSWORD)")
                for username, role, password in created
            ]
            self.stdout.write("Demo accounts created:\n" + "\n".join(lines))
            if not fixed:
                # Shown once on screen; also kept owner-readable under var/ so a missed
                # terminal line does not lock the newcomer out of their own demo.
                path = Path(settings.VAR_DIR) / "demo-passwords.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("\n".join(lines) + "\n")
                path.chmod(0o600)
                self.stdout.write(f"(also written to {path})")
        else:
            self.stdout.write("Demo accounts already present; their passwords are unchanged.")
        if self.stored_tokens:
            self.stdout.write(
                "Stored the sandbox token (HOLDPOINT_SANDBOX_TOKENS) as the `tasks` credential "
                f"of: {', '.join(self.stored_tokens)}."
            )

    @transaction.atomic
    def seed(self) -> list[tuple[str, str, str]]:
        tenants = {
            slug: Tenant.objects.get_or_create(slug=slug, defaults={"name": name})[0]
            for slug, name in TENANTS
        }
        admins = self._tenant_admin_group()
        created: list[tuple[str, str, str]] = []
        for username, slug, role in ACCOUNTS:
            tenant = tenants[slug]
            user, is_new = User.objects.get_or_create(username=username)
            if is_new:
                password = settings.HOLDPOINT_DEMO_PASSWORD or secrets.token_urlsafe(12)
                if role == Role.AGENT:
                    user.set_unusable_password()
                    password = "(token only: manage.py agent_token issue " + username + ")"
                else:
                    user.set_password(password)
                user.is_staff = role == Role.ADMIN
                user.save()
                created.append((username, role, password))
            if role != Role.AGENT and not user.email:
                # An address at the reserved example.com, so the notifications `make run`
                # sends show in its console (the console email backend under DEBUG).
                user.email = f"{username}@example.com"
                user.save(update_fields=["email"])
            Membership.objects.get_or_create(tenant=tenant, user=user, defaults={"role": role})
            if role == Role.ADMIN:
                user.groups.add(admins)
            # demo-admin decides too, so a run demo-reviewer starts from the Runs page can be
            # approved by someone else (whoever starts a run cannot approve its actions).
            if role in (Role.REVIEWER, Role.ADMIN):
                group, _ = Group.objects.get_or_create(name=reviewer_group_name(tenant))
                user.groups.add(group)
        for tenant in tenants.values():
            self._tracker_tools(tenant)
        self._demo_policy(tenants["demo"])
        self.stored_tokens: list[str] = []
        for tenant in tenants.values():
            self._default_policies(tenant)
            if self._sandbox_credential(tenant):
                self.stored_tokens.append(tenant.slug)
        return created

    def _tracker_tools(self, tenant: Tenant) -> None:
        """The task tracker's tools (runtime/tooldata/tasks.json) as the tenant's own
        definitions, pointed at the sandbox: data a tenant admin can read and change in the
        admin, like any tool they define. Unchanged definitions stay at their version."""
        define_many(
            tenant,
            tracker_definitions(getattr(self, "tracker_url", TRACKER_BASE)),
            "system:seed_demo",
        )

    def _sandbox_credential(self, tenant: Tenant) -> bool:
        """When the sandbox tracker requires a token (HOLDPOINT_SANDBOX_TOKENS, read by
        `sandbox_tasks` too), each demo tenant's `tasks` credential is its first one, so
        `make run` keeps working with one variable set for both. Stored encrypted. True if
        it was stored now (said on the way out: a second `make run` with the variable newly
        set changes the credential, and must not say "nothing changed")."""
        tokens = settings.HOLDPOINT_SANDBOX_TOKENS
        if not tokens:
            return False
        credential = ToolCredential.objects.filter(tenant=tenant, service="tasks").first()
        try:
            if credential is not None and credential.secret().reveal() == tokens[0]:
                return False
        except SecretUnreadable:
            pass  # written under keys no longer configured: replace it
        credential = credential or ToolCredential(tenant=tenant, service="tasks")
        credential.set_secret(tokens[0], actor="system:seed_demo")
        credential.save()
        return True

    def _demo_policy(self, tenant: Tenant) -> None:
        """tasks.create in the demo tenant waits for a demo reviewer (a hold point)."""
        policy, _ = ApprovalPolicy.objects.get_or_create(
            tenant=tenant,
            name="Review tasks before they are created",
            defaults={"tool": "tasks.create", "expiry_seconds": 24 * 3600},
        )
        grant(policy, Group.objects.get(name=reviewer_group_name(tenant)))

    def _default_policies(self, tenant: Tenant) -> None:
        """Each of the tenant's write tools that no policy names gets now the policy its
        first held action would get (any reviewer of the tenant decides): the demo holds
        what it held, and `manage.py doctor` on a fresh `make run` has no write tool to warn
        about."""
        named = gates.tools_named_by_policy(tenant.pk)
        for definition in tracker_definitions(getattr(self, "tracker_url", TRACKER_BASE)):
            if changes_something(definition) and definition["name"] not in named:
                default_write_policy(tenant.pk, definition["name"])

    def _tenant_admin_group(self) -> Group:
        group, _ = Group.objects.get_or_create(name=TENANT_ADMIN_GROUP)
        perms = [
            Permission.objects.get(content_type__app_label=app, codename=codename)
            for app, codename in TENANT_ADMIN_PERMS
        ]
        group.permissions.add(*perms)
        return group
