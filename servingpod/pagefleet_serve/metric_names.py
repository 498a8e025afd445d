"""The names of the Prometheus series that leave a process: the serving pod's (exported by
`pagefleet_serve.server.metrics` and `server.state`, read by the operator's autoscaler, the
router, dashboards and the benchmarks) and the router's that the operator reads.

vLLM's names wherever vLLM measures the same thing, so that dashboards, KEDA/HPA rules and
the Gateway API Inference Extension read a pod unchanged; ours alone carry the
`pagefleet:` prefix. Torch-free and importing nothing: the operator's image loads it. The
router, which imports nothing of `pagefleet_serve`, spells the four it reads and writes
out, and tests/router checks they are these. A counter's samples carry prometheus_client's
`_total` suffix after these names.
"""

# The load gauges every pod reports: the router balances on them, the autoscaler scales
# on the KV cache usage (0-1) and the waiting requests.
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
# An info gauge (value 1) whose labels carry the cache's shape: `block_size` and
# `num_gpu_blocks`, which a GIE/llm-d prefix scorer reads.
CACHE_CONFIG_INFO = "vllm:cache_config_info"

# The engine's counters.
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

# Per-request histograms (vLLM's buckets).
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:request_time_per_output_token_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"
REQUEST_INFERENCE_TIME_SECONDS = "vllm:request_inference_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"

# The LoRA adapters of the running and waiting requests, as labels (running_lora_adapters,
# waiting_lora_adapters: comma-separated names; max_lora), the value the time it was read:
# what the Gateway API Inference Extension routes adapters by.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
# 1 per LoRA adapter resident now, whether requests use it or not (labels lora_name, and
# tier: "device", in one of the --max-loras slots, or "cpu", in host memory only, reported
# with --max-cpu-loras alone): what the router keeps an idle adapter's requests on. The
# device's adapters are in host memory too, so at most max_cpu_loras samples (max_loras
# without it); an evicted adapter's series ends.
LORA_ADAPTER_RESIDENT = "pagefleet:lora_adapter_resident"

# The pod's own series.
REQUESTS_REJECTED = "pagefleet:requests_rejected"
# Of GENERATION_TOKENS, those a reasoning model spent thinking (its markers included).
REASONING_TOKENS = "pagefleet:reasoning_tokens"
# Streams aborted because their client read nothing for --stream-write-timeout seconds.
STREAM_WRITE_TIMEOUTS = "pagefleet:stream_write_timeouts"
KV_CACHE_BLOCKS = "pagefleet:kv_cache_blocks"
KV_CACHE_USED_BLOCKS = "pagefleet:kv_cache_used_blocks"
# A hybrid model's state slots (its recurrent layers' per-sequence state): the pool, those
# running sequences hold, the prefix cache's checkpoints holding a state, and the bytes of
# one sequence's state.
STATE_SLOTS = "pagefleet:state_slots"
STATE_USED_SLOTS = "pagefleet:state_used_slots"
STATE_CHECKPOINTS = "pagefleet:state_checkpoints"
STATE_BYTES_PER_SEQUENCE = "pagefleet:state_bytes_per_sequence"
NUM_REQUESTS_QUEUED = "pagefleet:num_requests_queued"
ENGINE_HEALTHY = "pagefleet:engine_healthy"
DRAINING = "pagefleet:draining"
# KV event batches the publisher's full queue dropped (--kv-events-config): vLLM's
# publisher blocks its step instead, and has no such counter.
KV_EVENTS_DROPPED = "pagefleet:kv_events_dropped"
# A vision-language model's: images per accepted request; images whose embeddings were
# asked of the encoder cache, those it held, and the seconds the vision encoder ran.
REQUEST_IMAGES = "pagefleet:request_images"
ENCODER_CACHE_QUERIES = "pagefleet:encoder_cache_queries"
ENCODER_CACHE_HITS = "pagefleet:encoder_cache_hits"
ENCODER_SECONDS = "pagefleet:encoder_seconds"

# The KV tier below the prefix cache (--kv-offloading-size, --kv-offload-dir): vLLM's
# counters of the prompt tokens looked up in an external cache (its KV connector's, here
# the tier's: those the device cache missed) and found there; then, by `medium` (CPU:
# host memory, STORAGE: files), the tokens found, the bytes loaded into the device and
# copied out of it (written, for files), and the bytes held now; the file writer's queue,
# its dropped and refused writes, and the invalid files (truncated, corrupted, foreign).
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
KV_OFFLOAD_HIT_TOKENS = "pagefleet:kv_offload_hit_tokens"
KV_OFFLOAD_LOAD_BYTES = "pagefleet:kv_offload_load_bytes"
KV_OFFLOAD_STORE_BYTES = "pagefleet:kv_offload_store_bytes"
KV_OFFLOAD_STORED_BYTES = "pagefleet:kv_offload_stored_bytes"
KV_OFFLOAD_QUEUE_DEPTH = "pagefleet:kv_offload_queue_depth"
KV_OFFLOAD_DROPPED_WRITES = "pagefleet:kv_offload_dropped_writes"
KV_OFFLOAD_WRITE_ERRORS = "pagefleet:kv_offload_write_errors"
KV_OFFLOAD_INVALID_BLOCKS = "pagefleet:kv_offload_invalid_blocks"
# Seconds each start-up phase took (label `phase`: imports, download, kernel_load,
# weight_load, kv_cache, warm_up, and total: the process's start to the engine ready).
STARTUP_SECONDS = "pagefleet:startup_seconds"

# The router's gauge of requests held while no pod is ready: the autoscaler's demand
# signal at zero replicas.
ROUTER_HELD_REQUESTS = "pagefleet:router_held_requests"
