"""A vision-language model's image side in the API process (which loads no model code):
whether the model takes images, read from its config.json (a Hugging Face
vision-language checkpoint carries a `vision_config`), and its family's preprocessing,
what transformers' slow (PIL) image processor and processor do:

- Gemma 3: the image resized to the vision tower's fixed size (bilinear), rescaled to
  [0, 1], normalized per channel; the `<start_of_image>` the chat template writes where
  the image stood expanded to `\\n\\n<start_of_image>` + `mm_tokens_per_image` image
  tokens + `<end_of_image>\\n\\n`. Pan-and-scan crops are not made.

The pixels travel to the core as float32 bytes beside the prompt (`messages.ImageInput`),
with the image's hash and where its image tokens sit.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from pagefleet_serve.frontend.images import LoadedImage
from pagefleet_serve.messages import ImageInput


@dataclass(frozen=True)
class Gemma3ImageProcessing:
    height: int
    width: int
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: int
    image_seq_length: int
    boi_token: str
    full_image_sequence: str
    image_token_id: int

    @classmethod
    def read(cls, model_dir: Path, hf: dict, tokenizer) -> "Gemma3ImageProcessing":
        pre = _json(model_dir / "preprocessor_config.json")
        processor = _json(model_dir / "processor_config.json")
        size = pre.get("size") or {"height": 896, "width": 896}
        seq_length = int(processor.get("image_seq_length") or hf.get("mm_tokens_per_image", 256))
        boi, eoi, image = tokenizer.convert_ids_to_tokens(
            [hf["boi_token_index"], hf["eoi_token_index"], hf["image_token_index"]]
        )
        return cls(
            height=int(size["height"]),
            width=int(size["width"]),
            rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
            mean=tuple(pre.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(pre.get("image_std", (0.5, 0.5, 0.5))),
            resample=int(pre.get("resample", Image.Resampling.BILINEAR)),
            image_seq_length=seq_length,
            boi_token=boi,
            full_image_sequence=f"\n\n{boi}{image * seq_length}{eoi}\n\n",
            image_token_id=int(hf["image_token_index"]),
        )

    def expand(self, text: str, num_images: int) -> str:
        """The rendered prompt with each image's placeholder expanded to its tokens;
        ValueError when the template wrote a placeholder per image no more."""
        found = text.count(self.boi_token)
        if found != num_images:
            raise ValueError(
                f"messages: the chat template wrote {found} image placeholders "
                f"({self.boi_token}) for {num_images} images"
            )
        return text.replace(self.boi_token, self.full_image_sequence)

    def pixels(self, image: Image.Image) -> np.ndarray:
        """(3, height, width) float32, as Gemma3ImageProcessorPil makes them."""
        resized = image.resize((self.width, self.height), resample=self.resample)
        array = np.asarray(resized, dtype=np.uint8).astype(np.float64) * self.rescale_factor
        array = array.astype(np.float32)
        mean, std = np.array(self.mean, np.float32), np.array(self.std, np.float32)
        return np.ascontiguousarray(((array - mean) / std).transpose(2, 0, 1), np.float32)

    def inputs(self, token_ids: list[int], images: list[LoadedImage]) -> tuple[ImageInput, ...]:
        """Each image with where its tokens sit in the prompt (runs of the image token,
        in order)."""
        starts = [
            i
            for i, token in enumerate(token_ids)
            if token == self.image_token_id and (i == 0 or token_ids[i - 1] != token)
        ]
        if len(starts) != len(images):
            raise ValueError(
                f"messages: the prompt holds {len(starts)} images' tokens for {len(images)} images"
            )
        out = []
        for start, loaded in zip(starts, images, strict=True):
            array = self.pixels(loaded.image)
            out.append(
                ImageInput(
                    loaded.digest, start, self.image_seq_length, array.tobytes(), array.shape
                )
            )
        return tuple(out)


def load_image_processing(model: str, tokenizer) -> Gemma3ImageProcessing | None:
    """The preprocessing of the model at URI `model`; None for a text-only model."""
    from pagefleet_serve.model.loader.resolve import resolve_model_uri

    path = resolve_model_uri(model, weights="none").path  # resolved by the core already
    if path is None or not (path / "config.json").is_file() or tokenizer is None:
        return None
    hf = json.loads((path / "config.json").read_text())
    if "vision_config" not in hf:
        return None
    # The core serves no other vision-language family (it refuses the model first).
    return Gemma3ImageProcessing.read(path, hf, tokenizer)


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
