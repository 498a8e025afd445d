"""Publishes the block manager's KV cache events over ZMQ, as vLLM does with
--kv-events-config (the format is in `pagefleet_serve.kv_event_messages`).

The step loop hands each step's events over as one batch and goes on: the batch waits in
a bounded queue for the publisher thread, which encodes it, numbers it and sends it on a
PUB socket, and keeps the last `buffer_steps` batches for the ROUTER replay socket (a
subscriber that saw a gap asks from a sequence number and gets every kept batch from
there, then END_OF_REPLAY). A full queue drops the batch and counts it: a subscriber
then sees a gap in the numbers and resyncs, while the step never waits on the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from pagefleet_serve.config import KVEventsConfig
from pagefleet_serve.kv_event_messages import END_OF_REPLAY, EventBatch, KVCacheEvent

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how long the thread waits on the replay socket between queue checks


def binds(endpoint: str) -> bool:
    """A wildcard host or a local path is this pod's own address: bind it. Any other
    address is a collector's: connect to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0  # batches the full queue turned away
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(config.max_queue_size)
        self._context = zmq.Context()
        # Made here so that a bad or taken endpoint fails the start, not the thread; used
        # only by the thread from then on (its start orders the two).
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint}: {exc}") from exc
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as a batch (nothing when there are none)."""
        if not events:
            return
        batch = EventBatch(time.time(), events, self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped & (self.num_dropped - 1) == 0:  # 1, 2, 4, 8, ...: a trace
                logger.warning(
                    "KV event queue full (%d batches): %d batches dropped so far",
                    self.config.max_queue_size,
                    self.num_dropped,
                )

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        sequence = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((topic, sequence.to_bytes(8, "big"), payload))
            except zmq.ZMQError:  # the batch is kept: a subscriber gets it by replay
                logger.exception("sending KV event batch %d failed", sequence)
            self._kept.append((sequence, payload))
            sequence += 1

    def _answer_replay(self) -> None:
        """A request [identity, b"", first sequence number] gets every kept batch from
        there as [identity, b"", number, payload], then END_OF_REPLAY."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        identity, _, first = frames
        start = int.from_bytes(first, "big")
        for sequence, payload in list(self._kept):
            if sequence >= start:
                self._replay.send_multipart((identity, b"", sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))
