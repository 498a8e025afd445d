"""The autoscaling decision, as tables: (replicas, samples over time, policy) -> replicas."""

from __future__ import annotations

import pytest
from pagefleet_operator.autoscale import Decision, PodSample, Recommendation, decide
from pagefleet_operator.scaler import get_autoscaler_status, read_history, read_idle_since
from pagefleet_operator.spec import AutoscalingSpec

POLICY = AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=8)


def pods(*loads, starting: int = 0, unscraped: int = 0) -> list[PodSample]:
    """One ready pod per (kv, waiting) pair, plus starting and unscrapable ones."""
    samples = [PodSample(f"p{i}", True, kv, waiting) for i, (kv, waiting) in enumerate(loads)]
    samples += [PodSample(f"s{i}", False) for i in range(starting)]
    samples += [PodSample(f"u{i}", True) for i in range(unscraped)]
    return samples


def run(current, rounds, policy=POLICY, interval=15.0):
    """Feed rounds of samples `interval` seconds apart, scaling as decided; return replicas."""
    history: tuple = ()
    trace = []
    for i, samples in enumerate(rounds):
        samples = samples(current) if callable(samples) else samples
        decision = decide(current, samples, policy, history, now=1000.0 + i * interval)
        history, current = decision.history, decision.replicas
        trace.append(current)
    return trace


@pytest.mark.parametrize(
    ("current", "samples", "expected", "reason_start"),
    [
        # Steady: 2 pods at 60% KV with a short queue stay at 2.
        (2, pods((0.6, 1), (0.6, 1)), 2, "hold 2"),
        # KV pressure: ceil(2 x 0.95 / 0.8) = 3.
        (2, pods((0.95, 0), (0.95, 0)), 3, "scale up 2 -> 3"),
        # Queue pressure: ceil(20 / 4) = 5, but at most doubling: 4.
        (2, pods((0.3, 10), (0.3, 10)), 4, "scale up 2 -> 4"),
        # Bounded by maxReplicas.
        (6, pods(*[(1.0, 50)] * 6), 8, "scale up 6 -> 8"),
        # Idle with an empty window: down to the recommendation, bounded by minReplicas.
        (3, pods((0.0, 0), (0.0, 0), (0.0, 0)), 1, "scale down 3 -> 1"),
        # Exactly at target is not over it (1.0000000000000002 must not round up).
        (2, pods((0.4, 0), (0.4, 0)), 1, "scale down 2 -> 1"),
        # No metrics at all: hold.
        (2, pods(unscraped=2), 2, "hold 2"),
        # Below minReplicas (e.g. set by hand): raised to the minimum.
        (0, [], 1, "scale up 0 -> 1"),
        # From 0, busy pods still draining: doubling from nothing is one replica.
        (0, pods((1.0, 20), (1.0, 20)), 1, "scale up 0 -> 1"),
    ],
)
def test_single_decision(current, samples, expected, reason_start):
    decision = decide(current, samples, POLICY, (), now=0.0)
    assert decision.replicas == expected
    assert decision.reason.startswith(reason_start), decision.reason


def test_disabled_autoscaling_never_changes_replicas():
    policy = AutoscalingSpec(enabled=False)
    history = (Recommendation(0.0, 5),)
    decision = decide(3, pods((1.0, 100)), policy, history, now=0.0)
    assert decision == Decision(3, 3, "autoscaling is disabled", 3, history)


def test_spike_scales_up_at_once_then_down_only_after_the_window():
    spike = [pods((0.95, 12), (0.95, 12))] * 2
    idle = [lambda n: pods(*[(0.1, 0)] * n)] * 30  # 30 rounds x 15 s = 450 s > 300 s window
    trace = run(2, spike + idle)
    # Doubling, then the queue's 6 (24 waiting / 4). The last spike round (t=15 s) stays in
    # the 300 s down-window through t=315 s: the first round after it (t=330 s, round 22)
    # goes down to the idle recommendation.
    assert trace == [4, 6] + [6] * 20 + [1] * 10


