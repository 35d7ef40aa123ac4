"""Memory tiers: named capacities that every device allocation is charged to."""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """``"32GiB"`` -> 34359738368; plain numbers are bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write bytes or e.g. '512MiB', '32GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class MemoryAttr(str, enum.Enum):
    CACHED = "cached"
    UNCACHED = "uncached"


class DeviceOutOfMemoryError(RuntimeError):
    """An allocation asked a tier for more than it has free."""


@dataclass(slots=True)
class Allocation:
    tag: str
    nbytes: int
    attr: MemoryAttr


@dataclass
class MemoryTier:
    name: str
    capacity: int  # bytes; 0 means unbounded (plain host memory)
    flag: str = "--gpu-memory-utilization"  # the setting a user changes when this tier runs out
    allocations: dict[int, Allocation] = field(default_factory=dict)
    peak: int = 0
    _next_handle: int = 0

    @property
    def used(self) -> int:
        return sum(a.nbytes for a in self.allocations.values())

    @property
    def free(self) -> int:
        return max(self.capacity - self.used, 0) if self.capacity else 2**62

    def reserve(self, nbytes: int, tag: str, attr: MemoryAttr) -> int:
        if self.capacity and nbytes > self.free:
            raise DeviceOutOfMemoryError(
                f"memory tier '{self.name}' cannot hold {tag}: asked {format_bytes(nbytes)}, "
                f"{format_bytes(self.free)} free of {format_bytes(self.capacity)}; use a larger "
                f"device preset (--device) or lower the demand ({self.flag}, --max-model-len, "
                f"--quantization int4)"
            )
        self._next_handle += 1
        self.allocations[self._next_handle] = Allocation(tag, nbytes, attr)
        self.peak = max(self.peak, self.used)
        return self._next_handle

    def release(self, handle: int) -> None:
        assert handle in self.allocations, f"tier '{self.name}': release of unknown handle {handle}"
        del self.allocations[handle]

    def stats(self) -> dict:
        return {
            "name": self.name,
            "capacity_bytes": self.capacity,
            "used_bytes": self.used,
            "peak_bytes": self.peak,
            "allocations": {a.tag: a.nbytes for a in self.allocations.values()},
        }
