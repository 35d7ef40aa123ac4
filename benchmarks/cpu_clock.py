"""The core clock and the int8 multiply-add peak, to state a kernel's arithmetic as MACs per cycle
per core and as a share of what the core can do.

    python -m benchmarks.cpu_clock      # prints this CPU's clock, microarchitecture and peaks

The clock: a chain of dependent integer adds (one a cycle on every x86 core since the Pentium
Pro), timed in the thread's own CPU time, so that other processes on the machine count less; a
C program built with the system's compiler once into the benchmarks' cache. (A virtual machine
usually hides the performance counters, and /proc/cpuinfo's MHz is the nominal clock, not the
boosted one a benchmark runs at.)

The peaks (int8 multiply-adds a cycle a core), from the instruction tables of the
microarchitectures (Agner Fog's; AMD's and Intel's optimisation guides):
- AVX2 without VNNI (Zen 1-3, Haswell to Ice Lake client): two 256-bit vpmaddubsw a cycle,
  64 (the int16 sums they make still need adding, so a kernel does fewer);
- AVX2 with AVX-VNNI, or AVX-512 VNNI on a core with one 512-bit multiply pipe (Zen 4, which
  runs a 512-bit op on two 256-bit halves; Ice Lake and Sapphire Rapids servers: port 0):
  64 (vpdpbusd);
- AVX-512 VNNI on Zen 5 (family 0x1A), whose two 512-bit pipes each take a vpdpbusd: 128.
The avx2 target (which takes AVX-VNNI's vpdpbusd where the CPU has it) is held to 64 on every
CPU: two 256-bit multiply pipes either way.
"""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

from benchmarks.bench_models import cache_root

CHAIN = r"""
#include <stdio.h>
#include <time.h>
static double thread_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(void) {
  const long n = 400000000L;  /* adds: 4 a loop, each waiting for the last */
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    long x = 0;
    double start = thread_seconds();
    __asm__ volatile("mov %1, %%rcx\n1:\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n"
                     " dec %%rcx\n jnz 1b" : "+r"(x) : "r"(n / 4) : "rcx");
    double s = thread_seconds() - start;
    if (s < best) best = s;
  }
  printf("%.4f\n", n / best / 1e9);
  return 0;
}
"""


@cache
def clock_ghz() -> float:
    """This core's clock while busy, in GHz (best of 5 chains of 4e8 dependent adds)."""
    exe = cache_root() / "cpu_clock"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        source = exe.with_suffix(".c")
        source.write_text(CHAIN)
        subprocess.run(["cc", "-O1", str(source), "-o", str(exe)], check=True)
    return float(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)


def cpu_family() -> tuple[str, int, int]:
    """(vendor, family, model) from /proc/cpuinfo."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if key.strip() == "model" and "cpu family" in fields:
            break
    return (
        fields.get("vendor_id", "?"),
        int(fields.get("cpu family", 0)),
        int(fields.get("model", 0)),
    )


def microarchitecture() -> str:
    """AMD's Zen generations by family and model (a virtual machine's "AMD EPYC" names none)."""
    vendor, family, model = cpu_family()
    if vendor == "AuthenticAMD":
        if family == 0x1A:
            return "Zen 5"
        if family == 0x19:
            return "Zen 4" if model in range(0x10, 0x20) or model >= 0x60 else "Zen 3"
        if family == 0x17:
            return "Zen 2" if model >= 0x30 else "Zen 1"
    return f"{vendor} family {family} model {model}"


def int8_peak_macs_per_cycle(kernels: str) -> int:
    """int8 multiply-adds a cycle a core for the instructions of target ``kernels`` here."""
    if kernels == "avx512" and microarchitecture() == "Zen 5":
        return 128
    if kernels in ("avx512", "avx2"):
        return 64
    return 0  # portable and eager: no int8 kernel of their own


def main() -> None:
    print(f"{microarchitecture()}: {clock_ghz():.2f} GHz busy; int8 peak a core: "
          f"avx512 {int8_peak_macs_per_cycle('avx512')}, avx2 {int8_peak_macs_per_cycle('avx2')}"
          " MACs a cycle")  # fmt: skip


if __name__ == "__main__":
    main()