def run_through_status(current, rounds, policy=POLICY, interval=15.0):
    """Like `run`, but each round reads its history back from the status the previous round
    wrote, as the operator does (the status is its only memory between rounds)."""
    status: dict = {}
    trace = []
    for i, samples in enumerate(rounds):
        now = 1_700_000_000.0 + i * interval
        decision = decide(
            current, samples(current), policy, read_history(status), now, read_idle_since(status)
        )
        status = {"autoscaler": get_autoscaler_status(decision, now)}
        current = decision.replicas
        trace.append(current)
    return trace, status


def test_status_carries_the_window_between_rounds():
    spike = [lambda n: pods((0.95, 12), (0.95, 12))] * 2
    idle = [lambda n: pods(*[(0.1, 0)] * n)] * 30
    trace, status = run_through_status(2, spike + idle)
    assert trace == [4, 6] + [6] * 20 + [1] * 10
    # The status keeps the last 300 s of recommendations, compacted to the latest entry per
    # replica count (the 21 rounds inside the window all recommended 1).
    kept = status["autoscaler"]["recentRecommendations"]
    assert kept == [{"time": "2023-11-14T22:21:05Z", "replicas": 1}]


def test_history_entries_that_do_not_parse_are_dropped():
    status = {
        "autoscaler": {
            "recentRecommendations": [
                {"time": "2023-11-14T22:13:20Z", "replicas": 3},
                {"time": "yesterday", "replicas": 4},
                {"time": "2023-11-14T22:13:35Z"},
                {"time": "2023-11-14T22:13:50Z", "replicas": "many"},
                {"time": None, "replicas": 2},
                {"time": "2023-11-14T22:14:05Z", "replicas": "5"},
            ]
        }
    }
    assert read_history(status) == [
        Recommendation(1_700_000_000.0, 3),
        Recommendation(1_700_000_045.0, 5),
    ]
    assert read_history({}) == [] and read_history({"autoscaler": None}) == []


def test_sawtooth_load_does_not_flap():
    # A fixed amount of work spread over however many pods run: peaks need 3 replicas.
    busy = lambda n: pods(*[(1.8 / n, 12 / n)] * n)  # noqa: E731
    quiet = lambda n: pods(*[(0.2 / n, 0)] * n)  # noqa: E731
    trace = run(2, [busy, quiet] * 15)
    # Up to meet the peak once, then steady: the window always holds a busy round.
    assert trace == [3] * 30


def test_scale_up_stabilization_takes_the_lowest_recent_recommendation():
    policy = AutoscalingSpec(enabled=True, max_replicas=8, scale_up_stabilization_seconds=60)
    steady, busy = pods((0.5, 0), (0.5, 0)), pods((0.95, 0), (0.95, 0))
    trace = run(2, [steady] + [busy] * 5, policy)
    # The steady round (recommending 2) stays in the 60 s up-window until t=75 s.
    assert trace == [2, 2, 2, 2, 2, 3]


def test_scrape_failures_do_not_count_as_idle():
    # One pod idle, one unreachable: no scale-down on missing data.
    decision = decide(2, pods((0.0, 0), unscraped=1), POLICY, (), now=0.0)
    assert (decision.current, decision.replicas, decision.recommended) == (2, 2, 2)
    assert decision.reason == (
        "hold 2: KV cache 0% on 1 pod(s) (target 80%), 0 waiting (target 4/replica); "
        "holding at 2: only 1/2 pods report metrics"
    )
    # Exactly at the current count, nothing is being held back: no "holding" note.
    decision = decide(2, pods((1.0, 0), unscraped=1), POLICY, (), now=0.0)
    assert decision.reason == (
        "hold 2: KV cache 100% on 1 pod(s) (target 80%), 0 waiting (target 4/replica)"
    )
    decision = decide(2, pods(unscraped=2), POLICY, (), now=0.0)
    assert decision.reason == "hold 2: no metrics from any ready pod"
    # ...but what was scraped can still drive a scale-up.
    decision = decide(2, pods((1.0, 20), unscraped=1), POLICY, (), now=0.0)
    assert decision.replicas == 4


def test_starting_pods_are_not_capacity():
    # Scaled to 4, two still starting: the two ready ones' load is what counts,
    # and the recommendation cannot drop below the replicas already ordered.
    decision = decide(4, pods((0.9, 0), (0.9, 0), starting=2), POLICY, (), now=0.0)
    assert decision.replicas == 4
    assert decision.scraped_pods == 2


