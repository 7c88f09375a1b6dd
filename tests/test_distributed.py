"""Store ports for multi-process runs: free, distinct, and out of the kernel's ephemeral range."""

import socket

from megatron_longstraw.distributed import _ephemeral_port_range, free_ports


def test_free_ports_are_distinct_bindable_and_never_ephemeral():
    """A port from the ephemeral range can be taken by any socket a run opens (gloo's pairs) between
    being chosen and its store listening on it; CI failed that way (EADDRINUSE)."""
    low, high = _ephemeral_port_range()
    ports = free_ports(12)
    assert len(set(ports)) == 12
    assert not any(low <= port <= high for port in ports), (ports, low, high)
    socks = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
    finally:
        for sock in socks:
            sock.close()


def test_a_port_in_use_is_not_chosen(monkeypatch):
    """Of 16 candidate ports, two held here: the 12 chosen are among the other 14."""
    import megatron_longstraw.distributed as distributed

    monkeypatch.setattr(distributed, "_ephemeral_port_range", lambda: (10016, 60999))
    held = [socket.socket(), socket.socket()]
    try:
        held[0].bind(("127.0.0.1", 10003))
        held[1].bind(("127.0.0.1", 10011))
        ports = free_ports(12)
        assert set(ports) <= set(range(10000, 10016)) - {10003, 10011}, ports
    finally:
        for sock in held:
            sock.close()
