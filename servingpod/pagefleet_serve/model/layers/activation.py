"""The gated activations of the MLPs: act(gate) * up over a fused [gate | up] row, SwiGLU
(silu) or GeGLU (gelu, tanh approximation), computed by the kernel backend's
`act_and_mul`."""

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


def is_gelu(hidden_act: str) -> bool:
    """Whether `act_and_mul` takes the GeGLU path for this config.json `hidden_act`."""
    return hidden_act == "gelu_pytorch_tanh"
