"""LangGraph adapter tests (holdpoint_client.langgraph, examples/langgraph_agent.py)."""
