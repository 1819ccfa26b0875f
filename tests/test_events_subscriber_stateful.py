"""The subscriber's bookkeeping (:class:`kvpool.events.subscriber.SequenceTracker`, no sockets) against a
scripted publisher: cases by hand for each fault, then a hypothesis state machine that restarts the
publisher, drops and loses batches, races replay requests with live batches, lets the replay socket go
silent, and compares what the tracker delivers and counts missed with a brute-force model of the stream."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytest.importorskip("msgspec")

from kvpool.errors import InvalidArgumentError  # noqa: E402
from kvpool.events.subscriber import SequenceTracker  # noqa: E402


def _drain(t: SequenceTracker) -> list[tuple[int, object]]:
    out = []
    while (got := t.pop()) is not None:
        out.append(got)
    return out


# ---- the faults, one by one (hand-worked sequences) -----------------------------------------------------


def test_a_restarted_publisher_is_followed_from_0_again() -> None:
    # issue item 3: a publisher restarted on the same endpoint numbers from 0; the old next number (3)
    # used to drop every new batch as already seen.
    t = SequenceTracker(replay=False)
    for seq in range(3):
        t.live(seq, ("old", seq), now=0.0)
    assert [s for s, _ in _drain(t)] == [0, 1, 2]
    for seq in range(4):
        t.live(seq, ("new", seq), now=1.0)
    assert _drain(t) == [(seq, ("new", seq)) for seq in range(4)]
    assert (t.restarts, t.missed) == (1, 0)


def test_a_restart_hands_out_the_old_streams_waiting_batches_then_asks_for_the_new_one_from_0() -> None:
    t = SequenceTracker(replay=True, idle_s=100.0)
    t.live(0, "a0", 0.0)
    t.live(2, "a2", 0.0)  # 1 lost: a gap, asked for
    assert _drain(t) == [(0, "a0")] and t.poll(0.0) == 1 and t.generation == 0
    t.live(1, "b1", 0.1)  # the new publisher's batch 1 (its 0 lost): 1 <= 2, a restart
    assert t.generation == 1  # the request to the old publisher is abandoned: a fresh socket
    assert _drain(t) == [(2, "a2")] and (t.restarts, t.missed) == (1, 1)  # old seq 1 never came
    t.replay_frame(1, "stale", 0.1)  # a late reply to the abandoned request: ignored
    assert t.poll(0.1) == 0  # ask the new publisher from 0
    t.replay_frame(0, "b0", 0.2)
    t.replay_frame(1, "b1", 0.2)
    t.replay_end(0.2)
    assert _drain(t) == [(0, "b0"), (1, "b1")] and t.missed == 1


def test_an_unanswered_replay_request_times_out_and_delivery_goes_on() -> None:
    # issue item 4: joined late (first batch heard: 5), the replay socket never answers.
    t = SequenceTracker(replay=True, idle_s=0.2, replay_timeout_s=2.0)
    t.live(5, "p5", 0.0)
    assert t.poll(0.0) == 0 and t.pop() is None
    t.live(6, "p6", 1.0)
    assert t.poll(1.9) is None and t.pop() is None  # still waiting
    assert t.poll(2.0) is None and t.generation == 1 and t.replay_timeouts == 1
    assert _drain(t) == [(5, "p5"), (6, "p6")] and t.missed == 5  # 0..4
    assert t.poll(3.9) is None  # a silent replay socket: idle asks every replay_timeout_s, not idle_s
    t.live(8, "p8", 4.0)  # a new gap is still asked for at once
    assert t.poll(4.0) == 7


def test_batches_waiting_behind_a_gap_are_bounded() -> None:
    t = SequenceTracker(replay=True, replay_timeout_s=1e9, max_pending=4)
    t.live(3, 3, 0.0)
    assert t.poll(0.0) == 0
    for seq in range(4, 10):
        t.live(seq, seq, 0.0)
        _drain(t)
        assert t.pending <= 4
    assert t.overflows == 1 and t.missed == 3 and t.next == 10


def test_a_gap_opened_while_a_request_is_out_is_asked_for_again() -> None:
    # issue item 6: the reply to the request for 1 was made before batch 3 existed; its end marker used
    # to skip 3 as missed although the publisher keeps it.
    t = SequenceTracker(replay=True, idle_s=100.0)
    t.live(0, 0, 0.0)
    t.live(2, 2, 0.0)
    _drain(t)
    assert t.poll(0.0) == 1
    t.live(4, 4, 0.1)  # 3 lost on the way while the request is out
    t.replay_frame(1, 1, 0.2)
    t.replay_frame(2, 2, 0.2)
    t.replay_end(0.2)
    assert [s for s, _ in _drain(t)] == [1, 2] and t.missed == 0
    assert t.poll(0.2) == 3  # asked again
    t.replay_frame(3, 3, 0.3)
    t.replay_frame(4, 4, 0.3)
    t.replay_end(0.3)
    assert [s for s, _ in _drain(t)] == [3, 4] and t.missed == 0


def test_a_gap_the_publisher_does_not_have_is_missed_after_one_reply() -> None:
    t = SequenceTracker(replay=True, idle_s=100.0)
    t.live(0, 0, 0.0)
    t.live(3, 3, 0.0)  # 1, 2 dropped by the publisher (a full queue)
    _drain(t)
    assert t.poll(0.0) == 1
    t.replay_frame(3, 3, 0.1)
    t.replay_end(0.1)
    assert _drain(t) == [(3, 3)] and t.missed == 2 and t.poll(0.1) is None


def test_bad_bounds_are_refused() -> None:
    for kwargs in ({"idle_s": 0}, {"replay_timeout_s": -1.0}, {"max_pending": 0}, {"idle_s": "1"}):
        with pytest.raises(InvalidArgumentError):
            SequenceTracker(replay=True, **kwargs)


# ---- the state machine ----------------------------------------------------------------------------------

BUFFER = 5  # batches the scripted publisher keeps for replay
MAX_PENDING = 6
IDLE_S, TIMEOUT_S = 1.0, 5.0


class SubscriberAgainstScriptedPublisher(RuleBasedStateMachine):
    """The model: a publisher numbering batches from 0 in each epoch (a restart starts a new one), keeping
    its last BUFFER; each batch is dropped (never sent, never kept), lost on the way (kept, not heard live)
    or sent live. Live messages, replay requests and replies travel in three FIFO channels the rules drain
    in any interleaving; a replay socket replaced by the tracker (a new generation) loses its replies.

    What must hold: every delivered batch is the one published under that number in that epoch, in order,
    once; ``missed`` counts exactly the numbers skipped between delivered batches (once settled); a number
    skipped in an epoch with no timeout and no overflow is one the publisher did not have (dropped or let
    go of its buffer); and once settled, every batch the publisher still keeps has been delivered."""

    def __init__(self) -> None:
        super().__init__()
        self.t = SequenceTracker(replay=True, idle_s=IDLE_S, replay_timeout_s=TIMEOUT_S,
                                 max_pending=MAX_PENDING)
        self.now, self.epoch, self.seq, self.gen, self.dead = 0.0, 0, 0, 0, False
        self.kept: dict[int, tuple[int, int]] = {}
        self.gone: dict[int, set[int]] = {0: set()}  # per epoch: dropped or let go of the buffer
        self.live_q: deque[tuple[int, tuple[int, int]]] = deque()
        self.requests: deque[tuple[int, int]] = deque()  # (generation, start)
        self.replies: deque[tuple[int, int | None, object]] = deque()  # (generation, seq | None=end, payload)
        self.delivered: list[tuple[int, tuple[int, int]]] = []
        self.forced_at = self.recognised = 0  # timeouts + overflows when the tracker saw the last restart

    # ---- the publisher
    def _publish(self, fate: str) -> None:
        seq, payload = self.seq, (self.epoch, self.seq)
        self.seq += 1
        if fate == "dropped":
            self.gone[self.epoch].add(seq)
            return
        self.kept[seq] = payload
        if len(self.kept) > BUFFER:
            oldest = min(self.kept)
            del self.kept[oldest]
            self.gone[self.epoch].add(oldest)
        if fate == "live":
            self.live_q.append((seq, payload))

    @rule(fate=st.sampled_from(["live", "live", "live", "lost", "dropped"]))
    def publish(self, fate: str) -> None:
        self._publish(fate)

    @precondition(lambda self: self.t.waiting)
    @rule(serve_first=st.booleans())
    def open_a_gap_while_a_request_is_out(self, serve_first: bool) -> None:
        """The race of a reply with live batches: (the publisher answers the request, then) one batch is
        lost on the way and the next one heard live, before the subscriber reads the reply."""
        if serve_first and self.requests and not self.dead and self.t.restarts == self.epoch:
            self.serve_request()
        self._publish("lost")
        self._publish("live")
        while self.live_q:
            self.hear_live()

    @precondition(lambda self: self.t.last_live is not None or self.live_q)
    @rule()
    def restart(self) -> None:
        """The publisher starts again from 0 (its first batch reaches the subscriber live: that is how a
        restart is recognised); requests it had not answered die with it."""
        self.epoch, self.seq = self.epoch + 1, 0
        self.kept, self.gone[self.epoch] = {}, set()
        self.requests.clear()
        self._publish("live")

    @rule()
    def toggle_replay_socket(self) -> None:
        self.dead = not self.dead

    @precondition(lambda self: self.requests and not self.dead and self.t.restarts == self.epoch)
    @rule()
    def serve_request(self) -> None:
        gen, start = self.requests.popleft()
        if gen != self.gen:
            return  # its socket is gone: the ROUTER drops the reply
        self.replies.extend((gen, s, self.kept[s]) for s in sorted(self.kept) if s >= start)
        self.replies.append((gen, None, None))

    # ---- the subscriber's sockets
    @precondition(lambda self: self.live_q)
    @rule()
    def hear_live(self) -> None:
        self.t.live(*self.live_q.popleft(), self.now)
        self._after()

    @precondition(lambda self: self.replies)
    @rule()
    def hear_reply(self) -> None:
        gen, seq, payload = self.replies.popleft()
        if gen == self.gen:
            self.t.replay_end(self.now) if seq is None else self.t.replay_frame(seq, payload, self.now)
        self._after()

    @rule(dt=st.sampled_from([0.1, 0.1, 0.5, IDLE_S, TIMEOUT_S + 1]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._after()

    def _after(self) -> None:
        """What KVEventSubscriber.recv does around each message: hand out what is ready, ask if told to."""
        if self.t.restarts != self.recognised:
            self.recognised, self.forced_at = self.t.restarts, self.t.replay_timeouts + self.t.overflows
        self._take()
        start = self.t.poll(self.now)
        if self.t.generation != self.gen:  # a fresh replay socket: replies to the old one are lost
            self.gen = self.t.generation
            self.replies.clear()
        if start is not None:
            self.requests.append((self.gen, start))
        self._take()

    def _take(self) -> None:
        while (got := self.t.pop()) is not None:
            self.delivered.append(got)

    # ---- the comparison with the model
    def _by_epoch(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for seq, (epoch, _) in self.delivered:
            out.setdefault(epoch, []).append(seq)
        return out

    def _holes(self) -> dict[int, set[int]]:
        return {e: set(range(max(seqs) + 1)) - set(seqs) for e, seqs in self._by_epoch().items()}

    @invariant()
    def delivered_in_order_once_and_true(self) -> None:
        assert all(seq == payload[1] for seq, payload in self.delivered)
        epochs = [payload[0] for _, payload in self.delivered]
        assert epochs == sorted(epochs)
        for seqs in self._by_epoch().values():
            assert seqs == sorted(set(seqs))

    @invariant()
    def bounded_and_counted(self) -> None:
        assert self.t.pending <= MAX_PENDING
        assert self.t.missed >= sum(len(h) for h in self._holes().values())

    @invariant()
    def missed_only_what_the_publisher_did_not_have(self) -> None:
        unforced = self.t.replay_timeouts + self.t.overflows == self.forced_at
        if unforced and self.t.restarts == self.epoch:
            assert self._holes().get(self.epoch, set()) <= self.gone[self.epoch]

    def teardown(self) -> None:
        """Settle: the replay socket answers, every channel drains, idle asks fetch the tail."""
        self.dead = False
        for _ in range(4 * (BUFFER + MAX_PENDING)):
            while self.live_q:
                self.hear_live()
            while self.requests and self.t.restarts == self.epoch:
                self.serve_request()
            while self.replies:
                self.hear_reply()
            if not (self.live_q or self.requests or self.replies or self.t.waiting):
                self.tick(IDLE_S if self.t.replay_timeouts == 0 else TIMEOUT_S)  # an idle ask
                if not self.requests:
                    break
        if self.t.restarts != self.epoch:  # the new publisher's first batch never heard: nothing to check
            return
        self.delivered_in_order_once_and_true()
        assert self.t.missed == sum(len(h) for h in self._holes().values())
        if self.t.replay_timeouts + self.t.overflows == self.forced_at:
            assert set(self.kept) <= set(self._by_epoch().get(self.epoch, []))


SubscriberAgainstScriptedPublisher.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_subscriber_against_a_scripted_publisher = SubscriberAgainstScriptedPublisher.TestCase
