from __future__ import annotations

import json
from pathlib import Path

from validate import compat

GOOD_HEAD = {"yoco_global_kv_layer": None, "yoco_local_kv_layer": None, "draft_vocab_size": 1024,
             "moe_layers": [], "interleave_moe_layer_step": 0}


def _write(tmp_path: Path, cfg: dict[str, object]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_good_head_has_no_problems(tmp_path: Path) -> None:
    assert compat.head_problems(_write(tmp_path, GOOD_HEAD)) == []


def test_missing_key_names_it_and_the_loader(tmp_path: Path) -> None:
    cfg = {k: v for k, v in GOOD_HEAD.items() if k != "draft_vocab_size"}
    [problem] = compat.head_problems(_write(tmp_path, cfg))
    assert "'draft_vocab_size'" in problem and compat.EAGLE_LOADER in problem


def test_moe_head_is_refused(tmp_path: Path) -> None:
    problems = compat.head_problems(_write(tmp_path, {**GOOD_HEAD, "interleave_moe_layer_step": 1}))
    assert problems == [f"head config 'interleave_moe_layer_step' is 1; {compat.EAGLE_LOADER} "
                        "supports only 0"]


def test_tp_that_does_not_divide_heads_says_the_numbers(tmp_path: Path) -> None:
    cfg = {"text_config": {"num_attention_heads": 40, "num_key_value_heads": 8,
                           "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                           "num_local_experts": 128}}
    target = _write(tmp_path, cfg)
    assert compat.tp_problems(target, 8) == []
    problems = compat.tp_problems(target, 3)
    assert "40 attention heads are not divisible by tensor parallel size 3" in problems
    assert any("8 key/value heads" in p for p in problems)
    assert any("128 experts" in p for p in problems)
