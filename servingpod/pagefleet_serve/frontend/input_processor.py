"""A prompt in, a validated `Request` out: the one place a prompt is templated, tokenized and
checked before any engine core sees it (`process`).

Chat messages are rendered in one place (`render_chat`: a reasoning parser's own renderer,
harmony for gpt-oss, else the model's chat template), and a reasoning model's thinking is
read off the rendered token ids in one place (`thinking`): the offline `LLM` calls them
through `process` with a `ChatPrompt`, the server's endpoints call them themselves (their
requests also truncate the prompt, `truncate_prompt_tokens`, between the two) and hand
over the token ids. Text goes through the one tokenization path (`tokenize`, no special
tokens: the template wrote them), and the result is checked against the core's limits
(context length, vocabulary, n) once; the core trusts what comes out. A structured output's constraint is not compiled here: the core
compiles it, once, when the core client asks it to (see `EngineCoreClient.process_input`).

Text is refused by its length before any tokenizer sees it: a prompt of more than
`max_prompt_chars` characters (`MAX_CHARS_PER_TOKEN` per token of the context) is refused
unread, so that tokenizing what cannot be served costs nothing.
"""

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pagefleet_serve.frontend.tokenizer import Tokenizer
from pagefleet_serve.messages import ImageInput, Request, RequestLimits
from pagefleet_serve.reasoning import ReasoningParser
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.thinking import ThinkingSpec

# Characters a token of the context may stand for, on average, in a prompt the server
# reads: text averages 3 to 5, code and whitespace runs a few more. A prompt past this is
# refused by its length, unread (capped by the vocabulary's longest piece, the true bound).
MAX_CHARS_PER_TOKEN = 32


