"""The ``agentspec-verifier`` server (sessions, batched verification, OpenAI-compatible endpoint)."""
