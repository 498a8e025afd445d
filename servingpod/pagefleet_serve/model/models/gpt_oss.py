"""gpt-oss: a mixture of experts on every layer with attention sinks (a learned logit per
query head joins each softmax's denominator), YaRN rope, a biased router whose softmax is
over its top k, and experts with biases and a clamped SwiGLU.

Its checkpoints name the router `mlp.router`, hold the experts as transformers multiplies
them (x @ W: gate_up_proj (E, H, 2I) with gate and up interleaved, gate the even columns;
down_proj (E, I, H)), and ship them in MXFP4 (`*_blocks` + `*_scales`, already rows x
columns), dequantized once here."""

import re
from dataclasses import dataclass

import torch
from pagefleet_kernels import moe

from pagefleet_serve.model import mxfp4
from pagefleet_serve.model.layers.moe import MoEBlock, MoEConfig
from pagefleet_serve.model.models.llama import LlamaAttention, LlamaForCausalLM
from pagefleet_serve.model.models.mixtral import MoEDecoderLayer
from pagefleet_serve.model.weights import Weight, load

_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?")


@dataclass(frozen=True)
class GptOssConfig(MoEConfig):
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.swiglu_limit}")

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        return super().family_fields(hf) | {
            "router_scoring": "top_k_softmax",
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        }


class GptOssAttention(LlamaAttention):
    def attention_options(self, config: GptOssConfig) -> dict:
        return {"sink_heads": self.qkv_proj.q_heads}


class GptOssDecoderLayer(MoEDecoderLayer):
    attention_class = GptOssAttention

    def make_experts(self, config: GptOssConfig) -> MoEBlock:
        activation = moe.ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
        return MoEBlock(config, router_bias=True, expert_bias=True, activation=activation)


class GptOssForCausalLM(LlamaForCausalLM):
    layer_class = GptOssDecoderLayer
    config_class = GptOssConfig
    reads_mxfp4 = True
    unsplit_reason = (
        "gpt-oss is not split for tensor parallelism yet (its attention sinks and "
        "interleaved experts)"
    )

    def load_weights(self, weights) -> None:
        self._mxfp4: dict[str, torch.Tensor] = {}  # a projection's blocks or scales, alone
        super().load_weights(weights)

    def finish_checkpoint(self) -> None:
        if self._mxfp4:
            name = sorted(self._mxfp4)[0]
            if name.endswith("_blocks"):
                scales = name.removesuffix("_blocks").rsplit(".", 1)[1] + "_scales"
                raise mxfp4.Mxfp4FormatError(f"{name} has no {scales} beside it")
            raise mxfp4.Mxfp4FormatError(f"MXFP4 scales without their blocks: {name}")
        del self._mxfp4

    def load_weight(self, name: str, weight: Weight) -> None:
        # The router is the block's `gate`; the sinks are the attention layer's.
        name = name.replace(".mlp.router.", ".mlp.gate.").replace(
            ".self_attn.sinks", ".self_attn.attn.sinks"
        )
        match = _EXPERTS.fullmatch(name)
        if match is None:
            super().load_weight(name, weight)
            return
        prefix, projection, suffix = match[1], match[2], match[3]
        tensor = load(weight, self.load_dtype)
        if suffix in ("_blocks", "_scales"):
            other = f"{prefix}.{projection}" + ("_scales" if suffix == "_blocks" else "_blocks")
            if other not in self._mxfp4:
                self._mxfp4[name] = tensor
                return
            pair = {suffix: tensor, other[-7:]: self._mxfp4.pop(other)}
            tensor = mxfp4.dequantize(pair["_blocks"], pair["_scales"], self.load_dtype)
        elif suffix is None:  # (E, in, out) as transformers multiplies x @ W
            tensor = tensor.transpose(1, 2)
        if projection == "gate_up_proj":  # interleaved rows (or bias entries) -> [gate | up]
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        target = f"{prefix}.{projection}" + ("_bias" if suffix == "_bias" else "")
        self.load_param(target, (None, None), tensor)
