"""AWQ (activation-aware weight quantization) and RTN over a plain state dict, layer by layer.

For layer i: run it on the calibration hidden states, capturing each linear's input; for each group
of linears sharing an input, grid-search ``s = x_mean^a / w_mean^(1-a)`` (and the identity) to
minimise the group's output error under 4-bit quantization; fold the scales into what precedes
(q/k/v <- input_layernorm, o <- v_proj rows, gate_up <- post_attention_layernorm, down <- the up
half of gate_up); search a per-group clipping range (not for q/k, whose error does not reach the
output linearly); quantize; then feed layer i's *quantized* output to layer i+1.

GQA: o_proj's input channel (head h, dim d) comes from v channel (h // (H/KV), d), so the o scales
are tied across the query heads of a kv head (geometric mean) before folding into v.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from pagedserve.models.config import GlmConfig
from pagedserve.models.quant_formats import (
    QuantizedLinear,
    check_group_size,
    dequantize,
    fake_quantize,
    quantize_rtn,
)
from pagedserve.quant.forward import LINEARS, ReferenceGlm, layer_weights

logger = logging.getLogger(__name__)

SEED_SKIP_NAMES = {
    "ln_1.weight",
    "ln_1.bias",
    "ln_2.weight",
    "ln_2.bias",
    "attn.softmax",
    "ln_1",
    "ln_2",
    "ln_f",
    "ln_f.weight",
    "ln_f.bias",
}
GRID = [i / 20 for i in range(20)]
MAX_SEARCH_TOKENS = 4096
MAX_CLIP_TOKENS = 512
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


@dataclass
class QuantizeSettings:
    method: str = "awq"  # "awq" or "rtn"
    group_size: int = 32
    skip_layers: list[str] = field(default_factory=list)
    clip: bool = True


@dataclass
class QuantizeResult:
    dense: dict[str, torch.Tensor]  # everything that stays 16-bit (norms folded)
    quantized: dict[str, QuantizedLinear]
    report: dict


# ---- which linears --------------------------------------------------------------------------------
def linear_prefixes(config: GlmConfig) -> list[str]:
    return [f"model.layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in LINEARS]


def resolve_skip_layers(patterns: list[str], config: GlmConfig) -> set[str]:
    """Linear prefixes that stay 16-bit. The norm/softmax names of the Kunlun XPU deployment
    guide's glm4_quantize are accepted and ignored."""
    prefixes = linear_prefixes(config)
    skipped: set[str] = set()
    for pattern in patterns:
        if pattern in SEED_SKIP_NAMES:
            logger.info("skip-layers: %s is a norm or softmax; those are never quantized", pattern)
            continue
        hits = [
            p
            for p in prefixes
            if fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p + ".weight", pattern)
        ]
        if not hits:
            raise ValueError(
                f"--skip-layers entry {pattern!r} matches no quantizable linear; use a module "
                f"name such as {prefixes[-1]!r} or a glob such as '*.down_proj'"
            )
        skipped.update(hits)
    return skipped


def check_shapes(config: GlmConfig, group_size: int) -> None:
    k_in = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads * head_dim": config.num_attention_heads * config.head_dim,
    }
    for what, k in k_in.items():
        check_group_size(k, group_size, f"a linear whose input is {what}")


# ---- the search -----------------------------------------------------------------------------------
def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return ((x @ (w_hat - w).T) ** 2).mean().item()


def _subsample(x: torch.Tensor, n: int) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] <= n:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, n).long()]


def _w_mean(w: torch.Tensor, group_size: int) -> torch.Tensor:
    g = w.abs().reshape(-1, group_size)
    g = g / g.amax(-1, keepdim=True).clamp(min=1e-8)
    return g.reshape(w.shape).mean(0)


