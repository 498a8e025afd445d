"""Operator-wide settings: explicit, frozen, read from the command line or environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_IMAGE = "ghcr.io/pagefleet/servingpod:0.1.0"
DEFAULT_IMAGE_ENV = "PAGEFLEET_OPERATOR_DEFAULT_IMAGE"
DEFAULT_PULL_POLICY_ENV = "PAGEFLEET_OPERATOR_DEFAULT_IMAGE_PULL_POLICY"


@dataclass(frozen=True)
class OperatorConfig:
    # Used for every InferenceService that does not name spec.engine.image.
    default_image: str = DEFAULT_IMAGE
    # Used for every InferenceService that does not name spec.engine.imagePullPolicy;
    # None leaves it to Kubernetes (Always for :latest, else IfNotPresent).
    default_image_pull_policy: str | None = None

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            default_image=os.environ.get(DEFAULT_IMAGE_ENV) or DEFAULT_IMAGE,
            default_image_pull_policy=os.environ.get(DEFAULT_PULL_POLICY_ENV) or None,
        )
