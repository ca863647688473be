"""`transfer.grant`: a revoked grant's frames in flight. A frame admitted under a grant counts
until `done`; `revoke` returns only once none is left, cutting (shutting down the connection of)
those still moving bytes, and every later frame under the grant is refused."""

from __future__ import annotations

import socket
import threading

from transfer.grant import READ, REVOKED, WRITE, Frame, Grants


def test_revoke_cuts_a_frame_still_moving_and_returns_after_it_stopped():
    grants = Grants(b"k" * 32, "engine")
    grant = grants.sign(WRITE, 1, 0, 4096, 60)
    ours, peer = socket.socketpair()
    frame = Frame(ours)
    assert grants.admit(grant, WRITE, 1, 0, 4096, frame) is None
    stopped: list[bytes] = []

    def receive() -> None:  # the data server's thread, blocked in the frame's payload
        try:
            stopped.append(ours.recv(4096))  # b"": the cut woke it
        finally:
            grants.done(frame)

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        grants.revoke(grant)
        assert frame.cut and stopped == [b""]  # cut, and already stopped when revoke returned
        assert grants.admit(grant, WRITE, 1, 0, 4096, Frame(None)) == REVOKED
    finally:
        thread.join(5)
        ours.close()
        peer.close()


def test_a_frame_that_ended_is_not_cut_and_other_grants_are_untouched():
    grants = Grants(b"k" * 32, "engine")
    first, second = grants.sign(READ, 1, 0, 4096, 60), grants.sign(READ, 1, 0, 4096, 60)
    done, other = Frame(None), Frame(None)
    assert grants.admit(first, READ, 1, 0, 4096, done) is None
    grants.done(done)
    assert grants.admit(second, READ, 1, 0, 4096, other) is None  # the same range under another grant
    grants.revoke(first)  # nothing of `first` in flight: returns at once
    assert not done.cut and not other.cut
    assert grants.check(first, READ, 1, 0, 4096) == REVOKED and grants.check(second, READ, 1, 0, 4096) is None
    grants.done(other)


def test_an_expired_grant_revoked_still_refuses_frames():
    grants = Grants(b"k" * 32, "engine")
    grant = grants.sign(READ, 1, 0, 4096, -1)
    grants.revoke(grant)
    assert grants.admit(grant, READ, 1, 0, 4096, Frame(None)) == "grant expired"
