"""The scheduler's fairness between clients (no model): who is admitted first, and who
gives up seats when one client fills the batch."""

import pytest
from pagefleet_serve.engine.sequence import SequenceStatus

from tests.engine.test_engine_scheduler import make_scheduler, make_seq, run_step, steps_while


def from_client(client, request_id, num_tokens=4, n=1, **kwargs):
    seq = make_seq(request_id, num_tokens, **kwargs)
    seq.client = client
    seq.sibling_generators = [None] * (n - 1)
    return seq


def test_a_client_with_fewer_seats_is_admitted_before_earlier_requests_of_another():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(from_client("a", f"a{i}", first_token=10 * i))
    s.add(from_client("b", "b0", first_token=90))
    # Arrival order would run a0 and a1; b holds no seat, a holds one after a0.
    assert set(run_step(s)[0]) == {"a0", "b0"}
    assert [q.request_id for q in s.waiting] == ["a1", "a2"]


def test_one_client_is_first_come_first_served():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add(from_client("a", f"a{i}", first_token=10 * i))
    scheduled, out = run_step(s)
    assert set(scheduled) == {"a0", "a1"} and not out.preempted


def test_a_full_batch_gives_a_new_client_seats_from_the_one_holding_them_all():
    s = make_scheduler(max_num_seqs=4, num_blocks=128)
    hog = from_client("a", "hog", num_tokens=8, n=4, max_tokens=50)
    s.add(hog)
    run_step(s)  # prefilled and forked: four samples hold every seat
    assert len(s.running) == 4
    victim = from_client("b", "victim", first_token=90, max_tokens=3)
    s.add(victim)
    scheduled, out = run_step(s)
    # The newest of a's samples gives its seat (recomputed later); the victim's prompt runs.
    assert scheduled["victim"] == 4 and len(out.preempted) == 1
    (preempted,) = out.preempted
    assert preempted.client == "a" and preempted.sample_index == 3
    assert preempted.status is SequenceStatus.WAITING and preempted.num_preemptions == 1
    steps_while(s, lambda: not victim.is_finished)
    # Its seat comes back: every sample of the hog runs to its end.
    steps_while(s, s.has_unfinished)
    samples = [q for q in (hog, preempted)]
    assert all(q.is_finished and q.num_output_tokens == 50 for q in samples)
    assert s.num_preemptions == 1
    s.block_manager.check_no_leaks()


def test_a_request_wider_than_its_share_waits_for_free_seats():
    s = make_scheduler(max_num_seqs=4, num_blocks=128)
    s.add(from_client("a", "hog", num_tokens=8, n=4, max_tokens=5))
    run_step(s)
    wide = from_client("b", "wide", n=3, first_token=90)
    s.add(wide)
    # Two clients: a share is 2 seats; n=3 would take more, so nobody is preempted for it.
    scheduled, out = run_step(s)
    assert "wide" not in scheduled and not out.preempted
    steps_while(s, lambda: wide.status is SequenceStatus.WAITING)
    assert s.num_preemptions == 0


def test_better_priority_sequences_keep_their_seats():
    s = make_scheduler(max_num_seqs=2)
    s.add(from_client("a", "a0", priority=-1, max_tokens=20))
    s.add(from_client("a", "a1", priority=-1, max_tokens=20, first_token=20))
    run_step(s)
    late = from_client("b", "late", priority=0, first_token=90)
    s.add(late)
    scheduled, out = run_step(s)
    assert "late" not in scheduled and not out.preempted


def test_preempted_for_fairness_sequences_give_back_this_steps_budget():
    # a's three decodes are scheduled first (3 tokens of a 6-token budget); the one
    # preempted for b gives its token back, so b's 4-token prompt fits in this step.
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=6, num_blocks=128)
    s.add(from_client("a", "hog", num_tokens=6, n=3, max_tokens=30))
    run_step(s)
    s.add(from_client("b", "victim", first_token=90))
    scheduled, out = run_step(s)
    assert len(out.preempted) == 1 and scheduled["victim"] == 4
    assert out.num_batched_tokens == 6


def fill(s, holdings):
    """Running sequences per client: {client: seats}, each a forked request's samples."""
    for index, (client, seats) in enumerate(holdings.items()):
        s.add(from_client(client, f"{client}-hog", num_tokens=4, n=seats, first_token=40 * index))
        run_step(s)


def test_a_request_that_fits_the_batch_exactly_preempts_nobody():
    s = make_scheduler(max_num_seqs=4, num_blocks=128)
    fill(s, {"a": 3})
    s.add(from_client("b", "last", first_token=90))
    scheduled, out = run_step(s)
    assert scheduled["last"] == 4 and not out.preempted


def test_the_seats_taken_are_those_of_the_client_holding_the_most_not_the_last_named():
    # "z" sorts last but holds one seat; "a" holds the most: a's give way.
    s = make_scheduler(max_num_seqs=8, num_blocks=256)
    fill(s, {"a": 6, "z": 2})
    s.add(from_client("m", "victim", first_token=90))
    _, out = run_step(s)
    assert [q.client for q in out.preempted] == ["a"]


def test_a_request_wider_than_its_share_waits_even_when_the_top_client_could_give_enough():
    # Three clients over 9 seats: a share is 3. b's n=4 is wider: it waits, though a's 7
    # seats could make room for it.
    s = make_scheduler(max_num_seqs=9, num_blocks=256)
    fill(s, {"a": 7, "c": 2})
    s.add(from_client("b", "wide", n=4, first_token=90))
    scheduled, out = run_step(s)
    assert "wide" not in scheduled and not out.preempted


