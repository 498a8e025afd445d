"""`pagefleet serve`: the command line (vLLM's flag names; every flag also read from
`PAGEFLEET_<FLAG>`), start-up, and uvicorn with a graceful drain on SIGTERM."""

import argparse
import contextlib
import dataclasses
import functools
import logging
import threading
import time

from pagefleet_flags import EnvFlags

from pagefleet_serve.config import (
    ACTIVATION_QUANTIZATIONS,
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    TASKS,
    EngineConfig,
    LoRAModule,
    parse_bytes,
)
from pagefleet_serve.cpu_placement import (
    available_cpus,
    cpu_quota,
    omp_num_threads,
    place_frontend,
    plan_placement,
)
from pagefleet_serve.reasoning import REASONING_PARSERS
from pagefleet_serve.server import lora_file_watcher
from pagefleet_serve.server.settings import SCHEDULING_POLICIES, ServerSettings
from pagefleet_serve.server.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("pagefleet_serve.serve")

_LOG_LEVELS = ("debug", "info", "warning", "error")


def _default(cls, name: str):
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (FastAPI under uvicorn).",
    )
    flag = EnvFlags(parser)
    engine = functools.partial(_default, EngineConfig)
    server = functools.partial(_default, ServerSettings)
    flag(
        "--model",
        "hf://org/name[@revision][/file.gguf] (downloaded into HF_HOME), a GGUF file or "
        "Hugging Face model directory (a path or file:///path), or builtin://smollm2-135m",
        default=engine("model"),
    )
    flag(
        "--task",
        "generate: sample text (/v1/completions, /v1/chat/completions); embed: pool each "
        "prompt's final hidden states into a vector (/v1/embeddings); auto: embed for a "
        "sentence-transformers checkpoint (modules.json with a Pooling module), else generate",
        default=engine("task"),
        choices=TASKS,
    )
    flag(
        "--served-model-name",
        "name(s) clients use for the model (default: the model's name)",
        nargs="+",
        default=None,
    )
    flag("--host", "address to listen on", default=server("host"))
    flag("--port", "port to listen on", type=int, default=server("port"))
    flag("--block-size", "tokens per KV cache block", type=int, default=engine("block_size"))
    flag("--max-num-seqs", "most sequences in one batch", type=int, default=engine("max_num_seqs"))
    flag(
        "--max-num-batched-tokens",
        "most tokens computed in one engine step",
        type=int,
        default=engine("max_num_batched_tokens"),
    )
    flag(
        "--max-model-len",
        "context length (default: the model's, capped by the KV pool)",
        type=int,
        default=engine("max_model_len"),
    )
    flag(
        "--kv-cache-memory",
        "KV cache pool size in bytes, e.g. 2GiB (default: 1GiB on CPU, "
        "--gpu-memory-utilization on CUDA)",
        type=parse_bytes,
        default=None,
    )
    flag(
        "--gpu-memory-utilization",
        "fraction of GPU memory the engine may use",
        type=float,
        default=engine("gpu_memory_utilization"),
    )
    flag(
        "--enable-prefix-caching",
        "reuse KV blocks of shared prompt prefixes",
        action=argparse.BooleanOptionalAction,
        default=engine("enable_prefix_caching"),
    )
    flag(
        "--kv-cache-dtype",
        "element type of the KV cache (auto: the model's dtype)",
        default=engine("kv_cache_dtype"),
        choices=KV_CACHE_DTYPES,
    )
    flag(
        "--attention-backend",
        "kernel backend (vLLM's flag name): the attention and also the layer ops, matmul "
        "kernels and fused layers around it; torch: PyTorch throughout, cpu: the C++ CPU "
        "kernels, triton: the Triton ones (auto: triton on CUDA, cpu on the CPU where its "
        "C++ extension builds, else torch)",
        default=engine("attention_backend"),
        choices=ATTENTION_BACKENDS,
    )
    flag(
        "--speculative-config",
        'speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (default: off)',
        default=None,
    )
    flag(
        "--kv-events-config",
        "publish KV cache events as vLLM does, for a KV-aware router (llm-d's indexer, "
        "pagefleet router): vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558"}\' (default: off)',
        default=None,
    )
    flag(
        "--kv-offloading-size",
        "GiB of host memory for a KV tier below the prefix cache (vLLM's flag): blocks the "
        "device computed are kept there and loaded back when a prompt's prefix misses the "
        "device cache (default: none)",
        type=float,
        default=engine("kv_offloading_size"),
    )
    flag(
        "--kv-offload-dir",
        "directory of the KV tier's block files, which outlive the process and may be "
        "shared by several servers of the same model (default: none)",
        default=engine("kv_offload_dir"),
    )
    flag(
        "--kv-offload-dir-max-size",
        "GiB the block files of --kv-offload-dir are kept under (least recently used out)",
        type=float,
        default=engine("kv_offload_dir_max_size"),
    )
    flag(
        "--quantization",
        "weights: auto keeps a GGUF's Q4_0/Q4_1/Q8_0 blocks quantized (CPU) and a float8 "
        "checkpoint in float8 (CUDA), none expands them to --dtype, int8 is weight-only int8 "
        "with a scale per output row (CPU), fp8 keeps float8 checkpoints in float8 (any device)",
        default=engine("quantization"),
        choices=QUANTIZATIONS,
    )
    flag(
        "--activation-quantization",
        "int8 rounds the activations of 4-bit matmuls to int8, one scale per 32 inputs, and "
        "multiplies with integer dot products, as llama.cpp does (CPU, float32, with "
        "--quantization auto); none (default) keeps them as they are",
        default=engine("activation_quantization"),
        choices=ACTIVATION_QUANTIZATIONS,
    )
    flag(
        "--enforce-eager",
        "run the model op by op; --no-enforce-eager compiles each layer's work around its "
        "attention with torch.compile (a C++ compiler on CPU; slower start-up)",
        action=argparse.BooleanOptionalAction,
        default=engine("enforce_eager"),
    )
    flag(
        "--dtype",
        "model dtype (auto: bfloat16 on CUDA and on CPUs with native bfloat16, else float32)",
        default=engine("dtype"),
        choices=DTYPES,
    )
    flag("--device", "auto, cpu or cuda[:N]", default=engine("device"))
    flag(
        "--seed",
        "seed of the sampler's generator for requests that set no seed of their own: the "
        "same seed and requests give the same outputs (a request's own seed wins)",
        type=int,
        default=engine("seed"),
    )
    flag(
        "--cpu-threads-bind",
        "CPUs of the engine core process's intra-op threads: auto (4+ CPUs: all but the "
        "last, which the API process keeps; fewer: all, shared; under a container CPU "
        "limit below the CPUs in sight: no pinning, threads sized to the limit), none (no "
        "pinning), or a list such as 0-2,4 (the API process keeps the rest)",
        default="auto",
    )
    flag("--api-key", "require 'Authorization: Bearer <key>' on /v1/*", default=None)
    flag(
        "--max-num-queued-requests",
        "requests waiting for the engine beyond which new ones get 429 (default: the number "
        "of KV cache blocks, at least --max-num-seqs)",
        type=int,
        default=None,
    )
    flag(
        "--shutdown-timeout",
        "seconds in-flight requests may run after SIGTERM",
        type=float,
        default=server("shutdown_timeout"),
    )
    flag(
        "--stream-coalesce-interval",
        "seconds within which later stream tokens are merged into one chunk (0: none)",
        type=float,
        default=server("stream_coalesce_interval"),
    )
    flag(
        "--sse-keepalive-interval",
        "seconds of stream silence before an SSE comment is sent, for proxies that close "
        "idle connections (0, the default: never; some SSE readers lose the next event)",
        type=float,
        default=server("sse_keepalive_interval"),
    )
    flag(
        "--stream-write-timeout",
        "seconds a stream's client may take no bytes (it stopped reading) before the "
        "stream and its request are aborted (0: never)",
        type=float,
        default=server("stream_write_timeout"),
    )
    flag(
        "--max-request-body-bytes",
        "request bodies larger than this get 413, e.g. 4MiB",
        type=parse_bytes,
        default=server("max_request_body_bytes"),
    )
    flag(
        "--header-read-timeout",
        "seconds a connection has to send a request's headers before it is closed",
        type=float,
        default=server("header_read_timeout"),
    )
    flag(
        "--body-read-timeout",
        "seconds a request has to send its body after its headers (then 408 and close)",
        type=float,
        default=server("body_read_timeout"),
    )
    flag(
        "--limit-concurrency",
        "requests in flight beyond which new ones get 503 (idle connections and the "
        "/health, /ready and /metrics probes do not count)",
        type=int,
        default=server("limit_concurrency"),
    )
    flag(
        "--max-connections-per-client",
        "connections one client address may hold open; more are closed at once (default: "
        "no cap; behind the router every client shares its address)",
        type=int,
        default=None,
    )
    flag(
        "--refusals-per-second",
        "refusals (4xx answers) one client may get a second, in bursts of two seconds' "
        "worth, before each further one is answered --refusal-delay seconds late",
        type=float,
        default=server("refusals_per_second"),
    )
    flag(
        "--refusal-delay",
        "seconds a refusal past a client's --refusals-per-second waits before it is "
        "answered (0: refusals are never delayed); accepted requests never wait",
        type=float,
        default=server("refusal_delay"),
    )
    flag(
        "--forwarded-allow-ips",
        "comma-separated addresses or networks (or *) whose X-Forwarded-For header names "
        "the client, as uvicorn's flag: set it to the router's or load balancer's so that "
        "fairness between clients sees each client",
        default=server("forwarded_allow_ips"),
    )
    flag(
        "--scheduling-policy",
        "fcfs: arrival order, requests may not set priority; priority: lower priority "
        "values run first",
        default=server("scheduling_policy"),
        choices=SCHEDULING_POLICIES,
    )
    flag(
        "--serve-docs",
        "serve /docs, /redoc and /openapi.json (default: only when no --api-key is set)",
        action=argparse.BooleanOptionalAction,
        default=None,
    )
    flag(
        "--otlp-traces-endpoint",
        "OTLP/HTTP URL receiving a span per request, e.g. http://collector:4318/v1/traces",
        default=None,
    )
    flag(
        "--enable-auto-tool-choice",
        'let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
        action=argparse.BooleanOptionalAction,
        default=server("enable_auto_tool_choice"),
    )
    flag(
        "--structured-outputs-compile-timeout",
        "seconds a response_format / structured_outputs / tools grammar may take to compile; "
        "a request whose grammar takes longer gets a 400 naming it",
        type=float,
        default=engine("structured_outputs_compile_timeout"),
    )
    flag(
        "--enable-lora",
        "serve LoRA adapters of the model: a request names one as its model; each row of a "
        "step carries its own adapter or none",
        action=argparse.BooleanOptionalAction,
        default=engine("enable_lora"),
    )
    flag(
        "--lora-modules",
        "LoRA adapters (PEFT: adapter_config.json + adapter_model.safetensors) served from "
        "start-up, as name=path, the path local, file://, pvc:// or hf://org/name[@revision] "
        "(needs --enable-lora)",
        nargs="+",
        default=None,
    )
    flag(
        "--lora-modules-file",
        'a JSON file listing LoRA adapters as [{"name": ..., "uri": ...}] (uris as '
        "--lora-modules' paths): served from start-up, then re-read every "
        "--lora-modules-file-poll-interval seconds, adapters added and removed without a "
        "restart (needs --enable-lora)",
        default=None,
    )
    flag(
        "--lora-modules-file-poll-interval",
        "seconds between two reads of --lora-modules-file",
        type=float,
        default=lora_file_watcher.POLL_INTERVAL_S,
    )
    flag(
        "--max-loras",
        "LoRA adapters resident on the device at once (a step reads at most this many; "
        "requests for others wait for a slot)",
        type=int,
        default=engine("max_loras"),
    )
    flag(
        "--max-lora-rank",
        "the highest LoRA rank served; adapters of a higher rank are refused",
        type=int,
        default=engine("max_lora_rank"),
    )
    flag(
        "--max-cpu-loras",
        "LoRA adapters kept in host memory at once, at least --max-loras (default: "
        "--max-loras); a request for another reads it again from its path",
        type=int,
        default=engine("max_cpu_loras"),
    )
    flag(
        "--max-lora-adapters",
        "LoRA adapters served by name at once; a load past it is refused (429) until one is "
        "unloaded",
        type=int,
        default=engine("max_lora_adapters"),
    )
    flag(
        "--lora-read-timeout",
        "seconds an adapter's files may take to be read (a load or a read back into host "
        "memory) before the read fails",
        type=float,
        default=engine("lora_read_timeout"),
    )
    flag(
        "--allow-runtime-lora-updating",
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING; needs --enable-lora)",
        action=argparse.BooleanOptionalAction,
        default=server("allow_runtime_lora_updating"),
    )
    flag(
        "--allowed-lora-root",
        "the directory under which POST /v1/load_lora_adapter may read local adapter paths "
        "(symlinks followed; default: none, only hf:// adapters load at run time)",
        default=server("allowed_lora_root"),
    )
    flag(
        "--limit-mm-per-prompt",
        'images one prompt may carry, as vLLM\'s JSON ({"image": 2}); default: none for a '
        "text-only model, 4 for one with a vision tower",
        default=server("limit_mm_per_prompt"),
    )
    flag(
        "--allowed-local-media-path",
        "the directory image_url's file:// URLs may name (symlinks followed; default: none, "
        "images come as data: URLs only)",
        default=server("allowed_local_media_path"),
    )
    flag(
        "--max-image-bytes",
        "an image's encoded size beyond which it is refused unread",
        type=int,
        default=server("max_image_bytes"),
    )
    flag(
        "--max-image-pixels",
        "an image's width x height (read from its header) beyond which it is refused undecoded",
        type=int,
        default=server("max_image_pixels"),
    )
    flag(
        "--responses-store-max-entries",
        "recent /v1/responses responses kept in this process for previous_response_id "
        "(least recently used out first; 0: none kept, store is then always false)",
        type=int,
        default=server("responses_store_max_entries"),
    )
    flag(
        "--responses-store-max-age",
        "seconds a kept /v1/responses response can be continued by previous_response_id",
        type=float,
        default=server("responses_store_max_age"),
    )
    flag(
        "--tool-call-parser",
        "format of the model's tool calls, parsed into message.tool_calls",
        default=None,
        choices=tuple(TOOL_CALL_PARSERS),
    )
    flag(
        "--reasoning-parser",
        "how the model's thinking is split from its answer (message.reasoning); default: "
        "the model family's, chosen by its tokenizer and template; none: no split",
        default=None,
        choices=(*REASONING_PARSERS, "none"),
    )
    flag(
        "--generation-config",
        "where a request's left-out temperature, top_p, top_k, min_p and repetition_penalty "
        "come from: auto (the model's generation_config.json), vllm (none: SamplingParams' "
        "defaults) or a directory holding a generation_config.json",
        default=server("generation_config"),
    )
    flag(
        "--override-generation-config",
        "JSON of those defaults, added to or replacing the generation config's, e.g. "
        "'{\"temperature\": 0.5}'",
        default=None,
    )
    _add_parallel_flags(flag, engine)
    flag("--log-level", "log level", default="info", choices=_LOG_LEVELS)
    parser.set_defaults(handler=run)


