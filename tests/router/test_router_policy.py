"""The routing policy on its own: prefix affinity under bounded load, consistent hashing,
load and queue limits, tie-breaks, pods appearing and vanishing, stale metrics."""

import hashlib

import pytest
from pagefleet_router.discovery import PodMetrics, PodRegistry, parse_pod_metrics
from pagefleet_router.policy import PodState, PolicyConfig, choose_pod, rendezvous_order
from pagefleet_router.prefix import PrefixTable, block_hashes, prompt_text

CONFIG = PolicyConfig(max_queue_depth=4, load_factor=1.25, max_metrics_age_s=5)
URLS = [f"http://pod-{i}:8000" for i in range(4)]


def pod(url: str, waiting=0.0, kv=0.0, in_flight=0, age=0.5, adapters=()) -> PodState:
    return PodState(
        url=url,
        num_requests_waiting=waiting,
        kv_cache_usage=kv,
        metrics_age_s=age,
        in_flight=in_flight,
        adapters=frozenset(adapters),
    )


def hashes_of(text: str) -> list[bytes]:
    return block_hashes(text, block_chars=8, max_blocks=64)


def test_block_hashes_are_chained_over_full_blocks_only():
    a = hashes_of("system: you are terse. user: hi")
    b = hashes_of("system: you are brief. user: bye there")
    assert len(a) == 3 and len(b) == 4  # 31 and 38 characters: the tail block is not hashed
    assert a[:2] == b[:2] and a[2] != b[2]  # same first 16 characters, then they differ
    # chained: the same 8 characters after a different prefix hash differently
    assert hashes_of("xxxxxxxxABCDEFGH")[1] != hashes_of("yyyyyyyyABCDEFGH")[1]
    assert block_hashes("a" * 100, block_chars=8, max_blocks=3) == hashes_of("a" * 100)[:3]


def test_prompt_text_keys_chat_and_completions_by_model_and_content():
    chat = {"model": "m", "messages": [{"role": "system", "content": "be brief"}]}
    assert prompt_text("/v1/chat/completions", chat) == "m\nsystem\nbe brief\n"
    assert prompt_text("/v1/completions", {"model": "m", "prompt": ["hello"]}) == "m\nhello"
    assert prompt_text("/v1/completions", {"model": "m", "prompt": [1, 2]}) == "m\n[1,2]"
    assert prompt_text("/v1/completions", {"model": "n", "prompt": "x"}) != prompt_text(
        "/v1/completions", {"model": "m", "prompt": "x"}
    )


def test_longest_matching_prefix_wins_over_a_shorter_one():
    table = PrefixTable(capacity=100)
    shared = hashes_of("A" * 16)
    table.record(shared, URLS[0])  # served the 2-block prefix
    table.record(hashes_of("A" * 32), URLS[1])  # later served the 4-block prefix
    pods = [pod(u) for u in URLS]
    assert choose_pod(hashes_of("A" * 40), pods, table.get, CONFIG).url == URLS[1]
    assert choose_pod(hashes_of("A" * 40), pods, table.get, CONFIG).reason == "prefix"
    # the most recent server of a block is remembered, not the first
    table.record(shared, URLS[2])
    assert choose_pod(hashes_of("A" * 16 + "B" * 8), pods, table.get, CONFIG).url == URLS[2]


def test_a_hot_prefix_spills_to_the_next_pod_in_its_hash_order_at_the_load_bound():
    hashes = hashes_of("hot prefix shared by everyone")
    order = rendezvous_order(hashes[0], URLS)
    table = PrefixTable(capacity=100)
    in_flight = dict.fromkeys(URLS, 0)
    picks = []
    for _ in range(12):
        pods = [pod(u, in_flight=in_flight[u]) for u in URLS]
        decision = choose_pod(hashes, pods, table.get, CONFIG)
        table.record(hashes, decision.url)
        in_flight[decision.url] += 1
        picks.append(decision)
    assert picks[0].url == order[0] and picks[0].reason == "hash"
    # bound = ceil(1.25 * (total + 1) / 4) = 4 at the 12th: no pod ever holds more, and
    # the overflow fills the prefix's hash order, not random pods
    assert [in_flight[u] for u in order] == [4, 4, 4, 0]
    assert {d.reason for d in picks} <= {"hash", "prefix", "bounded"}
    assert any(d.reason == "bounded" for d in picks)
    # the first spill goes to the second pod in the prefix's hash order
    first_spill = next(d for d in picks if d.reason == "bounded")
    assert first_spill.url == order[1]


