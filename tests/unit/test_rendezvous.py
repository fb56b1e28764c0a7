"""The trainer group's rendezvous port: picked where no other process of the run takes ports meanwhile."""

from __future__ import annotations

import socket

from tidal.cluster.groups import RENDEZVOUS_PORTS, _ephemeral_range, _free_port


def test_the_port_is_free_and_outside_the_ranges_others_take_ports_from():
    low, high = _ephemeral_range()
    for _ in range(20):
        port = _free_port()
        assert port in RENDEZVOUS_PORTS and not low <= port <= high
        assert not 10002 <= port <= 19999  # Ray's worker ports
        with socket.socket() as s:
            s.bind(("", port))  # still free: it can be listened on


def test_ports_held_by_others_are_skipped(tmp_path):
    # Only two candidates (an ephemeral range covering the rest): the one held is never returned.
    first = RENDEZVOUS_PORTS.start
    with socket.socket() as held:
        try:
            held.bind(("", first))
            with socket.socket() as probe:
                probe.bind(("", first + 1))
        except OSError:
            return  # one of the two taken on this machine already: nothing to tell them apart with
        for _ in range(10):
            assert _free_port(ephemeral=(first + 2, RENDEZVOUS_PORTS.stop)) == first + 1
        # No candidate at all: the kernel picks one.
        assert _free_port(ephemeral=(0, 65535)) > 0


def test_the_kernel_range_is_read_from_its_file(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert _ephemeral_range(str(f)) == (40000, 50000)
    assert _ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
