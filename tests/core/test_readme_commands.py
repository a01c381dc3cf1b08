"""The README names every management command Holdpoint ships, and the options it shows for a
command are that command's options.

An operator learns the commands from the README: `checkpoint_verify` shipped without a line
there, so nobody would have run it from cron beside `audit_verify`. Fast and without a
database: the commands' parsers are built, never run.
"""

from __future__ import annotations

import re

from django.core.management import get_commands, load_command_class

from tests.core.readme import README, ROOT

APPS = ("runtime", "approvals", "audit", "chaos")
# `manage.py NAME …` inside one inline code span on one line (not a fenced block's lines).
SPAN = re.compile(r"`[^`\n]*?manage\.py (?P<name>[a-z_]+)(?P<rest>[^`\n]*)`")


def shipped() -> list[str]:
    """Our own commands: those in our apps' management/commands, not Django's or a library's."""
    return sorted(
        path.stem
        for app in APPS
        for path in (ROOT / app / "management" / "commands").glob("[a-z]*.py")
    )


def test_every_command_holdpoint_ships_is_in_the_readme() -> None:
    text = README.read_text()
    # `make run` runs seed_demo itself; the README names it as `seed_demo`.
    missing = [
        name for name in shipped() if f"manage.py {name}" not in text and f"`{name}`" not in text
    ]
    assert shipped() and not missing, f"commands the README never names: {missing}"


def test_the_options_the_readme_shows_are_the_commands_options() -> None:
    commands = get_commands()
    wrong = []
    seen = 0
    for span in SPAN.finditer(README.read_text()):
        name = span["name"]
        assert name in commands, f"README names `manage.py {name}`, which does not exist"
        parser = load_command_class(commands[name], name).create_parser("manage.py", name)
        known = {option for action in parser._actions for option in action.option_strings}
        for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", span["rest"]):
            seen += 1
            if option not in known:
                wrong.append(f"manage.py {name} {option}")
    assert seen > 10, "the README's synopses name options (purge, audit_verify, agent_token…)"
    assert not wrong, f"options the README shows that the command does not take: {wrong}"
