"""A vision-language model (Gemma 3: SigLIP tower, projector, bidirectional attention over
an image's tokens) served over the OpenAI chat API with images as data: URLs, against
transformers on a tiny random checkpoint its own classes built
(tests/server/vision_checkpoint.py): the preprocessing equals transformers' PIL image
processor; greedy tokens equal transformers' generate for two different images; the same
image again hits the prefix cache (and the encoder cache) with the same tokens; the same
text with another image gets no false hit and that image's tokens; broken and oversized
images get a 400 naming the part and leave the server serving."""

import base64
import io
import os
import struct
import zlib

import httpx
import numpy as np
import pytest
from openai import OpenAI
from pagefleet_serve.frontend.vision import load_image_processing
from PIL import Image

from tests.server import vision_checkpoint
from tests.server.server_harness import ThreadServer, assert_error

QUESTION = "what is it?"
OTHER_QUESTION = "and the colours?"
MAX_TOKENS = 8


def picture(seed: int, size=(40, 30)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    return Image.fromarray(pixels, "RGB")


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(image: Image.Image | None, text: str = QUESTION) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "look: "}]
    if image is not None:
        parts.append({"type": "image_url", "image_url": {"url": data_url(image)}})
    parts.append({"type": "text", "text": " " + text})
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return vision_checkpoint.build(tmp_path_factory.mktemp("gemma3-vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy tokens for the chat with each picture (seeds 1 and 2)."""
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(checkpoint, backend="pil")
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint).eval()
    out = {}
    for seed, question in ((1, QUESTION), (2, QUESTION), (1, OTHER_QUESTION)):
        chat = [
            {"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"}]}
        ]
        chat[0]["content"].append({"type": "text", "text": " " + question})
        text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=text, images=[picture(seed)], return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(
                **inputs,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        prompt = inputs["input_ids"].shape[1]
        if question == OTHER_QUESTION:
            out["other"] = (prompt, generated.sequences[0, prompt:].tolist())
            continue
        out[seed] = (prompt, generated.sequences[0, prompt:].tolist())
        # the first token's log-probabilities: where attention over the image's tokens
        # both ways (not causal) shows, by about 3e-3 in this checkpoint
        first = generated.scores[0][0].log_softmax(-1)
        top = first.topk(5)
        out[("logprobs", seed)] = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        image_token = processor.tokenizer.image_token_id
        positions = (inputs["input_ids"][0] == image_token).nonzero().flatten().tolist()
        out["image"] = (positions[0], positions[-1] + 1)
    out["processor"] = processor
    return out


@pytest.fixture(scope="module")
def server(checkpoint):
    running = ThreadServer(
        # Refusals unthrottled: the memory test sends 200 of them.
        {
            "served_model_names": ("served",),
            "max_image_bytes": 64 << 10,
            "refusals_per_second": 10_000.0,
            "refusal_delay": 0.0,
        },
        model=str(checkpoint),
        max_num_seqs=4,
        max_model_len=128,
        block_size=16,
        # The image's tokens are prompt tokens 16 .. 19: a first chunk of 18 would end in
        # them, so it ends before them and the next takes them whole.
        max_num_batched_tokens=18,
        kv_cache_memory_bytes=8 << 20,
        enable_prefix_caching=True,
    )
    yield running
    running.stop()


def test_the_pixels_equal_transformers_pil_image_processor(checkpoint, reference):
    from transformers import AutoTokenizer

    processing = load_image_processing(str(checkpoint), AutoTokenizer.from_pretrained(checkpoint))
    assert processing is not None
    for image in (picture(1), picture(3, (17, 61)), picture(4, (300, 200))):
        ours = processing.pixels(image)
        theirs = reference["processor"].image_processor(image, return_tensors="np")
        np.testing.assert_allclose(ours, theirs["pixel_values"][0], rtol=0, atol=1e-6)


def chat(
    client: OpenAI, image: Image.Image | None, reference=None, text: str = QUESTION
) -> tuple[int, list[int]]:
    """The prompt's token count and the greedy tokens; with `reference` (transformers'
    first-token log-probabilities by token id) the first token's are checked against it."""
    reply = client.chat.completions.create(
        model="served",
        messages=messages(image, text),
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={
            "return_token_ids": True,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        },
    )
    choice = reply.choices[0]
    if reference is not None:
        first = choice.logprobs.content[0].top_logprobs
        ours = {int(entry.token.removeprefix("token_id:")): entry.logprob for entry in first}
        assert ours.keys() == reference.keys()
        for token, logprob in ours.items():
            assert abs(logprob - reference[token]) < 5e-4, (token, logprob, reference)
    return reply.usage.prompt_tokens, choice.token_ids


def test_greedy_tokens_equal_transformers_and_the_prefix_cache_knows_the_image(server, reference):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    client.models.list()
    stats = server.core.stats
    image_start, image_end = reference["image"]
    assert chat(client, picture(1), reference[("logprobs", 1)]) == reference[1]
    hits = stats().prefix_cache_hits
    # the same image again: its blocks are found, past its tokens; the tokens the same
    assert chat(client, picture(1)) == reference[1]
    assert stats().prefix_cache_hits - hits >= image_end
    # the same text with another image: only the blocks before the image's tokens are
    # taken, and that image's tokens come out
    hits = stats().prefix_cache_hits
    assert chat(client, picture(2), reference[("logprobs", 2)]) == reference[2]
    assert stats().prefix_cache_hits - hits <= image_start
    assert reference[1][1] != reference[2][1]  # the image moves the tokens
    # the first image once more: its blocks are still the first image's
    assert chat(client, picture(1)) == reference[1]
    # the image's embeddings come from the encoder cache when its blocks cannot: another
    # text after the same image (a block boundary inside the image makes the prefix
    # cache stop before it)
    encoder = stats().encoder
    assert chat(client, picture(1), text=OTHER_QUESTION) == reference["other"]
    assert stats().encoder.hits == encoder.hits + 1
    assert stats().encoder.queries == encoder.queries + 1
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'pagefleet:request_images_count{model_name="served"} 5.0' in metrics
    assert (
        f'pagefleet:encoder_cache_hits_total{{model_name="served"}} {encoder.hits + 1}.0' in metrics
    )


def claimed_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, its body a few bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def base64_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


UNREADABLE = [
    (base64_url(b"\x89PNG broken"), "not an image"),
    (base64_url(claimed_png(100_000, 100_000)), "too many pixels"),
    (base64_url(claimed_png(5000, 5000)), "5000 x 5000 pixels"),
    ("data:image/png;base64," + "A" * 100_000, "bytes; at most 65536"),
    ("http://10.0.0.1/cat.png", "not fetched by this server"),
]


def image_body(url: str) -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        "max_tokens": 2,
    }


