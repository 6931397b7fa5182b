"""Unit tests run with the network disabled: any attempt to open an internet socket fails the test."""

from __future__ import annotations

import socket

import pytest


class NetworkUsedError(RuntimeError):
    pass


def _blocked(*args, **kwargs):
    raise NetworkUsedError("unit tests must not use the network (use tests/integration for loopback servers)")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _blocked)
    monkeypatch.setattr(socket.socket, "connect_ex", _blocked)
    monkeypatch.setattr(socket, "getaddrinfo", _blocked)
    monkeypatch.setattr(socket, "create_connection", _blocked)
