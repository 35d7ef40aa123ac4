"""What an engine's start can refuse before it loads or spawns anything, in well under a second:
a tensor-parallel layout the node or the flags cannot give, a damaged model directory, and a
tensor-parallel size that cannot split the model. ``serve`` runs them in the HTTP process before
it starts the engine core, ``LLMEngine`` before it starts the ranks. No torch here."""

from __future__ import annotations

from pathlib import Path

from pagedserve.config import EngineConfig, UsageContext
from pagedserve.hal.device_preset import DevicePreset, load_device_preset
from pagedserve.models.config import GlmConfig, int4_group_size, load_config
from pagedserve.models.model_dir import check_weights


def refuse_parallel_config(
    config: EngineConfig, usage_context: UsageContext
) -> tuple[DevicePreset, list[int]]:
    """Refuse sizes the node or the flags cannot give; (the device preset, the cards of each
    node the ranks leave unused)."""
    parallel, name = config.parallel, usage_context.name_of
    tp = parallel.tensor_parallel_size
    if tp % parallel.nnodes:
        raise ValueError(
            f"{usage_context.assignment('tensor_parallel_size', tp)} cannot be spread evenly over "
            f"{usage_context.assignment('nnodes', parallel.nnodes)}; use a multiple of "
            f"{parallel.nnodes}"
        )
    if parallel.node_rank >= parallel.nnodes:
        raise ValueError(
            f"{usage_context.assignment('node_rank', parallel.node_rank)} must be less than "
            f"{name('nnodes')} {parallel.nnodes}"
        )
    if parallel.nnodes > 1 and not parallel.dist_init_addr:
        raise ValueError(
            f"{name('nnodes')} {parallel.nnodes} needs {name('dist_init_addr')} HOST:PORT, the "
            "address of node 0 that every node can reach"
        )
    preset = load_device_preset(config.device.device)
    unused = preset.check_tensor_parallel_size(
        parallel.ranks_per_node, name("tensor_parallel_size")
    )
    return preset, unused


def check_model_dir(
    model_dir: Path,
    config: EngineConfig,
    usage_context: UsageContext = UsageContext.OPENAI_API_SERVER,
) -> GlmConfig:
    """config.json (a ``ModelDirError`` naming the file and the field), every weight file whole,
    and that ``tensor_parallel_size`` splits the model; the model's config."""
    model_config = load_config(model_dir)
    check_weights(model_dir)
    mc = config.model
    model_config.check_tensor_parallel(
        config.parallel.tensor_parallel_size,
        int4_group_size(model_config.quantization_config, mc.quantization, mc.quant_group_size),
        usage_context.name_of("tensor_parallel_size"),
    )
    return model_config


def check_before_start(
    model_dir: Path,
    config: EngineConfig,
    usage_context: UsageContext = UsageContext.OPENAI_API_SERVER,
) -> GlmConfig:
    """The node's layout, then the model directory and its split (``check_model_dir``); the
    model's config."""
    refuse_parallel_config(config, usage_context)
    return check_model_dir(model_dir, config, usage_context)
