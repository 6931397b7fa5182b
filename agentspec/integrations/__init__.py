"""Integrations with other serving engines (vLLM)."""
