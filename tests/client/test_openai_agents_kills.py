"""examples/openai_agents_agent.py killed after an ungated call's effect, then started again.

No hold point: nothing pauses, so no RunState is stored before the effect, and the
example's model (like a real one) names a new call id every time it is asked. Real
processes over real sockets: the API on `live_server`, the sandbox task tracker, the agent
SIGKILLed at the client's `after_tool_response` fault point.
"""

from __future__ import annotations

import pytest

from tests.client import the_action
from tests.client.test_openai_agents import SdkAgent, assert_done_once, crashed, sdk  # noqa: F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.ci_database("postgresql"),
]


def test_killed_after_an_ungated_calls_effect_makes_one_task(sdk: SdkAgent) -> None:  # noqa: F811
    """The restart asked the model again, and its new answer's call id made a new key: a
    second task in the tracker. The model's answers are now recorded in the run, so the
    restart is given the first answer again (same call id, same key) and the ledger settles
    the sent action with the tracker's dedup contract."""
    crashed(sdk, sdk.launch("oa-ungated", faults="after_tool_response"), "after_tool_response")
    assert the_action("oa-ungated").status == "sent" and len(sdk.box.tasks()) == 1
    assert len(sdk.model_inputs()) == 1

    assert sdk.finish(sdk.launch("oa-ungated")) == 0, sdk.log.read_text()

    assert_done_once(sdk, "oa-ungated")
    assert len(sdk.model_inputs()) == 2  # the first answer replayed, the second asked once
