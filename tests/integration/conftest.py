"""Integration tests: real servers on loopback only."""
