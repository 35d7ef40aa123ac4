"""Device presets: a device's cards, its memory tiers and their capacities, read from a YAML file
in ``configs/devices/`` (shipped in the package) or a built-in. No torch here: ``pagedserve tune``
plans from the same presets the HAL builds its devices from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pagedserve.hal.memory import MemoryAttr, parse_bytes
from pagedserve.presets import find_preset, parse_cards, preset_names

# Used when no YAML preset of that name exists (e.g. an installed package without configs/).
BUILTIN_PRESETS: dict[str, dict] = {
    "kunlun-emu": {
        "backend": "kunlun-emu",
        "description": "CPU emulation of a Kunlun XPU node: 8 cards of 8 GiB HBM",
        "cards": 8,
        "memory_bytes": "8GiB",
        "tiers": {"kv": "2GiB", "weight": "8GiB", "host": "8GiB"},
        "kv_memory_attr": "cached",
    },
    "cpu": {
        "backend": "cpu",
        "cards": "per-process",
        "description": "plain PyTorch on the host CPU",
        "tiers": {"kv": "2GiB", "weight": 0, "host": 0},
        "kv_memory_attr": "cached",
    },
    "cuda": {
        "backend": "cuda",
        "description": "an NVIDIA GPU through PyTorch",
        "tiers": {"kv": "16GiB", "weight": 0, "host": 0},
        "kv_memory_attr": "cached",
    },
}


# The backends whose device memory is this machine's RAM: their KV pool is also capped by it.
HOST_MEMORY_BACKENDS = frozenset({"cpu", "kunlun-emu"})


@dataclass
class DevicePreset:
    name: str
    backend: str
    description: str = ""
    tiers: dict[str, int] = field(default_factory=dict)
    kv_memory_attr: MemoryAttr = MemoryAttr.CACHED
    memory_bytes: int = 0  # one HBM that the kv and weight tiers share; 0: the tiers are separate
    cards: int | None = 1  # cards in the node, each with these tiers; None: one per process

    def check_tensor_parallel_size(self, tp_size: int, flag: str = "--tp-size") -> list[int]:
        """The cards ``tp_size`` ranks leave unused (named in a warning by the caller); more ranks
        than the node has cards is refused, as the Kunlun XPU deployment guide says."""
        if tp_size < 1:
            raise ValueError(f"{flag} {tp_size}: use 1 or more")
        if self.cards is None:
            return []
        if tp_size > self.cards:
            raise ValueError(
                f"{flag} {tp_size} asks for more cards than device {self.name!r} has: "
                f"{self.cards} card(s) per node; use {flag} {self.cards} or less, or add nodes "
                f"with --nnodes"
            )
        return list(range(tp_size, self.cards))

    @property
    def in_host_memory(self) -> bool:
        """Whether this device's memory is the host's RAM (an emulation, or plain CPU)."""
        return self.backend in HOST_MEMORY_BACKENDS

    @classmethod
    def from_dict(cls, name: str, d: dict) -> DevicePreset:
        tiers = {k: parse_bytes(v) for k, v in (d.get("tiers") or {}).items()}
        for required in ("kv", "weight", "host"):
            tiers.setdefault(required, 0)
        return cls(
            name=d.get("name", name),
            backend=d.get("backend", name),
            description=d.get("description", ""),
            tiers=tiers,
            kv_memory_attr=MemoryAttr(d.get("kv_memory_attr", "cached")),
            memory_bytes=parse_bytes(d.get("memory_bytes", 0)),
            cards=parse_cards(d.get("cards", 1)),
        )


def host_memory_limit() -> float:
    """Half of this machine's available RAM: what a KV pool in host memory may take (inf where
    the OS does not say). Available, not free: the page cache gives its memory back when asked
    (Linux's MemAvailable counts it), so a machine that has read many files is not a small one."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 2
    except (OSError, ValueError, IndexError):
        pass
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return float("inf")
    return free / 2


def kv_pool_limits(
    preset: DevicePreset,
    weight_bytes: int,
    utilization: float,
    kv_used: int = 0,
    host_limit: float = float("inf"),
) -> dict[str, float]:
    """Each bound on the bytes of one card's KV page pool; the pool takes the least of them.

    ``Device.num_kv_pages_available`` sizes the pool by this rule at start-up and ``pagedserve
    tune`` plans by it, so the two agree. With a shared HBM (``memory_bytes``) the weights are paid
    from the same budget, as vLLM's ``--gpu-memory-utilization`` does, and the KV tier caps what is
    left; otherwise the KV tier is its own budget. An emulated card also stops at ``host_limit``.
    """
    kv = preset.tiers["kv"]
    if preset.memory_bytes:
        limits = {
            "kv tier": kv - kv_used,
            "memory budget": preset.memory_bytes * utilization - kv_used - weight_bytes,
        }
    else:
        limits = {"kv tier": kv * utilization - kv_used}
    if host_limit != float("inf"):
        limits["host memory"] = host_limit
    return limits


def available_presets() -> list[str]:
    names = set(BUILTIN_PRESETS) | set(preset_names("devices"))
    return sorted(names)


def load_device_preset(name_or_path: str) -> DevicePreset:
    """A preset by name (``configs/devices/NAME.yaml``, shipped in the package, or a built-in) or
    by path to a YAML file."""
    path = find_preset("devices", name_or_path)
    if path is not None:
        return DevicePreset.from_dict(path.stem, yaml.safe_load(path.read_text()))
    if name_or_path in BUILTIN_PRESETS:
        return DevicePreset.from_dict(name_or_path, BUILTIN_PRESETS[name_or_path])
    raise ValueError(
        f"unknown device {name_or_path!r}; choose one of {', '.join(available_presets())} "
        f"(--device), or give the path of a preset YAML file"
    )
