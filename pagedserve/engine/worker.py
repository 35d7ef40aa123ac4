"""One tensor-parallel rank: its card (a ``Device``), its shard of the weights, its KV pages and its
model runner.

Rank 0 is built by the engine core (``LLMEngine``), which owns the scheduler and the single block
manager: every rank holds the same pages, of its own KV heads. The other ranks run ``run_worker``:
the same start-up, then a loop that receives each step from rank 0 (``executor.py``) and runs it.
"""

from __future__ import annotations

import logging

import torch

from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.hal import DeviceOutOfMemoryError, get_device
from pagedserve.hal.memory import format_bytes
from pagedserve.lora.slots import LoRASlots
from pagedserve.models import load_config, load_state_dict, resolve_model_path
from pagedserve.models.config import int4_group_size
from pagedserve.models.glm4 import GlmForCausalLM
from pagedserve.models.loader import weight_files
from pagedserve.models.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, checkpoint_dtype: str | None) -> torch.dtype:
    if dtype == "auto":
        dtype = checkpoint_dtype if checkpoint_dtype in _DTYPES else "bfloat16"
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class Worker:
    """Rank ``rank`` of ``world_size``; its device has joined the process group already when
    ``world_size > 1`` (``executor.init_distributed``)."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        world_size: int = 1,
        usage_context: UsageContext = UsageContext.OPENAI_API_SERVER,
    ):
        self.config = config
        self.usage_context = usage_context
        self.model_path = resolve_model_path(config.model.model)
        self.model_config = load_config(self.model_path)
        self.dtype = resolve_dtype(config.model.dtype, self.model_config.torch_dtype)
        self.device = get_device(config.device.device, config.device.kernel_choice)
        self.device.join_group(rank, world_size)
        self.tp = TensorParallel(self.model_config, rank, world_size)
        self.tp.check(self._int4_group_size(), usage_context.name_of("tensor_parallel_size"))
        self.model = self._load_model()
        self.lora = self._lora_slots()  # before the KV pool is sized: it leaves them room
        self.block_size = config.cache.block_size
        self.kv_cache_dtype = torch.int8 if config.cache.kv_cache_dtype == "int8" else self.dtype
        self.runner: ModelRunner | None = None
        self.num_swap_frames = self.num_host_cache_frames = 0  # the host tier's shares

    # ---- weights ------------------------------------------------------------------------------
    def _int4_group_size(self) -> int | None:
        mc = self.config.model
        qc = self.model_config.quantization_config
        return int4_group_size(qc, mc.quantization, mc.quant_group_size)

    def _load_model(self) -> GlmForCausalLM:
        mc = self.config.model
        if mc.quantization not in (None, "int4", "w4a8", "awq", "gptq"):
            raise ValueError(
                f"--quantization {mc.quantization!r} is not supported; use int4 (load-time "
                f"round-to-nearest, bf16 activations), w4a8 (the same weights, int8 activations), "
                f"or point --model at an AWQ/GPTQ/pagedserve quantized directory"
            )
        if mc.quantization in ("awq", "gptq") and not self.model_config.quantization_config:
            raise ValueError(
                f"--quantization {mc.quantization} needs a quantized checkpoint, but "
                f"{self.model_path} has no quantization_config; use --quantization int4 to "
                f"quantize at load time, or run `pagedserve quantize` first"
            )
        state_dict = load_state_dict(self.model_path, self.model_config, self.dtype, self.tp)
        model = GlmForCausalLM(
            self.model_config,
            self.device,
            self.dtype,
            mc.quantization,
            mc.quant_group_size,
            mc.quantize_lm_head,
            self.tp,
        )
        try:
            model.load_weights(state_dict)
        except DeviceOutOfMemoryError as e:
            raise ValueError(self._weights_do_not_fit(e)) from None
        return model

    def _weights_do_not_fit(self, error: DeviceOutOfMemoryError) -> str:
        """What to do when a card cannot hold its share of the weights: more ranks."""
        checkpoint = sum(f.stat().st_size for f in weight_files(self.model_path))
        tier = self.device.tiers["weight"]
        card = self.device.preset.memory_bytes or tier.capacity
        flag = self.usage_context.name_of("tensor_parallel_size")
        tp = self.tp.size
        sizes = [n for n in (2, 4, 8, 16, 32, 64) if n > tp and checkpoint / n < 0.9 * card]
        advice = (
            f"split it over {sizes[0]} cards with {self.usage_context.assignment('tensor_parallel_size', sizes[0])}"
            if sizes
            else "use a larger device preset or --quantization int4"
        )
        return (
            f"the weights do not fit on one card of {self.device.name} at {flag} {tp}: the "
            f"checkpoint has {format_bytes(checkpoint)}, a card holds {format_bytes(card)} "
            f"({error}); {advice}"
        )

    def _lora_slots(self) -> LoRASlots | None:
        lora = self.config.lora
        if not lora.enable_lora:
            return None
        try:
            return LoRASlots(
                self.model_config,
                self.device,
                self.dtype,
                self.tp,
                lora.max_loras,
                lora.max_lora_rank,
                lora.cpu_loras,
                self.usage_context.name_of("max_lora_rank"),
            )
        except DeviceOutOfMemoryError as e:
            name = self.usage_context.name_of
            raise ValueError(
                f"the LoRA adapters' device slots do not fit beside the weights ({e}); lower "
                f"{name('max_loras')} or {name('max_lora_rank')}"
            ) from None

    # ---- the KV cache -------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """On this card: its KV heads only, in the KV cache's dtype (``--kv-cache-dtype``)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.model_config.kv_bytes_per_token(
            self.tp.num_kv_heads, elem, self.config.cache.kv_cache_dtype
        )

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token()

    def init_kv_cache(self) -> ModelRunner:
        """Allocate the KV page pool (as many pages as the fullest card allows: every rank holds
        the same pages), the host tier's frames, and the model runner over them."""
        c, cache = self.model_config, self.config.cache
        page_bytes = self.page_bytes
        num_pages = cache.num_kv_pages or self.device.num_kv_pages_available(
            page_bytes, cache.gpu_memory_utilization
        )
        num_pages = self._same_on_every_rank(num_pages)
        if num_pages < 1:
            name = self.usage_context.name_of
            raise ValueError(
                f"no room for KV pages on {self.device.name}: one page needs "
                f"{format_bytes(page_bytes)}; raise {name('gpu_memory_utilization')} or use a "
                f"larger {name('device')}"
            )
        kv_cache = self.device.allocate_kv_cache(
            c.num_hidden_layers,
            num_pages,
            self.block_size,
            self.tp.num_kv_heads,
            c.head_dim,
            self.kv_cache_dtype,
        )
        self._init_host_tier()
        self.runner = ModelRunner(self.model, self.device, kv_cache, self.block_size, self.lora)
        return self.runner

    def _same_on_every_rank(self, count: int) -> int:
        """The smallest ``count`` of all ranks (the pool every rank can hold)."""
        t = torch.tensor([count], device=self.device.torch_device)
        return int(self.device.all_reduce(t, op="min")[0])

    def _init_host_tier(self) -> None:
        """Frames in the host tier for ``--swap-space`` and ``--host-prefix-cache`` GiB, a page
        each, as one pool (``engine.host_tier``)."""
        cache = self.config.cache
        swap = self._same_on_every_rank(int(cache.swap_space * 2**30 // self.page_bytes))
        cached = self._same_on_every_rank(int(cache.host_prefix_cache * 2**30 // self.page_bytes))
        if not swap + cached:
            return
        nbytes = (swap + cached) * self.page_bytes
        name = self.usage_context.name_of
        asked = (
            f"{name('swap_space')} {cache.swap_space:g} GiB and {name('host_prefix_cache')} "
            f"{cache.host_prefix_cache:g} GiB ({format_bytes(nbytes)})"
        )
        tier, limit = self.device.tiers["host"], self.device.host_memory_limit()
        if tier.capacity and nbytes > tier.free:
            raise ValueError(
                f"{asked} do not fit the host tier of {self.device.name}: "
                f"{format_bytes(tier.free)} free of {format_bytes(tier.capacity)}; lower them or "
                "use a device preset with a larger host tier"
            )
        if nbytes > limit:
            raise ValueError(
                f"{asked} ask for more host memory than this machine can give "
                f"({format_bytes(int(limit))}); lower them"
            )
        self.device.allocate_host_kv_cache(swap + cached)
        self.num_swap_frames, self.num_host_cache_frames = swap, cached

    def device_stats(self) -> dict:
        """This card's part of what ``pagedserve smi`` shows (the engine adds the KV pool, the
        requests and rank 0's faults and weight patrol, the same for every card)."""
        dev = self.device
        stats = {
            "name": dev.card_name,
            "backend": dev.backend,
            "kernels": dev.kernel_set,
            "native_ops": dev.native_ops(),
            "description": dev.preset.description,
            "tiers": dev.memory_stats(),
        }
        if dev.world_size > 1:
            stats |= {"tp_rank": dev.rank, "collective_bytes_sent": dev.collective_bytes_sent}
        if self.lora is not None:  # this card's share of the adapters
            stats["lora_memory"] = {
                "slots_bytes": self.lora.nbytes,
                "host_bytes": self.lora.host_nbytes,
                "host_adapters": len(self.lora.host),
                "disk_loads_total": self.lora.num_disk_loads,
            }
        return stats
