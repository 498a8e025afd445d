"""vLLM's `POST /tokenize` and `POST /detokenize`: the server's own tokenizer and chat
template, so that clients count and cut prompts exactly as the server will see them.

/tokenize takes a `prompt` (completions style) or `messages` (chat style, rendered by the
same template as /v1/chat/completions) and answers `{count, max_model_len, tokens,
token_strs}`, with the chat path's `chat_template_kwargs` and prompt renderer;
/detokenize takes `tokens` and answers `{prompt}`."""

from typing import Any, Literal

from pydantic import BaseModel

from pagefleet_serve.server.chat_template import template_messages
from pagefleet_serve.server.errors import bad_request
from pagefleet_serve.server.media import read_images
from pagefleet_serve.server.protocol import _CONFIG, ChatMessage, Tool, parse
from pagefleet_serve.server.reasoning_api import render_prompt, template_kwargs
from pagefleet_serve.server.state import ServerState


class TokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as on /v1/chat/completions
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]


class TokenizeEndpoints:
    """Both routes' work, run in the frontend thread (the tokenizer is not thread-safe)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.inputs = state.engine.inputs
        self.outputs = state.engine.outputs
        self.tokenizer = self.inputs.tokenizer
        self.max_model_len = self.inputs.limits.max_model_len
        self.max_chars = self.inputs.max_prompt_chars

    def tokenize(self, body: bytes) -> dict:
        request = parse(TokenizeRequest, body)
        self.state.check_model(request.model)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        tokens = self._tokens(request)
        return {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": (
                self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
            ),
        }

    def detokenize(self, body: bytes) -> dict:
        request = parse(DetokenizeRequest, body)
        self.state.check_model(request.model)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens: ids must be in [0, {vocab}), got {bad[0]}", param="tokens")
        return {"prompt": self.outputs.decode(request.tokens)}

    def _tokens(self, request: TokenizeRequest) -> list[int]:
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if request.prompt is not None:
            text, special = request.prompt, request.add_special_tokens is not False
        else:
            if request.add_generation_prompt and request.continue_final_message:
                raise bad_request(
                    "continue_final_message: cannot be combined with add_generation_prompt",
                    param="continue_final_message",
                )
            tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
            # Images are read (and refused) as a chat request's are; their tokens counted.
            images = read_images(request.messages, self.state.media, self.state.settings.model_name)
            text = render_prompt(
                self.inputs,
                template_messages(request.messages),
                tools,
                template_kwargs(request.chat_template_kwargs, request.reasoning_effort),
                request.add_generation_prompt,
                request.continue_final_message,
            )
            special = bool(request.add_special_tokens)
            if images and self.state.image_processing is not None:
                try:
                    text = self.state.image_processing.expand(text, len(images))
                except ValueError as exc:
                    raise bad_request(str(exc), param="messages") from None
        if len(text) > self.max_chars:
            raise bad_request(
                f"prompt: {len(text)} characters cannot fit in {self.max_model_len} tokens",
                param="prompt",
            )
        return self.inputs.tokenize(text, add_special_tokens=special)