def _add_parallel_flags(flag: EnvFlags, engine) -> None:
    """vLLM's distributed flags (what the operator passes a parallel InferenceService)."""
    flag(
        "--tensor-parallel-size",
        "split the model over this many ranks (processes over torch.distributed: one GPU "
        "each, or on the CPU one group of --cpu-threads-bind's CPUs each)",
        "-tp",
        type=int,
        default=engine("tensor_parallel_size"),
    )
    flag(
        "--pipeline-parallel-size",
        "split the layers into this many stages, one after the other, each of "
        "--tensor-parallel-size ranks (with --nnodes: one stage per node)",
        "-pp",
        type=int,
        default=engine("pipeline_parallel_size"),
    )
    flag(
        "--nnodes",
        "nodes the tensor-parallel ranks are split over (each runs tensor-parallel-size / "
        "nnodes of them; node 0 serves the API)",
        type=int,
        default=1,
    )
    flag("--node-rank", "this node's rank in the group (0: the API server's)", type=int, default=0)
    flag(
        "--master-addr",
        "address of the ranks' rendezvous (rank 0's node)",
        default=engine("master_addr"),
    )
    flag(
        "--master-port",
        "port of the ranks' rendezvous (default: a free one; needed with --nnodes > 1)",
        type=int,
        default=engine("master_port"),
    )
    flag(
        "--headless",
        "run only this node's engine worker ranks, no API server (a node other than 0 of --nnodes)",
        action=argparse.BooleanOptionalAction,
        default=False,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        lora_file = _read_lora_modules_file(args)
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            kv_cache_memory_bytes=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
            activation_quantization=args.activation_quantization,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
            speculative_config=args.speculative_config,
            kv_events_config=args.kv_events_config,
            kv_offloading_size=args.kv_offloading_size,
            kv_offload_dir=args.kv_offload_dir,
            kv_offload_dir_max_size=args.kv_offload_dir_max_size,
            structured_outputs_compile_timeout=args.structured_outputs_compile_timeout,
            enable_lora=args.enable_lora,
            lora_modules=tuple(args.lora_modules or ()) + (lora_file[1] if lora_file else ()),
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            lora_read_timeout=args.lora_read_timeout,
            max_lora_adapters=args.max_lora_adapters,
            task=args.task,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
        )
        if args.headless != (config.node_rank > 0):
            raise ValueError(
                "--headless runs the worker ranks of a node other than 0 (--node-rank 1 .. "
                "--nnodes - 1); node 0 serves the API"
            )
        if args.allow_runtime_lora_updating and not config.enable_lora:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
        settings = ServerSettings(
            served_model_names=tuple(args.served_model_name or [args.model]),
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            max_num_queued_requests=args.max_num_queued_requests,
            shutdown_timeout=args.shutdown_timeout,
            stream_coalesce_interval=args.stream_coalesce_interval,
            sse_keepalive_interval=args.sse_keepalive_interval,
            stream_write_timeout=args.stream_write_timeout,
            max_request_body_bytes=args.max_request_body_bytes,
            header_read_timeout=args.header_read_timeout,
            body_read_timeout=args.body_read_timeout,
            limit_concurrency=args.limit_concurrency,
            max_connections_per_client=args.max_connections_per_client,
            refusals_per_second=args.refusals_per_second,
            refusal_delay=args.refusal_delay,
            forwarded_allow_ips=args.forwarded_allow_ips,
            scheduling_policy=args.scheduling_policy,
            serve_docs=args.serve_docs,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            allowed_lora_root=args.allowed_lora_root,
            responses_store_max_entries=args.responses_store_max_entries,
            responses_store_max_age=args.responses_store_max_age,
            generation_config=args.generation_config,
            override_generation_config=args.override_generation_config,
            limit_mm_per_prompt=args.limit_mm_per_prompt,
            allowed_local_media_path=args.allowed_local_media_path,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
        )
        placement = plan_placement(
            args.cpu_threads_bind, available_cpus(), cpu_quota(), omp_num_threads()
        )
    except ValueError as exc:
        logger.error("invalid configuration: %s", exc)
        return 2
    if args.headless:
        from pagefleet_serve.engine.executor.headless import run_headless

        return run_headless(config)

    from pagefleet_serve.frontend.process_link import ProcessLink

    try:
        with _progress(f"loading model {config.model} in the engine core process"):
            # The core first: its imports and load run beside this process's imports
            # below (transformers for the frontend).
            link = ProcessLink(config, placement, args.log_level)
            from pagefleet_serve.frontend.core_client import start_core_process

            engine = start_core_process(config, link)
    except (ValueError, OSError, RuntimeError) as exc:
        logger.error("cannot load model %s: %s", config.model, exc)
        return 1
    from pagefleet_serve.server.uvicorn_server import create_server

    place_frontend(placement.frontend)
    logger.info(
        "CPU placement: engine core on %s (%s intra-op threads), API process on %s",
        placement.core or "any CPU",
        placement.core_threads or "torch's default",
        placement.frontend or "any CPU",
    )
    if not args.served_model_name:
        settings = dataclasses.replace(settings, served_model_names=(engine.model_name,))
    watcher = None
    if lora_file is not None:
        watcher = lora_file_watcher.LoRAFileWatcher(
            args.lora_modules_file, engine, *lora_file, args.lora_modules_file_poll_interval
        )
    try:
        server = create_server(settings, engine, args.log_level, watcher)
    except ValueError as exc:  # a bad --reasoning-parser or generation config for the model
        logger.error("invalid configuration: %s", exc)
        engine.shutdown()
        return 2
    try:
        server.run()
    finally:
        engine.shutdown()  # idempotent: the app's lifespan has usually done it
    return 1 if server.force_exit else 0


def _read_lora_modules_file(
    args: argparse.Namespace,
) -> tuple[bytes, tuple[LoRAModule, ...]] | None:
    """--lora-modules-file's content and adapters at start (None without the flag);
    ValueError: the file is unreadable or malformed, or LoRA is off."""
    if args.lora_modules_file is None:
        return None
    if not args.enable_lora:
        raise ValueError("--lora-modules-file needs --enable-lora")
    # Checked here, before the model loads, though the watcher starts after.
    lora_file_watcher.check_poll_interval(args.lora_modules_file_poll_interval)
    return lora_file_watcher.read_lora_modules_file(args.lora_modules_file)


@contextlib.contextmanager
def _progress(what: str, every_s: float = 5.0):
    """Log `what`, then how long it has been running every few seconds until done."""
    logger.info("%s", what)
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while not done.wait(every_s):
            logger.info("%s: %.0fs", what, time.monotonic() - started)

    thread = threading.Thread(target=tick, name="load-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