def test_history_is_trimmed_to_the_longest_window():
    old = (Recommendation(0.0, 5), Recommendation(950.0, 3))
    decision = decide(2, pods((0.5, 0), (0.5, 0)), POLICY, old, now=1000.0)
    assert [h.time for h in decision.history] == [950.0, 1000.0]
    # The 3 from 50 s ago is still in the scale-down window: no change from 2 upward
    # is recommended now, so it holds.
    assert (decision.current, decision.replicas, decision.recommended) == (2, 2, 2)
    # A lower recommendation held back by the window says so.
    decision = decide(3, pods((0.1, 0), (0.1, 0), (0.1, 0)), POLICY, old, now=1000.0)
    assert (decision.replicas, decision.recommended) == (3, 1)
    assert decision.reason.startswith("hold 3 (recommended 1, stabilizing): KV cache 10%")


def test_observation_is_reported():
    decision = decide(2, pods((0.5, 3), (0.7, 2)), POLICY, (), now=0.0)
    assert decision.kv_cache_usage == pytest.approx(0.6)
    assert decision.queue_depth == 5
    assert (decision.scraped_pods, decision.unscraped_pods) == (2, 0)


TO_ZERO = AutoscalingSpec(
    enabled=True, min_replicas=0, max_replicas=4, scale_to_zero_after_seconds=60
)
IDLE = lambda n: pods(*[(0.0, 0)] * n)  # noqa: E731
BUSY = lambda n: pods(*[(0.05, 0)] * n)  # noqa: E731 (one running request: some KV used)


def test_scale_to_zero_after_an_unbroken_idle_window_read_back_from_status():
    # Idle from t=0: t=60 s is the first round with 60 s of idleness behind it.
    trace, status = run_through_status(2, [IDLE] * 6, policy=TO_ZERO)
    assert trace == [1, 1, 1, 1, 0, 0]
    # At zero the autoscaler holds (only the router wakes it), idleSince kept.
    assert status["autoscaler"]["idleSince"] == "2023-11-14T22:13:20Z"


def test_one_busy_round_restarts_the_idle_window():
    trace, _ = run_through_status(1, [IDLE] * 3 + [BUSY] + [IDLE] * 6, policy=TO_ZERO)
    # Busy at t=45 s: idle again from t=60 s, so zero at t=120 s (round 8), not t=60 s.
    assert trace == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    decision = decide(1, BUSY(1), TO_ZERO, (), now=0.0, idle_since=-1000.0)
    assert decision.idle_since is None
    assert get_autoscaler_status(decision, 0.0)["idleSince"] is None  # removed by the patch


def test_missing_metrics_or_a_starting_pod_is_not_idleness():
    for samples in (pods((0.0, 0), unscraped=1), pods((0.0, 0), starting=1), []):
        decision = decide(1, samples, TO_ZERO, (), now=100.0, idle_since=0.0)
        assert (decision.replicas, decision.idle_since) == (1, None), samples


def test_at_zero_the_autoscaler_waits_for_the_router_and_min_one_still_wakes():
    at_zero = decide(0, [], TO_ZERO, (), now=0.0)
    assert (at_zero.replicas, at_zero.signal) == (0, "scaled_to_zero")
    # With minReplicas 1, zero (someone's `kubectl scale --replicas 0`) is raised again.
    assert decide(0, [], POLICY, (), now=0.0).replicas == 1


def test_idle_pods_with_min_one_never_go_to_zero():
    trace, _ = run_through_status(1, [IDLE] * 30, policy=POLICY)
    assert trace == [1] * 30


def test_a_burst_held_at_zero_asks_for_its_replicas_at_once():
    # 13 requests held by the router, 4 per replica: ceil(13 / 4) = 4 now, not 1.
    decision = decide(0, [], TO_ZERO, (), now=0.0, held_requests=13)
    assert (decision.replicas, decision.signal, decision.queue_depth) == (4, "held_requests", 13)
    assert decision.reason == "scale up 0 -> 4: 13 held by the router (target 4/replica)"
    assert decision.history == (Recommendation(0.0, 4),)
    # One held request is one replica; a flood is bounded by maxReplicas.
    assert decide(0, [], TO_ZERO, (), now=0.0, held_requests=1).replicas == 1
    assert decide(0, [], TO_ZERO, (), now=0.0, held_requests=500).replicas == 4


