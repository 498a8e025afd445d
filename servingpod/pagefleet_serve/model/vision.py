"""What a vision-language model's forward pass takes beside the token batch: for each
image a step touches, which of the batch's rows hold its tokens (`ImageRows`); and the
cache of encoder outputs by image hash (`EncoderCache`), so that an image's tower and
projector run once for all its chunks, its repeats and the requests that send it again.
A family takes them as `images=` in its `forward` (`models/gemma3_vl.py`)."""

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pagefleet_kernels.metadata import AttentionMetadata, BidirectionalRows


class ImageInput(Protocol):
    """An image as the frontend hands it over (`messages.ImageInput`, which the model
    layer does not import): its pixels, hash, and the prompt tokens it fills."""

    @property
    def digest(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def pixels(self) -> bytes: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class ImageRows:
    """Rows `row` .. `row + count - 1` of a step's batch hold the image's tokens `first` ..
    `first + count - 1`, of the sequence whose block table is the batch's `seq_index`."""

    image: ImageInput
    row: int
    first: int
    count: int
    seq_index: int

    @property
    def span_end(self) -> int:
        """The position after the image's last token: where its tokens' context ends."""
        return self.image.offset + self.image.length


def image_rows(
    images: Sequence[ImageInput], seq_index: int, row: int, start: int, num_new: int
) -> list[ImageRows]:
    """The rows of a sequence's chunk (its tokens `start` .. `start + num_new - 1` at
    batch rows from `row`) that hold its images' tokens."""
    out = []
    for image in images:
        lo, hi = max(start, image.offset), min(start + num_new, image.offset + image.length)
        if lo < hi:
            out.append(ImageRows(image, row + lo - start, lo - image.offset, hi - lo, seq_index))
    return out


def bidirectional_rows(images: Sequence[ImageRows], attn: AttentionMetadata) -> BidirectionalRows:
    """The image rows as one-token queries each seeing up to its image's end (see
    `layers.attention.Attention`)."""
    device = attn.block_tables.device
    rows = torch.cat([torch.arange(r.row, r.row + r.count) for r in images]).to(device)
    tables = torch.cat([attn.block_tables[r.seq_index].expand(r.count, -1) for r in images])
    lens = [r.span_end for r in images for _ in range(r.count)]
    starts = list(range(len(lens) + 1))
    span = AttentionMetadata(
        slot_mapping=attn.slot_mapping.index_select(0, rows),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
        query_lens=[1] * len(lens),
        seq_lens_host=lens,
        query_start_loc_host=starts,
    )
    return BidirectionalRows(rows, span)


class EncoderCache:
    """Encoder outputs (image tokens, hidden) by image hash, least recently used out
    first once `capacity` images are held."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._outputs: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.queries = self.hits = 0
        self.seconds = 0.0  # the encoder's, for the images it held not

    def get(self, image: ImageInput, encode: Callable[[ImageInput], torch.Tensor]) -> torch.Tensor:
        self.queries += 1
        out = self._outputs.get(image.digest)
        if out is not None:
            self.hits += 1
            self._outputs.move_to_end(image.digest)
            return out
        started = time.perf_counter()
        out = encode(image)
        self.seconds += time.perf_counter() - started
        self._outputs[image.digest] = out
        while len(self._outputs) > self.capacity:
            self._outputs.popitem(last=False)
        return out
