"""``endpoints.free_tcp_port``: the one free-port helper of the package, tests, benchmarks and examples."""

from __future__ import annotations

import socket

import pytest

from tokenspeed_router.endpoints import free_tcp_port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_free_port_can_be_bound() -> None:
    port = free_tcp_port()
    assert 0 < port <= 65535
    assert _bindable(port)


def test_consecutive_ports_are_all_free() -> None:
    base = free_tcp_port(consecutive=3)
    assert all(_bindable(p) for p in range(base, base + 3))


def test_avoid_keeps_ranges_apart() -> None:
    first = free_tcp_port(consecutive=2)
    for _ in range(20):
        second = free_tcp_port(consecutive=2, avoid=(first,))
        assert abs(second - first) >= 2  # [first, first+1] and [second, second+1] do not overlap


def test_a_port_in_use_is_never_returned_as_part_of_a_range() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        for _ in range(20):
            base = free_tcp_port(consecutive=2)
            assert taken not in (base, base + 1)


def test_consecutive_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        free_tcp_port(consecutive=0)
