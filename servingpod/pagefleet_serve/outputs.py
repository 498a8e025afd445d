"""What the engine hands back, step by step: plain data, no tensors."""

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass
class CompletionOutput:
    """One sample. In a step's output: what is new since the last output (a delta); in
    `LLM.generate`'s result: the whole sample."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # A reasoning model's thinking, split from `text` by the request's reasoning parser,
    # and how many of `token_ids` it took (its markers included).
    reasoning: str = ""
    num_reasoning_tokens: int = 0
    stop_reason: str | None = None  # the stop string that ended it (vLLM's stop_reason)

    def extend(self, delta: "CompletionOutput") -> None:
        self.text += delta.text
        self.reasoning += delta.reasoning
        self.num_reasoning_tokens += delta.num_reasoning_tokens
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason or self.stop_reason


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # the samples with news this step
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed this request
    # An embedding request's pooled vector (float32 values, normalised as the model says).
    embedding: list[float] | None = None
    # With prompt_logprobs, in the request's first output: one entry per prompt token, the
    # first None (nothing comes before it to score it).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
