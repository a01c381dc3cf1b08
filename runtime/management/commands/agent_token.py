"""`manage.py agent_token issue|rotate|revoke|list <username>`: an agent's API tokens.

issue   prints a new key once (only its hash is stored); --name, --expires-in 90d.
rotate  prints a new key and lets the agent's live tokens (or the one named by --prefix)
        keep working for --overlap (24h by default), then only the new one works.
revoke  refuses a token (--prefix) or all of the agent's tokens (--all) from the next request.
list    prefix, status, name, creation, expiry and last use; never a key or hash.

The key is the last line of `issue` and `rotate`'s output, alone, so a script can take it
with `tail -n 1`. Every change is journalled in the tenant's stream (runtime/auth.py).
"""

from __future__ import annotations

import getpass
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from runtime.auth import (
    DEFAULT_OVERLAP,
    Issued,
    issue_token,
    parse_duration,
    revoke_token,
    rotate_tokens,
)
from runtime.models import AgentToken, Tenant


def _os_user() -> str:
    """Who ran the command, for the journal's actor (best effort: containers may not know)."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "unknown"


class Command(BaseCommand):
    help = "Issue, rotate, revoke or list an agent account's API tokens."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["issue", "rotate", "revoke", "list"])
        parser.add_argument("username", help="the agent account (tokens are for agents only)")
        parser.add_argument("--tenant", help="tenant slug (checked against the agent's)")
        parser.add_argument("--name", default=None, help="what the token is for")
        parser.add_argument("--expires-in", default=None, help="issue: e.g. 90d (default never)")
        parser.add_argument(
            "--overlap", default=None, help="rotate: how long old tokens keep working (24h)"
        )
        parser.add_argument("--prefix", default=None, help="rotate/revoke: only this token")
        parser.add_argument("--all", action="store_true", help="revoke: every token")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"no user {options['username']!r}")
        tenant = None
        if options["tenant"]:
            tenant = Tenant.objects.filter(slug=options["tenant"]).first()
            if tenant is None:
                raise CommandError(f"no tenant {options['tenant']!r}")
        self.actor = f"system:agent_token ({_os_user()})"
        try:
            getattr(self, options["action"])(user, tenant, options)
        except ValueError as exc:
            raise CommandError(str(exc)) from None

    def _tokens(self, user: Any, tenant: Tenant | None, prefix: str | None) -> Any:
        tokens = AgentToken.objects.filter(user=user).select_related("tenant", "user")
        if tenant is not None:
            tokens = tokens.filter(tenant=tenant)
        if prefix:
            tokens = tokens.filter(prefix=prefix)
        return tokens

    def _print_key(self, issued: Issued) -> None:
        token = issued.token
        self.stdout.write(
            f"New token {token.prefix}… for {token.user.get_username()} in {token.tenant.slug}"
            + (f", expires {token.expires_at.isoformat()}" if token.expires_at else "")
            + ". Shown once; only its hash is stored:"
        )
        self.stdout.write(issued.key)

    def issue(self, user: Any, tenant: Tenant | None, options: dict[str, Any]) -> None:
        expires_at = None
        if options["expires_in"]:
            expires_at = timezone.now() + parse_duration(options["expires_in"])
        issued = issue_token(
            user, actor=self.actor, tenant=tenant, name=options["name"] or "", expires_at=expires_at
        )
        self._print_key(issued)

    def rotate(self, user: Any, tenant: Tenant | None, options: dict[str, Any]) -> None:
        overlap = parse_duration(options["overlap"]) if options["overlap"] else DEFAULT_OVERLAP
        replace = None
        if options["prefix"]:
            replace = list(self._tokens(user, tenant, options["prefix"]))
            if not replace:
                raise CommandError(f"no token {options['prefix']} of {user.get_username()}")
            tenant = replace[0].tenant
        issued, old = rotate_tokens(
            user,
            actor=self.actor,
            tenant=tenant,
            overlap=overlap,
            replace=replace,
            name=options["name"],
        )
        for token in old:
            self.stdout.write(f"Old token {token.prefix}… works until {token.expires_at}")
        self._print_key(issued)

    def revoke(self, user: Any, tenant: Tenant | None, options: dict[str, Any]) -> None:
        if not options["prefix"] and not options["all"]:
            raise CommandError("name the token with --prefix, or pass --all")
        tokens = list(self._tokens(user, tenant, options["prefix"]).filter(revoked_at=None))
        if not tokens:
            raise CommandError("no such unrevoked token")
        for token in tokens:
            revoke_token(token, actor=self.actor)
            self.stdout.write(f"Revoked {token.prefix}…")

    def list(self, user: Any, tenant: Tenant | None, options: dict[str, Any]) -> None:
        now = timezone.now()
        for token in self._tokens(user, tenant, options["prefix"]):
            self.stdout.write(
                f"{token.prefix:<14} {token.status(now):<9} {token.tenant.slug:<12} "
                f"created {token.created_at:%Y-%m-%d %H:%M} "
                f"expires {token.expires_at or 'never'} "
                f"last used {token.last_used_at or 'never'}"
                + (f"  {token.name}" if token.name else "")
            )
