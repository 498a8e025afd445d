"""The scheduler's fairness between clients (no model): who is admitted first, and who
gives up seats when one client fills the batch."""

from pagefleet_serve.engine.sequence import SequenceStatus
from test_engine_scheduler import make_scheduler, make_seq, run_step, steps_while


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
