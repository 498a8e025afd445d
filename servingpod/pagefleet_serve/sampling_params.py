"""Per-request sampling settings, validated at construction (ValueError names the field)."""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: the sampled token's logprob plus the top k
    skip_special_tokens: bool = True
    priority: int = 0  # lower runs first; ties go by arrival

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _int(self, "n", lo=1)
        _int(self, "max_tokens", lo=1)
        _number(self, "temperature", lambda v: v >= 0, "must be >= 0")
        _number(self, "top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
        _int(self, "top_k", lo=-1)
        _number(self, "min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]")
        _number(self, "presence_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]")
        _number(self, "frequency_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]")
        _number(self, "repetition_penalty", lambda v: v > 0, "must be > 0")
        if self.seed is not None:
            _int(self, "seed", lo=-(2**63))
        if self.logprobs is not None:
            _int(self, "logprobs", lo=0, hi=20)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def needs_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


def _int(params: SamplingParams, name: str, lo: int, hi: int | None = None) -> None:
    value = getattr(params, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _number(params: SamplingParams, name: str, ok: Callable[[float], bool], rule: str) -> None:
    value = getattr(params, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not ok(value):
        raise ValueError(f"{name} {rule}, got {value}")
