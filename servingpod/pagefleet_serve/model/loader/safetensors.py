"""Hugging Face model directories: config.json and *.safetensors (sharded or not, float8
with their scales), read as the model's weight loaders take them.

Unsplit float weights are read whole, each straight into its place in the model's
parameters, the shards in parallel (`safetensors_reader`): the walk over the checkpoint
hands each weight loader a `ScheduledRead`, whose destination is noted, and the reads run
once every tensor has one, as shards still downloading arrive. A tensor-parallel rank's
part, and float8 weights with their scales, go through safetensors' slices
(`SliceWeight`), which read only the rows or columns a loader cuts.
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pagefleet_serve.model import fp8
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.layers.rotary import rope_scaling
from pagefleet_serve.model.loader import safetensors_reader
from pagefleet_serve.model.loader.hub import ArrivingShards
from pagefleet_serve.model.quant import QuantizedWeight
from pagefleet_serve.model.registry import hf_architecture, model_class
from pagefleet_serve.model.tensor_parallel import TensorParallel
from pagefleet_serve.model.weights import Ranges, Weight, take
from pagefleet_serve.model_uri import UnsupportedModelError


@dataclass
class ScheduledRead:
    """A whole tensor of a file, read when the walk is over (`plan`: name -> where)."""

    entry: safetensors_reader.Entry
    plan: dict[str, torch.Tensor]
    file: Path
    arrive: Callable[[Path], object] | None = None
    kept_quantized = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    def cut(self, dim: int, ranges: Ranges) -> Weight:
        raise ValueError(f"{self.entry.name} is read whole: no rank cuts it")

    def dequantized(self) -> "ScheduledRead":
        return self

    def load(self, dtype: torch.dtype) -> torch.Tensor:
        """Read now (a loader that needs the values: gpt-oss's experts), in the file's
        dtype."""
        if self.arrive is not None:
            self.arrive(self.file)
        entry = next(
            e for e in safetensors_reader.read_header(self.file) if e.name == self.entry.name
        )
        out = torch.empty(entry.shape, dtype=entry.dtype)
        safetensors_reader.read_into(self.file, [(entry, out)])
        return out

    def load_into(self, out: torch.Tensor) -> None:
        self.plan[self.entry.name] = out


@dataclass
class SliceWeight:
    """A tensor of an open safetensors file, read when loaded: only the `cuts` taken of it;
    a float8 weight whole, with its `scale`, dequantized (or kept float8 with one scale per
    output row, `kept_quantized`) and then cut."""

    handle: object  # safetensors' safe_open
    key: str
    shape: tuple[int, ...]
    scale: torch.Tensor | None = None
    scheme: fp8.Fp8Scheme | None = None
    kept_quantized: bool = False
    cuts: list[tuple[int, Ranges]] = field(default_factory=list)

    def cut(self, dim: int, ranges: Ranges) -> "SliceWeight":
        if self.kept_quantized:
            raise ValueError(f"{self.key}: float8 weights kept float8 are not split")
        shape = list(self.shape)
        shape[dim] = sum(end - first for first, end in ranges)
        return replace(self, shape=tuple(shape), cuts=[*self.cuts, (dim, ranges)])

    def dequantized(self) -> "SliceWeight":
        return replace(self, kept_quantized=False)

    def load(self, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
        if self.scale is None:
            if not self.cuts:
                return self.handle.get_tensor(self.key)
            (dim, ranges), *later = self.cuts  # one cut from the file, the rest in memory
            tensor = take(self.handle.get_slice(self.key), dim, ranges)
        else:  # float8: read whole, with its scales (by block, too), then cut
            weight = self.handle.get_tensor(self.key)
            if self.kept_quantized:
                return fp8.kept(self.key, weight, self.scale, self.scheme)
            tensor, later = fp8.dequantize(self.key, weight, self.scale, self.scheme), self.cuts
        for dim, ranges in later:
            tensor = take(tensor, dim, ranges)
        return tensor

    def load_into(self, out: torch.Tensor) -> None:
        out.copy_(self.load(out.dtype))


@dataclass
class HFCheckpoint:
    config: ModelConfig
    weights: Iterator[tuple[str, Weight]]


def open_hf_dir(
    path: Path,
    supported: str,
    keep_fp8: bool,
    parallel: TensorParallel,
    shards: ArrivingShards | None = None,
    headless: bool = False,
) -> HFCheckpoint:
    """The config of a Hugging Face directory, and its weights to walk (once); sharded
    hf:// checkpoints still downloading (`shards`) are read shard by shard as they arrive.
    `supported`: what the error messages list; `headless`: see `model_loader.load_local`."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise UnsupportedModelError(f"{path} has no config.json; supported: {supported}")
    hf = json.loads(config_file.read_text())
    architecture = hf_architecture(hf)
    if architecture is None:
        raise UnsupportedModelError(
            f"{path}: model_type {hf.get('model_type')!r} is not Llama-family; supported: "
            f"{supported}"
        )
    cls = model_class(architecture)
    hf = cls.config_class.language_config(hf)
    scheme = _weight_scheme(path, hf, cls.reads_mxfp4)
    if shards is not None and (scheme is not None or parallel.parallel):
        shards.wait_all()  # slices and float8 scales are read through safetensors' own reader
        shards = None
    index = path / "model.safetensors.index.json"
    if index.exists():  # only the shards it names: a directory may hold other copies
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / shard for shard in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path} has no *.safetensors weights; supported: {supported}")
    if shards is not None:  # the headers as the Hub has them: the shards are on their way
        headers = {
            path / shard: safetensors_reader.expected_entries(path / shard, tensors)
            for shard, tensors in shards.headers.items()
        }
    else:
        headers = {file: safetensors_reader.read_header(file) for file in files}
    names = {entry.name for entries in headers.values() for entry in entries}
    # Absent from config.json when it equals the config class's default: then the
    # checkpoint says, by having an lm_head or not.
    hf.setdefault("tie_word_embeddings", "lm_head.weight" not in names)
    if headless and "lm_head.weight" not in names:
        hf["tie_word_embeddings"] = True
    keep = keep_fp8 and scheme is not None and scheme.block is None
    if keep and parallel.parallel:
        raise UnsupportedModelError(
            f"{path}: float8 weights kept float8 are not split for tensor parallelism yet; "
            "use quantization none (dequantized on load) or tensor_parallel_size 1"
        )
    config = cls.config_class.from_hf(
        hf, rope_scaling(hf, path), _eos_token_ids(path, hf), architecture
    )
    if scheme is None and not parallel.parallel:
        arrive = None if shards is None else (lambda file: shards.wait(file.name))
        weights = _scheduled(path, files, headers, shards is not None, arrive)
    else:
        weights = _slices(path, files, scheme, keep)
    return HFCheckpoint(config, weights)


