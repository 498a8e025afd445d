"""Model URIs: one parser for the pod's loader and the operator's validation.

Forms:
  hf://org/name[@revision][/path/file.gguf]   downloaded from the Hugging Face Hub
  pvc://claim[/path]                          a PersistentVolumeClaim the operator mounts
  file:///path  or  /path, ./path, path       a local file or directory
  builtin://name                              shipped with the package

`parse_model_uri` is pure (no I/O, no torch) and this module imports nothing of the
package: the operator imports it to check a spec without downloading anything.
`pagefleet_serve.model.loader.resolve` turns a parsed URI into something on local disk,
downloading hf:// models on the way (`pagefleet_serve.model.loader.hub`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

BUILTIN_MODELS = ("smollm2-135m", "tiny-random")
# The operator mounts a pvc:// model's claim here (read-only) and rewrites the URI to a
# file:// path below it.
PVC_MOUNT_DIR = "/mnt/models"
FORMS = (
    "hf://org/name[@revision][/file.gguf], pvc://claim/path, file:///path, a local path, "
    f"or builtin://{{{','.join(BUILTIN_MODELS)}}}"
)

# Hub repository names: letters, digits, '.', '_' and '-', not starting with '.' or '-'.
_HUB_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HF_URI = re.compile(
    rf"^hf://(?P<repo_id>{_HUB_NAME}/{_HUB_NAME})(@(?P<revision>[^/@\s]+))?"
    r"(/(?P<filename>[^\s@]+\.gguf))?$"
)
# A Kubernetes object name (RFC 1123 label).
_PVC_URI = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?P<path>/[^\s]*)?$")


class UnsupportedModelError(ValueError):
    """A model the pod cannot serve; the message says what is supported."""


class ModelURIError(UnsupportedModelError):
    """A model URI that does not have one of the supported forms."""


@dataclass(frozen=True)
class ModelURI:
    uri: str
    scheme: str  # "hf", "pvc", "file" (file:// and plain paths) or "builtin"
    repo_id: str | None = None  # hf
    revision: str | None = None  # hf; None: the repository's default branch
    filename: str | None = None  # hf: one .gguf file of the repository
    claim: str | None = None  # pvc
    path: str | None = None  # pvc: inside the claim; file: the local path
    builtin: str | None = None

    @property
    def name(self) -> str:
        """The model's name when no served name is given (Hugging Face's org/name for hf)."""
        if self.scheme == "hf":
            return self.repo_id if self.filename is None else Path(self.filename).stem
        if self.scheme == "builtin":
            return self.builtin
        path = Path(self.path or self.claim)
        return path.stem if path.suffix == ".gguf" else path.name


def parse_model_uri(uri: str) -> ModelURI:
    """Split a model URI into its parts; raises ModelURIError naming the allowed forms."""
    if not uri or uri != uri.strip():
        raise ModelURIError(f"model URI {uri!r} is empty or has surrounding spaces; use {FORMS}")
    if uri.startswith("hf://"):
        match = _HF_URI.match(uri)
        if match is None:
            raise ModelURIError(
                f"{uri!r} is not hf://org/name[@revision][/file.gguf] (names: letters, digits, "
                "'.', '_', '-'; a file inside the repository must end in .gguf)"
            )
        return ModelURI(uri, "hf", **match.groupdict())
    if uri.startswith("pvc://"):
        match = _PVC_URI.match(uri)
        if match is None:
            raise ModelURIError(f"{uri!r} is not pvc://claim-name/path (claim: a DNS-1123 label)")
        path = (match["path"] or "").strip("/")
        if ".." in path.split("/"):  # the claim is mounted as a directory: never climb out
            raise ModelURIError(f"{uri!r}: a pvc:// path must not contain '..' segments")
        return ModelURI(uri, "pvc", claim=match["claim"], path=path)
    if uri.startswith("builtin://"):
        name = uri.removeprefix("builtin://")
        if name not in BUILTIN_MODELS:
            raise ModelURIError(f"unknown built-in model {uri!r}; built-in: {BUILTIN_MODELS}")
        return ModelURI(uri, "builtin", builtin=name)
    if uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not path.startswith("/"):
            raise ModelURIError(f"{uri!r}: a file:// URI needs an absolute path (file:///path)")
        return ModelURI(uri, "file", path=path)
    if "://" in uri:
        raise ModelURIError(f"{uri!r} has an unsupported scheme; use {FORMS}")
    return ModelURI(uri, "file", path=uri)
