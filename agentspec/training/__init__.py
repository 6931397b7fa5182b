"""``agentspec train``: distil a tool-call drafter for a target (not built yet)."""
