"""The routing policy, a pure function: (a prompt's block hashes, the pods' states, which
pod last served each block, which pod holds the stored response the request names) -> a
pod and the reason it was chosen.

A request that names a stored response (/v1/responses' `previous_response_id`, or GET or
DELETE of one) goes to the pod that answered it, whatever its load or errors: the store
is per pod, and any other pod answers 404 ("response"). Otherwise, in order of
preference, among pods with fresh metrics whose queue is not over the limit and that are
under the load bound:
  0. "cached": with precise routing, the pod whose KV cache holds the most leading
     blocks of the prompt (its events say so), the least loaded of those that tie;
  1. "prefix": the pod that most recently served the longest matching prefix;
  2. "hash" / "bounded": the prompt's first block's home by rendezvous (highest random
     weight) hashing, or, when the home is at its bound, the next pod in that order;
  3. "load": no full block to hash, so the least loaded pod.
A request for a LoRA adapter (its `model`) is placed among the pods that hold it, by the
same steps: those that hold it on the device (in use, `vllm:lora_requests_info`, or idle
in a slot, `pagefleet:lora_adapter_resident`), else those that hold it in host memory (a
copy to the device, no read from storage); its reason is "adapter" unless a prefix match
chose. Other pods take it only when every holder is at its bound (it then loads the
adapter there). The model name leads the prompt text the prefix is hashed from, so prefix
affinity is per (adapter, prefix).
The load bound is consistent hashing with bounded loads (Mirrokni et al.): a pod takes a
new request only while its in-flight count stays within ceil(load_factor * mean), so one
hot prefix spills over to the next pods in its hash order instead of piling onto one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

REASONS = ("response", "cached", "prefix", "adapter", "hash", "bounded", "load", "all_busy")


@dataclass(frozen=True)
class PodState:
    """What the router knows about one ready pod. Metrics come from the pod's /metrics;
    `metrics_age_s` is None until the first successful scrape."""

    url: str
    num_requests_waiting: float = 0.0
    num_requests_running: float = 0.0
    kv_cache_usage: float = 0.0
    metrics_age_s: float | None = None
    in_flight: int = 0  # this router's requests to the pod right now
    # It answered a recent request with a server error: its prefixes go elsewhere.
    failing: bool = False
    # The LoRA adapters of its running and waiting requests (vllm:lora_requests_info) and
    # those idle in its device slots; those in its host memory only (--max-cpu-loras).
    adapters: frozenset[str] = frozenset()
    cpu_adapters: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PolicyConfig:
    max_queue_depth: float = 8.0
    load_factor: float = 1.25
    max_metrics_age_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_queue_depth < 0:
            raise ValueError(f"max_queue_depth must be >= 0, got {self.max_queue_depth}")
        if self.load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        if self.max_metrics_age_s <= 0:
            raise ValueError(f"max_metrics_age_s must be > 0, got {self.max_metrics_age_s}")


@dataclass(frozen=True)
class Decision:
    url: str
    reason: str


def choose_pod(
    hashes: Sequence[bytes],
    pods: Sequence[PodState],
    last_served: Callable[[bytes], str | None],
    config: PolicyConfig,
    model: str | None = None,
    response_holder: str | None = None,
    cached: Mapping[str, int] | None = None,
) -> Decision | None:
    """The pod for a request whose prompt has these leading block hashes; None if no pod.
    `last_served(block_hash)` names the pod that most recently served that block; `model`
    is the request's model (a LoRA adapter's name selects that adapter);
    `response_holder` the pod that answered the stored response the request names;
    `cached` each pod's leading blocks of the prompt in its KV cache, from its events
    (precise routing), None without them."""
    if not pods:
        return None
    if response_holder is not None and any(p.url == response_holder for p in pods):
        return Decision(response_holder, "response")
    # A pod that answers with errors while its /metrics looks fine would keep every prompt
    # whose prefix it served; it takes traffic again only when every pod is failing.
    pods = [p for p in pods if not p.failing] or list(pods)
    fresh = [p for p in pods if is_fresh(p, config)]
    # With no fresh metrics anywhere (scrapes failing), route on this router's own
    # in-flight counts rather than refuse: the pods' own limits still apply.
    use_metrics = bool(fresh)
    pool = fresh or list(pods)
    open_pods = [
        p for p in pool if not use_metrics or p.num_requests_waiting <= config.max_queue_depth
    ]
    if not open_pods:
        return Decision(least_loaded(pool, use_metrics).url, "all_busy")
    bound = load_bound(open_pods, config.load_factor)
    within = {p.url: p for p in open_pods if p.in_flight + 1 <= bound}
    # The pods that hold the adapter on the device, else those that hold it in host memory.
    holders: dict[str, PodState] = {}
    if model is not None:
        holders = {url: p for url, p in within.items() if model in p.adapters} or {
            url: p for url, p in within.items() if model in p.cpu_adapters
        }
    if holders:
        within, open_pods = holders, list(holders.values())
    depth = {url: cached.get(url, 0) for url in within} if cached else {}
    deepest = max(depth.values(), default=0)
    if deepest:
        pod = least_loaded([within[url] for url, n in depth.items() if n == deepest], use_metrics)
        return Decision(pod.url, "cached")
    for block_hash in reversed(hashes):
        url = last_served(block_hash)
        if url in within:
            return Decision(url, "prefix")
    if hashes:
        order = rendezvous_order(hashes[0], [p.url for p in open_pods])
        url = next(u for u in order if u in within)
        reason = "adapter" if holders else "hash" if url == order[0] else "bounded"
        return Decision(url, reason)
    pod = least_loaded(list(within.values()), use_metrics)
    return Decision(pod.url, "adapter" if holders else "load")


def is_fresh(pod: PodState, config: PolicyConfig) -> bool:
    return pod.metrics_age_s is not None and pod.metrics_age_s <= config.max_metrics_age_s


def load_bound(pods: Sequence[PodState], load_factor: float) -> int:
    """Most in-flight requests a pod may hold, counting the one being placed. Always >= 1
    more than the least loaded pod's count, so some pod is always within it."""
    total = sum(p.in_flight for p in pods) + 1
    return math.ceil(load_factor * total / len(pods))


def least_loaded(pods: Sequence[PodState], use_metrics: bool) -> PodState:
    """Lowest queue depth, then KV usage, then this router's in-flight count; the url
    breaks ties so the choice is deterministic."""
    if use_metrics:
        return min(
            pods, key=lambda p: (p.num_requests_waiting, p.kv_cache_usage, p.in_flight, p.url)
        )
    return min(pods, key=lambda p: (p.in_flight, p.url))


def rendezvous_order(key: bytes, urls: Sequence[str]) -> list[str]:
    """Pods by descending hash(key, pod): each key's order is stable, and a pod appearing
    or vanishing moves only the keys whose first choice it is."""
    return sorted(urls, key=lambda url: hashlib.sha256(key + url.encode()).digest(), reverse=True)
