"""`pagefleet router` (also `python -m pagefleet_router`): the command line, every flag
also read from `PAGEFLEET_<FLAG>`, and the aiohttp server."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from pagefleet_flags import EnvFlags
from pagefleet_operator.names import HTTP_PORT_NAME
from pagefleet_operator.tracing import get_tracer

from .discovery import Discovery, ScrapeSettings, StaticEndpoints
from .policy import PolicyConfig
from .proxy import Router, RouterSettings, Waker
from .tracing import RequestTracing

if TYPE_CHECKING:
    from .kv_feed import PreciseRouting

logger = logging.getLogger("pagefleet_router")

_LOG_LEVELS = ("debug", "info", "warning", "error")


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagefleet router",
        description="Route OpenAI requests to the pod holding their prompt prefix, by load.",
    )
    flag = EnvFlags(parser)
    router, policy, scrape = RouterSettings(), PolicyConfig(), ScrapeSettings()
    flag(
        "--endpoints",
        "the pods' base URLs, e.g. http://10.0.0.7:8000 (comma or space separated in the env)",
        nargs="+",
        default=None,
    )
    flag(
        "--service",
        "discover the pods from this Service's EndpointSlices instead of --endpoints",
        default=None,
    )
    flag(
        "--namespace",
        "the Service's namespace (default: the router pod's own)",
        default=None,
    )
    flag("--port-name", "the pods' named HTTP port in the Service", default=HTTP_PORT_NAME)
    flag("--host", "address to listen on", default=router.host)
    flag("--port", "port to listen on", type=int, default=router.port)
    flag(
        "--block-chars",
        "characters per prompt block hashed for prefix affinity",
        type=int,
        default=router.block_chars,
    )
    flag(
        "--max-prefix-blocks",
        "leading prompt blocks hashed per request",
        type=int,
        default=router.max_prefix_blocks,
    )
    flag(
        "--prefix-table-size",
        "block hashes remembered with the pod that last served them",
        type=int,
        default=router.prefix_table_size,
    )
    flag(
        "--response-table-size",
        "/v1/responses ids remembered with the pod that answered them (previous_response_id "
        "goes to that pod, whose store holds it)",
        type=int,
        default=router.response_table_size,
    )
    flag(
        "--max-queue-depth",
        "a pod with more waiting requests than this is skipped",
        type=float,
        default=policy.max_queue_depth,
    )
    flag(
        "--load-factor",
        "bounded load: a pod takes at most this times the mean in-flight requests",
        type=float,
        default=policy.load_factor,
    )
    flag(
        "--metrics-max-age",
        "seconds after which a pod's scraped metrics are stale",
        type=float,
        default=policy.max_metrics_age_s,
    )
    flag(
        "--scrape-interval",
        "seconds between /metrics scrapes",
        type=float,
        default=scrape.interval_s,
    )
    flag(
        "--scrape-timeout",
        "seconds one /metrics scrape may take",
        type=float,
        default=scrape.timeout_s,
    )
    flag(
        "--scrape-max-bytes",
        "largest /metrics body read from a pod",
        type=int,
        default=scrape.max_bytes,
    )
    flag(
        "--connect-timeout",
        "seconds to connect to a pod before trying another",
        type=float,
        default=router.connect_timeout_s,
    )
    flag(
        "--max-request-body-bytes",
        "request bodies larger than this many bytes get 413 (the pod's cap)",
        type=int,
        default=router.max_request_body_bytes,
    )
    flag(
        "--header-read-timeout",
        "seconds a connection has to send a request's headers before it is closed",
        type=float,
        default=router.header_read_timeout_s,
    )
    flag(
        "--body-read-timeout",
        "seconds a request has to send its body after its headers (then 408 and close)",
        type=float,
        default=router.body_read_timeout_s,
    )
    flag(
        "--prefix-scan-bytes",
        "leading bytes of a body parsed for its prompt prefix",
        type=int,
        default=router.prefix_scan_bytes,
    )
    flag(
        "--scale-from-zero",
        "this InferenceService (in --namespace) is raised from 0 to 1 replica through its "
        "scale subresource when a request arrives and no pod is ready; the request is held",
        default=None,
    )
    flag(
        "--max-held-requests",
        "requests held while no pod is ready (with --scale-from-zero); more get a 503",
        type=int,
        default=router.max_held_requests,
    )
    flag(
        "--hold-timeout",
        "seconds a held request waits for a ready pod before its 503",
        type=float,
        default=router.hold_timeout_s,
    )
    flag(
        "--otlp-traces-endpoint",
        "send a span per request to this OTLP/HTTP endpoint (e.g. "
        "http://collector:4318/v1/traces) and pass its context on in traceparent",
        default=None,
    )
    flag(
        "--ext-proc-port",
        "also serve Envoy's ext_proc on this port (gRPC): the router as a Gateway API "
        "Inference Extension InferencePool's Endpoint Picker, with gRPC health",
        type=int,
        default=None,
    )
    flag(
        "--ext-proc-fallbacks",
        "endpoints the Endpoint Picker names after its pick, for the gateway's retries",
        type=int,
        default=2,
    )
    flag(
        "--kv-events-endpoint",
        "precise prefix routing: subscribe to each pod's KV cache events (vLLM's format, "
        "`pagefleet serve --kv-events-config`) at this ZMQ endpoint, {host} and {port} "
        "taken from the pod's URL, e.g. tcp://{host}:5557; needs --tokenizer",
        default=None,
    )
    flag(
        "--kv-replay-endpoint",
        "the pods' KV event replay sockets, a template as --kv-events-endpoint (e.g. "
        "tcp://{host}:5558): a new pod's cache, lost batches and restarts are read again",
        default=None,
    )
    flag("--kv-events-topic", "the pods' KV event topic", default="")
    flag(
        "--tokenizer",
        "the model's tokenizer.json: the router names a prompt's blocks as the pods do",
        default=None,
    )
    flag(
        "--kv-block-size",
        "the pods' KV block size in tokens (their --block-size)",
        type=int,
        default=16,
    )
    flag("--log-level", "log level", default="info", choices=_LOG_LEVELS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = get_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if bool(args.endpoints) == bool(args.service):
        parser.error("give exactly one of --endpoints (the pods' base URLs) and --service")
    try:
        settings = RouterSettings(
            host=args.host,
            port=args.port,
            policy=PolicyConfig(
                max_queue_depth=args.max_queue_depth,
                load_factor=args.load_factor,
                max_metrics_age_s=args.metrics_max_age,
            ),
            scrape=ScrapeSettings(
                interval_s=args.scrape_interval,
                timeout_s=args.scrape_timeout,
                max_bytes=args.scrape_max_bytes,
            ),
            block_chars=args.block_chars,
            max_prefix_blocks=args.max_prefix_blocks,
            prefix_table_size=args.prefix_table_size,
            response_table_size=args.response_table_size,
            connect_timeout_s=args.connect_timeout,
            max_held_requests=args.max_held_requests,
            hold_timeout_s=args.hold_timeout,
            max_request_body_bytes=args.max_request_body_bytes,
            header_read_timeout_s=args.header_read_timeout,
            body_read_timeout_s=args.body_read_timeout,
            prefix_scan_bytes=args.prefix_scan_bytes,
        )
    except ValueError as exc:
        logger.error("invalid configuration: %s", exc)
        return 2
    if args.scale_from_zero and not args.service:
        parser.error("--scale-from-zero needs --service (the pods are discovered in the cluster)")
    try:
        tracer = get_tracer(args.otlp_traces_endpoint, "pagefleet-router")
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    tracing = None if tracer is None else RequestTracing(tracer)
    if args.ext_proc_fallbacks < 0:
        parser.error(f"--ext-proc-fallbacks must be >= 0, got {args.ext_proc_fallbacks}")
    if bool(args.kv_events_endpoint) != bool(args.tokenizer):
        parser.error("--kv-events-endpoint and --tokenizer go together (precise prefix routing)")
    router = Router(
        settings,
        *_discovery_and_waker(args, parser),
        tracing=tracing,
        precise=_precise_routing(args, settings) if args.kv_events_endpoint else None,
    )
    app = router.create_app()
    if args.ext_proc_port is not None:
        # Imported only here: the Envoy messages take most of a second to import.
        from .ext_proc import ExtProcServer

        ExtProcServer(router, settings.host, args.ext_proc_port, args.ext_proc_fallbacks).attach(
            app
        )
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        **router.server_options(),
        # aiohttp's banner, first line only: it names the port bound (with --port 0 too).
        print=lambda banner: logger.info("%s", banner.splitlines()[0].strip("= ")),
    )
    return 0


def _precise_routing(args: argparse.Namespace, settings: RouterSettings) -> PreciseRouting:
    # Imported only here: zmq, msgspec and tokenizers serve precise routing alone.
    from .kv_feed import FeedSettings, KVEventFeeds, PreciseRouting
    from .kv_index import KVBlockIndex, PromptBlocks

    index = KVBlockIndex()
    feeds = KVEventFeeds(
        FeedSettings(args.kv_events_endpoint, args.kv_replay_endpoint, args.kv_events_topic),
        index,
    )
    blocks = PromptBlocks(Path(args.tokenizer), args.kv_block_size, settings.max_prefix_blocks)
    return PreciseRouting(blocks, index, feeds)


_POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _discovery_and_waker(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[Discovery, Waker | None]:
    if args.endpoints:
        endpoints = tuple(url.rstrip("/") for url in args.endpoints)
        logger.info("routing to %s", ", ".join(endpoints))
        return StaticEndpoints(endpoints), None
    # Imported only here: the kubernetes client is slow to import and unused otherwise.
    from pagefleet_operator.kube import Kube, load_api_client

    from .endpointslices import EndpointSliceDiscovery
    from .wake import ScaleSubresourceWaker

    namespace = args.namespace
    if namespace is None and _POD_NAMESPACE_FILE.exists():
        namespace = _POD_NAMESPACE_FILE.read_text().strip()
    if not namespace:
        parser.error("--namespace is required outside a pod (no service account namespace)")
    logger.info("routing to the ready pods of Service %s/%s", namespace, args.service)
    kube = Kube(load_api_client())
    discovery = EndpointSliceDiscovery(kube, namespace, args.service, args.port_name)
    if not args.scale_from_zero:
        return discovery, None
    logger.info(
        "holding requests and waking %s/%s while no pod is ready", namespace, args.scale_from_zero
    )
    return discovery, ScaleSubresourceWaker(kube, namespace, args.scale_from_zero)
