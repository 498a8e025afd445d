"""The LoRA adapters an engine serves, by name: which are served (each load gets a new
id, so that a reloaded name shares no prefix-cache blocks; a read back keeps its id),
which are in host memory (`LoRAHostCache`, --max-cpu-loras; the scheduler's slots say
which are on the device), and the reads of those host memory dropped, made again off the
step loop in a reader thread of their own. The requests that wait for such a read are the
`Admission`'s; what the requests use is told to each call that needs it."""

import itertools
import logging
from collections.abc import Iterable, Set
from concurrent.futures import Future, ThreadPoolExecutor

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.lora_cache import LoRAHostCache
from pagefleet_serve.engine.lora_slots import LoRASlots
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.messages import LoRAAdapterInfo, LoRAStats
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.lora import (
    LoRAAdapter,
    LoRABusy,
    LoRAError,
    LoRANotFound,
    ServedLoRA,
    read_adapter,
)

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, slots: LoRASlots | None
    ) -> None:
        """`slots`: the scheduler's device slots (None: adapters are not enabled)."""
        self.config = config
        self.model_config = model_config
        self.adapters: dict[str, ServedLoRA] = {}
        self._ids = itertools.count(1)
        self.cache = LoRAHostCache(config.max_cpu_loras, slots) if slots is not None else None
        self.slots = slots
        # The reads back in flight by lora_id, in the reader thread (started with the first).
        self._reads: dict[int, Future[LoRAAdapter]] = {}
        self._reader: ThreadPoolExecutor | None = None

    def infos(self) -> tuple[LoRAAdapterInfo, ...]:
        return tuple(LoRAAdapterInfo(a.name, a.path) for a in self.adapters.values())

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter to serve as `name`, changing nothing here (any thread:
        a core reads adapters off its step loop). LoRAError: not enabled, the name taken,
        or the adapter unreadable or unfit for this model (naming the file)."""
        if not self.config.enable_lora:
            raise LoRAError("this server does not serve LoRA adapters: start it with --enable-lora")
        self._check_name_free(name)
        return read_adapter(
            name, next(self._ids), path, self.model_config, self.config.max_lora_rank
        )

    def add(self, adapter: LoRAAdapter, in_use: Set[int | None]) -> None:
        """Serve an adapter `read` read (engine thread only); with host memory full of
        adapters requests use (`in_use`: their lora_ids), it is read again for its first
        request."""
        self._check_name_free(adapter.name)
        self.adapters[adapter.name] = ServedLoRA(adapter.name, adapter.lora_id, adapter.path)
        if self.cache.reserve(adapter.lora_id, in_use):
            self.cache.put(adapter)
        logger.info(
            "LoRA adapter %s (rank %d) loaded from %s", adapter.name, adapter.rank, adapter.path
        )

    def _check_name_free(self, name: str) -> None:
        if name in self.adapters:
            raise LoRAError(f"the LoRA adapter {name!r} has already been loaded")

    def unload(self, name: str, users: Iterable[Sequence]) -> None:
        """Stop serving an adapter. LoRANotFound; LoRABusy while requests (of `users`, the
        sequences that read or will read an adapter) use it: they are not cut short,
        unload once they finish."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoRANotFound(f"the LoRA adapter {name!r} is not loaded")
        requests = {seq.request_id for seq in users if seq.lora_id == adapter.lora_id}
        if requests:
            raise LoRABusy(
                f"the LoRA adapter {name!r} is in use by {len(requests)} requests; unload it "
                "when they have finished"
            )
        del self.adapters[name]
        self.cache.drop(adapter.lora_id)
        logger.info("LoRA adapter %s unloaded", name)

    def lora_id(self, name: str | None) -> int | None:
        """The id of the adapter a request names (None: the base model); LoRANotFound."""
        if name is None:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoRANotFound(f"the LoRA adapter {name!r} is not loaded")
        return adapter.lora_id

    def served(self, lora_id: int) -> ServedLoRA:
        return next(a for a in self.adapters.values() if a.lora_id == lora_id)

    def use(self, lora_id: int | None) -> bool:
        """Whether a sequence of `lora_id` can run now (the base model, or its adapter in
        host memory, then the most recently used)."""
        if lora_id is None:
            return True
        if lora_id not in self.cache:
            return False
        self.cache.use(lora_id)
        return True

    def read_back(self, lora_id: int, in_use: Set[int | None]) -> None:
        """Start reading an adapter host memory dropped, once the cache has a place for it
        (one no request uses, of `in_use`); until then, nothing."""
        if self.cache.is_reserved(lora_id) or not self.cache.reserve(lora_id, in_use):
            return
        served = self.served(lora_id)
        logger.info("LoRA adapter %s: read back from %s", served.name, served.path)
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-reader")
        self._reads[lora_id] = self._reader.submit(
            read_adapter,
            served.name,
            lora_id,
            served.path,
            self.model_config,
            self.config.max_lora_rank,
        )

    def finish_reads(self) -> dict[int, Exception]:
        """Put the adapters read back since the last call into host memory; why each that
        could not be read failed, by lora_id."""
        failed = {}
        for lora_id, future in list(self._reads.items()):
            if not future.done():
                continue
            del self._reads[lora_id]
            try:
                self.cache.put(future.result())
            except Exception as exc:  # noqa: BLE001 - its requests fail, the step goes on
                self.cache.drop(lora_id)
                failed[lora_id] = exc
        return failed

    @property
    def reading(self) -> list[Future[LoRAAdapter]]:
        """The reads back in flight."""
        return list(self._reads.values())

    def stats(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> LoRAStats | None:
        """Which adapters the `running` and the `waiting` sequences use, and where the
        served ones are."""
        if not self.config.enable_lora:
            return None
        names = {a.lora_id: a.name for a in self.adapters.values()}

        def named(lora_ids) -> tuple[str, ...]:
            return tuple(sorted({names[i] for i in lora_ids if i in names}))

        on_device = set(self.slots.slot_of)
        in_host_memory = () if self.config.max_cpu_loras is None else self.cache.lora_ids()
        return LoRAStats(
            named(s.lora_id for s in running),
            named(s.lora_id for s in waiting),
            self.config.max_loras,
            on_device=named(on_device),
            in_host_memory=named(i for i in in_host_memory if i not in on_device),
        )

    def close(self) -> None:
        """Stop the reader thread, if any."""
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