def search_scale(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    quantize: list[bool],
    group_size: int,
    tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, float | None, float, float]:
    """(s, exponent or None for the identity, error with s = 1, best error) for one group."""
    xs = _subsample(x, MAX_SEARCH_TOKENS)
    x_mean = x.reshape(-1, x.shape[-1]).abs().mean(0)
    w_mean = _w_mean(torch.cat(weights), group_size)
    ref = xs @ torch.cat(weights).T

    def loss(s: torch.Tensor) -> float:
        w_hat = [
            fake_quantize(w * s, group_size) / s if q else w
            for w, q in zip(weights, quantize, strict=True)
        ]
        return ((xs @ torch.cat(w_hat).T - ref) ** 2).mean().item()

    best_s = torch.ones_like(x_mean)
    identity_err = best_err = loss(best_s)
    best_ratio = None
    for a in GRID:
        s = (x_mean.pow(a) / w_mean.pow(1 - a).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s = tie(s) if tie is not None else s
        err = loss(s)
        if err < best_err:
            best_s, best_err, best_ratio = s, err, a
    return best_s, best_ratio, identity_err, best_err


def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    group_size: int,
    steps: int = 10,
    max_shrink: float = 0.5,
    chunk: int = 256,
) -> torch.Tensor:
    """Per (row, group), the symmetric clipping range max|w| * r minimising the group's output error."""
    xs = _subsample(x, MAX_CLIP_TOKENS)
    xg = xs.reshape(xs.shape[0], -1, group_size)
    rows = [
        _clip_rows(w[i : i + chunk], xg, group_size, steps, max_shrink)
        for i in range(0, w.shape[0], chunk)
    ]
    return torch.cat(rows)


def _clip_rows(
    w: torch.Tensor, xg: torch.Tensor, group_size: int, steps: int, max_shrink: float
) -> torch.Tensor:
    n, k = w.shape
    wg = w.reshape(n, -1, group_size)
    max_abs = wg.abs().amax(-1, keepdim=True)
    ref = torch.einsum("mgj,ngj->mng", xg, wg)
    best_err = torch.full(max_abs.shape[:2], float("inf"))
    best = max_abs.clone()
    for step in range(int(steps * max_shrink) + 1):
        limit = max_abs * (1 - step / steps)
        q = fake_quantize(torch.maximum(torch.minimum(wg, limit), -limit).reshape(n, k), group_size)
        err = ((torch.einsum("mgj,ngj->mng", xg, q.reshape(wg.shape)) - ref) ** 2).mean(0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better.unsqueeze(-1), limit, best)
    return torch.maximum(torch.minimum(wg, best), -best).reshape(n, k)


# ---- one layer ------------------------------------------------------------------------------------
class LayerQuantizer:
    def __init__(self, config: GlmConfig, settings: QuantizeSettings, skipped: set[str]):
        self.config = config
        self.settings = settings
        self.skipped = skipped

    def capture_inputs(self, model: ReferenceGlm, i: int, w: dict, h: torch.Tensor) -> dict:
        inputs: dict[str, torch.Tensor] = {}
        model.layer(
            i, w, h, capture=lambda name, x: inputs.setdefault(name, x.reshape(-1, x.shape[-1]))
        )
        return inputs

    def search_and_fold(self, i: int, w: dict, inputs: dict) -> dict:
        """Find and fold the AWQ scales in place; returns {group: exponent} and the group errors."""
        G, c = self.settings.group_size, self.config
        quant = lambda n: f"model.layers.{i}.{n}" not in self.skipped  # noqa: E731
        ratios: dict[str, float | None] = {}
        qkv = [f"self_attn.{p}_proj" for p in "qkv"]
        s, ratios["qkv"], *_ = search_scale(
            inputs[qkv[0]], [w[f"{n}.weight"] for n in qkv], [quant(n) for n in qkv], G
        )
        w["input_layernorm.weight"] /= s
        for n in qkv:
            w[f"{n}.weight"] *= s
        s, ratios["o"], *_ = search_scale(
            inputs["self_attn.o_proj"],
            [w["self_attn.o_proj.weight"]],
            [quant("self_attn.o_proj")],
            G,
            tie=self._tie_heads,
        )
        s_v = s.view(c.num_key_value_heads, -1, c.head_dim)[:, 0].reshape(-1)
        w["self_attn.v_proj.weight"] /= s_v.unsqueeze(1)
        if "self_attn.v_proj.bias" in w:
            w["self_attn.v_proj.bias"] /= s_v
        w["self_attn.o_proj.weight"] *= s
        s, ratios["gate_up"], *_ = search_scale(
            inputs["mlp.gate_up_proj"],
            [w["mlp.gate_up_proj.weight"]],
            [quant("mlp.gate_up_proj")],
            G,
        )
        w["post_attention_layernorm.weight"] /= s
        w["mlp.gate_up_proj.weight"] *= s
        s, ratios["down"], *_ = search_scale(
            inputs["mlp.down_proj"], [w["mlp.down_proj.weight"]], [quant("mlp.down_proj")], G
        )
        w["mlp.gate_up_proj.weight"][c.intermediate_size :] /= s.unsqueeze(1)
        w["mlp.down_proj.weight"] *= s
        return ratios

    def _tie_heads(self, s: torch.Tensor) -> torch.Tensor:
        c = self.config
        g = s.view(c.num_key_value_heads, -1, c.head_dim)
        return g.log().mean(1, keepdim=True).exp().expand_as(g).reshape(-1)


