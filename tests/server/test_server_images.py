"""Images in chat content parts, read in the API process (frontend/images.py): a data URL's
size capped before base64 is decoded, a PNG's claimed pixels capped from its header before
any pixel is decoded, a broken or foreign file refused, http(s) URLs refused, file:// URLs
only under --allowed-local-media-path; --limit-mm-per-prompt parsed as vLLM's JSON; and
against a real server a text-only model answers an image with a 400 naming the part,
then serves the next request."""

import base64
import io
import struct
import zlib

import httpx
import pytest
from pagefleet_serve.frontend.images import (
    ImageError,
    MediaLimits,
    load_image,
    parse_limit_mm_per_prompt,
)
from pagefleet_serve.server.settings import ServerSettings
from pagefleet_serve.server.state import media_limits
from PIL import Image

from tests.server.server_harness import ThreadServer, assert_error

WHERE = "messages[0].content[1].image_url"
LIMITS = MediaLimits(max_images=2, max_image_bytes=64 << 10, max_image_pixels=256 * 256)


def png_bytes(width: int = 8, height: int = 6, color=(200, 30, 90)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def claimed_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels and whose body is a few bytes: what a
    decompression bomb looks like before it is decoded."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def refused(url: str, limits: MediaLimits = LIMITS) -> str:
    with pytest.raises(ImageError) as caught:
        load_image(url, WHERE, limits)
    assert str(caught.value).startswith(WHERE + ": ")
    return str(caught.value)


def test_a_data_url_png_is_decoded_and_known_by_its_bytes_hash():
    first = load_image(data_url(png_bytes()), WHERE, LIMITS)
    assert first.image.size == (8, 6) and first.image.mode == "RGB"
    assert first.image.getpixel((3, 2)) == (200, 30, 90)
    again = load_image(data_url(png_bytes()), WHERE, LIMITS)
    other = load_image(data_url(png_bytes(color=(0, 0, 0))), WHERE, LIMITS)
    assert first.digest == again.digest != other.digest


def test_a_png_claiming_100k_by_100k_pixels_is_refused_from_its_header():
    bomb = claimed_png(100_000, 100_000)
    assert len(bomb) < 200
    # Pillow's own limit (89M pixels) refuses it at its header, the server's cap below it
    assert "too many pixels; at most 65536 pixels are decoded" in refused(data_url(bomb))
    assert "300 x 300 pixels" in refused(data_url(claimed_png(300, 300)))


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (data_url(b"not an image at all"), "not an image"),
        (data_url(png_bytes(64, 64)[:60]), "truncated or corrupt"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:text/plain;base64,aGk=", "data:image/<format>;base64"),
        ("data:image/png," + "x" * 10, "data:image/<format>;base64"),
        ("http://169.254.169.254/latest/meta-data", "not fetched by this server"),
        ("https://example.com/cat.png", "not fetched by this server"),
        ("ftp://example.com/cat.png", "must be a data: URL"),
        ("file:///etc/passwd", "not enabled on this server"),
    ],
)
def test_unreadable_images_are_refused_naming_the_part(url, words):
    assert words in refused(url)


def test_a_foreign_format_is_refused_before_its_decoder_runs():
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="TIFF")
    assert "formats: PNG" in refused(data_url(buffer.getvalue(), "tiff"))


def test_a_too_large_data_url_is_refused_before_it_is_decoded():
    payload = "A" * (LIMITS.max_image_bytes * 4 // 3 + 8)
    assert "at most 65536 are read" in refused("data:image/png;base64," + payload)


def test_local_files_only_under_the_allowed_path(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(png_bytes(5, 5))
    (tmp_path / "secret.png").write_bytes(png_bytes(5, 5))
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    (root / "big.png").write_bytes(b"\0" * (LIMITS.max_image_bytes + 1))
    limits = MediaLimits(2, LIMITS.max_image_bytes, LIMITS.max_image_pixels, str(root))
    assert load_image(f"file://{root}/cat.png", WHERE, limits).image.size == (5, 5)
    assert "must name a file under" in refused(f"file://{root}/../secret.png", limits)
    assert "must name a file under" in refused(f"file://{root}/link.png", limits)
    assert "at most 65536 are read" in refused(f"file://{root}/big.png", limits)
    assert "cannot read missing.png" in refused(f"file://{root}/missing.png", limits)


def test_limit_mm_per_prompt_reads_vllms_json():
    assert parse_limit_mm_per_prompt(None) is None
    assert parse_limit_mm_per_prompt('{"image": 2}') == 2
    assert parse_limit_mm_per_prompt("{}") == 0
    for text, words in [
        ("{image: 2}", "not valid JSON"),
        ("[2]", "JSON object"),
        ('{"video": 1}', "video is not served"),
        ('{"image": -1}', "integer >= 0"),
        ('{"image": true}', "integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_limit_mm_per_prompt(text)


@pytest.fixture(scope="module")
def server():
    running = ThreadServer({}, max_num_seqs=2, max_model_len=128, kv_cache_memory_bytes=8 << 20)
    yield running
    running.stop()


def image_chat(*urls: str) -> dict:
    parts = [{"type": "text", "text": "what is this?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}


def test_a_text_only_model_refuses_an_image_and_keeps_serving(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json=image_chat(data_url(png_bytes())))
        error = assert_error(reply, 400, param="messages")
        assert error["message"].startswith("messages[0].content[1].image_url: model ")
        assert "takes no images" in error["message"]
        odd = {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}
        error = assert_error(http.post("/v1/chat/completions", json=odd), 400, param="messages")
        assert error["message"].startswith("messages[0].content[0]: a content part is text")
        text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
        served = http.post("/v1/chat/completions", json=text | {"max_tokens": 2})
        assert served.status_code == 200, served.text


def test_a_text_only_model_refuses_an_image_limit_at_start_up():
    settings = ServerSettings(("tiny",), limit_mm_per_prompt='{"image": 1}')
    with pytest.raises(ValueError, match="model tiny has no vision tower"):
        media_limits(settings, vision=False)
    assert media_limits(settings, vision=True).max_images == 1
    assert media_limits(ServerSettings(("tiny",)), vision=True).max_images == 4
    assert media_limits(ServerSettings(("tiny",)), vision=False).max_images == 0