@pytest.mark.parametrize(("url", "words"), UNREADABLE)
def test_unreadable_images_get_a_400_and_the_server_serves_on(server, url, words):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json=image_body(url))
        error = assert_error(reply, 400, param="messages")
        assert error["message"].startswith("messages[0].content[1].image_url: ")
        assert words in error["message"]
        assert http.get("/health").status_code == 200


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_stays_flat_over_200_refused_images(server):
    """The server runs in this process: its resident memory after 200 refused images is
    within a generous bound of where it was after the first 40."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:

        def refuse(count: int) -> None:
            for i in range(count):
                url, _ = UNREADABLE[i % len(UNREADABLE)]
                assert http.post("/v1/chat/completions", json=image_body(url)).status_code == 400

        refuse(40)  # allocator pools and caches warmed
        before = rss_bytes()
        refuse(200)
        assert rss_bytes() - before < 32 << 20
        served = http.post(
            "/v1/chat/completions",
            json={"messages": messages(picture(1)), "max_tokens": 2, "temperature": 0},
        )
        assert served.status_code == 200, served.text


def test_the_responses_api_takes_input_image_as_chat_does(server, reference):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    chat_reply = client.chat.completions.create(
        model="served", messages=messages(picture(2)), max_tokens=MAX_TOKENS, temperature=0
    )
    content = [
        {"type": "input_text", "text": "look: "},
        {"type": "input_image", "image_url": data_url(picture(2)), "detail": "auto"},
        {"type": "input_text", "text": " " + QUESTION},
    ]
    response = client.responses.create(
        model="served",
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,
    )
    assert response.usage.input_tokens == reference[2][0]
    assert response.output_text == chat_reply.choices[0].message.content
    broken = [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        reply = http.post(
            "/v1/responses",
            json={"model": "served", "input": [{"role": "user", "content": broken}]},
        )
        error = assert_error(reply, 400, param="input")
        assert error["message"].startswith("input[0].content[0].image_url: not an image")


def test_tokenize_counts_an_image_s_tokens(server, reference):
    body = {"model": "served", "messages": messages(picture(1)), "add_generation_prompt": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        reply = http.post("/tokenize", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["count"] == reference[1][0]
        body["messages"][0]["content"][1]["image_url"]["url"] = "data:image/png;base64,AAAA"
        error = assert_error(http.post("/tokenize", json=body), 400, param="messages")
        assert "not an image" in error["message"]
