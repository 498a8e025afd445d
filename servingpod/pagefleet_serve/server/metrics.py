"""Prometheus series of one serving pod, under vLLM's names wherever vLLM measures the same
thing (dashboards, KEDA/HPA rules and the Gateway API Inference Extension read them
unchanged); ours alone carry the `pagefleet:` prefix. The names live in
`pagefleet_serve.metric_names`, which the operator scrapes by too.

Two sources: the engine's stats snapshot, read at scrape time (gauges and the engine's
own counters), and each request's timestamped outputs, observed as they stream by
(`RequestTracker`). This module is the only place that touches prometheus_client.
"""

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagefleet_serve import metric_names as names
from pagefleet_serve.messages import EngineStats, KVTierStats, LoRAStats, SpecDecodeStats
from pagefleet_serve.outputs import RequestOutput
from pagefleet_serve.server.tracing import record_finished

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so histograms from both can be aggregated.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_IMAGE_BUCKETS = (0, 1, 2, 4, 8, 16)


# The label values a series is exported with from the start, at 0, so that a dashboard's
# panels read 0 rather than "No data" until the first one counts.
FINISHED_REASONS = ("stop", "length", "abort", "error")
REJECTION_REASONS = ("queue_full", "draining", "engine_unhealthy")


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], EngineStats],
        server_gauges: Callable[[], dict[str, tuple[str, float]]],
        startup_seconds: dict[str, float] | None = None,
        *,
        block_size: int,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        per_model: list[Counter | Histogram] = []  # labelled by model_name alone

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            metric = Counter(name, doc, labels + list(extra), registry=self.registry)
            if not extra:
                per_model.append(metric)
            return metric

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            per_model.append(metric)
            return metric

        self.prompt_tokens = counter(names.PROMPT_TOKENS, "Prefilled prompt tokens.")
        self.generation_tokens = counter(names.GENERATION_TOKENS, "Generated tokens.")
        self.reasoning_tokens = counter(
            names.REASONING_TOKENS, "Generated tokens a reasoning model spent thinking."
        )
        self.request_success = counter(
            names.REQUEST_SUCCESS, "Finished requests by finish reason.", ("finished_reason",)
        )
        self.rejected = counter(
            names.REQUESTS_REJECTED,
            "Requests turned away before reaching the engine.",
            ("reason",),
        )
        self.stream_write_timeouts = counter(
            names.STREAM_WRITE_TIMEOUTS,
            "Streams aborted because their client read nothing for --stream-write-timeout seconds.",
        )
        self.ttft = histogram(
            names.TIME_TO_FIRST_TOKEN_SECONDS, "Arrival to first generated token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            names.INTER_TOKEN_LATENCY_SECONDS,
            "Time between a request's successive engine outputs.",
            _ITL_BUCKETS,
        )
        self.tpot = histogram(
            names.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
            "Decode time of finished requests per output token after the first.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to the last token of finished requests.",
            _LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            names.REQUEST_QUEUE_TIME_SECONDS, "Arrival to first scheduled.", _LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            names.REQUEST_PREFILL_TIME_SECONDS, "First scheduled to first token.", _LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            names.REQUEST_DECODE_TIME_SECONDS, "First token to last token.", _LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            names.REQUEST_INFERENCE_TIME_SECONDS,
            "First scheduled to last token.",
            _LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            names.REQUEST_PROMPT_TOKENS, "Prompt length of finished requests.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            names.REQUEST_GENERATION_TOKENS,
            "Generated tokens of finished requests.",
            _TOKEN_BUCKETS,
        )
        self.request_images = histogram(
            names.REQUEST_IMAGES, "Images of chat requests that carry images.", _IMAGE_BUCKETS
        )
        for metric in per_model:
            metric.labels(model_name)
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        for reason in REJECTION_REASONS:
            self.rejected.labels(model_name, reason)
        self.registry.register(
            _EngineCollector(model_name, engine_stats, server_gauges, block_size)
        )
        startup = GaugeMetricFamily(
            names.STARTUP_SECONDS,
            "Seconds each start-up phase took.",
            labels=["model_name", "phase"],
        )
        for phase, seconds in (startup_seconds or {}).items():
            startup.add_metric([model_name, phase], seconds)
        self.registry.register(_Fixed(startup))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def track(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Observes one engine request's outputs as they arrive."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.started = False
        self.finished = False
        self.num_generated = 0
        self.last_token_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        m = self.metrics
        label = m.model_name
        timing = output.metrics
        num_new = output.num_generated_tokens
        if output.embedding is not None and not self.started:  # a prompt, pooled: no tokens
            self.started = True
            m.prompt_tokens.labels(label).inc(len(output.prompt_token_ids))
        if num_new:
            if not self.started:
                self.started = True
                m.prompt_tokens.labels(label).inc(len(output.prompt_token_ids))
                if timing and timing.first_token_time is not None:
                    m.ttft.labels(label).observe(timing.first_token_time - timing.arrival_time)
            elif timing and timing.last_token_time is not None and self.last_token_time is not None:
                m.itl.labels(label).observe(timing.last_token_time - self.last_token_time)
            self.num_generated += num_new
            m.generation_tokens.labels(label).inc(num_new)
            thought = sum(o.num_reasoning_tokens for o in output.outputs)
            if thought:
                m.reasoning_tokens.labels(label).inc(thought)
            if timing:
                self.last_token_time = timing.last_token_time
        if output.finished:
            self._finish(output)

    def abort(self) -> None:
        """The request ended on our side (client gone, drain) before the engine finished it."""
        if not self.finished:
            self.finished = True
            self.metrics.request_success.labels(self.metrics.model_name, "abort").inc()

    def _finish(self, output: RequestOutput) -> None:
        self.finished = True
        m = self.metrics
        label = m.model_name
        reasons = {o.finish_reason for o in output.outputs}
        reason = (output.error and "error") or next(
            (r for r in ("error", "abort", "length", "stop") if r in reasons), "stop"
        )
        m.request_success.labels(label, reason).inc()
        record_finished(output, self.num_generated, label)
        t = output.metrics
        if t is None or t.finished_time is None or not self.started:
            return
        m.e2e.labels(label).observe(t.finished_time - t.arrival_time)
        m.request_prompt_tokens.labels(label).observe(len(output.prompt_token_ids))
        m.request_generation_tokens.labels(label).observe(self.num_generated)
        if t.first_scheduled_time is not None:
            m.queue_time.labels(label).observe(t.first_scheduled_time - t.arrival_time)
            m.inference_time.labels(label).observe(t.finished_time - t.first_scheduled_time)
            if t.first_token_time is not None:
                m.prefill_time.labels(label).observe(t.first_token_time - t.first_scheduled_time)
        if t.first_token_time is not None:
            m.decode_time.labels(label).observe(t.finished_time - t.first_token_time)
            if self.num_generated > 1:
                tpot = (t.finished_time - t.first_token_time) / (self.num_generated - 1)
                m.tpot.labels(label).observe(tpot)


class _Fixed:
    """A collector of metric families fixed once (the start-up phases)."""

    def __init__(self, *families) -> None:
        self.families = families

    def describe(self):
        return []

    def collect(self):
        yield from self.families


class _EngineCollector:
    """Gauges and engine-side counters, read from the latest stats snapshot at scrape time."""

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], EngineStats],
        server_gauges: Callable[[], dict[str, tuple[str, float]]],
        block_size: int,
    ) -> None:
        self.model_name = model_name
        self.engine_stats = engine_stats
        self.server_gauges = server_gauges
        self.block_size = block_size

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        stats = self.engine_stats()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge(
            names.NUM_REQUESTS_RUNNING, "Sequences in the running batch.", stats.num_running
        )
        yield gauge(
            names.NUM_REQUESTS_WAITING, "Sequences waiting to be scheduled.", stats.num_waiting
        )
        yield gauge(
            names.KV_CACHE_USAGE_PERC,
            "Fraction of KV cache blocks in use (0-1).",
            stats.kv_cache_usage,
        )
        yield counter(
            names.PREFIX_CACHE_QUERIES,
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield counter(
            names.PREFIX_CACHE_HITS,
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits,
        )
        yield counter(
            names.NUM_PREEMPTIONS,
            "Sequences preempted for lack of KV blocks.",
            stats.num_preemptions,
        )
        yield gauge(names.KV_CACHE_BLOCKS, "KV cache blocks in the pool.", stats.num_blocks)
        yield _cache_config_info(label, self.block_size, stats.num_blocks)
        yield gauge(
            names.KV_CACHE_USED_BLOCKS,
            "KV cache blocks held by live sequences.",
            stats.num_used_blocks,
        )
        if stats.encoder is not None:
            encoder = stats.encoder
            yield counter(
                names.ENCODER_CACHE_QUERIES,
                "Images whose embeddings were asked of the encoder cache.",
                encoder.queries,
            )
            yield counter(names.ENCODER_CACHE_HITS, "Images the encoder cache held.", encoder.hits)
            yield counter(names.ENCODER_SECONDS, "Seconds the vision encoder ran.", encoder.seconds)
        if stats.state is not None:
            state = stats.state
            yield gauge(names.STATE_SLOTS, "State slots of running sequences.", state.num_slots)
            yield gauge(
                names.STATE_USED_SLOTS, "State slots held by live sequences.", state.num_used_slots
            )
            yield gauge(
                names.STATE_CHECKPOINTS,
                "Prefix-cache state checkpoints holding a state.",
                state.num_saved_checkpoints,
            )
            yield gauge(
                names.STATE_BYTES_PER_SEQUENCE,
                "Bytes of one sequence's recurrent state.",
                state.bytes_per_sequence,
            )
        yield from _spec_decode_counters(label, stats.spec_decode)
        if stats.kv_events_dropped is not None:
            yield counter(
                names.KV_EVENTS_DROPPED,
                "KV event batches dropped because the publisher's queue was full.",
                stats.kv_events_dropped,
            )
        if stats.kv_tier is not None:
            yield from _kv_tier_metrics(label, stats.kv_tier)
        if stats.lora is not None:
            yield _lora_info(label, stats.lora)
            yield _lora_resident(label, stats.lora)
        for name, (doc, value) in self.server_gauges().items():
            yield gauge(name, doc, value)


def _cache_config_info(label: list[str], block_size: int, num_blocks: int) -> GaugeMetricFamily:
    """vLLM's info gauge of the KV cache's shape: labels, value 1 (a scorer that models
    the pods' prefix caches reads the block size and the pool's blocks from it)."""
    family = GaugeMetricFamily(
        names.CACHE_CONFIG_INFO,
        "Information of the KV cache's configuration (labels).",
        labels=["model_name", "block_size", "num_gpu_blocks"],
    )
    family.add_metric([*label, str(block_size), str(num_blocks)], 1.0)
    return family


def _lora_info(label: list[str], lora: LoRAStats) -> GaugeMetricFamily:
    """vLLM's info gauge of the adapters in use: names as labels, the time as its value."""
    family = GaugeMetricFamily(
        names.LORA_REQUESTS_INFO,
        "LoRA adapters of the running and waiting requests (labels), read at this time.",
        labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    running, waiting = ",".join(lora.running), ",".join(lora.waiting)
    family.add_metric([*label, running, waiting, str(lora.max_loras)], time.time())
    return family


def _lora_resident(label: list[str], lora: LoRAStats) -> GaugeMetricFamily:
    """One sample per resident adapter, so that the series count stays within the slots
    (an info gauge of comma-joined names would make a series per combination)."""
    family = GaugeMetricFamily(
        names.LORA_ADAPTER_RESIDENT,
        "LoRA adapters resident now, in use or idle: in a device slot or in host memory only.",
        labels=["model_name", "lora_name", "tier"],
    )
    for tier, adapters in (("device", lora.on_device), ("cpu", lora.in_host_memory)):
        for adapter in adapters:
            family.add_metric([*label, adapter, tier], 1.0)
    return family


def _counters(label: list[str], *rows: tuple[str, str, float]):
    """One counter family of one sample (this model's) per (name, doc, value)."""
    for name, doc, value in rows:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(label, value)
        yield family


def _spec_decode_counters(label: list[str], spec: SpecDecodeStats):
    """vLLM's speculative decoding counters (all zero when it is off)."""
    yield from _counters(
        label,
        (names.SPEC_DECODE_NUM_DRAFTS, "Sequence-steps that verified drafts.", spec.num_drafts),
        (names.SPEC_DECODE_NUM_DRAFT_TOKENS, "Draft tokens verified.", spec.num_draft_tokens),
        (
            names.SPEC_DECODE_NUM_ACCEPTED_TOKENS,
            "Draft tokens accepted.",
            spec.num_accepted_tokens,
        ),
    )
    per_position = CounterMetricFamily(
        names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
        "Accepted draft tokens by position in the draft.",
        labels=["model_name", "position"],
    )
    # (Off, or before the speculator reports its positions: position 0 at 0.)
    for position, value in enumerate(spec.accepted_per_position or (0,)):
        per_position.add_metric([*label, str(position)], value)
    yield per_position


def _kv_tier_metrics(label: list[str], tier: KVTierStats):
    """The KV tier's series (see metric_names): vLLM's external prefix cache counters,
    then ours, by medium where the tier has two."""
    yield from _counters(
        label,
        (
            names.EXTERNAL_PREFIX_CACHE_QUERIES,
            "Prompt tokens looked up in the KV tier (the device prefix cache missed them).",
            tier.query_tokens,
        ),
        (names.EXTERNAL_PREFIX_CACHE_HITS, "Prompt tokens found in the KV tier.", tier.hit_tokens),
        (
            names.KV_OFFLOAD_DROPPED_WRITES,
            "Block writes dropped because the KV tier's file queue was full.",
            tier.storage_dropped_writes,
        ),
        (
            names.KV_OFFLOAD_WRITE_ERRORS,
            "Block writes the KV tier's directory refused (full, read-only, missing).",
            tier.storage_write_errors,
        ),
        (
            names.KV_OFFLOAD_INVALID_BLOCKS,
            "KV tier block files found truncated, corrupted or foreign (recomputed).",
            tier.storage_invalid_blocks,
        ),
    )
    by_medium = (
        (
            CounterMetricFamily,
            names.KV_OFFLOAD_HIT_TOKENS,
            "Prompt tokens loaded from the KV tier.",
            tier.cpu_hit_tokens,
            tier.storage_hit_tokens,
        ),
        (
            CounterMetricFamily,
            names.KV_OFFLOAD_LOAD_BYTES,
            "Bytes loaded from the KV tier into the device.",
            tier.cpu_bytes_loaded,
            tier.storage_bytes_loaded,
        ),
        (
            CounterMetricFamily,
            names.KV_OFFLOAD_STORE_BYTES,
            "Bytes copied out of the device into the KV tier (written, for files).",
            tier.cpu_bytes_stored,
            tier.storage_bytes_written,
        ),
        (
            GaugeMetricFamily,
            names.KV_OFFLOAD_STORED_BYTES,
            "Bytes the KV tier holds.",
            tier.cpu_stored_bytes,
            tier.storage_stored_bytes,
        ),
    )
    for kind, name, doc, cpu, storage in by_medium:
        family = kind(name, doc, labels=["model_name", "medium"])
        family.add_metric([*label, "CPU"], cpu)
        family.add_metric([*label, "STORAGE"], storage)
        yield family
    queue = GaugeMetricFamily(
        names.KV_OFFLOAD_QUEUE_DEPTH,
        "Block writes queued for the KV tier's files.",
        labels=["model_name"],
    )
    queue.add_metric(label, tier.storage_queue_depth)
    yield queue
