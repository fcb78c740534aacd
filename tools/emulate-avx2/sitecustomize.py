"""Run vLLM's CPU build with its AVX2 kernels on an AVX-512 machine, to measure AVX2 near-ties.

Measurement aid for docs/verdict.md, not part of any run: with this folder first on PYTHONPATH
and ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` set, oneDNN and ATen pick their AVX2
kernels and vLLM loads ``_C_AVX2`` (it asks torch whether AVX-512 is there; this says no). Every
process of the run imports it, the spawned TP workers included. A real AVX2 machine may still
differ (other cores, other memory layout), so figures from it are labelled as emulated.
"""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
