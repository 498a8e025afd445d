"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): the Gemma 3 text model, a
SigLIP vision tower (`layers/siglip.py`) and a projector that average-pools the tower's
patches to `mm_tokens_per_image` tokens, norms them (Gemma's 1 + weight RMSNorm) and maps
them to the text model's width. Each image's projected tokens replace the embeddings of
its image tokens (unscaled: Gemma's embedding scale applies to token embeddings only),
and an image's tokens attend to each other both ways (`model/vision.py`), as
transformers' mask has them. The tower runs once per image hash (`EncoderCache`)."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional

from pagefleet_serve.model.layers.siglip import SiglipConfig, SiglipVisionTower
from pagefleet_serve.model.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from pagefleet_serve.model.vision import (
    EncoderCache,
    ImageInput,
    ImageRows,
    bidirectional_rows,
)
from pagefleet_serve.model.weights import Weight, load_into

# Images whose encoder outputs are kept (a 896-pixel image's 256 tokens of a 4B model's
# width are 1.3 MB in bfloat16).
ENCODER_CACHE_IMAGES = 64


@dataclass(frozen=True)
class Gemma3VLConfig(Gemma3Config):
    vision: SiglipConfig | None = None
    mm_tokens_per_image: int = 256

    @classmethod
    def language_config(cls, hf: dict) -> dict:
        text = dict(hf.get("text_config") or {})
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
        return text | {k: hf[k] for k in ("vision_config", "mm_tokens_per_image") if k in hf}

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        return super().family_fields(hf) | {
            "vision": SiglipConfig.from_hf(hf["vision_config"]),
            "mm_tokens_per_image": int(hf.get("mm_tokens_per_image", 256)),
        }


class Gemma3Projector(nn.Module):
    def __init__(self, config: Gemma3VLConfig) -> None:
        super().__init__()
        vision = config.vision
        self.eps = vision.layer_norm_eps
        self.mm_soft_emb_norm = nn.Parameter(torch.zeros(vision.hidden_size))
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.hidden_size)
        )
        self.side = vision.patches_per_side
        self.kernel = self.side // int(config.mm_tokens_per_image**0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """(images, patches, vision hidden) -> (images, image tokens, hidden)."""
        images, _, size = patches.shape
        grid = patches.transpose(1, 2).reshape(images, size, self.side, self.side)
        pooled = functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (x * (1.0 + self.mm_soft_emb_norm.float())).to(pooled.dtype)
        return torch.matmul(normed, self.mm_input_projection_weight).to(patches.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    config_class = Gemma3VLConfig
    unsplit_reason = "Gemma 3's vision tower is not split over ranks yet"

    def __init__(self, config: Gemma3VLConfig) -> None:
        super().__init__(config)
        self.vision_tower = SiglipVisionTower(config.vision)
        self.projector = Gemma3Projector(config)
        self.encoder_cache = EncoderCache(ENCODER_CACHE_IMAGES)

    def forward(self, input_ids, positions, kv_caches, attn, hidden=None, images=()):
        if images:
            x = self.embed(input_ids)
            for rows in images:
                x[rows.row : rows.row + rows.count] = self._image_tokens(rows)
            attn.bidirectional = bidirectional_rows(images, attn)
            self.backend.prepare(attn.bidirectional.attn, kv_caches[0].key.shape[1], self.windows)
            hidden = x
        return super().forward(input_ids, positions, kv_caches, attn, hidden)

    def _image_tokens(self, rows: ImageRows) -> torch.Tensor:
        tokens = self.encoder_cache.get(rows.image, self._encode)
        return tokens[rows.first : rows.first + rows.count]

    def _encode(self, image: ImageInput) -> torch.Tensor:
        weight = self.projector.mm_input_projection_weight
        pixels = torch.frombuffer(bytearray(image.pixels), dtype=torch.float32)
        pixels = pixels.view(1, *image.shape).to(weight.device, weight.dtype)
        return self.projector(self.vision_tower(pixels))[0]

    # -- loading -----------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """transformers' layouts: `model.language_model.*` (or `language_model.model.*`),
        `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head`."""
        name = name.removeprefix("model.")
        for prefix in ("language_model.model.", "language_model."):
            if name.startswith(prefix):
                return super().checkpoint_name(name.removeprefix(prefix))
        if name.startswith("vision_tower."):
            inner = SiglipVisionTower.checkpoint_name(name.removeprefix("vision_tower."))
            return "vision_tower." + inner
        if name.startswith("multi_modal_projector."):
            inner = name.removeprefix("multi_modal_projector.")
            return "projector." + inner.replace("mm_soft_emb_norm.weight", "mm_soft_emb_norm")
        return super().checkpoint_name(name)

    def load_weight(self, name: str, weight: Weight) -> None:
        if not name.startswith(("vision_tower.", "projector.")):
            super().load_weight(name, weight)
            return
        param = self._params.get(name)
        if param is None:
            raise ValueError(f"weights do not fit the model's configuration: unexpected {name!r}")
        load_into(weight, param.data)
        self._loaded.add(name)
