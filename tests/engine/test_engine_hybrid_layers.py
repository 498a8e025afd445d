"""The recurrent layers of hybrid models (`model/layers/`: Gated DeltaNet in Qwen3-Next's and
Qwen3.5's layouts, the Mamba2 mixer as Mamba2, Nemotron-H and Granite 4.0-H build it,
LFM2's short convolution) against transformers' own modules with the same random weights,
in float32, on both backends' operators (torch: the definitions a token at a time; cpu: the
chunked forms).

Each layer is driven as the engine drives it: steps of a flattened batch, each sequence
giving its next tokens (a whole prompt, chunks of it, one token a step), in a slot of the
layer's state tensors, starting from zero on its first step over rows of NaN. Whatever the
schedule, every sequence's outputs equal transformers' outputs for the whole sequence in
one pass; several sequences in one batch equal each alone."""

import math

import pytest
import torch
from pagefleet_kernels import cpu_attention
from pagefleet_kernels.backend import KernelBackend, cpu_backend, torch_backend
from pagefleet_kernels.state_batch import metadata
from pagefleet_serve.model.context import ModelContext, building
from pagefleet_serve.model.layers.gated_deltanet import GatedDeltaNet, InterleavedGatedDeltaNet
from pagefleet_serve.model.layers.mamba2 import Mamba2Mixer
from pagefleet_serve.model.layers.short_conv import ShortConv
from pagefleet_serve.model.layers.state import StateSpec, allocate, bytes_per_sequence
from pagefleet_serve.model.tensor_parallel import TensorParallel
from transformers import (
    GraniteMoeHybridConfig,
    Lfm2Config,
    Mamba2Config,
    NemotronHConfig,
    Qwen3NextConfig,
)
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

HIDDEN = 64
SLOTS = 6
# float32; the chunked forms and the one-token steps sum in other orders than transformers'
# chunked scans.
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}

GATED_DELTANET = {
    "hidden_size": HIDDEN,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
    "num_hidden_layers": 1,
    "layer_types": ["linear_attention"],
}


def qwen3_next():
    config = Qwen3NextConfig(**GATED_DELTANET)
    return Qwen3NextGatedDeltaNet(config, 0), lambda: InterleavedGatedDeltaNet(
        HIDDEN, 2, 4, 16, 24, 4, config.rms_norm_eps
    )


def qwen3_5():
    config = Qwen3_5TextConfig(**GATED_DELTANET)
    return Qwen3_5GatedDeltaNet(config, 0), lambda: GatedDeltaNet(
        HIDDEN, 2, 4, 16, 24, 4, config.rms_norm_eps
    )


def mamba2():
    """8 heads of 16 in 2 groups, chunks of 32, in_proj and out_proj with biases."""
    config = Mamba2Config(
        hidden_size=HIDDEN, num_heads=8, head_dim=16, n_groups=2, state_size=16, expand=2,
        chunk_size=32, num_hidden_layers=1, use_bias=True,
    )  # fmt: skip
    return HFMamba2Mixer(config, 0), lambda: Mamba2Mixer(
        HIDDEN, 8, 16, 2, 16, config.conv_kernel, 32, config.layer_norm_epsilon, use_bias=True
    )


def nemotron_h():
    """4 groups, a dt limit that clamps, chunks of 48."""
    config = NemotronHConfig(
        hidden_size=HIDDEN, mamba_num_heads=8, mamba_head_dim=8, n_groups=4, ssm_state_size=8,
        chunk_size=48, num_hidden_layers=1, layer_types=["mamba"], time_step_limit=(0.05, 1.0),
    )  # fmt: skip
    return NemotronHMamba2Mixer(config, 0), lambda: Mamba2Mixer(
        HIDDEN, 8, 8, 4, 8, config.conv_kernel, 48, config.layer_norm_epsilon,
        use_conv_bias=config.use_conv_bias, time_step_limit=(0.05, 1.0),
    )  # fmt: skip


