"""Routing by where a LoRA adapter is resident: a pod that holds the adapter idle in a
device slot (pagefleet:lora_adapter_resident, tier "device") is preferred like one whose
requests use it, then one that holds it in host memory only (tier "cpu"), then any pod;
all within the load bound, which overrides residency."""

from pagefleet_router.discovery import PodMetrics, PodRegistry, parse_pod_metrics
from pagefleet_router.policy import PodState, PolicyConfig, choose_pod
from pagefleet_router.prefix import block_hashes

CONFIG = PolicyConfig(max_queue_depth=4, load_factor=1.25, max_metrics_age_s=5)
URLS = [f"http://pod-{i}:8000" for i in range(4)]
KEYS = [block_hashes(f"{i:08d} adapter prompt", block_chars=8, max_blocks=64) for i in range(40)]

GAUGES = (
    'vllm:num_requests_waiting{model_name="base"} 0\n'
    'vllm:num_requests_running{model_name="base"} 0\n'
    'vllm:kv_cache_usage_perc{model_name="base"} 0.0\n'
)
# What an idle pod with adapters resident exports: no request names them.
IDLE_INFO = (
    'vllm:lora_requests_info{max_lora="1",model_name="base",'
    'running_lora_adapters="",waiting_lora_adapters=""} 1.7e9\n'
)


def resident(name: str, tier: str) -> str:
    return (
        f'pagefleet:lora_adapter_resident{{lora_name="{name}",model_name="base",tier="{tier}"}} 1\n'
    )


def pod(url: str, in_flight=0, device=(), cpu=()) -> PodState:
    return PodState(
        url=url,
        metrics_age_s=0.5,
        in_flight=in_flight,
        adapters=frozenset(device),
        cpu_adapters=frozenset(cpu),
    )


def test_idle_resident_adapters_are_read_by_tier():
    text = GAUGES + IDLE_INFO + resident("sql", "device") + resident("chat", "cpu")
    metrics = parse_pod_metrics(text)
    assert metrics.adapters == {"sql"} and metrics.cpu_adapters == {"chat"}
    # an adapter both in use and reported in host memory counts as on the device
    in_use = IDLE_INFO.replace('running_lora_adapters=""', 'running_lora_adapters="chat"')
    metrics = parse_pod_metrics(GAUGES + in_use + resident("chat", "cpu"))
    assert metrics.adapters == {"chat"} and metrics.cpu_adapters == frozenset()
    # LoRA off: neither gauge, no adapters
    assert parse_pod_metrics(GAUGES) == PodMetrics(0.0, 0.0, 0.0)


def test_the_registry_passes_both_tiers_to_the_policy():
    registry = PodRegistry(clock=lambda: 100.0)
    registry.set_endpoints(URLS[:1])
    registry.update(URLS[0], PodMetrics(0, 0, 0, frozenset({"sql"}), frozenset({"chat"})))
    (state,) = registry.states()
    assert state.adapters == {"sql"} and state.cpu_adapters == {"chat"}


def test_a_pod_holding_the_adapter_idle_wins_over_pods_that_do_not():
    pods = [pod(u, device={"sql"} if u == URLS[2] else ()) for u in URLS]
    decisions = [choose_pod(k, pods, {}.get, CONFIG, model="sql") for k in KEYS]
    assert {(d.url, d.reason) for d in decisions} == {(URLS[2], "adapter")}
    # with no full block to hash, too
    assert choose_pod([], pods, {}.get, CONFIG, model="sql") == choose_pod(
        KEYS[0], pods, {}.get, CONFIG, model="sql"
    )
    # the base model still spreads over every pod
    assert len({choose_pod(k, pods, {}.get, CONFIG, model="base").url for k in KEYS}) == 4


def test_device_residency_wins_over_host_memory_which_wins_over_none():
    pods = [pod(URLS[0]), pod(URLS[1], cpu={"sql"}), pod(URLS[2], device={"sql"}), pod(URLS[3])]
    assert {choose_pod(k, pods, {}.get, CONFIG, model="sql").url for k in KEYS} == {URLS[2]}
    without_device = [pods[0], pods[1], pod(URLS[2]), pods[3]]
    decisions = [choose_pod(k, without_device, {}.get, CONFIG, model="sql") for k in KEYS]
    assert {(d.url, d.reason) for d in decisions} == {(URLS[1], "adapter")}
    # a prefix a pod without the adapter served does not pull the request off its holder
    table = {h: URLS[0] for h in KEYS[0]}
    assert choose_pod(KEYS[0], without_device, table.get, CONFIG, model="sql").url == URLS[1]
    # the holder's own prefix: reason "prefix"
    table = {h: URLS[1] for h in KEYS[0]}
    assert choose_pod(KEYS[0], without_device, table.get, CONFIG, model="sql").reason == "prefix"


def test_the_load_bound_overrides_residency():
    # 4 in flight over 4 pods: the bound is ceil(1.25 * 5 / 4) = 2, so the device holder
    # with 2 already takes no more; the host-memory holder is next, then any pod.
    pods = [
        pod(URLS[0]),
        pod(URLS[1], in_flight=1, cpu={"sql"}),
        pod(URLS[2], in_flight=2, device={"sql"}),
        pod(URLS[3], in_flight=1),
    ]
    assert {choose_pod(k, pods, {}.get, CONFIG, model="sql").url for k in KEYS} == {URLS[1]}
    # both holders at the bound: the request goes to the pods that hold nothing of it
    full = [pods[0], pod(URLS[1], in_flight=2, cpu={"sql"}), pods[2], pod(URLS[3])]
    spilled = {choose_pod(k, full, {}.get, CONFIG, model="sql") for k in KEYS}
    assert {d.url for d in spilled} == {URLS[0], URLS[3]}
    assert {d.reason for d in spilled} <= {"hash", "bounded"}
