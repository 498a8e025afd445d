"""The router's subscriptions to its pods' KV cache events (ZMQ SUB, vLLM's format), kept
in a `KVBlockIndex`; the engine side is servingpod's engine/kv_events.py.

Each pod's batches carry consecutive sequence numbers. A pod followed for the first time
is asked for what it kept (its replay socket, from 0) so that the index starts with what
it already holds. A number past the next one is a gap (batches lost, e.g. the pod's queue
was full): the missing ones are asked for again. A number below the next one from a batch
newer than the last applied is a restart (a new process counts from 0): what the pod held
is forgotten, and its kept batches are read again. Batches the replay and the live socket
both deliver are applied once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from pagefleet_serve.kv_event_messages import END_OF_REPLAY, EventBatch

from .kv_index import KVBlockIndex, PromptBlocks

logger = logging.getLogger("pagefleet_router.kv_feed")

_REPLAY_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class FeedSettings:
    """Where a pod's sockets are: templates over its URL's {host} and {port}."""

    events_endpoint: str  # e.g. tcp://{host}:5557
    replay_endpoint: str | None = None  # e.g. tcp://{host}:5558
    topic: str = ""

    def endpoints(self, url: str) -> tuple[str, str | None]:
        parts = urlsplit(url)
        values = {"host": parts.hostname, "port": parts.port}
        replay = self.replay_endpoint.format(**values) if self.replay_endpoint else None
        return self.events_endpoint.format(**values), replay


class PodFeed:
    """One pod's events into the index, until cancelled."""

    def __init__(
        self, url: str, settings: FeedSettings, index: KVBlockIndex, context: zmq.asyncio.Context
    ) -> None:
        self.url = url
        self.events_endpoint, self.replay_endpoint = settings.endpoints(url)
        self.topic = settings.topic.encode()
        self.index = index
        self.context = context
        self.decoder = msgspec.msgpack.Decoder(EventBatch)
        self.next_sequence = 0
        self.last_ts = 0.0
        self.num_gaps = 0
        self.num_restarts = 0

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.events_endpoint)
        try:
            await self._replay(0)
            while True:
                _topic, sequence, payload = await sub.recv_multipart()
                await self._receive(int.from_bytes(sequence, "big"), payload)
        finally:
            sub.close(linger=0)

    async def _receive(self, sequence: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        if sequence < self.next_sequence and batch.ts > self.last_ts:
            self.num_restarts += 1
            logger.info("pod %s restarted its KV events: resyncing", self.url)
            self.index.clear(self.url)
            self.next_sequence = 0
            await self._replay(0)
        elif sequence > self.next_sequence:
            self.num_gaps += 1
            logger.info(
                "pod %s: KV event batches %d-%d missed: replaying",
                self.url,
                self.next_sequence,
                sequence - 1,
            )
            await self._replay(self.next_sequence)
            if sequence > self.next_sequence:  # not kept any more: start afresh
                self.index.clear(self.url)
        self._apply(sequence, batch)

    def _apply(self, sequence: int, batch: EventBatch) -> None:
        if sequence < self.next_sequence:
            return  # already applied (replayed, then received live)
        self.index.apply(self.url, batch.events)
        self.next_sequence = sequence + 1
        self.last_ts = batch.ts

    async def _replay(self, start: int) -> None:
        """Apply the pod's kept batches from `start` on (nothing without a replay socket,
        or when it does not answer in time)."""
        if self.replay_endpoint is None:
            return
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), _REPLAY_TIMEOUT_S)
                _, sequence, payload = frames
                if sequence == END_OF_REPLAY:
                    return
                self._apply(int.from_bytes(sequence, "big"), self.decoder.decode(payload))
        except asyncio.TimeoutError:
            logger.warning("pod %s did not answer a KV event replay", self.url)
        finally:
            dealer.close(linger=0)


class KVEventFeeds:
    """A `PodFeed` per pod the router routes to, started and stopped with the pod list."""

    def __init__(self, settings: FeedSettings, index: KVBlockIndex) -> None:
        self.settings = settings
        self.index = index
        self.context = zmq.asyncio.Context()
        self.feeds: dict[str, tuple[PodFeed, asyncio.Task]] = {}

    def follow(self, urls: list[str]) -> None:
        for url in [u for u in self.feeds if u not in urls]:
            _, task = self.feeds.pop(url)
            task.cancel()
            self.index.clear(url)
        for url in urls:
            if url not in self.feeds:
                feed = PodFeed(url, self.settings, self.index, self.context)
                self.feeds[url] = (feed, asyncio.create_task(self._run(feed)))

    async def _run(self, feed: PodFeed) -> None:
        try:
            await feed.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # the pod is routed by the approximate table from now on
            logger.exception("following %s's KV events failed", feed.url)
            self.index.clear(feed.url)

    async def close(self) -> None:
        for _, task in self.feeds.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.feeds.clear()
        self.context.term()


@dataclass
class PreciseRouting:
    """What the router needs to route by what the pods' caches hold."""

    blocks: PromptBlocks
    index: KVBlockIndex
    feeds: KVEventFeeds
