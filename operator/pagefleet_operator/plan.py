"""What to apply and delete: a pure comparison of desired with observed objects.

Every desired object is applied whole with server-side apply, every time: the API server
removes the fields we set before and no longer set (a removed Ingress TLS entry, class
or annotation), keeps the fields others own (an injected sidecar, a `kubectl annotate`),
and writes nothing when the result is unchanged. So the plan never guesses what changed;
it only decides ownership, and the apply's resourceVersion says whether anything was
written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Apply:
    desired: dict[str, Any]
    # resourceVersion of the live object before the apply; None when it does not exist.
    observed_version: str | None


@dataclass(frozen=True)
class Plan:
    to_apply: tuple[Apply, ...] = ()
    to_delete: tuple[dict[str, Any], ...] = ()
    # Objects with our names that belong to someone else: never touched, reported instead.
    conflicts: tuple[dict[str, Any], ...] = ()


def contains(have: Any, want: Any) -> bool:
    """Whether `have` holds everything in `want`; the server drops empty values, so a
    wanted "" / [] / {} matches a missing field."""
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return False
        return all(
            contains(have[k], v) if k in have else v in ("", [], {}) for k, v in want.items()
        )
    if isinstance(want, list):
        if not isinstance(have, list) or len(have) != len(want):
            return False
        return all(contains(h, w) for h, w in zip(have, want, strict=True))
    return want == have and type(want) is type(have)


def is_owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner_uid and ref.get("controller") for ref in refs)


def plan(
    desired: Mapping[str, dict[str, Any] | None],
    observed: Mapping[str, dict[str, Any] | None],
    owner_uid: str,
) -> Plan:
    to_apply, to_delete, conflicts = [], [], []
    for kind, want in desired.items():
        have = observed.get(kind)
        if have is not None and not is_owned_by(have, owner_uid):
            if want is not None:
                conflicts.append(have)
        elif want is not None:
            version = have["metadata"].get("resourceVersion") if have is not None else None
            to_apply.append(Apply(want, version))
        elif have is not None:
            to_delete.append(have)
    return Plan(tuple(to_apply), tuple(to_delete), tuple(conflicts))