def test_held_requests_while_the_first_pod_starts_are_the_demand():
    # The router raised the service to 1; that pod is starting and 13 requests wait in
    # the router: 4 replicas, past the doubling bound (held requests have no pod at all).
    decision = decide(1, pods(starting=1), POLICY, (), now=0.0, held_requests=13)
    assert (decision.replicas, decision.signal) == (4, "held_requests")
    assert decision.reason == (
        "scale up 1 -> 4: no metrics from any ready pod; 13 held by the router (target 4/replica)"
    )
    # The same pod starting with nothing held: hold at 1, as before.
    decision = decide(1, pods(starting=1), POLICY, (), now=0.0)
    assert (decision.replicas, decision.signal) == (1, "no_metrics")


def test_held_requests_add_to_the_pods_queue_and_are_never_idle():
    # 2 pods with 2 waiting each, 12 held: 16 waiting -> ceil(16 / 4) = 4.
    decision = decide(2, pods((0.3, 2), (0.3, 2)), POLICY, (), now=0.0, held_requests=12)
    assert (decision.replicas, decision.queue_depth) == (4, 16)
    assert "16 waiting (12 of them held by the router)" in decision.reason
    # An idle pod while requests are held is not idleness: no scale to zero.
    decision = decide(1, IDLE(1), TO_ZERO, (), now=100.0, idle_since=0.0, held_requests=2)
    assert (decision.replicas, decision.idle_since) == (1, None)
    status = get_autoscaler_status(decision, 100.0)
    assert (status["heldRequests"], status["queueDepth"]) == (2, 2)
    # With nothing held, the field is removed by the merge patch.
    assert (
        get_autoscaler_status(decide(1, IDLE(1), TO_ZERO, (), now=0.0), 0.0)["heldRequests"] is None
    )


def _why(kv: str, pods_: int, waiting: int) -> str:
    return f"KV cache {kv} on {pods_} pod(s) (target 80%), {waiting} waiting (target 4/replica)"