def granite_4_h():
    """One group for all 8 heads, kernel 3."""
    config = GraniteMoeHybridConfig(
        hidden_size=HIDDEN, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_expand=2, mamba_d_conv=3, mamba_chunk_size=32, num_hidden_layers=1,
        layer_types=["mamba"],
    )  # fmt: skip
    return GraniteMoeHybridMambaLayer(config, 0), lambda: Mamba2Mixer(
        HIDDEN, 8, 16, 1, 16, 3, 32, config.rms_norm_eps, use_conv_bias=config.mamba_conv_bias
    )


def lfm2():
    config = Lfm2Config(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["conv"], conv_L_cache=3
    )
    return Lfm2ShortConv(config, 0), lambda: ShortConv(HIDDEN, 3, config.conv_bias)


LAYERS = {
    "qwen3-next": qwen3_next,
    "qwen3.5": qwen3_5,
    "mamba2": mamba2,
    "nemotron-h": nemotron_h,
    "granite-4.0-h": granite_4_h,
    "lfm2": lfm2,
}


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights at scales a trained layer has: decays from A_log in [log 1, log 8], norm
    weights around 1 (so the norm's weight matters), projections ~ 1 / sqrt(fan in)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name == "A_log":
            value = torch.rand(param.shape, generator=gen) * math.log(8)
        elif name.startswith("norm"):
            value = 1 + 0.3 * noise
        elif name in ("dt_bias", "D") or name.endswith("bias"):
            value = 0.5 * noise
        else:
            value = noise / math.sqrt(param[0].numel())
        param.data.copy_(value)


@pytest.fixture(params=["torch", "cpu"])
def backend(request) -> KernelBackend:
    if request.param == "cpu" and not cpu_attention.available():
        pytest.skip("no C++ compiler: the engine uses the torch backend")
    return torch_backend() if request.param == "torch" else cpu_backend()


def build(family: str, backend: KernelBackend):
    """transformers' layer and ours, with the same random weights loaded through our weight
    loaders by the checkpoint's names."""
    reference, make = LAYERS[family]()
    randomize(reference, seed=len(family))
    with building(ModelContext(backend)):
        ours = make()
    params = dict(ours.named_parameters())
    assert set(params) == set(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        params[name].weight_loader(params[name], tensor)
    return reference.eval(), ours


def drive(layer, sequences, schedules, slots) -> list[torch.Tensor]:
    """Step by step as the engine would: at step j sequence i gives its next
    schedules[i][j] tokens (0: none), in slot slots[i]; its first step starts from zero."""
    state = allocate(layer.state_specs(), SLOTS, "cpu")
    for tensor in state.values():
        tensor.fill_(float("nan"))  # stale rows: reading one fails the test
    done = [0] * len(sequences)
    outputs: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in range(max(len(s) for s in schedules)):
        running = [i for i, s in enumerate(schedules) if step < len(s) and s[step]]
        lengths = [schedules[i][step] for i in running]
        x = torch.cat(
            [sequences[i][done[i] : done[i] + n] for i, n in zip(running, lengths, strict=True)]
        )
        meta = metadata(lengths, [slots[i] for i in running], [done[i] > 0 for i in running])
        with torch.no_grad():
            out = layer(x, state, meta)
        for i, part in zip(running, out.split(lengths), strict=True):
            outputs[i].append(part)
            done[i] += len(part)
    assert done == [len(s) for s in sequences]
    return [torch.cat(o) for o in outputs]


def expected(reference, sequence: torch.Tensor) -> torch.Tensor:
    """transformers' output for the whole sequence in one pass, no cache."""
    with torch.no_grad():
        return reference(sequence[None])[0]


def prompts(*lengths: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(lengths))
    return [torch.randn(n, HIDDEN, generator=gen) for n in lengths]


SCHEDULES = {
    "whole": [150],
    "chunks": [37, 64, 1, 48],  # chunked prefill across steps, a one-token chunk among them
    "decode": [40] + [1] * 110,  # a prompt, then one token a step
}


@pytest.mark.parametrize("family", list(LAYERS))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_layer_matches_transformers(family, schedule, backend):
    reference, ours = build(family, backend)
    (sequence,) = prompts(150)
    (out,) = drive(ours, [sequence], [SCHEDULES[schedule]], slots=[3])
    torch.testing.assert_close(out, expected(reference, sequence), **TOLERANCE)


@pytest.mark.parametrize("family", list(LAYERS))
def test_sequences_in_one_batch_equal_each_alone(family, backend):
    """Three sequences of different lengths in one flattened batch, in slots out of order:
    one decoding while another is prefilled in chunks and a third arrives late, whole."""
    reference, ours = build(family, backend)
    sequences = prompts(90, 70, 33)
    schedules = [
        [20] + [1] * 70,
        [25, 25, 20],
        [0, 0, 33],
    ]
    outputs = drive(ours, sequences, schedules, slots=[4, 0, 2])
    for out, sequence in zip(outputs, sequences, strict=True):
        torch.testing.assert_close(out, expected(reference, sequence), **TOLERANCE)


def test_a_reused_slot_starts_from_zero():
    """A slot that held another sequence's state (finite, not NaN) gives the next sequence
    its own outputs when the step says it starts from zero."""
    reference, ours = build("qwen3.5", torch_backend())
    first, second = prompts(30, 20)
    state = allocate(ours.state_specs(), SLOTS, "cpu")
    with torch.no_grad():
        ours(first, state, metadata([30], [1], [False]))
        assert state["recurrent"][1].abs().sum() > 0
        out = ours(second, state, metadata([20], [1], [False]))
    torch.testing.assert_close(out, expected(reference, second), **TOLERANCE)


def test_state_specs_and_bytes_per_sequence():
    """The named per-sequence tensors each layer declares, and what one sequence costs."""
    with building(ModelContext(torch_backend(), dtype=torch.bfloat16)):
        deltanet = GatedDeltaNet(2048, 16, 32, 128, 128, 4, 1e-6)
        mixer = Mamba2Mixer(2560, 80, 64, 1, 128, 4, 256, 1e-5)
        short = ShortConv(1024, 3)
    assert deltanet.state_specs() == (
        StateSpec("conv", (2 * 16 * 128 + 32 * 128, 3), torch.bfloat16),
        StateSpec("recurrent", (32, 128, 128), torch.float32),
    )
    assert bytes_per_sequence(deltanet.state_specs()) == 8192 * 3 * 2 + 32 * 128 * 128 * 4
    assert mixer.state_specs() == (
        StateSpec("conv", (80 * 64 + 2 * 128, 3), torch.bfloat16),
        StateSpec("ssm", (80, 64, 128), torch.float32),
    )
    assert short.state_specs() == (StateSpec("conv", (1024, 2), torch.bfloat16),)
    assert bytes_per_sequence(short.state_specs()) == 1024 * 2 * 2


def test_tensor_parallel_ranks_are_refused_with_the_setting_to_change():
    with building(ModelContext(torch_backend(), TensorParallel(rank=0, size=2))):
        with pytest.raises(ValueError, match=r"tensor_parallel_size 2.*Gated DeltaNet"):
            GatedDeltaNet(HIDDEN, 2, 4, 16, 24, 4, 1e-6)
        with pytest.raises(ValueError, match=r"tensor_parallel_size 2.*Mamba2"):
            Mamba2Mixer(HIDDEN, 8, 16, 2, 16, 4, 32, 1e-5)


def test_value_heads_must_be_a_multiple_of_key_heads():
    with pytest.raises(
        ValueError, match=r"linear_num_value_heads \(5\).*linear_num_key_heads \(2\)"
    ):
        GatedDeltaNet(HIDDEN, 2, 5, 16, 24, 4, 1e-6)
