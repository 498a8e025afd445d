"""SigLIP's vision tower (Gemma 3's): the image cut into square patches by a strided
convolution, a learned position per patch, pre-norm encoder layers of full (non-causal)
attention and a GELU MLP, a final LayerNorm. It runs once per image, replicated on
every rank (it is small beside the language model), with torch's own modules."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    num_channels: int = 3

    @classmethod
    def from_hf(cls, hf: dict) -> "SiglipConfig":
        act = hf.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act: {act!r} is not served (gelu_pytorch_tanh)")
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            image_size=hf["image_size"],
            patch_size=hf["patch_size"],
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-6)),
            num_channels=hf.get("num_channels", 3),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipAttention(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(size, size) for _ in range(3))
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, size = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = functional.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, size))


class SiglipMLP(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(functional.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(size, eps=eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(size, eps=eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionTower(nn.Module):
    """(images, channels, size, size) pixels -> (images, patches, hidden) states."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, size, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, size)
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_layers))
        self.post_layernorm = nn.LayerNorm(size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        x = x + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A tower tensor's name under the tower (checkpoints spell it
        `embeddings.patch_embedding...` and `encoder.layers...`, some under `vision_model.`)."""
        name = name.removeprefix("vision_model.").removeprefix("embeddings.")
        return name.removeprefix("encoder.")
