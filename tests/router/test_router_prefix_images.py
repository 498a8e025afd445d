"""The router's prefix key reads an image by the hash of its URL, not its base64 text:
the same image behind the same text gives the same block hashes, another image gives
other ones from the image on, and a large image adds no more to the prefix than a
small one (the text after it stays within the blocks the router hashes)."""

import base64
import os

from pagefleet_router.prefix import block_hashes, prompt_text


def chat(image: bytes, text: str = "what is in it?") -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    parts = [
        {"type": "text", "text": "look: "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": text},
    ]
    return {"model": "gemma", "messages": [{"role": "user", "content": parts}]}


def response(image: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "hi"}]
    return {"model": "gemma", "input": [{"role": "user", "content": content}]}


def hashes(body: dict, path: str = "/v1/chat/completions") -> list[bytes]:
    return block_hashes(prompt_text(path, body), 16, 64)


def test_images_enter_the_prefix_by_hash():
    first, other = os.urandom(2048), os.urandom(2048)
    assert hashes(chat(first)) == hashes(chat(first))
    mine, theirs = hashes(chat(first)), hashes(chat(other))
    assert mine[0] == theirs[0]  # the model name and the text before the image
    assert mine[-1] != theirs[-1]
    big = prompt_text("/v1/chat/completions", chat(os.urandom(1 << 20)))
    small = prompt_text("/v1/chat/completions", chat(first))
    assert len(big) == len(small) < 300
    assert "what is in it?" in big


def test_the_responses_api_s_input_image_too():
    first, other = os.urandom(4096), os.urandom(4096)
    assert hashes(response(first), "/v1/responses") == hashes(response(first), "/v1/responses")
    assert hashes(response(first), "/v1/responses") != hashes(response(other), "/v1/responses")
    assert len(prompt_text("/v1/responses", response(first))) < 200