def test_several_seats_are_taken_for_a_wide_request_and_the_batch_never_overflows():
    s = make_scheduler(max_num_seqs=4, num_blocks=128)
    fill(s, {"a": 4})
    s.add(from_client("b", "pair", n=2, first_token=90))
    _, out = run_step(s)
    assert len(out.preempted) == 2
    assert sum(q.num_samples for q in s.running) == 4


def test_a_preempted_decode_gives_back_exactly_its_tokens_of_the_budget():
    # 3 decodes take 3 of 6 tokens; the one preempted gives back 1: the victim's 8-token
    # prompt gets the 4 left, chunked.
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=6, num_blocks=128)
    s.add(from_client("a", "hog", num_tokens=6, n=3, max_tokens=30))
    run_step(s)
    s.add(from_client("b", "victim", num_tokens=8, first_token=90))
    scheduled, out = run_step(s)
    assert len(out.preempted) == 1 and scheduled["victim"] == 4
    assert out.num_batched_tokens == 6


def test_seats_come_from_whichever_client_holds_the_most_at_each_pick():
    # 9 seats, a share of 3: a (5) gives one, then a and c hold 4 each: a gives one more,
    # then c, now holding the most, gives the third.
    s = make_scheduler(max_num_seqs=9, num_blocks=256)
    fill(s, {"a": 5, "c": 4})
    s.add(from_client("b", "three", n=3, first_token=90))
    _, out = run_step(s)
    assert sorted(q.client for q in out.preempted) == ["a", "a", "c"]


def test_every_preempted_decode_gives_its_token_back():
    # 4 decodes take 4 of 6 tokens; the two preempted for b's n=2 give back 2: its
    # 10-token prompt gets 4 tokens of this step.
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=6, num_blocks=128)
    s.add(from_client("a", "hog", num_tokens=4, n=4, max_tokens=30))
    run_step(s)
    s.add(from_client("b", "pair", num_tokens=10, n=2, first_token=90))
    scheduled, out = run_step(s)
    assert len(out.preempted) == 2 and scheduled["pair"] == 4
    assert out.num_batched_tokens == 6


@pytest.mark.parametrize("order", [("a1", "b1", "b2"), ("b1", "b2", "a1")])
def test_the_client_holding_fewer_seats_gets_the_free_seat_whichever_arrived_first(order):
    """One free seat, two waiting clients' requests of one priority: the client holding
    fewer seats gets it, before or after the other's requests in arrival order, and nobody
    is preempted for a wrong pick (a client's second waiting request is not a client of
    its own)."""
    s = make_scheduler(max_num_seqs=4, num_blocks=256)
    fill(s, {"a": 1, "b": 2})
    for index, request_id in enumerate(order):
        s.add(from_client(request_id[0], request_id, first_token=100 + 10 * index))
    scheduled, out = run_step(s)
    assert "a1" in scheduled and not out.preempted
    assert [q.request_id for q in s.waiting] == ["b1", "b2"]


def test_a_new_client_is_preferred_to_an_earlier_request_of_a_client_holding_one_seat():
    """The scan does not stop at a client holding one seat: a later request of a client
    holding none takes the free seat, and the first waits (the batch is then full), with
    nobody preempted."""
    s = make_scheduler(max_num_seqs=4, num_blocks=256)
    fill(s, {"a": 1, "b": 2})
    s.add(from_client("a", "a1", first_token=100))
    s.add(from_client("c", "c1", first_token=110))
    scheduled, out = run_step(s)
    assert "c1" in scheduled and not out.preempted
    assert [q.request_id for q in s.waiting] == ["a1"]


def test_a_worse_priority_behind_the_best_request_does_not_stop_its_admission():
    """The scan stops at the first request of a worse priority, and admits the best one it
    found before it, of whichever client; the worse one runs after it."""
    s = make_scheduler(max_num_seqs=8, num_blocks=256)
    fill(s, {"a": 1})
    s.add(from_client("a", "urgent", first_token=100))
    s.add(from_client("b", "later", first_token=110, priority=1))
    scheduled, _ = run_step(s)
    assert {"urgent", "later"} <= set(scheduled)


def test_a_client_is_first_to_a_new_seat_while_any_request_of_it_waits():
    """A client with two waiting requests still counts as waiting after the first is
    admitted: for the next free seat its second request, holding fewer seats, is preferred
    to an earlier request of a client holding more, and nobody is preempted to undo a
    wrong pick."""
    s = make_scheduler(max_num_seqs=5, num_blocks=256)
    fill(s, {"b": 3})
    s.add(from_client("b", "b1", first_token=100))
    s.add(from_client("a", "a1", first_token=110))
    s.add(from_client("a", "a2", first_token=120))
    scheduled, out = run_step(s)
    assert {"a1", "a2"} <= set(scheduled) and not out.preempted
    assert [q.request_id for q in s.waiting] == ["b1"]


def test_the_waiting_clients_are_counted_exactly_and_forgotten_when_none_waits():
    """The count of each client's waiting requests (which ends the admission scan once
    every waiting client was seen) follows adds and admissions exactly, and a client with
    nothing waiting leaves it, so that a server seeing many clients keeps no entry for
    those gone."""
    s = make_scheduler(max_num_seqs=2, num_blocks=256)
    for request_id in ("a1", "a2", "b1"):
        s.add(from_client(request_id[0], request_id, first_token=10 * len(s.waiting)))
    assert s._waiting_clients == {"a": 2, "b": 1}
    run_step(s)  # a1 and b1 take the two seats
    assert s._waiting_clients == {"a": 1}
    s.finish(s.sequences_of("a2")[0], "abort")
    assert s._waiting_clients == {}
