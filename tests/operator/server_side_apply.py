"""What a real API server stores after a server-side apply (not a test module).

Shared by the in-memory FakeKube and the kmock emulator adapter, so both test doubles
hold what kube-apiserver would: fields the manager applied before and no longer sets are
removed, fields it sets are set, fields only others set are kept, and an apply that
changes nothing writes nothing. Lists whose items all carry a `name` (containers, env,
ports, volumes) merge by name, as their `x-kubernetes-list-map-keys` say; other lists are
atomic. One field manager's view, which is all the operator needs.
"""

from __future__ import annotations

import copy
from typing import Any


def _keyed(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, dict) and "name" in i for i in value)


def merge_applied(live: Any, before: Any, after: Any) -> Any:
    """`live` after the manager that last applied `before` applies `after`."""
    if isinstance(after, dict) and isinstance(live, dict):
        before = before if isinstance(before, dict) else {}
        result = {k: v for k, v in live.items() if not (k in before and k not in after)}
        for key, value in after.items():
            result[key] = merge_applied(live.get(key), before.get(key), value)
        return result
    if _keyed(after) and _keyed(live) and after:
        ours_before = {i["name"] for i in before} if _keyed(before) else set()
        wanted = {i["name"]: i for i in after}
        have = {i["name"]: i for i in live}
        result = [
            merge_applied(item, _by_name(before, item["name"]), wanted[item["name"]])
            if item["name"] in wanted
            else item
            for item in live
            if item["name"] in wanted or item["name"] not in ours_before
        ]
        return result + [copy.deepcopy(i) for i in after if i["name"] not in have]
    return copy.deepcopy(after)


def _by_name(items: Any, name: str) -> Any:
    if not _keyed(items):
        return None
    return next((i for i in items if i["name"] == name), None)


def merge_patch(old: dict, new: dict) -> dict:
    """The JSON merge patch that turns `old` into `new` (None removes a key)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            nested = merge_patch(old[key], value)
            if nested:
                patch[key] = nested
        elif key not in old or old[key] != value:
            patch[key] = copy.deepcopy(value)
    return patch
