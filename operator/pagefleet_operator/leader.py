"""One operator acts per scope: leader election on coordination.k8s.io Leases.

kopf's own peering lets operators of equal priority run side by side (it only warns), so
two releases reconciled and autoscaled the same resources. Here an operator holds a Lease
for its scope before it starts a handler, as controller-runtime's operators do: one in
every namespace it watches, or one cluster-wide Lease (in --leader-election-namespace)
when it watches them all. A standby waits, taking a Lease over only once its holder has
not renewed it for the lease duration; a leader that cannot renew stops, so that it never
acts beside the next one. Writes are merge patches that carry the resourceVersion read:
the API server answers 409 to a writer that lost the race.

`may_take` is the pure rule; `Lease` its I/O through Kube.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .kube import Kube, KubeError

logger = logging.getLogger("pagefleet_operator.leader")

LEASE_NAME = "pagefleet-operator"
CLUSTER_LEASE_NAMESPACE = "kube-system"


@dataclass(frozen=True)
class LeaseTiming:
    # A holder silent this long has lost the Lease; it renews well within it, and steps
    # down when it could not renew for renew_deadline_s (before anyone may take over).
    duration_s: float = 15.0
    renew_interval_s: float = 2.0
    renew_deadline_s: float = 10.0
    retry_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.renew_interval_s < self.renew_deadline_s < self.duration_s:
            raise ValueError(
                "lease timing needs 0 < renew_interval_s < renew_deadline_s < duration_s, "
                f"got {self.renew_interval_s}, {self.renew_deadline_s}, {self.duration_s}"
            )


def _parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _format_time(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # MicroTime


def may_take(spec: dict, identity: str, now: datetime.datetime) -> bool:
    """Whether `identity` may hold a Lease whose spec is `spec` at `now`: it holds it
    already, nobody does, or its holder has not renewed it within its duration."""
    holder = spec.get("holderIdentity")
    if not holder or holder == identity:
        return True
    renewed = spec.get("renewTime") or spec.get("acquireTime")
    if not renewed:
        return True
    duration = datetime.timedelta(seconds=spec.get("leaseDurationSeconds") or 0)
    return _parse_time(renewed) + duration < now


def lease_namespaces(watched: list[str], cluster_namespace: str) -> list[str]:
    """Where an operator's Leases live: each watched namespace, sorted (two operators
    sharing namespaces take them in one order, so neither holds half while waiting), or
    one cluster-wide Lease namespace."""
    return sorted(set(watched)) or [cluster_namespace]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class Lease:
    """One Lease, held as `identity` through `kube`."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        identity: str,
        timing: LeaseTiming,
        name: str = LEASE_NAME,
        clock: Callable[[], datetime.datetime] = _now,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.identity = identity
        self.timing = timing
        self.name = name
        self.clock = clock
        self.holder: str | None = None  # as last read

    @property
    def path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.name}"

    def try_hold(self) -> bool:
        """Acquire or renew: True if this operator holds the Lease now."""
        now = self.clock()
        try:
            live = self.kube.request("GET", self.path)
        except KubeError as exc:
            if exc.status != 404:
                raise
            return self._create(now)
        spec = live.get("spec") or {}
        self.holder = spec.get("holderIdentity")
        if not may_take(spec, self.identity, now):
            return False
        mine = spec.get("holderIdentity") == self.identity
        patch = {
            "metadata": {"resourceVersion": live["metadata"]["resourceVersion"]},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.timing.duration_s),
                "renewTime": _format_time(now),
                **(
                    {}
                    if mine
                    else {
                        "acquireTime": _format_time(now),
                        "leaseTransitions": (spec.get("leaseTransitions") or 0) + 1,
                    }
                ),
            },
        }
        try:
            self.kube.request(
                "PATCH", self.path, patch, content_type="application/merge-patch+json"
            )
        except KubeError as exc:
            if exc.status == 409:  # another operator wrote it since we read it
                return False
            raise
        self.holder = self.identity
        return True

    def _create(self, now: datetime.datetime) -> bool:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.timing.duration_s),
                "acquireTime": _format_time(now),
                "renewTime": _format_time(now),
                "leaseTransitions": 0,
            },
        }
        try:
            self.kube.request("POST", self.path.rsplit("/", 1)[0], body)
        except KubeError as exc:
            if exc.status == 409:  # created by another operator first
                return False
            raise
        self.holder = self.identity
        return True

    def release(self) -> None:
        """Give the Lease up on a clean stop, so that a standby need not wait it out."""
        try:
            live = self.kube.request("GET", self.path)
            if (live.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            patch = {
                "metadata": {"resourceVersion": live["metadata"]["resourceVersion"]},
                "spec": {"holderIdentity": None, "leaseDurationSeconds": 1},
            }
            self.kube.request(
                "PATCH", self.path, patch, content_type="application/merge-patch+json"
            )
        except KubeError as exc:
            logger.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc)


class LeaderElection:
    """Holds every Lease of a scope: `wait_until_leader` blocks until it does, then a
    thread renews them and sets `lost` when one could not be renewed in time (and calls
    what `when_lost` was given)."""

    def __init__(self, leases: list[Lease], timing: LeaseTiming) -> None:
        self.leases = leases
        self.timing = timing
        self.lost = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._on_lost: list[Callable[[], object]] = []

    def when_lost(self, callback: Callable[[], object]) -> None:
        """Call `callback` once a Lease is lost (from the renewal thread), or now if one
        already is."""
        with self._lock:
            if not self.lost.is_set():
                self._on_lost.append(callback)
                return
        callback()

    def wait_until_leader(self) -> None:
        for lease in self.leases:
            waiting_on = None
            while not self._attempt(lease):
                if lease.holder != waiting_on:
                    waiting_on = lease.holder
                    logger.info(
                        "standing by: Lease %s/%s is held by %s; another operator acts on "
                        "this scope",
                        lease.namespace,
                        lease.name,
                        waiting_on,
                    )
                time.sleep(self.timing.retry_interval_s)
            logger.info("holding Lease %s/%s as %s", lease.namespace, lease.name, lease.identity)
        self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
        self._thread.start()

    @staticmethod
    def _attempt(lease: Lease) -> bool:
        try:
            return lease.try_hold()
        except KubeError as exc:
            logger.warning("Lease %s/%s: %s", lease.namespace, lease.name, exc)
            return False

    def _renew(self) -> None:
        renewed = {id(lease): time.monotonic() for lease in self.leases}
        while not self._stopped.wait(self.timing.renew_interval_s):
            for lease in self.leases:
                if self._attempt(lease):
                    renewed[id(lease)] = time.monotonic()
                    continue
                taken = lease.holder not in (None, lease.identity)
                if taken or time.monotonic() - renewed[id(lease)] > self.timing.renew_deadline_s:
                    logger.error(
                        "lost Lease %s/%s (held by %s now): stopping",
                        lease.namespace,
                        lease.name,
                        lease.holder,
                    )
                    with self._lock:
                        self.lost.set()
                        callbacks, self._on_lost = self._on_lost, []
                    for callback in callbacks:
                        callback()
                    return

    def stop(self) -> None:
        """Stop renewing; give the Leases up unless they were lost."""
        logger.info("stopped: giving up the Leases")
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        if not self.lost.is_set():
            for lease in self.leases:
                lease.release()
