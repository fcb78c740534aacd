"""Checks of model folders against what vLLM will demand, before any engine starts.

Pure JSON reading (no vLLM, no torch): an engine at TP=8 takes minutes to start and then fails
with an assertion deep in a worker; these checks say the same thing in a second, with the numbers
and the file that demands them. Used by the end-to-end script (engine side) and by the host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EAGLE_LOADER = "vllm/model_executor/models/llama4_eagle.py"

# What vLLM's Llama-4 EAGLE loader reads by plain attribute access, and the value it accepts
# (None: any value of the given type). Missing keys crash engine start-up in every worker.
HEAD_KEYS: dict[str, tuple[type | None, Any]] = {
    "yoco_global_kv_layer": (None, None),  # asserted to be null
    "yoco_local_kv_layer": (None, None),  # asserted to be null
    "draft_vocab_size": (int, ...),  # size of the head's lm_head
    "moe_layers": (list, []),  # asserted empty: the head is dense
    "interleave_moe_layer_step": (int, 0),  # otherwise vLLM builds MoE layers for the head
}


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {model_dir} a model folder?")
    return json.loads(path.read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part: Maverick and Scout nest it under ``text_config``."""
    return config.get("text_config") or config


def head_problems(head_dir: Path) -> list[str]:
    """What in a Llama-4 EAGLE head's config.json vLLM's loader will reject."""
    cfg = read_config(head_dir)
    problems = []
    for key, (kind, wanted) in HEAD_KEYS.items():
        if key not in cfg:
            problems.append(
                f"head config {Path(head_dir) / 'config.json'} lacks {key!r}, which {EAGLE_LOADER}"
                f" reads (add \"{key}\": {json.dumps(wanted if wanted is not ... else 0)})"
            )
            continue
        value = cfg[key]
        if kind is None and value is not None:
            problems.append(f"head config {key!r} is {value!r}; {EAGLE_LOADER} requires null")
        elif kind is not None and not isinstance(value, kind):
            problems.append(f"head config {key!r} is {value!r}; {EAGLE_LOADER} needs a {kind.__name__}")
        elif wanted is not ... and kind is not None and value != wanted:
            problems.append(
                f"head config {key!r} is {value!r}; {EAGLE_LOADER} supports only {wanted!r}"
            )
    return problems


def tp_problems(target_dir: Path, tp: int) -> list[str]:
    """Sizes that tensor parallelism of ``tp`` cannot shard, with the numbers."""
    cfg = text_config(read_config(target_dir))
    problems = []
    if tp < 1:
        return [f"tensor parallel size must be at least 1, got {tp}"]
    heads = cfg.get("num_attention_heads")
    if heads is not None and heads % tp:
        problems.append(f"{heads} attention heads are not divisible by tensor parallel size {tp}")
    kv = cfg.get("num_key_value_heads")
    if kv is not None and kv % tp and tp % kv:
        problems.append(
            f"{kv} key/value heads and tensor parallel size {tp}: one must divide the other"
        )
    for key, what in (("intermediate_size", "expert intermediate size"),
                      ("intermediate_size_mlp", "dense MLP intermediate size")):
        size = cfg.get(key)
        if size is not None and size % tp:
            problems.append(f"{what} {size} ({key}) is not divisible by tensor parallel size {tp}")
    experts = cfg.get("num_local_experts")
    if experts is not None and experts % tp and tp % experts:
        problems.append(f"{experts} experts and tensor parallel size {tp}: one must divide the other")
    return problems
