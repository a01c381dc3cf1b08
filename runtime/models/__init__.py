"""Runtime models, one module per concept."""

from runtime.models.tenancy import AgentAccount, Membership, Role, Tenant

__all__ = ["AgentAccount", "Membership", "Role", "Tenant"]
