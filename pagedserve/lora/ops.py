"""``y += scale * B_a (A_a x)`` for every row of a flat batch, each row with its own adapter.

The adapters of one linear layer sit in device slots: ``a`` [slots, in, r] and ``b`` [slots, r,
out] (scale folded into ``b``); each row of the batch carries its slot, -1 for a base-model row.
``add_lora_reference`` is the definition, a row at a time; ``add_lora`` is what the model runs
where the device has no kernel of its own for the rows (``Device.lora_add``: the CPU targets'
``csrc/lora.h`` takes a decode step's few rows), held to it by the tests:

- the engine puts a step's sequences in slot order (base rows first), so the adapter
  rows are one span of the batch, each slot's rows together (``LoRABatch``, shared by every
  layer): the ops take views of ``x`` and add into a view of ``y``, no gather, no scatter;
- one adapter: two matmuls;
- *padded*: two or more adapters whose runs are about as long (decode spread over adapters):
  the runs padded to one length (a view of the span when they are equal) and two ``bmm`` calls
  over their slots. A 16-bit matmul of a few rows costs some 15 us on the CPU whatever its size;
  ``bmm`` pays that once for every adapter;
- *grouped*: otherwise (a long prompt beside short ones), one grouped GEMM
  (``torch._grouped_mm``, a matmul per slot's run inside one call) for the shrink and one for
  the expand: no padding, the work in proportion to the rows.
Rows in any other order (a caller that does not sort) are gathered and scattered back.

``benchmarks/lora.py`` measured both against a loop of matmuls per adapter, a gathered
per-row ``bmm`` (Punica's BGMV) and one matmul over every slot with the other slots' columns
masked; README "LoRA adapters" has the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# padded bmm when the padded runs hold at most this many rows per real one (and >= 2 adapters)
PADDED_MAX_FILL = 1.25


@dataclass
class LoRABatch:
    """One step's rows grouped by adapter slot (every layer of the step reuses it)."""

    num_tokens: int
    row_slots: torch.Tensor  # [num_tokens] int32: each row's slot, -1 for a base-model row
    order: torch.Tensor  # [N]: the adapter rows, sorted by slot (stable)
    offsets: torch.Tensor  # [slots] int32: where each slot's run ends in ``order``
    runs: list[tuple[int, int, int]]  # (slot, start, end) in ``order``, present slots only
    # the adapter rows are rows [span) of x, already in slot order (the model runner sorts a
    # step's sequences by slot): no gather and no scatter, only views of x and y
    span: tuple[int, int] | None = None
    padded: torch.Tensor | None = None  # [k, L]: rows of x per present slot, num_tokens = pad
    padded_valid: torch.Tensor | None = None  # flat positions of real rows in [k * L]
    slots: torch.Tensor | None = None  # [k]: the present slots (None: the range below)
    slot_range: tuple[int, int] = (0, 0)

    @classmethod
    def build(
        cls, token_slots: list[int], num_slots: int, padded: bool | None = None
    ) -> LoRABatch | None:
        """None when no row has an adapter (the model then runs no LoRA at all). ``padded``:
        None chooses the path by the rules above; True or False forces it (the benchmark)."""
        per_slot: list[list[int]] = [[] for _ in range(num_slots)]
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                per_slot[slot].append(row)
        order = [row for rows in per_slot for row in rows]
        if not order:
            return None
        runs, ends, at = [], [], 0
        for slot, rows in enumerate(per_slot):
            if rows:
                runs.append((slot, at, at + len(rows)))
            at += len(rows)
            ends.append(at)
        batch = cls(
            len(token_slots),
            torch.tensor(token_slots, dtype=torch.int32),
            torch.tensor(order, dtype=torch.long),
            torch.tensor(ends, dtype=torch.int32),
            runs,
        )
        if order == list(range(order[0], order[0] + len(order))):
            batch.span = (order[0], order[0] + len(order))
        batch._plan_padded(per_slot, padded)
        return batch

    def _plan_padded(self, per_slot: list[list[int]], force: bool | None) -> None:
        present = [(slot, per_slot[slot]) for slot, _, _ in self.runs]
        slots = [slot for slot, _ in present]
        longest = max(len(rows) for _, rows in present)
        if slots == list(range(slots[0], slots[-1] + 1)):
            self.slot_range = (slots[0], slots[-1] + 1)
        else:
            self.slots = torch.tensor(slots, dtype=torch.long)
        fill = len(present) * longest
        even = len(present) >= 2 and fill <= PADDED_MAX_FILL * len(self.order)
        if not (even if force is None else force):
            return
        grid = [rows + [self.num_tokens] * (longest - len(rows)) for _, rows in present]
        self.padded = torch.tensor(grid, dtype=torch.long)
        flat = [i * longest + j for i, (_, rows) in enumerate(present) for j in range(len(rows))]
        self.padded_valid = torch.tensor(flat, dtype=torch.long)

    @property
    def views_only(self) -> bool:
        """The padded bmm over a view of x: a span of equal runs (no padding at all)."""
        k, (start, end) = len(self.runs), self.span or (0, -1)
        return self.span is not None and (end - start) == k * self.padded.shape[1]

    def to(self, device: torch.device) -> LoRABatch:
        for name in ("row_slots", "order", "offsets", "padded", "padded_valid", "slots"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self


Parts = torch.Tensor | list[torch.Tensor]


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Parts, batch: LoRABatch):
    """``y[t] + x[t] @ a[s] @ b[s]`` for every row ``t`` whose slot ``s`` is not -1.

    ``b`` is one [slots, r, out] tensor, or parts [slots, r, out_p] that fill ``y``'s columns
    side by side, part ``p`` reading columns ``p*r`` .. of ``x @ a``: q, k and v of a fused
    qkv layer, so that no part reads the others' (zero) weights. Returns ``y`` itself, added to
    in place, when it is contiguous (a kernel's output may be a view of a wider buffer, and
    ``index_add_`` into one is a hundred times slower on the CPU)."""
    parts = [b] if isinstance(b, torch.Tensor) else list(b)
    if not y.is_contiguous():
        y = y.contiguous()
    h = _per_slot_matmul(_adapter_rows(x, batch), a, batch)
    r, col = parts[0].shape[1], 0
    for p, part in enumerate(parts):
        out = _per_slot_matmul(h[..., p * r : (p + 1) * r], part, batch)
        columns = y if len(parts) == 1 else y[:, col : col + part.shape[2]]
        _add_rows(columns, out, batch)
        col += part.shape[2]
    return y