def test_without_a_full_block_the_least_loaded_pod_wins_with_url_as_tie_break():
    pods = [pod(URLS[2], waiting=1), pod(URLS[3], kv=0.2), pod(URLS[1], kv=0.1)]
    assert choose_pod([], pods, {}.get, CONFIG).url == URLS[1]  # equal queues: lower KV
    tied = [pod(URLS[3]), pod(URLS[1]), pod(URLS[2])]
    decision = choose_pod([], tied, {}.get, CONFIG)
    assert decision.url == URLS[1] and decision.reason == "load"
    # in-flight counts break a tie in the scraped metrics
    assert choose_pod([], [pod(URLS[1], in_flight=1), pod(URLS[2])], {}.get, CONFIG).url == URLS[2]


def test_a_pod_whose_queue_is_over_the_limit_is_skipped_even_with_the_prefix():
    hashes = hashes_of("prefix that lives on pod 0")
    table = {h: URLS[0] for h in hashes}
    pods = [pod(URLS[0], waiting=5), pod(URLS[1], waiting=4)]
    assert choose_pod(hashes, pods, table.get, CONFIG).url == URLS[1]
    busy = [pod(URLS[0], waiting=9), pod(URLS[1], waiting=7)]
    assert choose_pod(hashes, busy, table.get, CONFIG) == choose_pod(
        [], busy, {}.get, CONFIG
    )  # all over: the least queued, named as such
    assert choose_pod(hashes, busy, table.get, CONFIG).reason == "all_busy"
    assert choose_pod(hashes, busy, table.get, CONFIG).url == URLS[1]


def test_an_adapters_requests_go_to_the_pods_that_hold_it_within_the_load_bound():
    keys = [hashes_of(f"{i:08d} adapter prompt") for i in range(40)]
    holders = {URLS[1], URLS[3]}
    pods = [pod(u, adapters={"sql"} if u in holders else ()) for u in URLS]
    decisions = [choose_pod(k, pods, {}.get, CONFIG, model="sql") for k in keys]
    assert {d.url for d in decisions} == holders  # spread over both holders, by hash
    assert {d.reason for d in decisions} == {"adapter"}
    # the base model and an adapter no pod holds route as before, over every pod
    for model in ("base", "other"):
        plain = [choose_pod(k, pods, {}.get, CONFIG, model=model) for k in keys]
        assert plain == [choose_pod(k, pods, {}.get, CONFIG) for k in keys]
        assert len({d.url for d in plain}) == 4
    # a prefix another pod served does not pull the adapter's request off its holders
    table = {h: URLS[0] for h in keys[0]}
    assert choose_pod(keys[0], pods, table.get, CONFIG, model="sql").url in holders
    # no full block: the least loaded holder
    loaded = [pod(URLS[1], waiting=2, adapters={"sql"}), pod(URLS[3], adapters={"sql"})]
    assert choose_pod([], [*loaded, pod(URLS[0])], {}.get, CONFIG, model="sql").url == URLS[3]
    # holders at the load bound: the request spills to the other pods (which load it)
    busy = [pod(u, in_flight=3 if u in holders else 0, adapters={"sql"} if u in holders else ())
            for u in URLS]  # fmt: skip
    spilled = choose_pod(keys[0], busy, {}.get, CONFIG, model="sql")
    assert spilled.url not in holders and spilled.reason in ("hash", "bounded")


