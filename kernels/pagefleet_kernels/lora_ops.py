"""The batched LoRA operator in PyTorch (Punica's shrink-then-expand, one pair of matmuls
per adapter slot present in the step): the ground truth, the torch backend's operator, and
the cpu backend's for what its C++ one does not take (`cpu_layer_ops.add_lora`).

Each row of a step carries its own adapter slot or none (`LoRAMapping`); the rows of one
slot are gathered, multiplied by that slot's A then B, and added back into the layer's
output, so that a batch mixing adapters costs one gather and two small matmuls per slot
present, not per row.
"""

import torch

from pagefleet_kernels.metadata import LoRAMapping

__all__ = ["add_lora", "add_lora_padded"]


def add_lora(
    y: torch.Tensor,  # (T, N): a linear layer's output, added to in place
    x: torch.Tensor,  # (T, K): that layer's input
    lora_a: torch.Tensor,  # (slots, R, K)
    lora_b: torch.Tensor,  # (slots, N, R), the adapter's scale folded in
    mapping: LoRAMapping,
    parts: tuple[int, ...] = (),  # lora_b's blocks: read whole (see `AddLoRAOp`)
) -> None:
    """y[t] += lora_b[s] @ (lora_a[s] @ x[t]) for each row t of slot s; the rows without an
    adapter are left as they are."""
    for slot, rows in mapping.slot_rows:
        shrunk = x.index_select(0, rows) @ lora_a[slot].t()  # (n, R)
        y.index_add_(0, rows, shrunk @ lora_b[slot].t())  # (n, N)


def add_lora_padded(
    y: torch.Tensor,  # (T, N), added to in place
    x: torch.Tensor,  # (T, K)
    lora_a: torch.Tensor,  # (slots, R, K)
    lora_b: torch.Tensor,  # (slots, N, R)
    mapping: LoRAMapping,
    parts: tuple[int, ...] = (),  # lora_b's blocks: read whole (see `AddLoRAOp`)
) -> None:
    """`add_lora` in a fixed handful of ops whatever the step mixes (the cpu backend's: on
    a small CPU each op costs microseconds, and a step calls this four times a layer): the
    rows of every slot read gathered into one padded (slots read, most rows, K) batch, two
    batched matmuls, one scatter back. The slots' weights are read in place when the step
    reads every slot, gathered otherwise."""
    rows, padded_rows, positions = mapping.rows, mapping.padded_rows, mapping.padded_positions
    if rows is None or padded_rows is None or positions is None:
        add_lora(y, x, lora_a, lora_b, mapping)
        return
    slots = [slot for slot, _ in mapping.slot_rows]
    if slots != list(range(lora_a.shape[0])):
        index = mapping.token_slots.new_tensor(slots)
        lora_a, lora_b = lora_a.index_select(0, index), lora_b.index_select(0, index)
    # A padding place gathers row 0: its product is left out by `positions`.
    gathered = x.index_select(0, padded_rows).view(len(slots), -1, x.shape[1])
    delta = torch.bmm(torch.bmm(gathered, lora_a.transpose(1, 2)), lora_b.transpose(1, 2))
    y.index_add_(0, rows, delta.view(-1, y.shape[1]).index_select(0, positions))
