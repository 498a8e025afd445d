"""Every Triton kernel variant the engine can launch compiles for the GPUs it targets (see
triton_aot.py), fits in a block's shared memory there and spills no registers: a variant
that does not is a failing test here, not a surprise on the first GPU run.

`make test` compiles a pairwise covering set of the attention variants (every two axes'
values meet in some variant), the listed layer-op variants and the MoE grouped GEMM's
variants (for sm_80, sm_89 and sm_90); the full cross product of
the attention axes runs under `-m slow`.
"""

import inspect
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl
from pagefleet_kernels import triton_attention

from tests.kernels.kernel_batches import make_batch
from tests.kernels.triton_aot import (
    AXES,
    DEFAULT_TARGETS,
    LAYER_OP_KERNELS,
    LAYER_OP_VARIANTS,
    LORA_VARIANTS,
    MAX_SHARED_BYTES,
    MOE_TARGETS,
    MOE_VARIANTS,
    TARGETS,
    LaunchRecorder,
    layer_op_id,
    lora_variant_id,
    moe_variant_id,
    pairwise,
    product,
    variant_id,
)

REPO = Path(__file__).resolve().parents[2]


def compile_all(mode: str, tmp_path: Path) -> dict:
    """Run triton_aot.py in a child without TRITON_INTERPRET, with a fresh Triton cache
    (so every compile runs ptxas, whose log reports the spills). It runs as a module from
    the repository root, where its `tests.kernels` imports resolve."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env |= {
        "TRITON_CACHE_DIR": str(tmp_path / "triton_cache"),
        "TRITON_ALWAYS_COMPILE": "1",
        "TRITON_DUMP_PTXAS_LOG": "1",
    }
    out = tmp_path / "compiled.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton_aot", mode, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def pairwise_compiles(tmp_path_factory) -> dict:
    return compile_all("pairwise", tmp_path_factory.mktemp("aot_pairwise"))


@pytest.fixture(scope="module")
def product_compiles(tmp_path_factory) -> dict:
    return compile_all("product", tmp_path_factory.mktemp("aot_product"))


@pytest.fixture(scope="module")
def moe_compiles(tmp_path_factory) -> dict:
    return compile_all("moe", tmp_path_factory.mktemp("aot_moe"))


@pytest.fixture(scope="module")
def lora_compiles(tmp_path_factory) -> dict:
    return compile_all("lora", tmp_path_factory.mktemp("aot_lora"))


def check_variant(compiles: dict, variant: dict) -> None:
    expected = {"_write_kv_cache_kernel", "_paged_attention_kernel"}
    if variant["shape"][1] > 1:
        expected.add("_merge_segments_kernel")
    targets = TARGETS.get(variant["cache"], DEFAULT_TARGETS)
    check_reports(compiles["variants"][variant_id(variant)], expected, targets)


def check_reports(reports: list[dict], expected: set[str], targets: tuple) -> None:
    """Each expected kernel compiled for each target, within shared memory, no spills."""
    launched = {(report["kernel"], report["capability"]) for report in reports}
    assert launched == set(itertools.product(expected, targets))
    problems = [
        f"{r['kernel']} sm_{r['capability']}: {r['shared']} bytes of shared memory (at most "
        f"{MAX_SHARED_BYTES[r['capability']]}), {r['registers']} registers, "
        f"{r['spill_stores']} bytes of register spills, {r['num_warps']} warps"
        for r in reports
        if r["shared"] > MAX_SHARED_BYTES[r["capability"]] or r["spill_stores"]
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("variant", pairwise(AXES), ids=variant_id)
def test_kernel_variants_compile_and_fit(variant, pairwise_compiles):
    check_variant(pairwise_compiles, variant)


@pytest.mark.parametrize("variant", LAYER_OP_VARIANTS, ids=layer_op_id)
def test_layer_op_variants_compile_and_fit(variant, pairwise_compiles):
    """Also: no float multiply and add fused into one rounding (the launches turn fp
    fusion off), which would make the add and rope differ from torch's bits on the GPU."""
    reports = pairwise_compiles["variants"][layer_op_id(variant)]
    check_reports(reports, {LAYER_OP_KERNELS[variant["op"]]}, DEFAULT_TARGETS)
    assert [report["float_fmas"] for report in reports] == [0] * len(reports)


@pytest.mark.parametrize("variant", MOE_VARIANTS, ids=moe_variant_id)
def test_moe_variants_compile_and_fit(variant, moe_compiles):
    """Both launches of a forward ([gate | up]; down with the routing weights)."""
    reports = moe_compiles["variants"][moe_variant_id(variant)]
    assert len(reports) == 2 * len(MOE_TARGETS)
    check_reports(reports, {"_grouped_gemm_kernel"}, MOE_TARGETS)


@pytest.mark.parametrize("variant", LORA_VARIANTS, ids=lora_variant_id)
def test_lora_variants_compile_and_fit(variant, lora_compiles):
    """Both launches of the operator: the shrink, then the expand."""
    reports = lora_compiles["variants"][lora_variant_id(variant)]
    check_reports(reports, {"_lora_shrink_kernel", "_lora_expand_kernel"}, DEFAULT_TARGETS)


@pytest.mark.slow
@pytest.mark.parametrize("variant", product(AXES), ids=variant_id)
def test_every_kernel_variant_compiles_and_fits(variant, product_compiles):
    check_variant(product_compiles, variant)


def test_integer_arguments_are_annotated():
    """A single sequence passes num_seqs = 1: unannotated, the JIT would compile it in as a
    constexpr (and `_find_seq_idx` reassigns it)."""
    recorder = LaunchRecorder(triton_attention._paged_attention_kernel)
    batch = make_batch([1], [5], 4, 2, dtype=torch.float16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention, "_paged_attention_kernel", recorder)
        batch.attention(triton_attention)
    [(args, _)] = recorder.launches
    parameters = list(inspect.signature(recorder.kernel.fn).parameters.values())
    integers = {
        p.name: p.annotation
        for p, arg in zip(parameters[: len(args)], args, strict=True)
        if type(arg) is int
    }
    assert integers["num_seqs"] == tl.int32
    assert all(annotation in (tl.int32, tl.int64) for annotation in integers.values()), integers


def test_pairwise_covers_every_pair_of_axis_values():
    rows = pairwise(AXES)
    for a, b in itertools.combinations(AXES, 2):
        seen = {(repr(row[a]), repr(row[b])) for row in rows}
        assert len(seen) == len(AXES[a]) * len(AXES[b]), (a, b)
    assert len(rows) < len(product(AXES)) // 50
