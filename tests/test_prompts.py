from __future__ import annotations

import pytest

from validate import prompts


def test_seed_mix_is_the_seed_prs_hundred_chats() -> None:
    chats = prompts.chat_prompts("seed", 100)
    assert len(chats) == 100
    assert all(c[0]["role"] == "user" and len(c) == 1 for c in chats)
    texts = [c[0]["content"] for c in chats]
    assert sum("repeat the word" in t for t in texts) + sum("ten-word sentence" in t
                                                             for t in texts) == 100
    # 2 kinds x 4 words, drawn the same way each time
    assert len(set(texts)) == 8
    assert chats == prompts.chat_prompts("seed", 100)


def test_other_seed_gives_other_prompts() -> None:
    assert prompts.chat_prompts("seed-wide", 50) != prompts.chat_prompts("seed-wide", 50,
                                                                          random_seed=1)


def test_unknown_set() -> None:
    with pytest.raises(KeyError, match="seed-wide"):
        prompts.chat_prompts("nope", 1)
