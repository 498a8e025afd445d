"""Request bodies of the OpenAI API (pydantic), their validation errors as 400s naming the
field, and their translation into SamplingParams.

Bodies are validated strictly (a string where a number belongs is an error, as with
OpenAI; so is a float that is not finite); unknown fields are ignored, as OpenAI does, but
fields of the API that this server does not implement are refused when they ask for
something (`tools`, `logit_bias`, ...), so that a client never takes a 200 for a feature.
"""

import json
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.server.body_cost import check_body_cost
from pagefleet_serve.server.errors import APIError, bad_request
from pagefleet_serve.structured.constraint import StructuredOutputs, structural_tag_text
from pagefleet_serve.structured.thinking import ThinkingSpec

_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
# Request bodies keep unknown fields, so that unimplemented ones can be refused by name.
_BODY_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
# A completions request runs one engine request per prompt.
MAX_PROMPTS_PER_REQUEST = 64
# OpenAI's bounds on `metadata`.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# `user` names an end user (OpenAI documents no bound; an id needs far less than this).
MAX_USER_CHARS = 256
# A chat message's `name`, as a function's name.
MAX_NAME_CHARS = 64


def _absent(*neutral: object) -> Callable[[object], bool]:
    """A check that a value asks for nothing: null, or one of `neutral` (same type)."""
    return lambda value: (
        value is None or any(type(value) is type(n) and value == n for n in neutral)
    )


# Fields of OpenAI's and vLLM's APIs that this server does not implement, with the values
# that ask for nothing; any other value is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, Callable[[object], bool]] = {
    # Declared on chat only: on completions they are extra fields, refused here.
    "tools": _absent([]),
    "tool_choice": _absent("none"),
    "parallel_tool_calls": _absent(),
    "functions": _absent([]),
    "function_call": _absent("none"),
    "best_of": _absent(1),
    "echo": _absent(False),  # declared on completions only
    "suffix": _absent(""),
    "audio": _absent(),
    "modalities": _absent(["text"]),
    "prediction": _absent(),
    "use_beam_search": _absent(False),
    "include_stop_str_in_output": _absent(False),
}


def refuse_unsupported(body: BaseModel, fields: dict[str, Callable[[object], bool]]) -> None:
    """400 naming the first extra field of `body` in `fields` whose value asks for
    something."""
    for name, value in (body.model_extra or {}).items():
        asks_nothing = fields.get(name)
        if asks_nothing is not None and not asks_nothing(value):
            raise bad_request(
                f"{name}: this server does not support {name}; remove it from the request",
                param=name,
                code="unsupported_field",
            )


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk


