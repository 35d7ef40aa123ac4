"""The one interface the engine and the model see: memory tiers, the KV page pool and the kernels.

A backend subclasses ``Device`` and overrides what it does faster; every override is held to the
reference in ``kernels.py`` by the tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from pagedserve.hal import int4, kernels
from pagedserve.hal.device_preset import DevicePreset, host_memory_limit, kv_pool_limits
from pagedserve.hal.faults import (
    FaultCounts,
    UnrecoverableFaultError,
    WeightPage,
    WeightScrubber,
)
from pagedserve.hal.int4 import Int4Linear
from pagedserve.hal.int8 import Int8Linear, int8_linear_reference
from pagedserve.hal.kernels import AttentionMetadata
from pagedserve.hal.memory import MemoryAttr, MemoryTier, format_bytes

logger = logging.getLogger(__name__)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# the setting a user changes when a tier runs out
_TIER_FLAGS = {"kv": "--gpu-memory-utilization", "host": "--swap-space, --host-prefix-cache"}


class Device:
    """Base backend: charges every allocation to a memory tier and runs the reference kernels."""

    backend = "base"

    def __init__(self, preset: DevicePreset, torch_device: str = "cpu"):
        self.preset = preset
        self.torch_device = torch.device(torch_device)
        self.tiers = {
            name: MemoryTier(name, cap, flag=_TIER_FLAGS.get(name, "--device"))
            for name, cap in preset.tiers.items()
        }
        self._handles: dict[int, tuple[str, int]] = {}
        self.kv_cache: torch.Tensor | None = None
        self.host_kv_cache: torch.Tensor | None = None  # the host tier's KV page frames
        self.kv_memory_attr: MemoryAttr | None = None
        self.weight_tensors: dict[str, torch.Tensor] = {}  # by tag: what the scrub covers
        self.scrubber: WeightScrubber | None = None
        self.faults = FaultCounts()
        self.rank, self.world_size = 0, 1  # this card's place among the tensor-parallel ranks
        self.collective_bytes_sent = 0

    def twin(self) -> Device:
        """A fresh device of the same backend and preset, placing tensors as this one does (a
        weight page's restoration rebuilds its tensor there)."""
        return type(self)(self.preset)

    @property
    def kernel_set(self) -> str:
        """The kernels this backend runs (the CPU backends name their native target)."""
        return "eager"

    @property
    def num_faults_detected(self) -> int:
        return sum(self.faults.detected.values())

    @property
    def card_name(self) -> str:
        """``kunlun-emu`` alone; ``kunlun-emu card 1`` among tensor-parallel ranks."""
        return self.name if self.world_size == 1 else f"{self.name} card {self.rank}"

    @property
    def name(self) -> str:
        return self.preset.name

    # ---- memory -------------------------------------------------------------------------------
    def to_device(
        self, t: torch.Tensor, tier: str, tag: str, attr: MemoryAttr = MemoryAttr.CACHED
    ) -> torch.Tensor:
        """Place a tensor on the device, charged to ``tier``."""
        handle = self.tiers[tier].reserve(t.numel() * t.element_size(), tag, attr)
        out = t.to(self.torch_device).contiguous()
        self._handles[id(out)] = (tier, handle)
        if tier == "weight":
            assert tag not in self.weight_tensors, f"two weight tensors tagged {tag!r}"
            self.weight_tensors[tag] = out
        return out

    def empty(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        tier: str,
        tag: str,
        attr: MemoryAttr = MemoryAttr.CACHED,
    ) -> torch.Tensor:
        return self._zeros_in(tier, tag, attr, shape, dtype, device=self.torch_device)

    def _zeros_in(
        self, tier: str, tag: str, attr: MemoryAttr, shape: tuple[int, ...], dtype, **where
    ) -> torch.Tensor:
        """``torch.zeros(shape, dtype, **where)``, charged to ``tier``."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        handle = self.tiers[tier].reserve(nbytes, tag, attr)
        out = torch.zeros(shape, dtype=dtype, **where)
        self._handles[id(out)] = (tier, handle)
        return out

    def free(self, t: torch.Tensor) -> None:
        tier, handle = self._handles.pop(id(t))
        self.tiers[tier].release(handle)
        self.weight_tensors = {k: v for k, v in self.weight_tensors.items() if v is not t}

    def num_kv_pages_available(self, page_bytes: int, utilization: float) -> int:
        """How many KV pages fit in ``utilization`` of the device memory, after the weights
        (``kv_pool_limits``: the rule ``pagedserve tune`` plans by)."""
        kv, weight = self.tiers["kv"], self.tiers["weight"]
        limits = kv_pool_limits(
            self.preset, weight.used, utilization, kv.used, self.host_memory_limit()
        )
        return max(int(min(limits.values()) // page_bytes), 0)

    def host_memory_limit(self) -> float:
        """Bytes a pool may take from this machine: half its available RAM where the device's memory
        is the host's (``cpu``, ``kunlun-emu``), so that a preset larger than the machine does
        not swap it to death; unbounded otherwise."""
        return host_memory_limit() if self.preset.in_host_memory else float("inf")

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_pages: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        attr: MemoryAttr | None = None,
    ) -> torch.Tensor:
        """The KV page pool: [layers, 2 (K, V), num_pages, block_size, kv_heads, row], with row
        ``kernels.kv_row_width(head_dim, dtype)``: the head's values, and for an INT8 cache
        (``dtype=torch.int8``) their scale.

        Page frame ``p`` is index ``p`` of dim 2: one page holds ``block_size`` tokens of every layer.
        """
        attr = attr or self.preset.kv_memory_attr
        if attr is MemoryAttr.UNCACHED:
            logger.warning(
                "the KV page pool on %s is allocated UNCACHED: every attention read goes to memory "
                "uncached and decode slows down; set kv_memory_attr: cached in the device preset",
                self.name,
            )
        shape = (
            num_layers,
            2,
            num_pages,
            block_size,
            num_kv_heads,
            kernels.kv_row_width(head_dim, dtype),
        )
        self.kv_cache = self.empty(shape, dtype, "kv", "kv_cache", attr)
        self.kv_memory_attr = attr
        return self.kv_cache

    def take_faulted_pages(self) -> list[int]:
        """KV pages whose contents the device found corrupted since the last call."""
        return []

    # ---- the host tier's KV page frames -------------------------------------------------------
    def allocate_host_kv_cache(self, num_frames: int) -> torch.Tensor:
        """Page frames in the host tier for KV pages that leave the KV tier (the pages of a
        swapped-out sequence, prefix blocks the KV tier evicts): [num_frames, layers, 2,
        block_size, kv_heads, row], the KV pool's pages page-major (``kernels.swap_out_pages``),
        in host memory. Pages move between the tiers whole, by ``swap_out`` and ``swap_in``."""
        assert self.kv_cache is not None, "allocate_host_kv_cache before the KV cache"
        layers, _, _, *page = self.kv_cache.shape
        shape = (num_frames, layers, 2, *page)
        self.host_kv_cache = self.host_empty(shape, self.kv_cache.dtype, "host_kv_cache")
        return self.host_kv_cache

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        """A zeroed tensor in host memory, charged to the host tier (a backend whose device
        memory is not the host's pins it there, for copies that overlap compute)."""
        return self._zeros_in("host", tag, MemoryAttr.CACHED, shape, dtype, device="cpu")

    def swap_out(self, moves: list[tuple[int, int]]) -> None:
        """Copy KV pages to host frames: (device page, host frame) pairs, before the step that
        may write the pages again."""
        if moves:
            kernels.swap_out_pages(self.kv_cache, self.host_kv_cache, moves)

    def swap_in(self, moves: list[tuple[int, int]]) -> None:
        """Copy host frames back to KV pages: (host frame, device page) pairs."""
        if moves:
            kernels.swap_in_pages(self.kv_cache, self.host_kv_cache, moves)

    def take_faulted_host_frames(self) -> list[int]:
        """Host-tier KV frames whose contents the device found corrupted since the last call."""
        return []

    # ---- the weight tier's patrol scrub -------------------------------------------------------
    def seal_weights(self) -> None:
        """Take every weight page's checksum (call once the model's weights are placed)."""
        self.scrubber = WeightScrubber(self.weight_tensors)

    @property
    def num_weight_pages(self) -> int:
        return len(self.scrubber.pages) if self.scrubber else 0

    def scrub_weights(self, num_pages: int) -> list[WeightPage]:
        """Verify the patrol's next ``num_pages`` weight pages; the corrupted ones (counted)."""
        if self.scrubber is None or num_pages <= 0:
            return []
        bad = self.scrubber.scrub(num_pages)
        self.faults.detected["weight_page"] += len(bad)
        return bad

    def restore_weight_page(self, page: WeightPage, source: torch.Tensor) -> None:
        """Write a corrupted page back from ``source`` (its tensor rebuilt from the checkpoint)."""
        assert self.scrubber is not None, "restore_weight_page before seal_weights"
        if not self.scrubber.restore(page, source):
            raise UnrecoverableFaultError(
                f"weight page {page.index} of {page.tag} still fails its checksum after "
                "restoration: the checkpoint on disk differs from the one loaded"
            )
        self.faults.recovered["weight_page"] += 1

    def memory_stats(self) -> dict:
        return {name: tier.stats() for name, tier in self.tiers.items()}

    def describe(self) -> str:
        parts = [
            f"{name} {format_bytes(t.used)} / {format_bytes(t.capacity) if t.capacity else 'unbounded'}"
            for name, t in self.tiers.items()
        ]
        return f"{self.name} ({self.backend}): " + ", ".join(parts)

    def synchronize(self) -> None:
        pass

    def prepare_int4(
        self,
        qcodes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        tag: str,
        abits: int = 16,
    ) -> Int4Linear:
        """Place an int4 layer (canonical form, see ``int4.py``) in the weight tier."""
        n, k = qcodes.shape
        w = Int4Linear(n, k, group_size, abits)
        w.qcodes = self.to_device(qcodes.to(torch.uint8), "weight", f"{tag}.qcodes")
        w.scales = self.to_device(scales.float(), "weight", f"{tag}.scales")
        w.zeros = self.to_device(zeros.float(), "weight", f"{tag}.zeros")
        return w

    def prepare_int8(
        self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, tag: str
    ) -> Int8Linear:
        """Place an int8 per-channel layer (``int8.py``) in the weight tier."""
        n, k = qweight.shape
        return Int8Linear(
            n,
            k,
            self.to_device(qweight.to(torch.int8), "weight", f"{tag}.qweight"),
            self.to_device(scales.to(dtype), "weight", f"{tag}.scales"),
        )

    # ---- kernels (reference implementations; backends override) -------------------------------
    def plan_kernels(self, dtype: torch.dtype, head_dim: int) -> None:
        """Decide, as a model loads, which kernel runs each of its ops (a backend with native
        kernels says here, once, which ops fall back to the reference and why)."""

    def native_ops(self) -> dict[str, str]:
        """The loaded model's ops by name: "native", or why each runs a fallback; {} where the
        backend runs the references (or PyTorch's ops) alone."""
        return {}

    def linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor | Int4Linear | Int8Linear,
        b: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(w, Int4Linear):
            return self.int4_linear(x, w, b)
        if isinstance(w, Int8Linear):
            return self.int8_linear(x, w, b)
        return kernels.linear(x, w, b)

    def int8_linear(
        self, x: torch.Tensor, w: Int8Linear, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        return int8_linear_reference(x, w, b)

    def int4_linear(
        self, x: torch.Tensor, w: Int4Linear, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        return int4.int4_linear_reference(x, w, b)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.rms_norm(x, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (just ``x`` when there is no residual yet) and its RMSNorm: the
        residual stream of a decoder, vLLM's fused_add_rms_norm. A backend may update
        ``residual`` in place."""
        residual = x if residual is None else residual + x
        return self.rms_norm(residual, w, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)

    def rotary_at(self, cos_sin: torch.Tensor, positions: torch.Tensor) -> object:
        """Per-token rotary factors, made once per forward pass in the form ``apply_rotary`` wants."""
        return kernels.rotary_at(cos_sin, positions)

    def apply_rotary(self, x: torch.Tensor, rope: object) -> torch.Tensor:
        """Rotated ``x``; a backend may rotate ``x`` in place and return it."""
        return kernels.apply_rotary(x, *rope)

    def rotary_and_write_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        rope: object,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q and k of ``qkv`` [T, heads + 2 kv_heads, D], store k and v at their slots;
        returns q [T, heads, D]. The cache holds rotated keys."""
        num_kv_heads = k_cache.shape[2]
        qk = self.apply_rotary(qkv[:, : num_heads + num_kv_heads], rope)
        self.write_kv(
            qk[:, num_heads:], qkv[:, num_heads + num_kv_heads :], k_cache, v_cache, slot_mapping
        )
        return qk[:, :num_heads]

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return kernels.paged_attention(q, k_cache, v_cache, meta, scale)

    def fused_decoder_layer(
        self, weights: object, num_heads: int, num_kv_heads: int, head_dim: int, eps: float
    ) -> Callable | None:
        """A backend's one-call kernel for a whole GLM-4 decoder layer on decode-only batches, or
        None: the model then runs the layer op by op (which defines what the kernel computes).

        ``weights`` has the fields of ``models.glm4.DecoderLayerWeights``. The callable takes
        ``(h, residual, rope, meta, kv)`` and returns ``(output, residual)`` as
        ``GlmForCausalLM._decoder_layer`` does.
        """
        return None

    # the most query rows per sequence a forward may have for ``fused_decoder_layer``'s kernel
    fused_layer_max_query_rows = 1

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Per row, the index of the first largest value (greedy sampling)."""
        return logits.argmax(dim=-1)

    def categorical(self) -> Callable[..., torch.Tensor] | None:
        """The backend's draw of a whole row in one call, (logits, 1 / temperature, u) -> token
        ids (sampler.Categorical); None: the sampler's PyTorch draw."""
        return None

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b, batch):
        """The backend's own kernel for ``y[t] += x[t] @ a[s] @ b[s]`` over the rows ``t`` of
        ``batch`` (``lora.ops.LoRABatch``) whose adapter slot ``s`` is not -1 (``b``: one
        [slots, r, out] tensor, or the parts of a fused layer): ``y``, added to in place where it
        is contiguous; or None where the backend has none for these rows, and the caller runs
        the grouped PyTorch ops (``lora.ops.add_lora``)."""
        return None

    # ---- collectives (tensor parallelism over torch.distributed) ------------------------------
    distributed_backend = "gloo"  # the collective library this backend's cards talk through

    def join_group(self, rank: int, world_size: int) -> None:
        """Make this card rank ``rank`` of the process group the caller initialised."""
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``t`` summed (or its minimum, ``op="min"``) over every rank, in place. A ring
        all-reduce sends ``2 (n-1)/n`` of the tensor from each card: that is what is counted."""
        if self.world_size == 1:
            return t
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}
        dist.all_reduce(t, op=ops[op])
        self._count_sent(_nbytes(t) * 2 * (self.world_size - 1) // self.world_size)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order; each card sends its part
        to the ``n - 1`` others."""
        if self.world_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        self._count_sent(_nbytes(t) * (self.world_size - 1))
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``t`` on every rank, in place (``src`` sends it to the ``n - 1`` others)."""
        if self.world_size == 1:
            return t
        dist.broadcast(t, src)
        if self.rank == src:
            self._count_sent(_nbytes(t) * (self.world_size - 1))
        return t

    def _count_sent(self, nbytes: int) -> None:
        self.collective_bytes_sent += nbytes

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        assert self.kv_cache is not None, "copy_pages before the KV cache was allocated"
        kernels.copy_pages(self.kv_cache, copies)
