"""One config tree for the engine, built from CLI flags, a YAML file in ``configs/`` or ``LLM(...)``
keyword arguments. Field names are vLLM's."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class UsageContext(enum.Enum):
    """Who builds the engine (vLLM's name), so that its messages name settings the way that user
    writes them: ``serve``'s flags or ``LLM(...)``'s keywords."""

    OPENAI_API_SERVER = "serve"
    LLM_CLASS = "LLM"

    def name_of(self, setting: str) -> str:
        """``--max-model-len`` for the server, ``max_model_len`` for ``LLM(...)``."""
        return setting if self is UsageContext.LLM_CLASS else "--" + setting.replace("_", "-")

    def assignment(self, setting: str, value: object) -> str:
        """``--max-model-len 4096`` for the server, ``max_model_len=4096`` for ``LLM(...)``."""
        if self is UsageContext.LLM_CLASS:
            return f"{setting}={value!r}"
        return f"{self.name_of(setting)} {value!r}"

    @property
    def start_with(self) -> str:
        """How a setting changes: "start the server with" or "create the LLM with"."""
        return "create the LLM with" if self is UsageContext.LLM_CLASS else "start the server with"


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Config):
    model: str = "demo"
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str | None = (
        None  # None | "int4" | "w4a8" (or the checkpoint's quantization_config)
    )
    quant_group_size: int = Field(32, description="int4 group size: 32, 64 or 128")
    quantize_lm_head: str | None = None  # none | int8 | int4; None: as the checkpoint has it
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    served_model_name: str | None = None


# --kv-cache-dtype: K and V in the model's dtype, or INT8 codes with a scale per token and head
KV_CACHE_DTYPES = ("auto", "int8")
# --preemption-mode: what a preempted sequence's KV pages become
PREEMPTION_MODES = ("recompute", "swap", "auto")


class CacheConfig(_Config):
    block_size: int = Field(16, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    num_kv_pages: int | None = Field(None, ge=1)  # overrides the computed pool size
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # GiB of the device's host tier per card, as page frames: for the pages of sequences that
    # are swapped out (vLLM's --swap-space), and for prefix blocks the KV tier evicts (SGLang's
    # HiCache); 0 leaves that share unused
    swap_space: float = Field(0.0, ge=0.0)
    host_prefix_cache: float = Field(0.0, ge=0.0)

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_cache_dtype(cls, value: str) -> str:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"{value!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        return value


class SchedulerConfig(_Config):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    # recompute: free a preempted sequence's pages and compute them again later (vLLM v1);
    # swap: copy them to the host tier and back (vLLM v0) while it has room; auto: swap when the
    # copy costs less than the recompute, as measured on this device
    preemption_mode: str = "auto"

    @field_validator("preemption_mode")
    @classmethod
    def _known_preemption_mode(cls, value: str) -> str:
        if value not in PREEMPTION_MODES:
            raise ValueError(f"{value!r} is not one of {', '.join(PREEMPTION_MODES)}")
        return value


# --kernels: a CPU backend's native kernel target (hal/native.py), or plain PyTorch ops
KERNEL_CHOICES = ("auto", "avx512", "avx2", "portable", "eager")


class DeviceConfig(_Config):
    device: str = "kunlun-emu"
    kernels: str = "auto"  # KERNEL_CHOICES: the CPU kernels' target, or eager
    enforce_eager: bool = False  # vLLM's flag: the same as kernels="eager"

    @field_validator("kernels")
    @classmethod
    def _known_kernels(cls, value: str) -> str:
        if value not in KERNEL_CHOICES:
            raise ValueError(f"{value!r} is not one of {', '.join(KERNEL_CHOICES)}")
        return value

    @property
    def kernel_choice(self) -> str:
        return "eager" if self.enforce_eager else self.kernels

    weight_scrub_pages: int = Field(2, ge=0)  # weight pages the patrol scrub verifies per step


class ParallelConfig(_Config):
    """Tensor parallelism: ``tensor_parallel_size`` ranks over ``nnodes`` machines (SGLang's
    multi-node flags); ranks ``node_rank * per_node ..`` run on this machine."""

    tensor_parallel_size: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    dist_init_addr: str | None = None  # HOST:PORT of node 0's rendezvous; None: a local port
    dist_timeout: float = Field(60.0, gt=0)  # seconds to wait for every rank at start-up

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


# --speculative-config's methods: drafts from the sequence's own earlier tokens (prompt lookup)
SPECULATIVE_METHODS = ("ngram",)
# a verification step keeps to the decode kernels while each sequence has at most this many query
# rows (hal/csrc/attention.h's FEW_QUERY_ROWS): its next token and its drafts
MAX_SPECULATIVE_TOKENS = 7


class SpeculativeConfig(_Config):
    """vLLM's ``--speculative-config`` for n-gram speculation: after each step, the last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens are looked up earlier in the sequence,
    and the ``num_speculative_tokens`` that followed the longest match are verified next step."""

    method: str = "ngram"
    num_speculative_tokens: int = Field(..., ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in SPECULATIVE_METHODS:
            raise ValueError(
                f"method {value!r} is not supported; use one of {', '.join(SPECULATIVE_METHODS)} "
                "(drafts looked up in the sequence itself: no draft model)"
            )
        return value

    @field_validator("num_speculative_tokens")
    @classmethod
    def _few_enough(cls, value: int) -> int:
        if value > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"{value} drafts a step is more than {MAX_SPECULATIVE_TOKENS}, the most a "
                f"verification step keeps to the decode kernels with; use 1 to "
                f"{MAX_SPECULATIVE_TOKENS}"
            )
        return value

    def model_post_init(self, _context: object) -> None:
        """vLLM's defaults: either bound alone stands for both, neither is 5; min <= max."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = 5, 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo > hi:
            raise ValueError(
                f"prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}; the n-grams looked up "
                "run from max down to min, so min must be <= max"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig:
        """A JSON text (the CLI's) or a mapping (``LLM(speculative_config={...})``); raises
        ``ValueError`` saying what is wrong."""
        import json

        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"not valid JSON ({e.msg} at character {e.pos}); expected e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(
                f"expected a JSON object of method, num_speculative_tokens, prompt_lookup_min and "
                f"prompt_lookup_max, got {type(value).__name__}"
            )
        try:
            return cls(**value)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in err['loc']) or 'value'}: "
                f"{err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()
            )
            raise ValueError(problems) from None