class ContextLengthError(ValueError):
    """The prompt plus max_tokens does not fit the model's context; carries the numbers so
    the API can word the error its own way."""

    def __init__(self, max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> None:
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        super().__init__(
            f"prompt: this model's maximum context length is {max_model_len} tokens, "
            f"but {num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for max_tokens)"
        )


class PromptTooLongError(ValueError):
    """Prompt text longer than the context could hold whatever its tokens, refused unread;
    carries the numbers so the API can word the error its own way."""

    def __init__(self, num_chars: int, max_prompt_chars: int, max_model_len: int) -> None:
        self.num_chars = num_chars
        super().__init__(
            f"prompt: {num_chars} characters cannot fit in this model's maximum context "
            f"length of {max_model_len} tokens (at most {max_prompt_chars} characters can)"
        )


class ChatPromptError(ValueError):
    """A chat prompt that cannot be rendered or whose thinking cannot be read; `param`:
    the request field at fault, for the API's error."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages (the template's dicts), rendered as `InputProcessor.render_chat`
    renders them, with the tools the model is told of and the template's variables
    (`template_kwargs`, e.g. `enable_thinking`); `thinking_token_budget`: the most tokens
    a reasoning model may think before it must answer."""

    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: Mapping[str, object] | None = None
    thinking_token_budget: int | None = None


@dataclass(frozen=True)
class ImagePrompt:
    """A vision-language model's prompt: its token ids (each image's tokens expanded) and
    its preprocessed images (see `frontend/vision.py`)."""

    token_ids: list[int]
    images: tuple[ImageInput, ...]


Prompt = str | list[int] | ChatPrompt | ImagePrompt


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        model_name: str,
        limits: RequestLimits,
        reasoning_parser: ReasoningParser | None = None,
    ) -> None:
        """`tokenizer` None: a model without one (token ids only); `reasoning_parser`: a
        reasoning model's (`pagefleet_serve.reasoning.reasoning_parser`), which renders
        its prompts where it has its own renderer and reads where their thinking ends."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.reasoning_parser = reasoning_parser
        self.max_prompt_chars = _max_prompt_chars(tokenizer, limits.max_model_len)

    # -- the one entry point -------------------------------------------------------------
    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        lora_name: str | None = None,
        pooling: bool = False,
        client: str = "",
    ) -> Request:
        """Template, tokenize and validate a prompt (text, token ids or chat messages).
        `lora_name`: the LoRA adapter it runs with, as its caller resolved it (None: the
        base model); `pooling`: an embedding request, whose prompt alone must fit the
        context (text is tokenized with the tokenizer's special tokens, as
        sentence-transformers does); `client`: who sent it, for the scheduler's fairness
        between clients. Raises ValueError
        (ContextLengthError when it does not fit the context, PromptTooLongError when its
        text is refused unread)."""
        images: tuple[ImageInput, ...] = ()
        if isinstance(prompt, ImagePrompt):
            images = prompt.images
            prompt = prompt.token_ids
        if isinstance(prompt, ChatPrompt):
            chat = prompt
            text = self.render_chat(chat.messages, chat.tools, template_kwargs=chat.template_kwargs)
            self._check_chars(text)  # refused unread, as any text prompt
            prompt = self.tokenize(text)
            spec = self.thinking(prompt, chat.template_kwargs or {}, chat.thinking_token_budget)
            if spec is not None:
                params = dataclasses.replace(params, thinking=spec)
        if isinstance(prompt, str):
            self._check_chars(prompt)
        prompt_token_ids = self.tokenize(prompt, add_special_tokens=pooling) if prompt else []
        limits = self.limits
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        # cheap: first
        self._check_fits(len(prompt_token_ids), 0 if pooling else params.max_tokens)
        vocab = limits.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if params.thinking is not None and any(t >= vocab for t in params.thinking.token_ids):
            raise ValueError(f"thinking: its token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if params.n > limits.max_num_seqs:
            raise ValueError(f"n must be at most max_num_seqs ({limits.max_num_seqs})")
        if any(image.offset + image.length > len(prompt_token_ids) for image in images):
            raise ValueError("messages: an image's tokens were cut off the prompt")
        return Request(
            request_id, prompt_token_ids, params, time.time(), lora_name, pooling, client, images
        )

    # -- text -> token ids ---------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, object] | None = None,
    ) -> str:
        """Chat messages -> prompt text: the reasoning parser's own renderer where it has
        one (harmony for gpt-oss), else the model's chat template (with the request's
        `template_kwargs` as variables). ChatPromptError naming the field at fault."""
        parser = self.reasoning_parser
        if parser is not None and parser.prompt_renderer is not None:
            if continue_final_message or not add_generation_prompt:
                raise ChatPromptError(
                    f"continue_final_message: the {parser.name} prompt always ends with the "
                    "assistant's turn opened; send add_generation_prompt true",
                    "continue_final_message",
                )
            try:
                return parser.prompt_renderer(messages, tools, template_kwargs or {})
            except ValueError as exc:  # its message starts with the field at fault
                raise ChatPromptError(str(exc), str(exc).split(":", 1)[0]) from None
        if self.tokenizer is None:
            raise ChatPromptError(
                "messages: this model has no tokenizer or chat template", "messages"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # noqa: BLE001 - a template raises whatever jinja raises
            raise ChatPromptError(
                f"messages: the model's chat template rejected them: {exc}", "messages"
            ) from None

    def thinking(
        self,
        prompt_token_ids: list[int],
        template_kwargs: Mapping[str, object],
        budget: int | None,
    ) -> ThinkingSpec | None:
        """Where a rendered chat prompt's thinking ends, for the engine core; None: it does
        not think. ChatPromptError (on `thinking_token_budget`) for a budget out of range
        or one this model cannot honour (no reasoning parser)."""
        param = "thinking_token_budget"
        if budget is not None and not 0 <= budget < 2**31:
            raise ChatPromptError(
                f"{param}: must be an integer in [0, {2**31 - 1}], got {budget}", param
            )
        if self.reasoning_parser is None:
            if budget is not None:
                raise ChatPromptError(
                    f"{param}: this server reads no reasoning model's thinking "
                    "(start it with --reasoning-parser)",
                    param,
                )
            return None
        try:
            return self.reasoning_parser.thinking(prompt_token_ids, template_kwargs, budget)
        except ValueError as exc:
            raise ChatPromptError(str(exc), param) from None

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]:
        """A prompt as token ids (token ids pass through). ValueError."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name} has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def _check_chars(self, text: str) -> None:
        """PromptTooLongError for text longer than the context could hold, whatever its
        tokens."""
        if self.tokenizer is not None and len(text) > self.max_prompt_chars:
            raise PromptTooLongError(len(text), self.max_prompt_chars, self.limits.max_model_len)

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ContextLengthError when a prompt this long plus max_tokens exceeds the context."""
        if num_prompt_tokens + max_tokens > self.limits.max_model_len:
            raise ContextLengthError(self.limits.max_model_len, num_prompt_tokens, max_tokens)


def _max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The most characters a prompt of max_model_len tokens is read with: no token's text
    is longer than its vocabulary entry (byte-level and SentencePiece pieces alike), and
    none is taken to stand for more than MAX_CHARS_PER_TOKEN."""
    if tokenizer is None:
        return 0
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    return max_model_len * min(longest, MAX_CHARS_PER_TOKEN)
