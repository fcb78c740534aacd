"""A deliberate, documented bug for the tests: noise on the target's logits in speculative verification.

Put this folder first on PYTHONPATH and every Python process of the run (the engine and its TP
workers, which are spawned) imports it at start-up. When vLLM's rejection sampler module is
imported, ``RejectionSampler.forward`` is wrapped so the target's logits it verifies drafts with
get Gaussian noise (``KIT_PERTURB_LOGIT_NOISE`` nats, fixed seed). The reference engine never runs
the rejection sampler, so only the speculative path's view of the target changes: exactly the
class of bug (a wrong target computation on the speculative path) that the tie-aware comparison
must report as hard divergences, not as near-ties.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

MODULE = "vllm.v1.sample.rejection_sampler"


def _patch(module) -> None:
    import torch

    original = module.RejectionSampler.forward
    std = float(os.environ.get("KIT_PERTURB_LOGIT_NOISE", "2.0"))
    gen = torch.Generator().manual_seed(0)

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        noise = torch.randn(logits.shape, generator=gen, dtype=torch.float32) * std
        return original(self, metadata, draft_probs, logits + noise.to(logits.dtype),
                        sampling_metadata)

    module.RejectionSampler.forward = forward


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
