"""What an agent author imports: every exception the client raises is in the package root."""

from __future__ import annotations

import inspect

import holdpoint_client
import holdpoint_client.errors as errors


def _public_errors() -> dict[str, type[BaseException]]:
    return {
        name: cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls)
        and issubclass(cls, BaseException)
        and cls.__module__ == errors.__name__
        and not name.startswith("_")
    }


def test_every_error_class_is_exported_from_the_package_root() -> None:
    """`except holdpoint_client.ServiceUnavailable` (or StaleGoalRev, InvalidTransition, …)
    was an AttributeError: only some classes were re-exported, the rest had to be imported
    from `holdpoint_client.errors`."""
    public = _public_errors()
    assert len(public) > 50  # the module's classes, not an empty match
    missing = sorted(name for name in public if name not in holdpoint_client.__all__)
    assert missing == []
    for name, cls in public.items():
        assert getattr(holdpoint_client, name) is cls, name
    assert sorted(holdpoint_client.__all__) == holdpoint_client.__all__