def test_pods_appearing_and_vanishing_move_only_their_own_keys():
    keys = [hashes_of(f"{i:08d}")[0] for i in range(200)]
    before = {k: choose_pod([k], [pod(u) for u in URLS[:3]], {}.get, CONFIG).url for k in keys}
    after = {k: choose_pod([k], [pod(u) for u in URLS], {}.get, CONFIG).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(after[k] == URLS[3] for k in moved)  # only to the new pod
    assert 20 < len(moved) < 80  # about a quarter
    # a vanished pod: its keys go elsewhere, everyone else's stay; its table entries are void
    table = {k: URLS[3] for k in keys}
    gone = {k: choose_pod([k], [pod(u) for u in URLS[:3]], table.get, CONFIG) for k in keys}
    assert all(d.url == before[k] and d.reason == "hash" for k, d in gone.items())
    assert choose_pod([keys[0]], [], table.get, CONFIG) is None


def test_the_registry_reports_vanished_pods_and_the_prefix_table_forgets_them():
    registry = PodRegistry(clock=lambda: 100.0)
    registry.set_endpoints(URLS[:2])
    assert registry.set_endpoints(URLS[1:3]) == [URLS[0]]
    assert [s.url for s in registry.states()] == URLS[1:3]
    table = PrefixTable(capacity=10)
    table.record(hashes_of("a" * 24), URLS[0])
    table.record(hashes_of("b" * 8), URLS[1])
    table.forget_pod(URLS[0])
    assert len(table) == 1 and table.get(hashes_of("b" * 8)[0]) == URLS[1]


def test_prefix_table_evicts_the_least_recently_served_block():
    table = PrefixTable(capacity=2)
    a, b, c = (hashes_of(x * 8)[0] for x in "abc")
    table.record([a], URLS[0])
    table.record([b], URLS[1])
    table.record([a], URLS[2])  # a served again: b is now the oldest
    table.record([c], URLS[3])
    assert (table.get(a), table.get(b), table.get(c)) == (URLS[2], None, URLS[3])


def test_stale_metrics_are_not_trusted_while_some_pod_has_fresh_ones():
    hashes = hashes_of("prefix served by a pod that stopped answering scrapes")
    table = {h: URLS[0] for h in hashes}
    pods = [pod(URLS[0], age=6.0), pod(URLS[1], waiting=3, age=1.0)]
    assert choose_pod(hashes, pods, table.get, CONFIG).url == URLS[1]  # affinity lost
    never_scraped = PodState(url=URLS[2])
    assert choose_pod([], [never_scraped, pod(URLS[1], waiting=3)], {}.get, CONFIG).url == URLS[1]
    # a stale "queue over the limit" does not exclude a pod forever: with no fresh metrics
    # anywhere, only this router's in-flight counts decide
    stale = [pod(URLS[0], waiting=50, age=60), pod(URLS[1], waiting=0, age=60, in_flight=1)]
    assert choose_pod([], stale, {}.get, CONFIG).url == URLS[0]
    assert choose_pod(hashes, stale, table.get, CONFIG).reason == "prefix"


def test_registry_ages_metrics_with_its_clock_and_a_failure_makes_them_stale():
    now = [10.0]
    registry = PodRegistry(clock=lambda: now[0])
    registry.set_endpoints([URLS[0]])
    registry.update(URLS[0], PodMetrics(2, 1, 0.5))
    now[0] = 13.0
    registry.acquire(URLS[0])
    (state,) = registry.states()
    assert (state.metrics_age_s, state.num_requests_waiting, state.in_flight) == (3.0, 2, 1)
    registry.mark_failed(URLS[0])
    registry.release(URLS[0])
    assert registry.states() == [PodState(url=URLS[0])]


def test_pod_metrics_are_summed_over_model_names_and_a_missing_gauge_is_named():
    text = (
        'vllm:num_requests_waiting{model_name="a"} 2\n'
        'vllm:num_requests_waiting{model_name="b"} 1\n'
        'vllm:num_requests_running{model_name="a"} 4\n'
        'vllm:kv_cache_usage_perc{model_name="a"} 0.25\n'
    )
    assert parse_pod_metrics(text) == PodMetrics(3, 4, 0.25)
    with pytest.raises(ValueError, match="vllm:kv_cache_usage_perc"):
        parse_pod_metrics(text.rsplit("vllm:kv", 1)[0])


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_queue_depth", -1), ("load_factor", 0.5), ("max_metrics_age_s", 0)],
)
def test_policy_config_names_the_invalid_field(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})


