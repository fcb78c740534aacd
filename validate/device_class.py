"""The hardware class a golden is keyed by, from facts either side can read without vLLM.

Runs on another class give other near-ties and acceptance, so a golden applies only to its own:
the GPU model (``h200``), or for CPUs the best instruction set the bf16 kernels use (oneDNN and
vLLM's CPU build pick their kernels by it: ``_C``, ``_C_AVX512``, ``_C_AVX2``). Pure: the engine
side hands in torch's GPU name, the host reads /proc/cpuinfo (``compare --baseline-golden``
refuses another class's golden before any engine starts).
"""

from __future__ import annotations

import platform

# CPU instruction sets that change bf16 results, best first.
CPU_CLASSES = (("amx_bf16", "cpu-amx"), ("avx512_bf16", "cpu-avx512bf16"), ("avx512f", "cpu-avx512"),
               ("avx2", "cpu-avx2"))


def of_cpu_flags(flags: set[str]) -> str:
    return next((cls for flag, cls in CPU_CLASSES if flag in flags), f"cpu-{platform.machine()}")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu() -> str:
    """This machine's CPU class."""
    return of_cpu_flags(cpu_flags())


def of_gpu_name(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA A100-SXM4-80GB``
    -> ``a100``: the model, without vendor, memory or form-factor words (the first word that mixes
    letters and digits and is not a memory size; else the last word)."""
    words = [w.split("-")[0] for w in name.lower().split()]
    model = next((w for w in words if any(c.isalpha() for c in w) and any(c.isdigit() for c in w)
                  and not w.endswith("gb")), words[-1] if words else "gpu")
    return "".join(c for c in model if c.isalnum()) or "gpu"

