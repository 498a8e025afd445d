"""Rotary position embeddings, every kind in one place: the frequencies of plain rope and
of its scalings (linear, llama3, longrope, YaRN, GGUF's per-dimension divisors), read from a
config.json's `rope_scaling` (`rope_scaling`), and the cos/sin each token rotates by
(`RotaryEmbedding`).
"""

import math

import torch
from pagefleet_kernels.metadata import AttentionMetadata
from torch import nn

from pagefleet_serve.model_uri import UnsupportedModelError

RopeScaling = tuple[tuple[str, object], ...] | None


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling = None, long: bool = False
) -> torch.Tensor:
    """The rotary frequencies (D/2,) of rope with base `theta` and `scaling`; longrope's
    long factors when `long`."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    options = dict(scaling or ())
    if options.get("rope_type") == "longrope":  # a divisor per frequency, short or long
        factors = options["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if options.get("rope_type") == "linear":  # positions divided by the factor
        inv_freq = inv_freq / options["factor"]
    elif options.get("rope_type") == "llama3":
        factor = options["factor"]
        low, high = options["low_freq_factor"], options["high_freq_factor"]
        old_len = options["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif options.get("rope_type") == "yarn":
        inv_freq = _yarn_inv_freq(theta**exponents, options, dim, theta)
    elif options.get("rope_type") == "freqs":  # GGUF's rope_freqs tensor: divisors per dim
        inv_freq = inv_freq / torch.tensor(options["divisors"], dtype=torch.float32)
    return inv_freq.float()


def _yarn_inv_freq(pos_freqs: torch.Tensor, scaling: dict, dim: int, theta: float) -> torch.Tensor:
    """YaRN (as transformers computes it): the frequencies that turn fewer than beta_slow
    times over the original context are divided by `factor` (interpolated), those that
    turn more than beta_fast times kept (extrapolated), a linear ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dimension turning that many times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


class RotaryEmbedding(nn.Module):
    """The cos and sin every token of a step rotates by, from its position. Longrope
    switches to its long factors for the tokens of a sequence whose context passes the
    original length, as transformers does per forward pass (keys already cached stay as
    they were)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        options = dict(scaling or ())
        self.longrope_switch = (
            options["original_max_position_embeddings"]
            if options.get("rope_type") == "longrope"
            else None
        )
        # What cos and sin are multiplied by (longrope's and YaRN's attention scaling).
        self.attention_factor = float(options.get("attention_factor", 1.0))
        self._set_frequencies(torch.device("cpu"))

    def _set_frequencies(self, device: torch.device) -> None:
        """The frequencies, computed (never loaded) in float32 on `device`: on the CPU when
        the module is built on the meta device (meta arithmetic imports torch._dynamo,
        seconds of start-up), and again after every `to()`, which would cast them to the
        model's dtype: a bfloat16 frequency is off by up to 2^-9, which at position 2,000
        turns the angle by about a radian."""
        with torch.device(device):
            frequencies = {"inv_freq": rope_inv_freq(self.head_dim, self.theta, self.scaling)}
            if self.longrope_switch is not None:
                long = rope_inv_freq(self.head_dim, self.theta, self.scaling, long=True)
                frequencies["inv_freq_long"] = long
        for name, value in frequencies.items():
            self.register_buffer(name, value, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._set_frequencies(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, attn: AttentionMetadata, dtype: torch.dtype):
        return self.cos_sin(positions, self._inv_freq(attn), dtype)

    def _inv_freq(self, attn: AttentionMetadata) -> torch.Tensor:
        """(D/2,) frequencies, or (T, D/2) with longrope: the long factors for the tokens
        of a sequence whose context (this step's tokens included) passes the switch."""
        if self.longrope_switch is None:
            return self.inv_freq
        # Each token's context length, from the device metadata alone; the known output
        # size spares the device a synchronisation.
        repeats = attn.query_start_loc.diff()
        num_tokens = sum(attn.query_lens)
        context = torch.repeat_interleave(attn.seq_lens, repeats, output_size=num_tokens)
        long = context > self.longrope_switch
        return torch.where(long[:, None], self.inv_freq_long, self.inv_freq)

    def cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
        """cos, sin (T, D) of each token, sin's first half negated (see `layer_ops.rope`);
        `inv_freq` (D/2,) or per token (T, D/2)."""
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # what layer_ops.rope takes
        factor = self.attention_factor
        if factor != 1.0:  # in float32, before the cast, as transformers does
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype), sin.to(dtype)


# -- config.json -> rope_scaling -------------------------------------------------------
def rope_scaling(hf: dict, path) -> RopeScaling:
    """A config's rope scaling as ModelConfig.rope_scaling (None: plain rope). Also moves a
    rope_theta given inside the scaling (or per layer type, Gemma 3) into `hf`."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or None
    if scaling and "full_attention" in scaling:  # per layer type (Gemma 3)
        local = scaling.get("sliding_attention") or {}
        hf.setdefault("rope_local_base_freq", local.get("rope_theta") or 10000.0)
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{path}: scaled rope on sliding layers is not supported")
        scaling = scaling["full_attention"]
    # The share of each head rope turns: `ModelConfig.partial_rotary_factor` (refused by
    # the families that rotate whole heads).
    hf["partial_rotary_factor"] = float(
        (scaling or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    )
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    scaling.pop("type", None)
    hf.setdefault("rope_theta", scaling.pop("rope_theta", None) or 10000.0)
    if scaling["rope_type"] == "default":
        return None
    if scaling["rope_type"] in ("longrope", "su"):  # "su": early Phi-3 128k configs
        scaling = _longrope(scaling, hf)
    elif scaling["rope_type"] == "yarn":
        scaling = _yarn(scaling, hf)
    elif scaling["rope_type"] not in ("linear", "llama3"):
        raise UnsupportedModelError(
            f"{path}: rope scaling {scaling['rope_type']!r} is not supported (default, "
            "linear, llama3, longrope, yarn)"
        )
    return tuple(sorted(scaling.items()))


def _original_and_factor(scaling: dict, hf: dict) -> tuple[int, float]:
    """The context length the model was trained at, and how far it is extended (by
    default, max_position_embeddings over it)."""
    original = scaling.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings", hf.get("max_position_embeddings", 2048)
    )
    factor = scaling.get("factor") or hf.get("max_position_embeddings", original) / original
    return original, factor


def _longrope(scaling: dict, hf: dict) -> dict:
    """Phi-3's longrope with every value resolved: the factors, the context length past
    which the long ones apply, and the attention factor (by default from the context
    extension factor, as the LongRoPE paper and transformers compute it)."""
    original, factor = _original_and_factor(scaling, hf)
    attention_factor = scaling.get("attention_factor", hf.get("rope_attention_factor"))
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return {
        "rope_type": "longrope",
        "short_factor": tuple(scaling["short_factor"]),
        "long_factor": tuple(scaling["long_factor"]),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
    }


def _yarn(scaling: dict, hf: dict) -> dict:
    """YaRN with every value resolved as transformers resolves it: the factor (by default
    the context's extension), beta_fast 32 and beta_slow 1 when unset, truncate true unless
    said otherwise, and the attention factor (by default 0.1 ln(factor) + 1, or the ratio
    of mscale to mscale_all_dim's when both are given)."""
    original, factor = _original_and_factor(scaling, hf)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "beta_fast": float(scaling.get("beta_fast") or 32),
        "beta_slow": float(scaling.get("beta_slow") or 1),
        "original_max_position_embeddings": int(original),
        "truncate": bool(scaling.get("truncate", True)),
        "attention_factor": float(attention_factor),
    }
