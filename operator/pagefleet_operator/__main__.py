"""Run the operator: `python -m pagefleet_operator [--namespace NS] ...`.

kopf has no leader election: run exactly one replica (Deployment strategy Recreate).
`python -m pagefleet_operator rbac` prints the ClusterRole it needs.
"""

from __future__ import annotations

import argparse
import sys

import kopf
import yaml

from .config import DEFAULT_IMAGE_ENV, DEFAULT_PULL_POLICY_ENV, OperatorConfig
from .rbac import get_cluster_role
from .spec import PULL_POLICIES


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagefleet operator", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="watch InferenceServices and reconcile them (the default)")
    sub.add_parser("rbac", help="print the ClusterRole the operator needs, as YAML")
    for target in (parser, run):
        target.add_argument(
            "-n",
            "--namespace",
            action="append",
            default=[],
            help="watch only this namespace (repeatable); all namespaces when absent",
        )
        target.add_argument(
            "--liveness",
            default="http://0.0.0.0:8080/healthz",
            help="kopf's liveness endpoint; empty to disable",
        )
        target.add_argument(
            "--default-image",
            default=OperatorConfig.from_env().default_image,
            help=f"serving-pod image when spec.engine.image is empty (env {DEFAULT_IMAGE_ENV})",
        )
        target.add_argument(
            "--default-image-pull-policy",
            default=OperatorConfig.from_env().default_image_pull_policy,
            choices=PULL_POLICIES,
            help="serving-pod imagePullPolicy when spec.engine.imagePullPolicy is empty "
            f"(env {DEFAULT_PULL_POLICY_ENV}; unset: Kubernetes' default)",
        )
        target.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    if args.command == "rbac":
        yaml.safe_dump(get_cluster_role(), sys.stdout, sort_keys=False)
        return 0
    from . import handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=True,  # one replica, no peering objects
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(
            config=OperatorConfig(
                default_image=args.default_image,
                default_image_pull_policy=args.default_image_pull_policy,
            )
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
