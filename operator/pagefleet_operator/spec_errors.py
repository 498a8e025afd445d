"""The error of a spec the operator cannot satisfy: spec.py's parse and kubefields.py's
checks raise it, the reconciler reports it as the Degraded condition."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec the operator cannot satisfy; the message names the field and what is allowed."""

    def __init__(self, field_path: str, problem: str):
        super().__init__(f"spec.{field_path}: {problem}")
        self.field_path = field_path
