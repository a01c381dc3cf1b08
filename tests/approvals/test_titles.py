"""A request's title comes from its tool (`Tool.title`), verb first (NOTES.md: the inbox)."""

from __future__ import annotations

from runtime.tools import Tool, get_tool


def test_the_task_tools_name_their_actions_verb_first() -> None:
    assert get_tool("tasks.create").title_for({"title": "Fix login"}) == "Create task: Fix login"
    assert get_tool("tasks.close").title_for({"task_id": "42"}, "t") == "Close task: 42"


def test_a_placeholder_the_action_leaves_empty_keeps_the_verb() -> None:
    tool = Tool(name="x.send", title="Send message: {subject} to {target}")
    assert tool.title_for({"subject": "Hi"}, "ops") == "Send message: Hi to ops"
    assert tool.title_for({"subject": ""}, "ops") == "Send message"
    assert tool.title_for({}, "") == "Send message"


def test_without_a_template_the_tool_name_and_target_say_it() -> None:
    assert Tool(name="x.run").title_for({"title": "ignored"}, "prod-db") == "Run x.run: prod-db"
    assert Tool(name="x.run").title_for({}) == "Run x.run"


def test_a_template_is_filled_by_name_only_never_formatted() -> None:
    """A template may one day be tool data: no attribute access, no format specs."""
    tool = Tool(name="x.y", title="Do {title.__class__} {title!r} {title:>9}: {title}")
    assert tool.title_for({"title": "a"}) == "Do {title.__class__} {title!r} {title:>9}: a"


def test_a_title_is_at_most_300_characters() -> None:
    assert len(Tool(name="x.y", title="T: {title}").title_for({"title": "a" * 500})) == 300
