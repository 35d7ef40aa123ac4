"""Hardware abstraction layer: every device detail lives below this line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.hal.device_preset import DevicePreset, available_presets, load_device_preset
from pagedserve.hal.memory import DeviceOutOfMemoryError, MemoryAttr

if TYPE_CHECKING:
    from pagedserve.hal.device import Device
    from pagedserve.hal.kernels import AttentionMetadata

DEFAULT_DEVICE = "kunlun-emu"
_TORCH_NAMES = {"Device": "pagedserve.hal.device", "AttentionMetadata": "pagedserve.hal.kernels"}


def __getattr__(name: str):
    # the devices and kernels pull in torch; the presets (pagedserve tune) need none of it
    if name in _TORCH_NAMES:
        import importlib

        return getattr(importlib.import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module 'pagedserve.hal' has no attribute {name!r}")


def get_device(name: str = DEFAULT_DEVICE, kernels: str = "auto") -> Device:
    """A device from a backend name (``kunlun-emu``, ``cpu``, ``cuda``) or a preset name / YAML path.

    ``kernels`` picks a CPU backend's native kernels (``native.KERNEL_CHOICES``: ``auto``, a
    target, or ``eager`` for plain PyTorch ops); other backends ignore it."""
    preset = load_device_preset(name)
    return _backend_class(preset)(preset, kernels=kernels)


def distributed_backend(name: str = DEFAULT_DEVICE) -> str:
    """The torch.distributed backend the cards of device ``name`` talk through (gloo, nccl)."""
    return _backend_class(load_device_preset(name)).distributed_backend


def _backend_class(preset: DevicePreset) -> type[Device]:
    from pagedserve.hal.cpu import CpuDevice
    from pagedserve.hal.cuda import CudaDevice
    from pagedserve.hal.kunlun_emu import KunlunEmuDevice

    backends = {"kunlun-emu": KunlunEmuDevice, "cpu": CpuDevice, "cuda": CudaDevice}
    if preset.backend not in backends:
        raise ValueError(
            f"device preset {preset.name!r} names unknown backend {preset.backend!r}; "
            f"backends: {', '.join(backends)}"
        )
    return backends[preset.backend]


__all__ = [
    "AttentionMetadata",
    "DEFAULT_DEVICE",
    "Device",
    "DeviceOutOfMemoryError",
    "DevicePreset",
    "MemoryAttr",
    "available_presets",
    "distributed_backend",
    "get_device",
    "load_device_preset",
]
