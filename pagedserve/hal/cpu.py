"""Plain PyTorch on the host CPU, with native kernels for what a decode step spends its time on.

The kernels, chosen at start-up (``--kernels``, ``native.py``):
- **a native target** (``avx512``, ``avx2`` or ``portable``; ``auto`` takes the best this CPU
  executes): ``csrc/``: the target's INT4 GEMMs, each with its own packed layout, that unpack each
  packed weight once for several rows (W4A16, or int8 activations for W4A8); a bf16 GEMV for a
  few rows; fused residual-add + RMSNorm, SiLU-and-mul, rotary + KV-cache write, paged decode
  attention that reads keys and values straight from their pages, and all of a decoder layer in
  one call for decode steps. An op a target lacks runs PyTorch's (the portable target's INT4
  layers: ``_weight_int4pack_mm_for_cpu``), the rest stays native.
- **eager** (``--kernels eager`` or ``--enforce-eager``, or where nothing can be built): PyTorch
  ops only, PyTorch's own int4 kernel and SDPA over gathered pages.

benchmarks/linear_paths.py and benchmarks/compare.py measure them; the tests hold every target
the machine can execute to the references in ``kernels.py`` and ``int4.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cached_property

import torch
import torch.nn.functional as F

from pagedserve.hal.device import Device, DevicePreset
from pagedserve.hal.huge_pages import on_huge_pages
from pagedserve.hal.int4 import (
    PACKERS,
    Int4Linear,
    cpu_int4_scales_and_zeros,
    pad_rows,
    quantize_activations_int8,
)
from pagedserve.hal.int8 import Int8Linear
from pagedserve.hal.kernels import AttentionMetadata, dequantize_kv, gather_context
from pagedserve.hal.native import KernelChoice, choose_kernels

logger = logging.getLogger(__name__)

# The most adapter rows in a step for the native LoRA kernel (one row at a time): measured with
# rank 16 and 8 adapters on a Zen 5 (2 threads), it took a fifth to a half of the grouped ops'
# time up to 64 rows, two thirds at 128, as long at 256, and up to twice as long at 2,048 (a
# prompt, where the grouped GEMMs reuse each weight across rows).
LORA_NATIVE_MAX_ROWS = 128


class CpuDevice(Device):
    backend = "cpu"

    def __init__(self, preset: DevicePreset, kernels: str = "auto"):
        super().__init__(preset, "cpu")
        self.kernels: KernelChoice = choose_kernels(kernels)
        self.native = self.kernels.module  # None: eager
        self._refusals: dict[tuple, str] = {}  # (statement, sizes) -> "" (taken) or why not
        self._op_status: dict[str, str] = {}  # op -> "" (native) or why it runs a fallback

    def twin(self) -> CpuDevice:
        return type(self)(self.preset, kernels=self.kernels.name)

    @property
    def kernel_set(self) -> str:
        """The kernels in use: avx512, avx2, portable or eager."""
        return self.kernels.name

    # ---- which ops run natively ---------------------------------------------------------------
    def _takes(
        self, op: str, statement: str, *sizes, fallback: str = "the PyTorch reference"
    ) -> bool:
        """Whether the native kernel of ``op`` takes ``sizes``, by the kernel's own statement of
        its limits (``csrc``'s ``<statement>``: the same function the kernel checks its input
        with), decided once per op and shape: a refusal is logged then, and kept for
        ``native_ops`` (``smi``, ``/device``)."""
        if self.native is None:
            return False
        key = (op, statement, sizes)
        why = self._refusals.get(key)
        if why is None:
            why = self._refusals[key] = getattr(self.native, statement)(*sizes)
            self._record(op, why, fallback)
        return not why

    def _record(self, op: str, why: str, fallback: str = "", log: bool = True) -> None:
        """Keep what runs ``op`` ("" native, else why not and what runs instead), and say a
        fallback once."""
        if not why:
            self._op_status.setdefault(op, "")
            return
        status = f"{why}; {fallback}"
        if log and status not in self._op_status.values():
            logger.warning("%s: %s; using %s", op, why, fallback)
        self._op_status[op] = status

    def plan_kernels(self, dtype: torch.dtype, head_dim: int) -> None:
        """Decide, as a model loads, which of its ops run natively for its dtype and head dim
        (each INT4 layer is decided as it is packed): what falls back is said once, now, and not
        at the first request."""
        for op in ("rms_norm", "silu_and_mul", "rotary_and_write_kv"):
            self._takes(op, "rows_rejects", dtype)
        for op in ("paged_attention_decode", "paged_attention_prefill"):
            self._takes(op, f"{op}_rejects", head_dim, dtype)

    def native_ops(self) -> dict[str, str]:
        """The model's ops by name: "native", or why each runs a fallback (``kernels`` eager: every
        op runs PyTorch's)."""
        if self.native is None:
            return {}
        return {op: why or "native" for op, why in sorted(self._op_status.items())}

    def _native_int4_layout(self, abits: int) -> str | None:
        """This target's own INT4 layout for ``abits`` activations; None: PyTorch's kernel."""
        name = "INT4_A8_LAYOUT" if abits == 8 else "INT4_LAYOUT"
        return getattr(self.native, name, None) or None

    # ---- int4 ---------------------------------------------------------------------------------
    def prepare_int4(
        self,
        qcodes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        tag: str,
        abits: int = 16,
    ) -> Int4Linear:
        """Pack for the target's own int4 kernel where it takes the layer's sizes, else for
        PyTorch's (``_weight_int4pack_mm_for_cpu``) where that takes them, else keep the reference
        form (dequantized on the fly)."""
        n, k = qcodes.shape
        layout = self._native_int4_layout(abits)
        if layout is None:  # the portable target and eager: PyTorch's kernel is theirs
            why, log = f"the {self.kernel_set} kernels have no INT4 kernel of their own", False
        else:
            why, log = self.native.int4_linear_rejects(k, group_size), True
        if not why:
            self._record("int4_linear", "")
        elif aten_why := aten_int4_rejects(n, k, group_size):
            because = f"{self.kernel_set}: {why}; {aten_why}" if log else aten_why
            self._record("int4_linear", because, "the dequantized reference")
            return super().prepare_int4(qcodes, scales, zeros, group_size, tag, abits)
        else:
            self._record("int4_linear", why, "PyTorch's INT4 kernel", log=log)
            layout = None
        w = Int4Linear(n, k, group_size, abits)
        if layout is not None:
            w.layout = layout
            packed, scales_and_zeros = PACKERS[layout](
                *pad_rows(qcodes, scales, zeros, self.native.INT4_TILE_ROWS), group_size
            )
        else:
            w.layout = "aten"
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qcodes.to(torch.int32), 1)
            scales_and_zeros = cpu_int4_scales_and_zeros(scales, zeros)
        # (the codes a decode step streams, on huge pages where the OS has them: huge_pages.py)
        w.packed = self.to_device(on_huge_pages(packed), "weight", f"{tag}.qweight")
        w.scales_and_zeros = self.to_device(
            on_huge_pages(scales_and_zeros), "weight", f"{tag}.scales_zeros"
        )
        return w

    def int4_linear(
        self, x: torch.Tensor, w: Int4Linear, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Native: the target's W4A16 (int16 activations, integer products; bf16 tiles on AMX)
        or W4A8 (int8 activations, integer products). PyTorch's kernel: bf16 activations always
        (20-60x slower with fp32 or fp16 ones, GLM4.md); W4A8 rounds them to int8 first."""
        if w.layout == "reference":
            return super().int4_linear(x, w, b)
        rows = x.reshape(-1, w.in_features)
        if w.layout in PACKERS:
            kernel = self.native.int4_int8_linear if w.abits == 8 else self.native.int4_linear
            bias = None if b is None else b.to(x.dtype)
            out = kernel(
                rows.contiguous(), w.packed, w.scales_and_zeros, w.group_size, bias, w.out_features
            )
            return out.view(*x.shape[:-1], w.out_features)
        if w.abits == 8:
            rows = quantize_activations_int8(rows)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(torch.bfloat16).contiguous(), w.packed, w.group_size, w.scales_and_zeros
        )
        if b is not None:
            out = out + b.to(out.dtype)
        return out.view(*x.shape[:-1], w.out_features).to(x.dtype)

    def prepare_int8(
        self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, tag: str
    ) -> Int8Linear:
        """PyTorch's int8 kernel where it takes the layer, else the reference (said once)."""
        w = super().prepare_int8(qweight, scales, dtype, tag)
        self._record("int8_linear", aten_int8_rejects(w.in_features), "the reference")
        return w

    def int8_linear(
        self, x: torch.Tensor, w: Int8Linear, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        if aten_int8_rejects(w.in_features):
            return super().int8_linear(x, w, b)
        rows = x.reshape(-1, w.in_features).to(w.scales.dtype).contiguous()
        out = torch._weight_int8pack_mm(rows, w.qweight, w.scales)
        if b is not None:
            out = out + b.to(out.dtype)
        return out.view(*x.shape[:-1], w.out_features).to(x.dtype)

    # ---- dense --------------------------------------------------------------------------------
    def linear(
        self, x: torch.Tensor, w: torch.Tensor | Int4Linear, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A dense layer takes the native kernels' rule (``dense_linear`` in csrc/linear.h, the
        fused decoder layer's too): the few-rows bf16 GEMV, fp32 GEMMs for bf16 on avx2."""
        if self.native is not None and isinstance(w, torch.Tensor):
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self.native.dense_linear(rows, w, b).view(*x.shape[:-1], w.shape[0])
        return super().linear(x, w, b)

    # ---- norms and activations ----------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """The reference's rounding (normalise in fp32, cast, then scale)."""
        if self._native_rows("rms_norm", x):
            return self.native.rms_norm(x.contiguous(), w, eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The native kernel adds ``x`` into ``residual`` in place."""
        if residual is None or not self._native_rows("rms_norm", x):
            return super().add_rms_norm(x, residual, w, eps)
        return self.native.add_rms_norm(x.contiguous(), residual, w, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self._native_rows("silu_and_mul", x):
            return self.native.silu_and_mul(x.contiguous())
        return super().silu_and_mul(x)

    def _native_rows(self, op: str, x: torch.Tensor) -> bool:
        """The row-wise kernels take rows of any length in the activation dtypes."""
        return self._takes(op, "rows_rejects", x.dtype)

    # ---- rotary and the KV cache --------------------------------------------------------------
    def rotary_at(self, cos_sin: torch.Tensor, positions: torch.Tensor) -> object:
        """Native: the cos/sin table and the positions, looked up inside the kernel. Eager: complex
        factors, an interleaved pair (x[2i], x[2i+1]) being x[2i] + i x[2i+1], so that the rotation
        is one complex product (half the ops of the reference)."""
        if self.native is not None:
            return cos_sin, positions
        return _complex_rotary(cos_sin, positions)

    def apply_rotary(self, x: torch.Tensor, rope: object) -> torch.Tensor:
        """Rotates ``x`` in place."""
        if isinstance(rope, tuple):  # the native form
            rope = _complex_rotary(*rope)
        rot = 2 * rope.shape[-1]
        pairs = torch.view_as_complex(x[..., :rot].float().unflatten(-1, (-1, 2)).contiguous())
        x[..., :rot] = torch.view_as_real(pairs * rope).flatten(-2)
        return x

    def rotary_and_write_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        rope: object,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        if not qkv.is_contiguous() or not self._native_rows("rotary_and_write_kv", qkv):
            return super().rotary_and_write_kv(qkv, num_heads, rope, k_cache, v_cache, slot_mapping)
        cos_sin, positions = rope
        num_kv_heads, head_dim = k_cache.shape[2], qkv.shape[-1]
        self.native.rotary_and_write_kv(
            qkv,
            positions,
            cos_sin,
            k_cache,
            v_cache,
            slot_mapping,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        return qkv[:, :num_heads]

    # ---- a whole decoder layer ----------------------------------------------------------------
    def fused_decoder_layer(
        self, weights: object, num_heads: int, num_kv_heads: int, head_dim: int, eps: float
    ) -> Callable | None:
        """Native: the layer's kernels in one call for decode-only steps (``decoder_layer.h``), where
        every op inside it takes the layer's sizes natively: its rows, its attention, and each
        linear INT4 (the target's layout or PyTorch's) or dense. Elsewhere the model runs the
        layer op by op, each op native where it can be."""
        if self.native is None:
            return None
        dtype = weights.input_layernorm.dtype
        linears = [weights.qkv_proj, weights.o_proj, weights.gate_up_proj, weights.down_proj]
        refused = [
            op
            for op, takes in (
                ("rms_norm", self._native_rows("rms_norm", weights.input_layernorm)),
                ("paged_attention_decode", self._takes(
                    "paged_attention_decode", "paged_attention_decode_rejects", head_dim, dtype
                )),
                ("int4_linear", all(map(self._native_linear_ok, linears))),
            )
            if not takes
        ]  # fmt: skip
        if refused:
            self._record(
                "fused_decoder_layer", f"{', '.join(refused)} not native", "its ops one at a time"
            )
            return None
        self._record("fused_decoder_layer", "")
        n = self.native
        layer = n.GlmDecoderLayer(
            qkv_proj=self._native_linear(weights.qkv_proj, weights.qkv_bias),
            o_proj=self._native_linear(weights.o_proj),
            gate_up_proj=self._native_linear(weights.gate_up_proj),
            down_proj=self._native_linear(weights.down_proj),
            input_layernorm=weights.input_layernorm,
            post_attention_layernorm=weights.post_attention_layernorm,
            post_self_attn_layernorm=weights.post_self_attn_layernorm,
            post_mlp_layernorm=weights.post_mlp_layernorm,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            eps=eps,
            scale=head_dim**-0.5,
        )

        def decoder_layer(h, residual, rope, meta, kv):
            plan = self._attention_plan(meta)
            cos_sin, positions = rope
            return layer.forward(
                h,
                residual,
                positions,
                cos_sin,
                kv[0],
                kv[1],
                meta.slot_mapping,
                plan.pages,
                plan.seq_lens,
                plan.query_start_loc,
            )

        return decoder_layer

    def _native_linear_ok(self, w: torch.Tensor | Int4Linear) -> bool:
        if isinstance(w, Int4Linear):
            return w.layout in (self._native_int4_layout(w.abits), "aten")
        return isinstance(w, torch.Tensor) and w.dim() == 2

    def _native_linear(self, w: torch.Tensor | Int4Linear, bias: torch.Tensor | None = None):
        if isinstance(w, Int4Linear):
            return self.native.NativeLinear(
                w.layout, w.packed, w.scales_and_zeros, w.group_size, w.abits == 8, None, bias,
                w.out_features,
            )  # fmt: skip
        return self.native.NativeLinear("dense", None, None, 0, False, w, bias, w.shape[0])

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Native: one vectorised pass per row (torch.argmax is scalar here: 28 us for 32000)."""
        if self.native is not None and logits.dtype == torch.float32 and logits.dim() == 2:
            return self.native.argmax_rows(logits if logits.stride(1) == 1 else logits.contiguous())
        return super().argmax(logits)

    def categorical(self) -> Callable[..., torch.Tensor] | None:
        """Native: sampler.draw's inverse CDF for a row without top-k, top-p or min-p in one
        call, three vectorised passes over the row (PyTorch's draw: a dozen ops, about 0.4 ms)."""
        return None if self.native is None else self._native_categorical

    def _native_categorical(
        self, logits: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor:
        return self.native.categorical_rows(
            logits.float().contiguous(),
            inv_temperature.float().contiguous(),
            u.float().contiguous(),
        )

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b, batch):
        """Native for the few adapter rows of a decode step: each row's shrink and expand in one
        call per layer (``csrc/lora.h``), in place in ``y``. None (the grouped PyTorch ops) for a
        prompt's many rows, whose GEMMs reuse each weight across rows where the kernel reads an
        adapter once a row, and where the kernel does not take the ranks or the dtype."""
        if not (
            len(batch.order) <= LORA_NATIVE_MAX_ROWS
            and self._takes("lora_add", "rows_rejects", x.dtype, fallback="the grouped PyTorch ops")
            and self._takes(
                "lora_add", "lora_add_rejects", a.shape[2], fallback="the grouped PyTorch ops"
            )
        ):
            return None
        parts = [b] if isinstance(b, torch.Tensor) else list(b)
        if not y.is_contiguous():
            y = y.contiguous()
        self.native.lora_add(y, x.contiguous(), a, parts, batch.row_slots)
        return y

    # ---- attention ----------------------------------------------------------------------------
    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan = self._attention_plan(meta)
        native = self._takes(
            "paged_attention_decode", "paged_attention_decode_rejects", q.shape[-1], q.dtype
        )
        if plan.all_decode:
            return self._decode_attention(q, k_cache, v_cache, plan, scale, native)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode_attention(
                q[plan.decode_rows], k_cache, v_cache, plan, scale, native
            )
        if native and self._takes(
            "paged_attention_prefill", "paged_attention_prefill_rejects", q.shape[-1], q.dtype
        ):
            prefill = plan.prefill
            rows = q if prefill.rows is None else q[prefill.rows]
            got = self.native.paged_attention_prefill(
                rows.contiguous(), k_cache, v_cache, prefill.pages, prefill.seq_lens,
                prefill.query_start_loc, scale,
            )  # fmt: skip
            if prefill.rows is None:
                return got
            out[prefill.rows] = got
            return out
        for sl, table, ctx in plan.prefills:
            k = gather_context(k_cache, table, ctx)
            v = gather_context(v_cache, table, ctx)
            out[sl] = prefill_attention(q[sl], k, v, scale).to(q.dtype)
        return out

    def _decode_attention(self, q, k_cache, v_cache, plan, scale, native: bool) -> torch.Tensor:
        if native:
            return self.native.paged_attention_decode(
                q.contiguous(), k_cache, v_cache, plan.pages, plan.seq_lens,
                plan.query_start_loc, scale,
            )  # fmt: skip
        if plan.decode_query_rows > 1:  # (only the native kernel takes several rows)
            return self._prefill_each(q, k_cache, v_cache, plan, scale)
        return decode_attention(q, k_cache, v_cache, plan, scale).to(q.dtype)

    @staticmethod
    def _prefill_each(q, k_cache, v_cache, plan, scale) -> torch.Tensor:
        out = torch.empty_like(q)
        starts = plan.query_start_loc.tolist()
        for b, (table, ctx) in enumerate(zip(plan.pages, plan.seq_lens.tolist())):
            rows = slice(starts[b], starts[b + 1])
            k, v = gather_context(k_cache, table, ctx), gather_context(v_cache, table, ctx)
            out[rows] = prefill_attention(q[rows], k, v, scale).to(q.dtype)
        return out

    @property
    def fused_layer_max_query_rows(self) -> int:
        """The most query rows per sequence a forward may have for the fused decoder layer (a
        decode row and its draft tokens)."""
        return getattr(self.native, "FEW_QUERY_ROWS", 1)

    def _attention_plan(self, meta: AttentionMetadata) -> _AttentionPlan:
        plan = meta.scratch.get("cpu")
        if plan is None:
            plan = meta.scratch["cpu"] = _AttentionPlan(meta, self.fused_layer_max_query_rows)
        return plan


def aten_int4_rejects(out_features: int, in_features: int, group_size: int) -> str:
    """What PyTorch's CPU INT4 kernel (``_weight_int4pack_mm_for_cpu``) takes: output rows in
    whole 16s, a group size of 32, 64, 128 or 256 that divides the input (GLM4.md)."""
    if group_size not in (32, 64, 128, 256):
        return f"group size {group_size} is not 32, 64, 128 or 256 (PyTorch's INT4 kernel)"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    if out_features % 16:
        return f"out_features {out_features} is not a multiple of 16 (PyTorch's INT4 kernel)"
    return ""


def aten_int8_rejects(in_features: int) -> str:
    """What PyTorch's CPU int8 kernel (``_weight_int8pack_mm``) takes: inputs in whole 16s (it
    reads past the end of others, and crashes the process: seen with torch 2.13)."""
    if in_features % 16:
        return f"in_features {in_features} is not a multiple of 16 (PyTorch's int8 kernel)"
    return ""


def _complex_rotary(cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return torch.complex(cos.contiguous(), sin.contiguous())


class _AttentionPlan:
    """What every layer of one forward pass shares: which sequences decode (at most
    ``decode_query_rows`` query rows each: a decode row, and its draft tokens where the kernel
    takes several), their rows, pages and lengths; the others are prefills, over their gathered
    context. The eager path's gather indices and mask are made only if it runs."""

    def __init__(self, meta: AttentionMetadata, decode_query_rows: int = 1):
        qs = meta.query_start_loc
        query_lens = meta.query_lens
        self.meta = meta
        decode = [i for i, n in enumerate(query_lens) if n <= decode_query_rows]
        self.prefill_indices = [i for i, n in enumerate(query_lens) if n > decode_query_rows]
        self.prefills = [
            (slice(qs[i], qs[i + 1]), meta.block_tables[i], meta.seq_lens[i])
            for i, n in enumerate(query_lens)
            if n > decode_query_rows
        ]
        self.decode_query_rows = max((query_lens[i] for i in decode), default=1)
        self.all_decode = len(decode) == len(query_lens)
        self.decode_rows = None
        self.block_size = meta.block_size
        starts = [0]
        for i in decode:
            starts.append(starts[-1] + query_lens[i])
        self.query_start_loc = torch.tensor(starts, dtype=torch.long)
        if self.all_decode:
            self.pages = meta.block_tables
            self.seq_lens = torch.tensor(meta.seq_lens, dtype=torch.long)
        elif decode:
            self.decode_rows = torch.tensor([r for i in decode for r in range(qs[i], qs[i + 1])])
            self.seq_lens = torch.tensor([meta.seq_lens[i] for i in decode], dtype=torch.long)
            self.pages = meta.block_tables[decode]

    @cached_property
    def prefill(self) -> _PrefillPlan:
        """The prefill sequences as one sub-batch for the native kernel."""
        return _PrefillPlan(self.meta, self.prefill_indices)

    @cached_property
    def max_ctx(self) -> int:
        return int(self.seq_lens.max())

    @cached_property
    def flat_pages(self) -> torch.Tensor:
        return self.pages[:, : -(-self.max_ctx // self.block_size)].flatten()

    @cached_property
    def allowed(self) -> torch.Tensor:
        """[B, 1, 1, C]: which context positions each decoding sequence may attend to."""
        return (torch.arange(self.max_ctx) < self.seq_lens.unsqueeze(1))[:, None, None, :]


class _PrefillPlan:
    """The prefill sequences of a batch as the native prefill kernel takes them: their rows of q
    (None: every row), pages, context lengths and query starts."""

    def __init__(self, meta: AttentionMetadata, indices: list[int]):
        qs = meta.query_start_loc
        every = len(indices) == meta.num_seqs
        self.rows = (
            None
            if every
            else torch.tensor(
                [r for i in indices for r in range(qs[i], qs[i + 1])], dtype=torch.long
            )
        )
        starts = [0]
        for i in indices:
            starts.append(starts[-1] + qs[i + 1] - qs[i])
        self.query_start_loc = torch.tensor(starts, dtype=torch.long)
        self.seq_lens = torch.tensor([meta.seq_lens[i] for i in indices], dtype=torch.long)
        self.pages = meta.block_tables if every else meta.block_tables[indices]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Eager: one query per sequence, all sequences at once: q [B, H, D] -> [B, H, D].

    Gathers each sequence's pages (``index_select``: 2.3x faster than advanced indexing) into a
    [B, KV, C, D] context padded to the longest one and runs SDPA in the cache's dtype (it
    accumulates in fp32), with each KV head's query group as a short query: 1.1 ms a layer at 64
    sequences x 192 tokens against 1.9 ms for GQA-expanded SDPA, and bf16 beat an fp32 upcast
    1.6x.
    """
    B, H, D = q.shape
    num_kv, num_blocks = k_cache.shape[2], len(plan.flat_pages) // B
    context = (B, num_blocks * k_cache.shape[1], num_kv, k_cache.shape[3])

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [B, KV, C, D]
        rows = cache.index_select(0, plan.flat_pages).view(context)[:, : plan.max_ctx]
        return (dequantize_kv(rows) if cache.dtype == torch.int8 else rows).transpose(1, 2)

    k, v = gather(k_cache), gather(v_cache)
    # Each KV head's query heads act as a query of length H/KV: no GQA expansion, no causal mask.
    out = F.scaled_dot_product_attention(
        q.to(k.dtype).view(B, num_kv, H // num_kv, D), k, v, attn_mask=plan.allowed, scale=scale
    )
    return out.reshape(B, H, D)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [L, H, D] at the last L positions of a context k, v [C, KV, D]; SDPA with GQA."""
    L, C = q.shape[0], k.shape[0]
    qt, kt, vt = (t.to(k.dtype).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if L == C:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        allowed = torch.arange(C).unsqueeze(0) <= torch.arange(C - L, C).unsqueeze(1)
        o = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=allowed, scale=scale, enable_gqa=True
        )
    return o.squeeze(0).transpose(0, 1)
