"""Operator-wide settings: explicit, frozen, read from the command line or environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_IMAGE = "ghcr.io/pagefleet/servingpod:0.1.0"
# The operator's own image: it carries `pagefleet router` (aiohttp, no torch).
DEFAULT_ROUTER_IMAGE = "ghcr.io/pagefleet/operator:0.1.0"
ROUTER_IMAGE_ENV = "PAGEFLEET_OPERATOR_ROUTER_IMAGE"
DEFAULT_IMAGE_ENV = "PAGEFLEET_OPERATOR_DEFAULT_IMAGE"
DEFAULT_PULL_POLICY_ENV = "PAGEFLEET_OPERATOR_DEFAULT_IMAGE_PULL_POLICY"
PLATFORM_USER_IDS_ENV = "PAGEFLEET_OPERATOR_PLATFORM_ASSIGNS_USER_IDS"
ALLOWED_IMAGE_PREFIXES_ENV = "PAGEFLEET_OPERATOR_ALLOWED_IMAGE_PREFIXES"
POD_MONITOR_DEFAULT_ENV = "PAGEFLEET_OPERATOR_POD_MONITOR_BY_DEFAULT"
INFERENCE_POOL_DEFAULT_ENV = "PAGEFLEET_OPERATOR_INFERENCE_POOL_BY_DEFAULT"


@dataclass(frozen=True)
class OperatorConfig:
    # Used for every InferenceService that does not name spec.engine.image.
    default_image: str = DEFAULT_IMAGE
    # Used for every InferenceService that does not name spec.engine.imagePullPolicy;
    # None leaves it to Kubernetes (Always for :latest, else IfNotPresent).
    default_image_pull_policy: str | None = None
    # Serving pods run as uid/gid/fsGroup 1000 unless the platform must pick them
    # (OpenShift's restricted-v2 SCC refuses a fixed uid outside the namespace's range).
    fixed_user_ids: bool = True
    # Creating an InferenceService means choosing the image its pods run; when set,
    # spec.engine.image must start with one of these (the default image always may).
    allowed_image_prefixes: tuple[str, ...] = ()
    # spec.monitoring.podMonitor of every InferenceService that leaves it unset.
    pod_monitor_default: bool = False
    # The router's image for every InferenceService that does not name spec.router.image.
    router_image: str = DEFAULT_ROUTER_IMAGE
    # spec.gateway.inferencePool.enabled of every InferenceService that leaves it unset.
    inference_pool_default: bool = False

    def spec_options(self) -> dict[str, object]:
        """The keyword arguments of spec.parse_spec that come from the operator."""
        return {
            "default_image": self.default_image,
            "default_image_pull_policy": self.default_image_pull_policy,
            "fixed_user_ids": self.fixed_user_ids,
            "allowed_image_prefixes": self.allowed_image_prefixes,
            "pod_monitor_default": self.pod_monitor_default,
            "router_image": self.router_image,
            "inference_pool_default": self.inference_pool_default,
        }

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            default_image=os.environ.get(DEFAULT_IMAGE_ENV) or DEFAULT_IMAGE,
            default_image_pull_policy=os.environ.get(DEFAULT_PULL_POLICY_ENV) or None,
            fixed_user_ids=os.environ.get(PLATFORM_USER_IDS_ENV, "").lower() != "true",
            allowed_image_prefixes=tuple(
                p for p in os.environ.get(ALLOWED_IMAGE_PREFIXES_ENV, "").split(",") if p
            ),
            pod_monitor_default=os.environ.get(POD_MONITOR_DEFAULT_ENV, "").lower() == "true",
            router_image=os.environ.get(ROUTER_IMAGE_ENV) or DEFAULT_ROUTER_IMAGE,
            inference_pool_default=os.environ.get(INFERENCE_POOL_DEFAULT_ENV, "").lower() == "true",
        )
