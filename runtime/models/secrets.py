"""Tool credentials: a tenant's secret for one outside service, stored encrypted.

A tool names the credential it sends (`Tool.credential`, e.g. "tasks" for the task tracker's
API token, used by tasks.create and tasks.close). The row holds only the ciphertext
(runtime/crypto.py); nothing here ever returns the plaintext except `secret()`, which gives a
masked `Secret`. str/repr name the tenant and service, never the value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from django.conf import settings
from django.db import models

from fastsql import statements
from runtime.crypto import Secret, decrypt, encrypt
from runtime.models.tenancy import Tenant


class ToolCredential(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="tool_credentials")
    service = models.CharField(
        max_length=64, help_text="The credential's name that tools refer to (tasks: the tracker)."
    )
    ciphertext = models.TextField(editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=200, blank=True, editable=False)

    class Meta:
        ordering = ["tenant__slug", "service"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "service"], name="runtime_toolcredential_one_per_service"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.service} credential of tenant {self.tenant_id}"

    @property
    def is_set(self) -> bool:
        return bool(self.ciphertext)

    def set_secret(self, value: str, actor: str = "") -> None:
        """Encrypt `value` into the row (saved by the caller). The tenant must be set: the
        ciphertext is bound to it."""
        self.ciphertext = encrypt(value, tenant_id=self.tenant_id, service=self.service)
        self.updated_by = actor

    def secret(self) -> Secret:
        return decrypt(self.ciphertext, tenant_id=self.tenant_id, service=self.service)

    @classmethod
    def lookup(cls, tenant_id: int, service: str) -> Secret | None:
        """The tenant's credential for a service, or None if it has none.

        A tool sends it on every call, so this runs per action: the ciphertext is read every
        time (a replaced or removed secret takes effect at the next call) — by the action's
        prepare statement where it read it (`read_along`), else here —, its decryption is
        remembered in this process by the ciphertext and the key list (`_decrypted`)."""
        along = _read_along.get()
        if along is not None and along[:2] == (tenant_id, service):
            ciphertext = along[2]
        else:
            rows = statements.select(
                cls, ("ciphertext",), {"tenant_id": tenant_id, "service": service}, limit=1
            )
            ciphertext = rows[0][0] if rows else None
        if not ciphertext:
            return None
        key = (ciphertext, tenant_id, service, tuple(settings.HOLDPOINT_SECRET_KEYS))
        secret = _decrypted.get(key)
        if secret is None:
            secret = decrypt(ciphertext, tenant_id=tenant_id, service=service)
            if len(_decrypted) >= 1_000:
                _decrypted.clear()
            _decrypted[key] = secret
        return secret


# (tenant, service, ciphertext or None): the credential as a statement that prepared an
# action read it, a moment before its call (runtime.dispatch) — the same read, made along.
_read_along: ContextVar[tuple[int, str, str | None] | None] = ContextVar(
    "credential_read_along", default=None
)


@contextmanager
def read_along(tenant_id: int, service: str, ciphertext: str | None) -> Iterator[None]:
    """`lookup` answers for (tenant, service) from `ciphertext` inside this block instead of
    reading the row again: it was read, in the same action, by its prepare statement."""
    token = _read_along.set((tenant_id, service, ciphertext))
    try:
        yield
    finally:
        _read_along.reset(token)


# (ciphertext, tenant, service, the key list) → its decryption: kept in this process's memory
# only, as a `Secret` (masked in every repr, so never logged). Keyed by the ciphertext, an
# entry cannot outlive its row's value; keyed by the key list, it cannot outlive a key change
# (a removed key must make the secret unreadable, as decryption would).
_decrypted: dict[tuple[str, int, str, tuple[str, ...]], Secret] = {}
