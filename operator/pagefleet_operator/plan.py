"""What to create, patch and delete: a pure comparison of desired with observed objects.

Observed objects carry fields the API server filled in (defaults, clusterIP, status),
so "unchanged" means every field we set is still there with our value, not equality.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

# Fields whose values the API server rewrites to a canonical quantity ("1000m" -> "1").
_QUANTITY_PARENTS = frozenset({"limits", "requests"})
_QUANTITY_KEYS = frozenset({"sizeLimit"})


@dataclass(frozen=True)
class Plan:
    to_create: tuple[dict[str, Any], ...] = ()
    to_patch: tuple[dict[str, Any], ...] = ()
    to_delete: tuple[dict[str, Any], ...] = ()
    # Objects with our names that belong to someone else: never touched, reported instead.
    conflicts: tuple[dict[str, Any], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.to_create or self.to_patch or self.to_delete)


def _same_quantity(want: Any, have: Any) -> bool:
    try:
        return parse_quantity(want) == parse_quantity(have)
    except ValueError:
        return False


def contains(have: Any, want: Any, key: str = "", parent: str = "") -> bool:
    """Whether `have` holds everything in `want`; the server drops empty values, so a
    wanted "" / [] / {} matches a missing field."""
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return False
        return all(
            contains(have[k], v, k, key) if k in have else v in ("", [], {})
            for k, v in want.items()
        )
    if isinstance(want, list):
        if not isinstance(have, list) or len(have) != len(want):
            return False
        return all(contains(h, w, key, parent) for h, w in zip(have, want, strict=True))
    if want == have and type(want) is type(have):
        return True
    if parent in _QUANTITY_PARENTS or key in _QUANTITY_KEYS:
        return _same_quantity(want, have)
    return False


def is_owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner_uid and ref.get("controller") for ref in refs)


def is_drifted(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> bool:
    want_meta, have_meta = desired["metadata"], observed.get("metadata", {})
    return not (
        contains(have_meta.get("labels", {}), want_meta.get("labels", {}))
        and contains(have_meta.get("annotations", {}), want_meta.get("annotations", {}))
        and contains(observed.get("spec", {}), desired.get("spec", {}))
    )


def plan(
    desired: Mapping[str, dict[str, Any] | None],
    observed: Mapping[str, dict[str, Any] | None],
    owner_uid: str,
) -> Plan:
    to_create, to_patch, to_delete, conflicts = [], [], [], []
    for kind, want in desired.items():
        have = observed.get(kind)
        if have is not None and not is_owned_by(have, owner_uid):
            if want is not None:
                conflicts.append(have)
        elif want is not None and have is None:
            to_create.append(want)
        elif want is not None and is_drifted(want, have):
            to_patch.append(want)
        elif want is None and have is not None:
            to_delete.append(have)
    return Plan(tuple(to_create), tuple(to_patch), tuple(to_delete), tuple(conflicts))
