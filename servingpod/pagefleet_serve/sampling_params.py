"""Per-request sampling settings, validated at construction (ValueError names the field).

Every number is bounded, so that nothing a client sends can overflow a tensor or poison a
step shared with other requests: integers fit in 64 bits, floats are finite, lists are
capped. Limits that depend on the model (top_k above the vocabulary, n above max_num_seqs,
the context length) are the engine's to check or clamp.
"""

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from pagefleet_serve.structured.constraint import StructuredOutputs
from pagefleet_serve.structured.thinking import ThinkingSpec

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this, a temperature is greedy (as vLLM does): dividing logits by it would overflow.
SAMPLING_EPS = 1e-5
# Stop strings are matched per token per sample on the engine's output side; a partial match
# holds back up to the longest one's length.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
# logit_bias: entries per request, and each bias's bound (OpenAI's: -100 bans a token,
# 100 all but forces it).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0


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
    # What the output must match (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputs | None = None
    # A reasoning model's thinking: where it ends (the grammar starts after it) and its
    # budget of tokens; None: the output does not think (or nobody splits it).
    thinking: ThinkingSpec | None = None
    # (token id, bias) pairs (or vLLM's {token id: bias}) added to the row's logits before
    # anything else reads them.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Output tokens before which EOS and the stop token ids cannot be sampled (and stop
    # strings do not end the output).
    min_tokens: int = 0
    # None: off; k: each prompt token's logprob (after the first) plus the top k there.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        object.__setattr__(self, "logit_bias", tuple(tuple(e) for e in pairs))
        _int(self, "n", lo=1)
        _int(self, "max_tokens", lo=1)
        _number(self, "temperature", lambda v: v >= 0, "must be >= 0", tiny_ok=True)
        _number(self, "top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
        _int(self, "top_k", lo=-1)
        _number(self, "min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]")
        _number(self, "presence_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]")
        _number(self, "frequency_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]")
        _number(self, "repetition_penalty", lambda v: v > 0, "must be > 0")
        if self.seed is not None:
            _int(self, "seed", lo=INT64_MIN)
        if self.logprobs is not None:
            _int(self, "logprobs", lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int(self, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
        _int(self, "min_tokens", lo=0, hi=self.max_tokens)
        _check_logit_bias(self.logit_bias)
        _int(self, "priority", lo=INT64_MIN)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise ValueError("structured_outputs must be a StructuredOutputs")
        if self.thinking is not None and not isinstance(self.thinking, ThinkingSpec):
            raise ValueError("thinking must be a ThinkingSpec")
        _capped(self, "stop", MAX_STOP_STRINGS)
        if any(
            not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop
        ):
            raise ValueError(
                f"stop must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"
            )
        _capped(self, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        if any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT64_MAX
            for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be integers in [0, {INT64_MAX}], got {self.stop_token_ids!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def needs_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


def _check_logit_bias(entries: tuple[tuple[int, float], ...]) -> None:
    if len(entries) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(entries)}"
        )
    for entry in entries:
        token_id, bias = entry if len(entry) == 2 else (None, None)
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {entry!r}")
        if (
            not isinstance(bias, (int, float))
            or isinstance(bias, bool)
            or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
        ):
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token_id}"
            )


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed` (both signed 64-bit): the
    seed itself for the first sample, so that sample i is what a single request seeded with
    `sample_seed(seed, i)` draws, and a hash of (seed, index) for the others, so that no
    two (seed, index) pairs share a stream by construction (with `seed + index`, sample 1 of
    seed s was sample 0 of seed s + 1)."""
    return seed if index == 0 else _hash64(f"{seed}:{index}")


def generator_seed(seed: int) -> int:
    """What `torch.Generator.manual_seed` is given for a signed 64-bit seed: a hash of it,
    since the CPU generator keeps only a seed's low 32 bits (seeds s and s + 2**32, or -2**63
    and 0, were one stream). Two seeds then share a stream only by chance: 1 in 2**32 on the
    CPU, 1 in 2**64 on CUDA."""
    return _hash64(str(seed)) % 2**64


def _hash64(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _int(params: SamplingParams, name: str, lo: int, hi: int = INT64_MAX) -> None:
    value = getattr(params, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
    if not lo <= value <= hi:
        allowed = f">= {lo}" if hi == INT64_MAX else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number
FLOAT32_MAX = 3.4028234663852886e38


def _number(
    params: SamplingParams,
    name: str,
    ok: Callable[[float], bool],
    rule: str,
    tiny_ok: bool = False,
) -> None:
    value = getattr(params, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    # The sampler works in float32: a finite value past its range would arrive as inf or 0
    # (a NaN row, or a division by zero), so it is refused here, naming the field. `tiny_ok`:
    # a value that rounds to 0 means what 0 means (a temperature below 1e-5 is greedy).
    if abs(value) > FLOAT32_MAX or (value and not tiny_ok and abs(value) < FLOAT32_TINY):
        raise ValueError(
            f"{name} must be 0 or of magnitude in [{FLOAT32_TINY:g}, {FLOAT32_MAX:g}] "
            f"(float32), got {value}"
        )
    if not ok(value):
        raise ValueError(f"{name} {rule}, got {value}")


def _capped(params: SamplingParams, name: str, limit: int) -> None:
    if len(getattr(params, name)) > limit:
        raise ValueError(
            f"{name} may hold at most {limit} entries, got {len(getattr(params, name))}"
        )