def add_lora_on(device, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Parts, batch):
    """What the model runs: ``device``'s own kernel for these rows (``Device.lora_add``, e.g. the
    CPU targets' for a decode step's few rows) where it has one, else ``add_lora``."""
    out = device.lora_add(y, x, a, b, batch)
    return add_lora(y, x, a, b, batch) if out is None else out


def _adapter_rows(x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """The adapter rows of ``x``: [k, L, in] padded per slot, else [N, in] in slot order."""
    if batch.padded is not None:
        k, longest = batch.padded.shape
        if batch.views_only:
            return x[batch.span[0] : batch.span[1]].reshape(k, longest, -1)
        return torch.cat([x, x.new_zeros(1, x.shape[1])])[batch.padded]
    return x[slice(*batch.span)] if batch.span else x.index_select(0, batch.order)


def _per_slot_matmul(h: torch.Tensor, w: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """Each slot's rows of ``h`` (``_adapter_rows``' layout) times that slot's ``w``."""
    if batch.padded is not None:
        if batch.slots is None:
            w = w[batch.slot_range[0] : batch.slot_range[1]]
        else:
            w = w.index_select(0, batch.slots)
        return torch.bmm(h, w)
    if len(batch.runs) > 1 and _grouped_gemm_ok(h, w):
        return torch._grouped_mm(h.contiguous(), w, offs=batch.offsets)
    # one adapter: one matmul; or a device without the grouped GEMM
    return torch.cat([h[i:j] @ w[s] for s, i, j in batch.runs])


def _add_rows(y: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
    """``out`` (the adapter rows, in ``_adapter_rows``' layout) added into their rows of ``y``."""
    if batch.padded is not None:
        out = out.reshape(-1, out.shape[-1])
        if batch.views_only:
            y[batch.span[0] : batch.span[1]] += out
            return
        out = out.index_select(0, batch.padded_valid)  # the real rows, in slot order
    if batch.span is not None:
        y[batch.span[0] : batch.span[1]] += out
    else:
        y.index_add_(0, batch.order, out)


def _grouped_gemm_ok(h: torch.Tensor, w: torch.Tensor) -> bool:
    """``torch._grouped_mm`` on the CPU, where every row it reads starts on 16 bytes."""
    if h.device.type != "cpu" or h.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = h.element_size()
    return all((n * size) % 16 == 0 for n in (h.shape[-1], w.shape[1], w.shape[2]))


def add_lora_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Parts, token_slots: list[int]
) -> torch.Tensor:
    """The definition, a row at a time: ``y[t] += (x[t] @ a[s]) @ b[s]`` where ``s`` is row
    ``t``'s slot (-1: a base-model row, left as it is); with parts, part ``p`` of ``y``'s
    columns gets ``(x[t] @ a[s])[p*r : (p+1)*r] @ b_p[s]``."""
    parts = [b] if isinstance(b, torch.Tensor) else list(b)
    r = parts[0].shape[1]
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        h, col = x[t] @ a[s], 0
        for p, part in enumerate(parts):
            y[t, col : col + part.shape[2]] += h[p * r : (p + 1) * r] @ part[s]
            col += part.shape[2]
    return y
