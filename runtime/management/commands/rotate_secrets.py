"""`manage.py rotate_secrets`: re-encrypt every tool credential with the current key.

Key rotation: put a new key first in HOLDPOINT_SECRET_KEYS (keep the old ones after it),
restart, run this, then remove the old keys. Each credential is re-encrypted in its own
short transaction under a row lock, so a concurrent admin change is never overwritten with
an older value. A credential no key can read is named and left as it is; the command then
fails (exit 1) so a removed key is noticed before its credentials are needed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from runtime.accounts import record_tenant_act
from runtime.crypto import SecretUnreadable, reencrypt
from runtime.models import ToolCredential


def rotate_credential(pk: int) -> ToolCredential:
    """Re-encrypt one credential under the current key; SecretUnreadable if no key reads it."""
    with transaction.atomic(durable=True):
        credential = ToolCredential.objects.select_for_update().get(pk=pk)
        credential.secret()  # opens, for its own tenant and service (else a named error)
        credential.ciphertext = reencrypt(credential.ciphertext)
        credential.save(update_fields=["ciphertext"])
    return credential


class Command(BaseCommand):
    help = "Re-encrypt every tool credential with the first key of HOLDPOINT_SECRET_KEYS."

    def handle(self, *args: Any, **options: Any) -> None:
        done: dict[int, list[str]] = defaultdict(list)
        failed: list[str] = []
        for pk in ToolCredential.objects.order_by("pk").values_list("pk", flat=True):
            try:
                credential = rotate_credential(pk)
            except SecretUnreadable as exc:
                failed.append(str(exc))
                continue
            except ToolCredential.DoesNotExist:
                continue  # deleted meanwhile
            done[credential.tenant_id].append(credential.service)
        for tenant_id, services in done.items():
            with transaction.atomic(durable=True):
                record_tenant_act(
                    tenant_id, "credentials_reencrypted", "system:rotate_secrets", services=services
                )
        count = sum(len(services) for services in done.values())
        self.stdout.write(f"Re-encrypted {count} credential(s) with the current key.")
        if failed:
            for line in failed:
                self.stderr.write(line)
            raise CommandError(f"{len(failed)} credential(s) could not be decrypted")