def test_the_adapters_in_use_are_each_models_newest_lora_info_sample():
    """vLLM keeps every label set of vllm:lora_requests_info it ever exported, valued by
    the time it was current: only each model's newest one says what runs now."""
    gauges = (
        'vllm:num_requests_waiting{model_name="base"} 0\n'
        'vllm:num_requests_running{model_name="base"} 2\n'
        'vllm:kv_cache_usage_perc{model_name="base"} 0.1\n'
    )
    info = 'vllm:lora_requests_info{{max_lora="2",model_name="{}",running_lora_adapters="{}",waiting_lora_adapters="{}"}} {}\n'
    text = gauges + "".join(
        info.format(*row)
        for row in [
            ("base", "old,older", "", 100.0),
            ("base", "sql", "chat", 250.0),  # the newest of base
            ("base", "gone", "", 200.0),
            ("other", "", "poet", 50.0),
        ]
    )
    assert parse_pod_metrics(text).adapters == {"sql", "chat", "poet"}
    assert parse_pod_metrics(gauges).adapters == frozenset()  # LoRA off: no info gauge


def test_the_limits_themselves_are_valid_settings():
    """Each limit is inclusive: a queue limit of 0 (only pods with nothing waiting), no
    headroom over the mean load (load factor 1), and a metrics age under a second are
    accepted, not refused as out of range."""
    config = PolicyConfig(max_queue_depth=0, load_factor=1, max_metrics_age_s=0.5)
    assert (config.max_queue_depth, config.load_factor, config.max_metrics_age_s) == (0, 1, 0.5)
    assert PolicyConfig(max_queue_depth=0.5, max_metrics_age_s=1).max_queue_depth == 0.5


def test_a_queue_exactly_at_the_limit_and_metrics_exactly_at_the_age_limit_still_count():
    """A pod whose queue equals max_queue_depth is open (only one over it is skipped), and
    metrics exactly max_metrics_age_s old are fresh: the pod is chosen by its metrics."""
    at_limit = pod(URLS[0], waiting=CONFIG.max_queue_depth, age=CONFIG.max_metrics_age_s)
    over = pod(URLS[1], waiting=CONFIG.max_queue_depth + 1, age=0.1)
    assert choose_pod([], [over, at_limit], lambda h: None, CONFIG).reason == "load"
    assert choose_pod([], [over, at_limit], lambda h: None, CONFIG).url == URLS[0]
    # Were its metrics stale, only the other pod's would count, and it is over the limit.
    stale = pod(URLS[0], waiting=0, age=CONFIG.max_metrics_age_s + 0.1)
    assert choose_pod([], [over, stale], lambda h: None, CONFIG).reason == "all_busy"


def test_an_adapter_request_without_a_full_block_goes_to_the_least_loaded_holder():
    """No block to hash: among the pods holding the adapter the least loaded takes it, and
    the reason is "adapter" (the holders chose), not "load"."""
    pods = [
        pod(URLS[0], waiting=0),
        pod(URLS[1], waiting=2, adapters={"sql"}),
        pod(URLS[2], waiting=1, adapters={"sql"}),
    ]
    decision = choose_pod([], pods, lambda h: None, CONFIG, model="sql")
    assert (decision.url, decision.reason) == (URLS[2], "adapter")


def test_rendezvous_order_is_by_descending_hash_of_key_and_pod():
    """Highest random weight first: the pods in descending order of sha256(key + url), so
    a key's home is the pod with the largest hash."""
    key = hashes_of("system: you are terse.")[0]
    expected = sorted(URLS, key=lambda u: hashlib.sha256(key + u.encode()).digest())[::-1]
    assert rendezvous_order(key, URLS) == expected
    assert expected != sorted(URLS) and expected != sorted(URLS, reverse=True)
