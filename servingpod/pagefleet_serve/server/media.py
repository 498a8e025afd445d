"""The images of a chat request, read in the API process before anything is templated:
counted against `--limit-mm-per-prompt` (a model without a vision tower takes none),
then each decoded under the server's caps (`frontend/images.py`); any failure is a 400
naming the content part."""

from pagefleet_serve.frontend.images import ImageError, LoadedImage, MediaLimits, load_image
from pagefleet_serve.server.errors import bad_request
from pagefleet_serve.server.protocol import ChatMessage


def read_images(
    messages: list[ChatMessage], limits: MediaLimits, model_name: str
) -> list[LoadedImage]:
    """The messages' images in order, decoded; a 400 for too many, for a model that
    takes none, or for one that cannot be read."""
    urls = [url for i, message in enumerate(messages) for url in message.image_urls(i)]
    if not urls:
        return []
    if limits.max_images == 0:
        raise bad_request(
            f"{urls[0][1]}: model {model_name} takes no images (image_url or input_image "
            "parts); send text content only",
            param="messages",
        )
    if len(urls) > limits.max_images:
        raise bad_request(
            f"messages: {len(urls)} images given; at most {limits.max_images} may be sent in "
            "one prompt (--limit-mm-per-prompt)",
            param="messages",
        )
    try:
        return [load_image(url, where, limits) for url, where in urls]
    except ImageError as exc:
        raise bad_request(str(exc), param="messages") from None
