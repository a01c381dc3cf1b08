"""Failed logins of one person in one tenant, counted per window (issue 16 L8).

Every failed login for an existing username used to append its own hash-chained entry to
each of the person's tenant streams, also while django-axes had the username locked out: a
guessing script could grow the journal without bound. Now the first failure of a window is
journalled at once (with the client's address and agent), the rest of the window only
counted here, and the count journalled when the window is closed — by the person's next
failure after it, their next login, or the periodic flush (runtime/accounts.py). Each
`login_failed` entry says how many failed logins it stands for.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from runtime.models.tenancy import Tenant


class FailedLoginWindow(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    started_at = models.DateTimeField()
    last_at = models.DateTimeField()
    # Failures after the window's first (which was journalled when it happened).
    unrecorded = models.PositiveIntegerField(default=0)
    locked_out = models.BooleanField(default=False)
    # Distinct client addresses of the unrecorded failures (at most MAX_ADDRESSES).
    ips = models.JSONField(default=list)
    user_agent = models.CharField(max_length=200, blank=True, default="")

    MAX_ADDRESSES = 20

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user", "tenant"], name="runtime_failedloginwindow_one_per_member"
            ),
        ]
        indexes = [
            # The periodic flush: windows that ended with failures still unrecorded.
            models.Index(fields=["started_at"], name="runtime_failedlogin_started"),
        ]

    def __str__(self) -> str:
        return f"failed logins of user {self.user_id} in tenant {self.tenant_id}"