# Every field of the decision, one row per path through `decide`: the recommendation, the
# signal that set it, the reason in words, the observation and the history it carries.
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(
            # ceil(2 x 0.95 / 0.8) = 3 over ceil(0 / 4) = 0.
            (2, pods((0.95, 0), (0.95, 0)), POLICY, (), 10.0),
            Decision(
                2,
                3,
                f"scale up 2 -> 3: {_why('95%', 2, 0)}",
                3,
                (Recommendation(10.0, 3),),
                kv_cache_usage=0.95,
                queue_depth=0,
                scraped_pods=2,
                signal="kv_cache",
            ),
            id="kv-cache-sets-the-recommendation",
        ),
        pytest.param(
            # ceil(20 / 4) = 5 over ceil(2 x 0.25 / 0.8) = 1; at most doubling: 4.
            (2, pods((0.25, 10), (0.25, 10)), POLICY, (), 0.0),
            Decision(
                2,
                4,
                f"scale up 2 -> 4: {_why('25%', 2, 20)}",
                5,
                (Recommendation(0.0, 5),),
                kv_cache_usage=0.25,
                queue_depth=20,
                scraped_pods=2,
                signal="queue_depth",
            ),
            id="queue-sets-the-recommendation-doubling-bounds-the-step",
        ),
        pytest.param(
            # ceil(2 x 0.5 / 0.8) = 2 = ceil(8 / 4): a tie is named after the KV cache.
            (2, pods((0.5, 4), (0.5, 4)), POLICY, (), 0.0),
            Decision(
                2,
                2,
                f"hold 2: {_why('50%', 2, 8)}",
                2,
                (Recommendation(0.0, 2),),
                kv_cache_usage=0.5,
                queue_depth=8,
                scraped_pods=2,
                signal="kv_cache",
            ),
            id="tie-is-kv-cache",
        ),
        pytest.param(
            (2, pods((0.0, 0), unscraped=1), POLICY, (), 0.0),
            Decision(
                2,
                2,
                f"hold 2: {_why('0%', 1, 0)}; holding at 2: only 1/2 pods report metrics",
                2,
                (Recommendation(0.0, 2),),
                kv_cache_usage=0.0,
                queue_depth=0,
                scraped_pods=1,
                unscraped_pods=1,
                signal="missing_metrics",
            ),
            id="missing-metrics-hold",
        ),
        pytest.param(
            # Idle for 30 s of the 60: the floor is still one replica.
            (1, IDLE(1), TO_ZERO, (), 30.0, 0.0),
            Decision(
                1,
                1,
                f"hold 1: {_why('0%', 1, 0)}",
                1,
                (Recommendation(30.0, 1),),
                kv_cache_usage=0.0,
                queue_depth=0,
                scraped_pods=1,
                signal="kv_cache",
                idle_since=0.0,
            ),
            id="idle-within-the-window-keeps-one",
        ),
        pytest.param(
            (1, IDLE(1), TO_ZERO, (), 60.0, 0.0),
            Decision(
                1,
                0,
                "scale down 1 -> 0: idle for 60 s (nothing running or waiting)",
                0,
                (Recommendation(60.0, 0),),
                kv_cache_usage=0.0,
                queue_depth=0,
                scraped_pods=1,
                signal="idle",
                idle_since=0.0,
            ),
            id="idle-for-the-window-goes-to-zero",
        ),
        pytest.param(
            # minReplicas 1: idle far past scaleToZeroAfterSeconds is still one replica.
            (1, IDLE(1), POLICY, (), 10_000.0, 0.0),
            Decision(
                1,
                1,
                f"hold 1: {_why('0%', 1, 0)}",
                1,
                (Recommendation(10_000.0, 1),),
                kv_cache_usage=0.0,
                queue_depth=0,
                scraped_pods=1,
                signal="kv_cache",
                idle_since=0.0,
            ),
            id="min-one-never-idles-to-zero",
        ),
        pytest.param(
            (0, [], TO_ZERO, (Recommendation(5.0, 1),), 30.0, 2.0),
            Decision(
                0,
                0,
                "hold 0: scaled to zero until a request arrives",
                0,
                (Recommendation(5.0, 1),),
                signal="scaled_to_zero",
                idle_since=2.0,
            ),
            id="at-zero-waits-for-the-router",
        ),
        pytest.param(
            (0, [], TO_ZERO, (Recommendation(5.0, 1),), 30.0, 2.0, 6),
            Decision(
                0,
                2,
                "scale up 0 -> 2: 6 held by the router (target 4/replica)",
                2,
                (Recommendation(5.0, 1), Recommendation(30.0, 2)),
                queue_depth=6,
                signal="held_requests",
                held_requests=6,
            ),
            id="held-at-zero-asks-for-its-replicas",
        ),
        pytest.param(
            (1, pods(starting=1), POLICY, (), 0.0, None, 6),
            Decision(
                1,
                2,
                "scale up 1 -> 2: no metrics from any ready pod; 6 held by the router "
                "(target 4/replica)",
                2,
                (Recommendation(0.0, 2),),
                queue_depth=6,
                signal="held_requests",
                held_requests=6,
            ),
            id="held-while-the-first-pod-starts",
        ),
    ],
)
def test_every_field_of_the_decision_on_each_path(args, expected):
    assert decide(*args) == expected


def test_float_noise_below_a_millionth_of_a_replica_does_not_add_one():
    """The replica count is rounded to 6 decimals before its ceiling: a load a ten-millionth
    over one replica's target (float noise, as 2 x 0.4 / 0.8 makes) holds at 1; a load a
    hundred-thousandth over it is real and asks for a second replica."""
    target = POLICY.target_kv_cache_utilization
    noise = decide(1, pods((target * 1.0000001, 0)), POLICY, (), now=1000.0)
    assert (noise.recommended, noise.replicas) == (1, 1)
    real = decide(1, pods((target * 1.00001, 0)), POLICY, (), now=1000.0)
    assert (real.recommended, real.replicas) == (2, 2)