def _scheduled(path, files, headers, expected: bool, arrive) -> Iterator[tuple[str, Weight]]:
    """Every tensor as a ScheduledRead; the reads run after the last is handed out."""
    plan: dict[str, torch.Tensor] = {}
    for file in files:
        for entry in headers[file]:
            if entry.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise UnsupportedModelError(f"{path}: {entry.name} is float8 and has no scale")
            yield entry.name, ScheduledRead(entry, plan, file, arrive)
    try:
        safetensors_reader.read_files(
            files, lambda entry: plan.get(entry.name), headers if expected else None, arrive
        )
    except safetensors_reader.SafetensorsFormatError as exc:
        raise UnsupportedModelError(str(exc)) from None


def _slices(path, files, scheme: fp8.Fp8Scheme | None, keep: bool):
    """Every tensor as a SliceWeight, file by file (one open at a time)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, "pt") as f:
            scales = {}  # a float8 weight's name -> its scale (small: read first)
            if scheme is not None:
                names = [k for k in f.keys() if scheme.is_scale(k)]  # noqa: SIM118
                scales = {scheme.weight_of(k): f.get_tensor(k) for k in names}
            for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if scheme is not None and (scheme.is_scale(k) or scheme.is_unused(k)):
                    continue
                lazy = f.get_slice(k)
                shape = tuple(lazy.get_shape())
                scale = scales.get(k)
                if scale is None and lazy.get_dtype() in ("F8_E4M3", "F8_E5M2"):
                    raise UnsupportedModelError(f"{path}: {k} is float8 and has no scale")
                yield k, SliceWeight(f, k, shape, scale, scheme, keep and scale is not None)


def _weight_scheme(path: Path, hf: dict, reads_mxfp4: bool) -> fp8.Fp8Scheme | None:
    """The float8 scheme of a checkpoint's weights (model/fp8.py: dequantized as they
    stream or, with keep_fp8 and a scale per tensor or row, kept float8), None for float
    weights and MXFP4 experts (read as their uint8 blocks and scales, which the family
    dequantizes); an error for what is not read."""
    quantization = hf.get("quantization_config")
    if not quantization:
        return None
    if quantization.get("quant_method") == "mxfp4":
        if not reads_mxfp4:
            raise UnsupportedModelError(f"{path}: MXFP4 weights are read for gpt_oss only")
        return None
    try:
        return fp8.fp8_scheme(quantization)
    except fp8.Fp8FormatError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from exc


def _eos_token_ids(path: Path, hf: dict) -> tuple[int, ...]:
    """The config's EOS id(s), then generation_config's (often a list: Llama 3 ends turns
    with <|eot_id|> as well as <|end_of_text|>), without repeats."""
    ids: list[int] = []
    sources = [hf.get("eos_token_id")]
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(token)
    return tuple(ids)