class LoRAConfig(_Config):
    """vLLM's LoRA settings: adapters beside the base model (``pagedserve/lora``)."""

    enable_lora: bool = False
    max_loras: int = Field(1, ge=1)  # distinct adapters in one step: the device slots
    max_lora_rank: int = Field(16, ge=1, le=512)
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters kept in host memory (>= max_loras)
    # adapters loaded at start-up: {"name", "path", "base_model_name"} (serve's --lora-modules)
    lora_modules: list[dict[str, str | None]] = Field(default_factory=list)

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


class EngineConfig(_Config):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    @classmethod
    def from_kwargs(
        cls, usage_context: UsageContext = UsageContext.OPENAI_API_SERVER, /, **kwargs
    ) -> EngineConfig:
        """Flat vLLM-style keyword arguments (``block_size=16, max_num_seqs=8``) into the tree;
        an invalid value is reported as ``usage_context``'s user wrote it."""
        sections = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "device": DeviceConfig,
            "parallel": ParallelConfig,
            "lora": LoRAConfig,
        }
        tree: dict = {name: {} for name in sections}
        speculative = kwargs.pop("speculative_config", None)
        if speculative is not None:
            try:
                tree["speculative"] = SpeculativeConfig.parse(speculative)
            except ValueError as e:
                raise ValueError(
                    f"invalid setting: {usage_context.name_of('speculative_config')}: {e}"
                ) from None
        for key, value in kwargs.items():
            owner = next((n for n, c in sections.items() if key in c.model_fields), None)
            if owner is None:
                known = sorted(f for c in sections.values() for f in c.model_fields)
                known.append("speculative_config")
                raise TypeError(f"unknown engine argument {key!r}; known: {', '.join(known)}")
            tree[owner][key] = value
        try:
            return cls(**tree)
        except ValidationError as e:  # name the setting, as the user typed it
            problems = "; ".join(
                f"{usage_context.assignment(str(err['loc'][-1]), err['input'])}: {err['msg']}"
                for err in e.errors()
            )
            raise ValueError(f"invalid setting: {problems}") from None