class JSONSchemaFormat(BaseModel):
    model_config = _CONFIG
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TaggedStructure(BaseModel):
    """One structure of vLLM's older structural_tag form."""

    model_config = _CONFIG
    begin: str
    schema_: dict | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    # type structural_tag, as vLLM takes it: xgrammar's `format`, or the older
    # `structures` and `triggers`.
    format: dict | None = None
    structures: list[TaggedStructure] | None = None
    triggers: list[str] | None = None

    def structural_tag(self) -> str:
        if self.format is not None:
            return structural_tag_text({"format": self.format})
        if self.structures is None or self.triggers is None:
            raise bad_request(
                "response_format: type structural_tag needs format (or structures and triggers)",
                param="response_format",
            )
        structures = [s.model_dump(by_alias=True) for s in self.structures]
        return structural_tag_text({"structures": structures, "triggers": self.triggers})


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` object (the fields PageFleet implements)."""

    model_config = _CONFIG
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # JSON text, either form response_format takes


class _GenerationRequest(BaseModel):
    """The fields both endpoints share; None means "not given"."""

    model_config = _BODY_CONFIG
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
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    priority: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as text) -> bias
    min_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    # What the output must match: OpenAI's response_format, vLLM's structured_outputs, or
    # vLLM's older guided_* fields (one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # A reasoning model's answer carries its thinking unless this is false (completions
    # never think: it changes nothing there).
    include_reasoning: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def truncated(self, prompt: list[int], max_model_len: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt
        if k == -1:
            k = max_model_len
        if not 1 <= k <= max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens: must be -1 or in [1, {max_model_len}] (the maximum "
                f"context length), got {self.truncate_prompt_tokens}",
                param="truncate_prompt_tokens",
            )
        return prompt[-k:]

    def check_supported(self) -> None:
        """400 for a field this server would otherwise ignore although it asks for
        something."""
        refuse_unsupported(self, UNSUPPORTED_FIELDS)
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options: only allowed when stream is true", param="stream_options"
            )

    def constraint(self) -> StructuredOutputs | None:
        """The structured-output constraint the request asks for; 400 for more than one."""
        found = [c for c in self._constraints() if c is not None]
        if len(found) > 1:
            raise bad_request(
                f"{found[1].field}: only one structured-output constraint per request, "
                f"got {found[0].field} too",
                param=found[1].field,
            )
        return found[0] if found else None

    def _constraints(self):
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            yield _constraint("response_format", json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request(
                    "response_format: json_schema.schema is required for type json_schema",
                    param="response_format",
                )
            yield _constraint("response_format", json=json.dumps(fmt.json_schema.schema_))
        elif fmt is not None and fmt.type == "structural_tag":
            yield _constraint("response_format", structural_tag=fmt.structural_tag())
        so = self.structured_outputs
        if so is not None:
            schema = so.json_ if not isinstance(so.json_, dict) else json.dumps(so.json_)
            yield _constraint(
                "structured_outputs",
                json=schema,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=bool(so.json_object),
                structural_tag=_structural_tag_field(so.structural_tag),
            )
        if self.guided_json is not None:
            schema = self.guided_json
            yield _constraint(
                "guided_json", json=schema if isinstance(schema, str) else json.dumps(schema)
            )
        if self.guided_regex is not None:
            yield _constraint("guided_regex", regex=self.guided_regex)
        if self.guided_choice is not None:
            yield _constraint("guided_choice", choice=self.guided_choice)
        if self.guided_grammar is not None:
            yield _constraint("guided_grammar", grammar=self.guided_grammar)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        constraint: StructuredOutputs | None = None,
        thinking: ThinkingSpec | None = None,
        prompt_logprobs: int | None = None,
        defaults: dict | None = None,
    ) -> SamplingParams:
        """`constraint`: one the endpoint sets (tool calls), else the request's own;
        `thinking`: where a reasoning model's thinking ends (server/reasoning_api.py);
        `defaults`: the model's sampling settings for the fields the request left out."""
        if constraint is not None and self.constraint() is not None:
            raise bad_request(
                f"{self.constraint().field}: cannot be combined with tool_choice "
                '"required" or a named function',
                param=self.constraint().field,
            )
        constraint = constraint or self.constraint()
        given = (defaults or {}) | {
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
                "min_tokens",
            )
            if getattr(self, name) is not None
        }
        if self.prompt_logprobs is not None or prompt_logprobs is not None:
            given["prompt_logprobs"] = max(self.prompt_logprobs or 0, prompt_logprobs or 0)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                logprobs=logprobs,
                structured_outputs=constraint,
                thinking=thinking,
                logit_bias=_logit_bias(self.logit_bias),
                **given,
            )
        except ValueError as exc:
            raise value_error(exc, type(self)) from None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as JSON keys) -> (token id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 19:
            raise bad_request(
                f"logit_bias: keys must be token ids (non-negative integers), got {key[:40]!r}",
                param="logit_bias",
            )
        pairs.append((int(key), value))
    return tuple(pairs)


def _structural_tag_field(text: str | None) -> str | None:
    """structured_outputs.structural_tag (JSON text of either form) -> xgrammar's form."""
    if text is None:
        return None
    try:
        spec = json.loads(text)
        if not isinstance(spec, dict):
            raise ValueError("not a JSON object")
        return structural_tag_text(spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise bad_request(
            "structured_outputs: structural_tag must be the JSON text of a structural tag "
            '({"type": "structural_tag", "format": ...} or {"structures": [...], '
            f'"triggers": [...]}}): {exc}',
            param="structured_outputs",
        ) from None


def _constraint(field: str, **kinds) -> StructuredOutputs:
    try:
        return StructuredOutputs(field=field, **kinds)
    except ValueError as exc:
        raise bad_request(str(exc), param=field) from None


class ImageURL(BaseModel):
    model_config = _CONFIG
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; every image is read whole


class ContentPart(BaseModel):
    model_config = _CONFIG
    type: str
    text: str | None = None
    image_url: ImageURL | None = None  # type "image_url"


class FunctionCall(BaseModel):
    model_config = _CONFIG
    name: str
    arguments: str


class ToolCallMessage(BaseModel):
    model_config = _CONFIG
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    tool_calls: list[ToolCallMessage] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool's result answers this call
    # An assistant turn's thinking, for templates that keep it (vLLM's two names).
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise bad_request("messages: only text content parts are supported", param="messages")
        return "\n".join(part.text for part in self.content)

    def image_urls(self, index: int) -> list[tuple[str, str]]:
        """The URLs of this message's image parts, each with where it sits
        (`messages[i].content[j].image_url`); a 400 for a part that is neither text nor
        an image."""
        if self.content is None or isinstance(self.content, str):
            return []
        urls = []
        for j, part in enumerate(self.content):
            where = f"messages[{index}].content[{j}]"
            if part.type == "image_url" and part.image_url is not None:
                urls.append((part.image_url.url, f"{where}.image_url"))
            elif part.type != "text" or part.text is None:
                raise bad_request(
                    f"{where}: a content part is text (type text, text) or an image "
                    "(type image_url, image_url.url)",
                    param="messages",
                )
        return urls


class FunctionDefinition(BaseModel):
    model_config = _CONFIG
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (server/reasoning_api.py): variables for the chat template, the
    # effort the template is told, whether the answer carries the thinking, and how many
    # tokens the thinking may take before its end is forced.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    thinking_token_budget: int | None = None
    metadata: dict[str, str] | None = None  # kept by OpenAI with a stored completion

    def check_supported(self) -> None:
        super().check_supported()
        check_metadata(self.metadata)


def check_metadata(metadata: dict[str, str] | None) -> None:
    """400 for `metadata` past OpenAI's bounds; the message quotes no more than a key."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(
            f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(
                f"metadata: keys are at most {MAX_METADATA_KEY_CHARS} characters, got one of "
                f"{len(key)} ({key[:MAX_METADATA_KEY_CHARS]!r}...)",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(
                f"metadata: values are at most {MAX_METADATA_VALUE_CHARS} characters; the "
                f"value of {key!r} has {len(value)}",
                param="metadata",
            )


Model = TypeVar("Model", bound=BaseModel)


def parse(model: type[Model], body: bytes) -> Model:
    check_body_cost(body)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def value_error(exc: ValueError, model: type[BaseModel]) -> APIError:
    """A ValueError whose message starts with a field name -> 400 naming that field."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":")
    return bad_request(message, param=first if first in model.model_fields else None)


def too_many_prompts(count: int) -> APIError:
    return bad_request(
        f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {count}",
        param="prompt",
    )


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
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "guided_json": "a JSON schema, as an object or as JSON text",
}
