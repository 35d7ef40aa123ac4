"""One rank's adapters: ``max_loras`` device slots per linear layer, the ``max_cpu_loras`` most
recently used adapters in host memory, and each step's rows by slot.

The slots are allocated once, in the device's weight tier, before the KV cache is sized (so the
pool leaves room for them): per decoder layer and target, ``lora_a`` [slots, in, r] and
``lora_b`` [slots, r, out] in the model's dtype, ``r`` the maximum rank rounded up to 8;
``qkv_proj`` has three parts, q, k and v: ``lora_a`` [slots, in, 3r] and a ``lora_b`` for each
(``lora/sizes.py`` has the shapes). An adapter moves into a slot by copy from
its host-memory copy (read from disk again if the host cache has dropped it); rank 0's
``LoRARegistry`` decides which slot, the same on every rank.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagedserve.hal import Device
from pagedserve.lora.ops import LoRABatch, add_lora_on
from pagedserve.lora.peft import TARGETS, LoRAAdapter, LoRALayerWeights, load_peft_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.sizes import slot_shapes
from pagedserve.models.config import GlmConfig
from pagedserve.models.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)


@dataclass
class LoRAStep:
    """What a forward pass adds for its adapter rows: ``apply`` after each target layer."""

    slots: LoRASlots
    batch: LoRABatch

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = self.slots.lora_a[target][layer], self.slots.lora_b[target][layer]
        return add_lora_on(self.slots.device, y, x, a, b, self.batch)


class LoRASlots:
    def __init__(
        self,
        config: GlmConfig,
        device: Device,
        dtype: torch.dtype,
        tp: TensorParallel,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_rank_setting: str = "--max-lora-rank",
    ):
        self.config, self.device, self.dtype, self.tp = config, device, dtype, tp
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.max_rank_setting = max_rank_setting
        self.lora_a: dict[str, list[torch.Tensor]] = {}  # per layer: [slots, in, parts x r]
        self.lora_b: dict[str, list[list[torch.Tensor]]] = {}  # per layer, part: [slots, r, out]
        layers = range(config.num_hidden_layers)
        for target, (fan_in, r, outs) in slot_shapes(config, tp.size, max_lora_rank).items():
            self.lora_a[target] = [
                device.empty(
                    (max_loras, fan_in, r * len(outs)), dtype, "weight", f"lora.{i}.{target}.a"
                )
                for i in layers
            ]
            self.lora_b[target] = [
                [
                    device.empty((max_loras, r, out), dtype, "weight", f"lora.{i}.{target}.b{p}")
                    for p, out in enumerate(outs)
                ]
                for i in layers
            ]
        self.requests: dict[int, LoRARequest] = {}  # every adapter this rank may be asked for
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_ids: list[int | None] = [None] * max_loras
        self.num_disk_loads = 0
        self.last_swap_in_seconds = 0.0

    @property
    def nbytes(self) -> int:
        tensors = [t for ts in self.lora_a.values() for t in ts]
        tensors += [t for parts in self.lora_b.values() for ts in parts for t in ts]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def host_nbytes(self) -> int:
        return sum(adapter.nbytes for adapter in self.host.values())

    # ---- adapters -----------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check the adapter (``LoRAAdapterError`` says what does not fit) and keep it
        in host memory."""
        adapter = self._load(request)
        self.requests[request.lora_int_id] = request
        self._keep(adapter)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        self.requests.pop(lora_int_id, None)
        self.host.pop(lora_int_id, None)
        self.slot_ids = [None if i == lora_int_id else i for i in self.slot_ids]

    def activate(self, slot: int, lora_int_id: int) -> None:
        """Copy an adapter into device slot ``slot`` (from host memory, or disk once dropped)."""
        start = time.perf_counter()
        adapter = self.host.get(lora_int_id)
        if adapter is None:
            adapter = self._load(self.requests[lora_int_id])
            self.num_disk_loads += 1
        self._keep(adapter)
        for i in range(self.config.num_hidden_layers):
            for target in TARGETS:
                a = self.lora_a[target][i][slot]
                parts = [b[slot] for b in self.lora_b[target][i]]
                weights = adapter.layers.get((i, target))
                for t in (a, *parts):
                    t.zero_()
                if weights is not None:
                    _copy_into_slot(weights, a, parts)
        self.slot_ids[slot] = lora_int_id
        self.last_swap_in_seconds = time.perf_counter() - start

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        adapter = load_peft_adapter(
            request.lora_path,
            self.config,
            request.lora_name,
            request.lora_int_id,
            self.max_lora_rank,
            self.dtype,
            self.tp,
            self.max_rank_setting,
        )
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        """Into the host cache as its most recently used entry; the least recently used beyond
        ``max_cpu_loras`` leave (they are read from disk again when next needed)."""
        self.host[adapter.lora_int_id] = adapter
        self.host.move_to_end(adapter.lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            dropped, _ = self.host.popitem(last=False)
            logger.debug("LoRA adapter %d leaves host memory (max_cpu_loras)", dropped)

    # ---- steps --------------------------------------------------------------------------------
    def step(self, token_slots: list[int]) -> LoRAStep | None:
        """The forward pass's LoRA for rows with these slots; None when no row has one."""
        batch = LoRABatch.build(token_slots, self.max_loras)
        if batch is None:
            return None
        return LoRAStep(self, batch.to(self.device.torch_device))


def _copy_into_slot(weights: LoRALayerWeights, a: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """An adapter's layer into a slot's zeroed ``a`` [in, parts x R] and parts' ``b`` [R, out_p].
    HF's q/k/v (``weights.parts`` 3: ``a`` side by side, ``b`` block-diagonal) land part by part;
    chatglm's fused query_key_value (one ``a``) gives every part the same ``a`` and its own
    columns of ``b``."""
    own, stride = weights.a.shape[1] // weights.parts, a.shape[1] // len(parts)
    col = 0
    for p, b in enumerate(parts):
        source = p if weights.parts == len(parts) else 0
        rows = slice(source * own, (source + 1) * own)
        a[:, p * stride : p * stride + own].copy_(weights.a[:, rows])
        b[:own].copy_(weights.b[rows, col : col + b.shape[1]])
        col += b.shape[1]
