"""Request bodies of the OpenAI API (pydantic), their validation errors as 400s naming the
field, and their translation into SamplingParams.

Bodies are validated strictly (a string where a number belongs is an error, as with
OpenAI); unknown fields are ignored, as OpenAI does.
"""

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.server.errors import APIError, bad_request

_CONFIG = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool | None = None


class _GenerationRequest(BaseModel):
    """The fields both endpoints share; None means "not given"."""

    model_config = _CONFIG
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    priority: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        given = {
            name: getattr(self, name)
            for name in (
                "n",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "seed",
                "stop",
                "stop_token_ids",
                "ignore_eos",
                "priority",
                "skip_special_tokens",
            )
            if getattr(self, name) is not None
        }
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)
        except ValueError as exc:
            raise value_error(exc, type(self)) from None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None


class ContentPart(BaseModel):
    model_config = _CONFIG
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise bad_request("messages: only text content parts are supported", param="messages")
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


Model = TypeVar("Model", bound=BaseModel)


def parse(model: type[Model], body: bytes) -> Model:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def value_error(exc: ValueError, model: type[BaseModel]) -> APIError:
    """A ValueError whose message starts with a field name -> 400 naming that field."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":")
    return bad_request(message, param=first if first in model.model_fields else None)


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}")
    if not first["loc"]:
        return bad_request(f"the request body must be a JSON object: {first['msg']}")
    field = str(first["loc"][0])
    same_field = [e for e in errors if e["loc"] and str(e["loc"][0]) == field]
    if len(same_field) > 1 and any(
        isinstance(e["loc"][1], str) for e in same_field if len(e["loc"]) > 1
    ):
        # A union field (e.g. prompt, stop): list what was allowed rather than every branch.
        expected = _UNION_HELP.get(field, "one of the types the API documents")
        return bad_request(f"{field}: wrong type; expected {expected}", param=field)
    path = ".".join(str(p) for p in first["loc"])
    if first["type"] == "missing":
        return bad_request(f"{path}: field required", param=field)
    return bad_request(f"{path}: {first['msg']}", param=field)


_UNION_HELP = {
    "prompt": "a string, an array of strings, an array of token ids or an array of arrays "
    "of token ids",
    "stop": "a string or an array of strings",
}
