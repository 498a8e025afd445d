"""The autoscaling decision: a pure function of replicas, scraped samples, policy and time.

Recommendation = max(ceil(ready x meanKV / targetKV), ceil(totalWaiting / targetQueueDepth)),
clamped to [minReplicas, maxReplicas]. Like the HPA, a scale-up goes to the lowest
recommendation of the scale-up window (at most doubling), and a scale-down only to the
highest recommendation of the scale-down window, so a sawtooth load does not flap.

Zero is special: with minReplicas 0 the service goes to zero only after every pod has
been idle (nothing running, nothing waiting) for scaleToZeroAfterSeconds without a
break, and from zero only the router raises it (holding the requests that arrive), so
the autoscaler never recommends leaving zero on its own.

Requests the router holds (no pod ready: at zero, or its first pods starting) are queue
depth that no pod reports: they count as waiting, so a burst held at zero asks for
ceil(held / targetQueueDepth) replicas at once (the doubling bound does not apply: each
held request is known demand with no pod at all), and a service with held requests is
never idle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .spec import AutoscalingSpec


@dataclass(frozen=True)
class PodSample:
    pod: str
    ready: bool
    # None when the pod is ready but its /metrics could not be read or parsed.
    kv_cache_usage: float | None = None
    num_requests_waiting: float | None = None

    @property
    def scraped(self) -> bool:
        return self.kv_cache_usage is not None and self.num_requests_waiting is not None


@dataclass(frozen=True)
class Recommendation:
    time: float  # seconds since the epoch
    replicas: int


@dataclass(frozen=True)
class Decision:
    current: int
    replicas: int
    reason: str
    recommended: int
    history: tuple[Recommendation, ...]
    kv_cache_usage: float | None = None  # mean over scraped pods
    queue_depth: int | None = None  # total waiting over scraped pods, plus held requests
    scraped_pods: int = 0
    unscraped_pods: int = 0
    # What set the recommendation, as a short label value: kv_cache, queue_depth,
    # no_metrics (no pod reported), missing_metrics (held: not every pod reported), idle
    # (to zero), scaled_to_zero (held at zero), held_requests (the router's held requests,
    # with no pod reporting) or disabled. `reason` says the same in words, with the numbers.
    signal: str = "disabled"
    # Since when every pod has been idle (seconds since the epoch); None when one is busy.
    idle_since: float | None = None
    # Requests the router(s) held for want of a ready pod, counted in queue_depth.
    held_requests: int = 0

    @property
    def scaled(self) -> bool:
        return self.replicas != self.current

    @property
    def direction(self) -> str:
        """up, down, or hold; a hold with another recommendation is stabilizing."""
        if self.replicas > self.current:
            return "up"
        if self.replicas < self.current:
            return "down"
        return "hold" if self.recommended == self.current else "stabilizing"


def _ceil(value: float) -> int:
    # 2 * 0.4 / 0.8 is 1.0000000000000002 in floating point; that must not mean 2 replicas.
    return math.ceil(round(value, 6))


def _clamp(replicas: int, policy: AutoscalingSpec, floor: int) -> int:
    """`replicas` within [floor, maxReplicas]; the floor is minReplicas or, with minReplicas
    0, what the idle window allows (see `_floor`)."""
    return max(floor, min(policy.max_replicas, replicas))


def _floor(policy: AutoscalingSpec, idle_since: float | None, now: float) -> int:
    """The fewest replicas allowed now: zero only after the idle window, without a break."""
    if policy.min_replicas > 0:
        return policy.min_replicas
    if idle_since is not None and now - idle_since >= policy.scale_to_zero_after_seconds:
        return 0
    return 1


def decide(
    current: int,
    samples: Sequence[PodSample],
    policy: AutoscalingSpec,
    history: Sequence[Recommendation],
    now: float,
    idle_since: float | None = None,
    held_requests: int = 0,
) -> Decision:
    """`idle_since` is the previous decision's: when every pod was last seen to turn idle.
    `held_requests`: the requests the router holds for want of a ready pod."""
    if not policy.enabled:
        return Decision(current, current, "autoscaling is disabled", current, tuple(history))
    by_held = _ceil(held_requests / policy.target_queue_depth)
    held = f"{held_requests} held by the router (target {policy.target_queue_depth}/replica)"
    if current == 0 and policy.min_replicas == 0 and held_requests:
        # The router raises the service to one; the held burst may need more at once.
        target = _clamp(by_held, policy, 1)
        return Decision(
            0,
            target,
            f"scale up 0 -> {target}: {held}",
            target,
            tuple(history) + (Recommendation(now, target),),
            queue_depth=held_requests,
            signal="held_requests",
            held_requests=held_requests,
        )
    if current == 0 and policy.min_replicas == 0:
        # Only the router wakes a service at zero: it holds the request that needs a pod.
        return Decision(
            0,
            0,
            "hold 0: scaled to zero until a request arrives",
            0,
            tuple(history),
            signal="scaled_to_zero",
            idle_since=idle_since,
        )

    ready = [s for s in samples if s.ready]
    scraped = [s for s in ready if s.scraped]
    unscraped = len(ready) - len(scraped)
    observed: dict[str, Any] = {
        "scraped_pods": len(scraped),
        "unscraped_pods": unscraped,
        "held_requests": held_requests,
    }

    if scraped:
        # Scraped samples carry both values (`PodSample.scraped`), which mypy cannot see.
        mean_kv = sum(s.kv_cache_usage for s in scraped) / len(scraped)  # type: ignore[misc]
        waiting = round(sum(s.num_requests_waiting for s in scraped)) + held_requests  # type: ignore[misc]
        by_kv = _ceil(len(scraped) * mean_kv / policy.target_kv_cache_utilization)
        by_queue = _ceil(waiting / policy.target_queue_depth)
        raw = max(by_kv, by_queue)
        in_queue = f" ({held_requests} of them held by the router)" if held_requests else ""
        why = (
            f"KV cache {mean_kv:.0%} on {len(scraped)} pod(s) (target "
            f"{policy.target_kv_cache_utilization:.0%}), {waiting} waiting{in_queue} (target "
            f"{policy.target_queue_depth}/replica)"
        )
        observed |= {"kv_cache_usage": mean_kv, "queue_depth": waiting}
        observed["signal"] = "queue_depth" if by_queue > by_kv else "kv_cache"
    elif held_requests:
        # Pods starting (the router woke the service): the held requests are the demand.
        raw, why = max(current, by_held), f"no metrics from any ready pod; {held}"
        observed |= {"queue_depth": held_requests, "signal": "held_requests"}
    else:
        raw, why = current, "no metrics from any ready pod"
        observed["signal"] = "no_metrics"
    # Missing data is not idleness, and a pod still starting is not spare capacity:
    # only when every replica is ready and scraped may the recommendation go down.
    if unscraped or len(scraped) < current:
        if raw < current:
            why += f"; holding at {current}: only {len(scraped)}/{current} pods report metrics"
            observed["signal"] = "missing_metrics"
        raw = max(raw, current)
    # Idle: every pod ready and reporting (none starting), with nothing running or
    # waiting (raw 0 means exactly that: any KV usage or queue rounds up to a replica).
    idle = raw == 0 and len(scraped) == len(samples) >= current
    observed["idle_since"] = (idle_since if idle_since is not None else now) if idle else None
    floor = _floor(policy, observed["idle_since"], now)
    recommended = _clamp(raw, policy, floor)

    window = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    history = tuple(h for h in history if now - h.time <= window) + (
        Recommendation(now, recommended),
    )

    def within(seconds: int) -> list[int]:
        return [h.replicas for h in history if now - h.time <= seconds]

    if recommended == 0:
        # The idle window was the stabilization: the pods are not needed.
        target = 0
        observed["signal"] = "idle"
    elif recommended > current:
        # Lowest recommendation of the up-window (just `recommended` when the window is 0).
        target = max(min(within(policy.scale_up_stabilization_seconds)), current)
        target = min(target, max(2 * current, 1, by_held))
    elif recommended < current:
        target = min(max(within(policy.scale_down_stabilization_seconds)), current)
    else:
        target = current
    target = _clamp(target, policy, floor)

    if target == 0:
        reason = (
            f"scale down {current} -> 0: idle for {policy.scale_to_zero_after_seconds} s "
            "(nothing running or waiting)"
        )
    elif target > current:
        reason = f"scale up {current} -> {target}: {why}"
    elif target < current:
        reason = f"scale down {current} -> {target}: {why}"
    elif recommended != current:
        reason = f"hold {current} (recommended {recommended}, stabilizing): {why}"
    else:
        reason = f"hold {current}: {why}"
    return Decision(current, target, reason, recommended, history, **observed)
