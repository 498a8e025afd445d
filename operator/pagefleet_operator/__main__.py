"""Run the operator: `python -m pagefleet_operator [--namespace NS] ...`.

One operator acts per scope: it holds a coordination.k8s.io Lease for it first
(leader.py); a second one stands by. `python -m pagefleet_operator rbac` prints the
ClusterRole it needs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import uuid

import kopf
import yaml

from .config import (
    ALLOWED_IMAGE_PREFIXES_ENV,
    DEFAULT_IMAGE_ENV,
    DEFAULT_PULL_POLICY_ENV,
    INFERENCE_POOL_DEFAULT_ENV,
    PLATFORM_USER_IDS_ENV,
    POD_MONITOR_DEFAULT_ENV,
    ROUTER_IMAGE_ENV,
    OperatorConfig,
)
from .kube import Kube, load_api_client
from .leader import CLUSTER_LEASE_NAMESPACE, LeaderElection, Lease, LeaseTiming, lease_namespaces
from .rbac import get_cluster_role
from .spec import PULL_POLICIES
from .telemetry import OperatorMetrics
from .tracing import get_tracer
from .uninstall import uninstall


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagefleet operator", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="watch InferenceServices and reconcile them (the default)")
    sub.add_parser("rbac", help="print the ClusterRole the operator needs, as YAML")
    remove = sub.add_parser(
        "uninstall",
        help="delete every InferenceService and wait until the operator released them "
        "(the chart's pre-delete hook)",
    )
    remove.add_argument(
        "-n", "--namespace", action="append", default=[], help="only this namespace (repeatable)"
    )
    remove.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="seconds to wait for the operator before releasing its finalizer here",
    )
    # Every option is taken before `run` and after it. A sub-parser writes its defaults
    # over what the main parser read (`--namespace NS run` ran cluster-wide), so only the
    # main parser has defaults; `run` sets an option only when it is given there.
    for target in (parser, run):

        def default(value, target=target):
            return value if target is parser else argparse.SUPPRESS

        target.add_argument(
            "-n",
            "--namespace",
            action="append",
            default=default([]),
            help="watch only this namespace (repeatable); all namespaces when absent",
        )
        target.add_argument(
            "--liveness",
            default=default("http://0.0.0.0:8080/healthz"),
            help="kopf's liveness endpoint; empty to disable",
        )
        target.add_argument(
            "--metrics-port",
            type=int,
            default=default(0),
            help="serve the operator's own Prometheus /metrics on this port; "
            "0, the default, serves none (the chart sets 8081)",
        )
        target.add_argument(
            "--metrics-bind-address",
            default=default("0.0.0.0"),
            help="the address --metrics-port listens on (127.0.0.1: this host only)",
        )
        target.add_argument(
            "--health-probe-bind-address",
            default=default(None),
            metavar="[HOST]:PORT",
            help="where kopf's health endpoint (/healthz) listens, as controller-runtime "
            "operators spell it (':8080' every address, '127.0.0.1:8080' this host only); "
            "replaces --liveness",
        )
        target.add_argument(
            "--pod-monitor-by-default",
            action="store_true",
            default=default(OperatorConfig.from_env().pod_monitor_default),
            help="create a PodMonitor for every InferenceService that leaves "
            f"spec.monitoring.podMonitor unset (env {POD_MONITOR_DEFAULT_ENV}=true)",
        )
        target.add_argument(
            "--inference-pool-by-default",
            action="store_true",
            default=default(OperatorConfig.from_env().inference_pool_default),
            help="create a Gateway API Inference Extension InferencePool (with the router as "
            "its Endpoint Picker) for every InferenceService that leaves "
            f"spec.gateway.inferencePool.enabled unset (env {INFERENCE_POOL_DEFAULT_ENV}=true)",
        )
        target.add_argument(
            "--default-image",
            default=default(OperatorConfig.from_env().default_image),
            help=f"serving-pod image when spec.engine.image is empty (env {DEFAULT_IMAGE_ENV})",
        )
        target.add_argument(
            "--router-image",
            default=default(OperatorConfig.from_env().router_image),
            help="`pagefleet router` image when spec.router.image is empty (env "
            f"{ROUTER_IMAGE_ENV}; the chart passes the operator's own image)",
        )
        target.add_argument(
            "--default-image-pull-policy",
            default=default(OperatorConfig.from_env().default_image_pull_policy),
            choices=PULL_POLICIES,
            help="serving-pod imagePullPolicy when spec.engine.imagePullPolicy is empty "
            f"(env {DEFAULT_PULL_POLICY_ENV}; unset: Kubernetes' default)",
        )
        target.add_argument(
            "--platform-assigns-user-ids",
            action="store_true",
            default=default(not OperatorConfig.from_env().fixed_user_ids),
            help="leave the serving pods' runAsUser, runAsGroup and fsGroup to the platform "
            f"(OpenShift restricted-v2) instead of 1000 (env {PLATFORM_USER_IDS_ENV}=true)",
        )
        target.add_argument(
            "--allowed-image-prefix",
            action="append",
            default=default(list(OperatorConfig.from_env().allowed_image_prefixes)),
            help="refuse spec.engine.image unless it starts with one of these (repeatable; "
            f"env {ALLOWED_IMAGE_PREFIXES_ENV}, comma-separated); unset: any image",
        )
        target.add_argument(
            "--otlp-traces-endpoint",
            default=default(None),
            help="send a span per reconcile and autoscaler round to this OTLP/HTTP endpoint "
            "(e.g. http://collector:4318/v1/traces); unset: no tracing",
        )
        target.add_argument(
            "--leader-election-namespace",
            default=default(CLUSTER_LEASE_NAMESPACE),
            help="where a cluster-wide operator keeps its Lease (every cluster-wide operator "
            "must use the same one); with --namespace, each watched namespace holds one",
        )
        for flag, value, what in (
            ("lease-duration", LeaseTiming.duration_s, "a holder silent this long loses the Lease"),
            (
                "renew-deadline",
                LeaseTiming.renew_deadline_s,
                "the leader steps down when it could not renew for this long",
            ),
            (
                "retry-period",
                LeaseTiming.renew_interval_s,
                "how often the leader renews and a standby tries to take the Lease",
            ),
        ):
            target.add_argument(
                f"--leader-election-{flag}",
                type=float,
                default=default(value),
                metavar="SECONDS",
                help=f"{what} (default {value:g}; controller-runtime's --leader-elect-{flag})",
            )
        target.add_argument("-v", "--verbose", action="store_true", default=default(False))
    return parser


def lease_timing(args: argparse.Namespace) -> LeaseTiming:
    """The --leader-election-* flags as a LeaseTiming; a usage error (exit 2) unless
    0 < retry period < renew deadline < lease duration."""
    try:
        return LeaseTiming(
            duration_s=args.leader_election_lease_duration,
            renew_deadline_s=args.leader_election_renew_deadline,
            renew_interval_s=args.leader_election_retry_period,
            retry_interval_s=args.leader_election_retry_period,
        )
    except ValueError:
        get_parser().error(
            "leader election needs 0 < --leader-election-retry-period < "
            "--leader-election-renew-deadline < --leader-election-lease-duration, got "
            f"{args.leader_election_retry_period:g}, {args.leader_election_renew_deadline:g}, "
            f"{args.leader_election_lease_duration:g}"
        )


def main(argv: list[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    if args.command == "rbac":
        yaml.safe_dump(get_cluster_role(), sys.stdout, sort_keys=False)
        return 0
    if args.command == "uninstall":
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        uninstall(Kube(load_api_client()), args.namespace, args.timeout)
        return 0
    liveness_endpoint(args)  # a malformed address fails here, before anything starts
    timing = lease_timing(args)
    from . import handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=args.verbose)
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_bind_address)
    identity = f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    kube = Kube(load_api_client())
    election = LeaderElection(
        [
            Lease(kube, namespace, identity, timing)
            for namespace in lease_namespaces(args.namespace, args.leader_election_namespace)
        ],
        timing,
    )
    election.wait_until_leader()
    try:
        asyncio.run(_operate(args, metrics, election))
    finally:
        election.stop()
    return 1 if election.lost.is_set() else 0


def liveness_endpoint(args: argparse.Namespace) -> str | None:
    """kopf's liveness URL: from --health-probe-bind-address when given, else --liveness
    (None: no health endpoint)."""
    address = args.health_probe_bind_address
    if address is None:
        return args.liveness or None
    host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(
            f"--health-probe-bind-address {address!r}: expected [HOST]:PORT, e.g. ':8080'"
        )
    return f"http://{host or '0.0.0.0'}:{port}/healthz"


async def _operate(
    args: argparse.Namespace, metrics: OperatorMetrics, election: LeaderElection
) -> None:
    """kopf until SIGTERM/SIGINT or a lost Lease, which cancels it. No kopf stop_flag:
    kopf leaves the task waiting on one pending when a signal stops it, and then waits 5 s
    for that "hung" task (and a threading.Event's waiter is an executor thread that
    asyncio.run's exit joins: the operator never exited on SIGTERM, and the kubelet killed
    it terminationGracePeriodSeconds later)."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    election.when_lost(lambda: loop.call_soon_threadsafe(task.cancel))
    try:
        await _kopf_operator(args, metrics)
    except asyncio.CancelledError:
        if not election.lost.is_set():
            raise


async def _kopf_operator(args: argparse.Namespace, metrics: OperatorMetrics) -> None:
    await kopf.operator(
        standalone=True,  # the Lease, not kopf's peering, keeps a second operator idle
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness_endpoint(args),
        memo=kopf.Memo(
            config=OperatorConfig(
                default_image=args.default_image,
                default_image_pull_policy=args.default_image_pull_policy,
                fixed_user_ids=not args.platform_assigns_user_ids,
                allowed_image_prefixes=tuple(args.allowed_image_prefix),
                pod_monitor_default=args.pod_monitor_by_default,
                router_image=args.router_image,
                inference_pool_default=args.inference_pool_by_default,
            ),
            metrics=metrics,
            tracer=get_tracer(args.otlp_traces_endpoint, "pagefleet-operator"),
            namespaces=tuple(args.namespace),
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
