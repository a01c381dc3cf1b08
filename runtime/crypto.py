"""Encryption at rest for tool credentials, with keys from the environment.

`HOLDPOINT_SECRET_KEYS` holds Fernet keys, newest first (config/env.py reads and checks
them). Encryption always uses the first; decryption tries each in turn (MultiFernet), so a
new key can be put in front, `manage.py rotate_secrets` re-encrypts every credential with
it, and only then the old key is removed. The database alone never reveals a credential:
a copy of it without the environment is ciphertext.

Each ciphertext also names the tenant and service it was written for; a row whose
ciphertext was copied from another tenant's row refuses to decrypt (a swapped row is not a
way to borrow another tenant's credential).
"""

from __future__ import annotations

import json
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings


class SecretUnreadable(Exception):
    """A stored credential cannot be decrypted with any configured key (or was written for
    another tenant or service). Never garbage: the caller gets this, not a wrong secret."""


class Secret:
    """A decrypted credential. Its str and repr are masked, so logging it, putting it in an
    exception or a traceback's locals shows `Secret('********')`; `reveal()` is the one way
    to the value, at the point where it goes on the wire."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__


@lru_cache(maxsize=4)
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(key.encode("ascii")) for key in keys])


def fernet() -> MultiFernet:
    """The configured keys; read from settings each time so a changed setting (tests, a
    reload) takes effect, built once per distinct key list."""
    keys = tuple(settings.HOLDPOINT_SECRET_KEYS)
    if not keys:
        raise SecretUnreadable("HOLDPOINT_SECRET_KEYS is empty")
    return _fernet(keys)


def encrypt(value: str, *, tenant_id: int, service: str) -> str:
    envelope = json.dumps({"tenant": tenant_id, "service": service, "secret": value})
    return fernet().encrypt(envelope.encode("utf-8")).decode("ascii")


def decrypt(ciphertext: str, *, tenant_id: int, service: str) -> Secret:
    where = f"the {service!r} credential of tenant {tenant_id}"
    try:
        envelope = json.loads(fernet().decrypt(ciphertext.encode("ascii")))
    except (InvalidToken, ValueError, UnicodeError):
        raise SecretUnreadable(
            f"{where} cannot be decrypted with any key in HOLDPOINT_SECRET_KEYS "
            "(was the key it was written with removed before `manage.py rotate_secrets`?)"
        ) from None
    if envelope.get("tenant") != tenant_id or envelope.get("service") != service:
        raise SecretUnreadable(f"{where} holds a ciphertext written for another credential")
    return Secret(str(envelope["secret"]))


def reencrypt(ciphertext: str) -> str:
    """The same credential under the current (first) key; SecretUnreadable if no key reads
    it."""
    try:
        return fernet().rotate(ciphertext.encode("ascii")).decode("ascii")
    except (InvalidToken, UnicodeError):
        raise SecretUnreadable(
            "a credential cannot be decrypted with any key in HOLDPOINT_SECRET_KEYS"
        ) from None
