"""The chat prompt sets of the end-to-end script, read from ``data/prompts.toml``.

Pure Python (no vLLM): the generator of the tiny pair trains its head on prompts of the same shape,
and tests check the seed's mix without starting an engine.
"""

from __future__ import annotations

import random
import tomllib
from importlib import resources
from typing import Any

Messages = list[dict[str, Any]]


def _load() -> dict[str, Any]:
    return tomllib.loads(resources.files("validate.data").joinpath("prompts.toml").read_text())


def known_sets() -> list[str]:
    return sorted(_load()["sets"])


def chat_prompts(set_name: str, count: int, *, random_seed: int | None = None) -> list[Messages]:
    """``count`` single-turn chats, drawn exactly as vLLM's ``get_test_prompts`` draws them.

    ``random_seed`` overrides the set's seed (the generator uses other seeds than the evaluation
    so the head is not trained on the prompts it is judged on).
    """
    data = _load()
    if set_name not in data["sets"]:
        raise KeyError(f"unknown prompt set {set_name!r}; known: {', '.join(known_sets())}")
    spec = data["sets"][set_name]
    rng = random.Random(spec["random_seed"] if random_seed is None else random_seed)
    kinds = rng.choices(spec["kinds"], k=count)
    prompts: list[Messages] = []
    for kind in kinds:
        word = rng.choice(spec["words"])
        text = data["kinds"][kind].format(word=word)
        prompts.append([{"role": "user", "content": text}])
    return prompts


def vocabulary_text(set_name: str) -> str:
    """All templates filled with every word of the set: a corpus for the tiny tokenizer."""
    data = _load()
    spec = data["sets"][set_name]
    return "\n".join(
        data["kinds"][kind].format(word=word) for kind in spec["kinds"] for word in spec["words"]
    )
