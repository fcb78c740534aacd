"""How much each part of the tiny pair's EAGLE head matters, in the generator's own replay.

Engine side (torch, transformers; never vLLM). The verdict can only catch a bug in vLLM's head path
if breaking that part costs acceptance well beyond the calibrated tolerance. This module breaks each
part of the head's path once (its two inputs, positions, attention, MLP, norms, ``fc``, the
embedding and LM head it shares with the target), replays greedy speculative decoding exactly as
``synth.simulate_acceptance`` does, and prints the table: acceptance with the part broken, the drop,
and whether the drop is at least 3 x the golden's tolerance.

    python -m validate.ablations [--golden validate/data/goldens/tiny-cpu-amx-tp1.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from validate import prompts, synth


class Variant(torch.nn.Module):
    """The head with one part of its forward changed (what a buggy loader or drafter would do)."""

    def __init__(self, head: synth.EagleHead, *, zero_positions: bool = False) -> None:
        super().__init__()
        self.head = head
        self.zero_positions = zero_positions

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.head.fc(torch.cat([embeds, features], dim=-1))
        pos = None
        if self.zero_positions:
            pos = torch.zeros(x.shape[:2], dtype=torch.long)
        return self.head.body(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state


def _edited(head: synth.EagleHead, edit: Callable[[synth.EagleHead], None]) -> synth.EagleHead:
    h = copy.deepcopy(head)
    with torch.no_grad():
        edit(h)
    return h


def _half(h: synth.EagleHead, which: int) -> None:
    size = h.fc.weight.shape[1] // 2
    h.fc.weight[:, which * size:(which + 1) * size] = 0


def _swap_halves(h: synth.EagleHead) -> None:
    w = h.fc.weight.clone()
    size = w.shape[1] // 2
    h.fc.weight.copy_(torch.cat([w[:, size:], w[:, :size]], dim=1))


def _layer(h: synth.EagleHead) -> Any:
    return h.body.layers[0]


def _zero_o_proj(h: synth.EagleHead) -> None:
    _layer(h).self_attn.o_proj.weight.zero_()


def _zero_down_proj(h: synth.EagleHead) -> None:
    _layer(h).feed_forward.down_proj.weight.zero_()


def _reset_input_norm(h: synth.EagleHead) -> None:
    _layer(h).input_layernorm.weight.fill_(1)


def _reset_post_attention_norm(h: synth.EagleHead) -> None:
    _layer(h).post_attention_layernorm.weight.fill_(1)


def _reset_final_norm(h: synth.EagleHead) -> None:
    h.body.norm.weight.fill_(1)


def _own_embedding(s: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(emb=torch.randn_like(s.emb) * s.emb.std(), lm_head=s.lm_head)


def _shifted_lm_head(s: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(emb=s.emb, lm_head=torch.roll(s.lm_head, 1, 0))


# name -> (what it stands for in vLLM, edit of the head's weights, edit of the shared tensors,
# positions zeroed)
ABLATIONS: dict[str, tuple[str, Callable[[synth.EagleHead], None] | None,
                           Callable[[SimpleNamespace], SimpleNamespace] | None, bool]] = {
    "token input zeroed": ("fc reads no token embedding", lambda x: _half(x, 0), None, False),
    "feature input zeroed": ("the target's hidden states never reach the head",
                             lambda x: _half(x, 1), None, False),
    "fc halves swapped": ("embedding and feature concatenated in the wrong order", _swap_halves,
                          None, False),
    "positions all zero": ("draft positions not advanced", None, None, True),
    "attention off": ("attention output lost (o_proj not loaded)", _zero_o_proj, None, False),
    "MLP off": ("MLP output lost (down_proj not loaded)", _zero_down_proj, None, False),
    "input norm at init": ("input_layernorm weight not loaded", _reset_input_norm, None, False),
    "post-attention norm at init": ("post_attention_layernorm weight not loaded",
                                    _reset_post_attention_norm, None, False),
    "final norm at init": ("the head's final norm weight not loaded", _reset_final_norm, None,
                           False),
    "own embedding": ("embedding not shared with the target (left at random init)", None,
                      _own_embedding, False),
    "LM head rows shifted": ("LM head not shared (vocabulary rows misaligned)", None,
                             _shifted_lm_head, False),
}


def load_head(pair: synth.Pair) -> synth.EagleHead:
    """The distilled head back from its released-format files (``model.*`` names, bf16)."""
    from safetensors.torch import load_file
    from transformers import Llama4TextConfig

    cfg = json.loads((pair.head / "config.json").read_text())
    for key in (*synth.HEAD_EXTRA_KEYS, "draft_vocab_size", "architectures", "model_type"):
        cfg.pop(key, None)
    config = Llama4TextConfig(**{**cfg, "moe_layers": [], "interleave_moe_layer_step": 1})
    head = synth.EagleHead(config)
    sd = {k: v.float() for k, v in load_file(str(pair.head / "model.safetensors")).items()}
    head.fc.weight.data.copy_(sd.pop("model.fc.weight"))
    head.body.load_state_dict({k.removeprefix("model."): v for k, v in sd.items()}, strict=False)
    return head.eval()


def table(pair: synth.Pair, k: int = 3) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer, Llama4ForCausalLM

    target = Llama4ForCausalLM.from_pretrained(pair.target, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    head = load_head(pair)
    man = pair.manifest
    sim = man["simulated_acceptance"]
    chats = prompts.chat_prompts(man["prompt_set"], sim["prompts"])
    ids = [synth._encode_chat(tokenizer, c) for c in chats]
    conts = synth.greedy(target, ids, sim["max_tokens"])
    seqs = [p + c for p, c in zip(ids, conts, strict=True)]
    feats = synth.features(target, seqs)
    lens = [len(p) for p in ids]
    shared = SimpleNamespace(emb=target.model.embed_tokens.weight.detach().float(),
                             lm_head=target.lm_head.weight.detach().float())
    torch.manual_seed(0)

    def replay(h: Any, s: SimpleNamespace) -> float:
        fake = SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=s.emb)),
                               lm_head=SimpleNamespace(weight=s.lm_head))
        return synth.simulate_acceptance(h, fake, lens, seqs, feats, k)["mean_acceptance_length"]

    rows = [{"ablation": "none (the distilled head)", "stands_for": "", "mean_acceptance_length":
             replay(head, shared)}]
    for name, (meaning, edit, share, zero_positions) in ABLATIONS.items():
        t = time.monotonic()
        h: Any = _edited(head, edit) if edit else head
        if zero_positions:
            h = Variant(h, zero_positions=True)
        s = share(shared) if share else shared
        rows.append({"ablation": name, "stands_for": meaning,
                     "mean_acceptance_length": replay(h, s)})
        print(f"[ablations] {name}: {rows[-1]['mean_acceptance_length']:.3f} "
              f"({time.monotonic() - t:.0f}s)", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m validate.ablations", description=__doc__.split("\n")[0])
    ap.add_argument("--golden", type=Path, default=None,
                    help="a golden whose tolerance sets the bar (3 x its mean-length tolerance)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--pair", type=Path, default=None, help="a pair folder (default: the cached pair)")
    args = ap.parse_args(argv)
    rows = table(synth.ensure(args.pair))
    tol = None
    if args.golden:
        tol = json.loads(args.golden.read_text())["acceptance"]["mean_acceptance_length"]["tolerance"]
    base = rows[0]["mean_acceptance_length"]
    print("| ablation | stands for (in vLLM) | mean acceptance length | drop | >= 3 x tolerance |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        drop = base - r["mean_acceptance_length"]
        r["drop"] = drop
        r["caught"] = None if tol is None or r is rows[0] else drop >= 3 * tol
        mark = "" if r["caught"] is None else ("yes" if r["caught"] else "**no**")
        print(f"| {r['ablation']} | {r['stands_for']} | {r['mean_acceptance_length']:.3f} | "
              f"{drop:.3f} | {mark} |")
    if tol is not None:
        print(f"\ntolerance {tol:.3f} (from {args.golden.name}); bar 3 x {tol:.3f} = {3 * tol:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"tolerance": tol, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["caught"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