def quantize_model(
    config: GlmConfig,
    state_dict: dict[str, torch.Tensor],
    calib_ids: torch.Tensor,
    settings: QuantizeSettings,
) -> QuantizeResult:
    """Quantize every linear of every decoder layer not in ``settings.skip_layers``."""
    if settings.method not in ("awq", "rtn"):
        raise ValueError(f"quant method {settings.method!r} is not supported; use 'awq' or 'rtn'")
    check_shapes(config, settings.group_size)
    skipped = resolve_skip_layers(settings.skip_layers, config)
    model = ReferenceGlm(config, state_dict)
    lq = LayerQuantizer(config, settings, skipped)
    dense = {k: v for k, v in state_dict.items() if not k.startswith("model.layers.")}
    quantized: dict[str, QuantizedLinear] = {}
    layers_report = []
    h = model.embed(calib_ids)
    desc = f"{settings.method.upper()} calibration"
    for i in tqdm(range(config.num_hidden_layers), desc=desc, unit="layer"):
        w = {k: v.clone() for k, v in layer_weights(state_dict, i).items()}
        entry, w_hat = _quantize_layer(lq, model, i, w, h, quantized)
        layers_report.append(entry)
        h = model.layer(i, w_hat, h)
        for k, v in w.items():
            name = f"model.layers.{i}.{k}"
            if not (k.endswith(".weight") and name[: -len(".weight")] in quantized):
                dense[name] = v.to(state_dict[name].dtype)
    report = {
        "method": settings.method,
        "group_size": settings.group_size,
        "skipped": sorted(skipped),
        "layers": layers_report,
    }
    return QuantizeResult(dense, quantized, report)


def _quantize_layer(
    lq: LayerQuantizer, model: ReferenceGlm, i: int, w: dict, h: torch.Tensor, quantized: dict
) -> tuple[dict, dict]:
    G = lq.settings.group_size
    inputs0 = lq.capture_inputs(model, i, w, h)
    original = {n: w[f"{n}.weight"].clone() for n in LINEARS}
    inputs, ratios = inputs0, {}
    if lq.settings.method == "awq":
        ratios = lq.search_and_fold(i, w, inputs0)
        inputs = lq.capture_inputs(model, i, w, h)
    w_hat, linears = dict(w), {}
    for n in LINEARS:
        prefix = f"model.layers.{i}.{n}"
        if prefix in lq.skipped:
            continue
        x, weight = _subsample(inputs[n], MAX_SEARCH_TOKENS), w[f"{n}.weight"]
        clipped = weight
        if lq.settings.method == "awq" and lq.settings.clip and n not in NO_CLIP:
            clipped = search_clip(weight, x, G)
        quantized[prefix] = (*quantize_rtn(clipped, G), G)
        w_hat[f"{n}.weight"] = dequantize(*quantized[prefix])
        x0 = _subsample(inputs0[n], MAX_SEARCH_TOKENS)
        energy = (x0 @ original[n].T).pow(2).mean().item() or 1.0
        linears[n] = {
            "error_rtn": output_error(x0, original[n], fake_quantize(original[n], G)) / energy,
            "error_final": output_error(x, weight, w_hat[f"{n}.weight"]) / energy,
        }
    return {"layer": i, "scale_exponents": ratios, "linears": linears}, w_hat
