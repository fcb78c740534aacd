"""Generate the tiny Llama-4 pair: a target, a distilled Llama-4 EAGLE head, a random head, a tokenizer.

Engine side (torch, transformers, tokenizers; never vLLM). Why a generated pair: the real pair is
~390 GB behind a gated license, and an exact-match check on any pair cannot tell a broken head from
a good one (greedy speculative decoding is lossless by design). So the tiny pair is built to make
the verdict informative:

* the target's greedy continuation depends on context, not only on the last token
  (``context_dependence`` below measures it; a test asserts it);
* the head is trained on the target's own features (EAGLE: input = fc([embed(t+1); feature(t)])),
  so vLLM's acceptance counters show whether vLLM feeds the head correctly;
* the head's decoder layer matters: bypassing it must cost acceptance (``ablations``), so a loader
  that mis-maps the layer's weights shows up as low acceptance, not as a pass.

Everything is deterministic from the seed in ``data/tiny_pair.toml``; the output folder carries a
fingerprint of that file and of this module, and is reused while both are unchanged.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import sys
import time
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from validate import files, prompts

MANIFEST = "pair.json"
PROMPT_SET = "seed-wide"

# The chat template of Llama 4 Instruct, reduced to text turns. Written by hand because the real
# one ships inside the gated repository; its special tokens are added to the tokenizer below.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|header_start|>{{ message['role'] }}<|header_end|>\n\n"
    "{{ message['content'] | trim }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>",
                  "<|eot|>", "<|finetune_right_pad|>"]

# Keys vLLM's Llama-4 EAGLE loader reads by attribute (vllm/model_executor/models/llama4_eagle.py).
HEAD_EXTRA_KEYS: dict[str, Any] = {
    "yoco_global_kv_layer": None,
    "yoco_local_kv_layer": None,
    "moe_layers": [],
    "interleave_moe_layer_step": 0,
}


def spec() -> dict[str, Any]:
    return tomllib.loads(resources.files("validate.data").joinpath("tiny_pair.toml").read_text())


def fingerprint() -> str:
    """Hash of the generator's inputs: the data file, this module and the prompt sets."""
    h = hashlib.sha256()
    for name in ("tiny_pair.toml", "prompts.toml"):
        h.update(resources.files("validate.data").joinpath(name).read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update(torch.__version__.split("+")[0].encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    """The pair's folder in the kit's state folder, one per fingerprint."""
    return files.state_dir() / "tiny-pair" / fingerprint()


@dataclass
class Pair:
    root: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def head(self) -> Path:
        return self.root / "head"

    @property
    def random_head(self) -> Path:
        return self.root / "random-head"

    @property
    def manifest(self) -> dict[str, Any]:
        return json.loads((self.root / MANIFEST).read_text())


def _log(msg: str) -> None:
    print(f"[synth] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# tokenizer


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "pa", "do", "fe", "gu", "hi",
                 "jo", "ba", "ce", "ly", "an", "or", "el", "ix", "um", "et"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def build_tokenizer(out: Path, cfg: dict[str, Any], rng: random.Random) -> Any:
    """A byte-level BPE trained on the prompt vocabulary, padded with reserved tokens to exactly
    ``vocab_size`` so every id the target can emit decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = cfg["tokenizer"]["vocab_size"]
    corpus = [prompts.vocabulary_text(PROMPT_SET)] * 20
    words = _pseudo_words(rng, 3000)
    corpus += [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot|>",
        pad_token="<|finetune_right_pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


# --------------------------------------------------------------------------------------------
# models


def target_config(cfg: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import Llama4TextConfig

    t = cfg["target"]
    return Llama4TextConfig(
        vocab_size=cfg["tokenizer"]["vocab_size"],
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        intermediate_size_mlp=t["intermediate_size_mlp"],
        num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        num_local_experts=t["num_local_experts"],
        num_experts_per_tok=t["num_experts_per_tok"],
        interleave_moe_layer_step=t["interleave_moe_layer_step"],
        no_rope_layers=list(t["no_rope_layers"]),
        attention_chunk_size=t["attention_chunk_size"],
        max_position_embeddings=t["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"]},
        initializer_range=t["initializer_range"],
        use_qk_norm=False,
        attn_temperature_tuning=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def head_config(cfg: dict[str, Any], target_cfg: Any) -> Any:
    """The head's config: the target's attention shape, one dense layer, RoPE + chunked attention."""
    from transformers import Llama4TextConfig

    h = cfg["head"]
    base = target_cfg.to_dict()
    for key in ("moe_layers", "layer_types", "no_rope_layers", "num_hidden_layers",
                "intermediate_size_mlp", "interleave_moe_layer_step", "architectures",
                "model_type", "transformers_version"):
        base.pop(key, None)
    return Llama4TextConfig(
        **base,
        num_hidden_layers=h["num_hidden_layers"],
        intermediate_size_mlp=h["intermediate_size_mlp"],
        no_rope_layers=[1] * h["num_hidden_layers"],
        moe_layers=[],
        interleave_moe_layer_step=1,
    )


class EagleHead(nn.Module):
    """The Llama-4 EAGLE draft model as vLLM runs it (``llama4_eagle.LlamaModel.forward``):
    ``norm(layers(fc(cat(embed(next_token), feature))))``; the returned state is both the drafting
    feature for the next step and the input of the target's (shared) ``lm_head``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama4.modeling_llama4 import Llama4TextModel

        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.body = Llama4TextModel(config)  # its layers + final norm; its embedding is unused
        self.body.embed_tokens = None  # the head shares the target's embedding

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, features], dim=-1))
        return self.body(inputs_embeds=x, use_cache=False).last_hidden_state

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the released heads' names: ``model.fc``, ``model.layers.*``, ``model.norm``."""
        sd = {"model.fc.weight": self.fc.weight}
        for name, tensor in self.body.state_dict().items():
            sd[f"model.{name}"] = tensor
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}


def save_head(head: EagleHead, config: Any, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    cfg.pop("layer_types", None)
    cfg.update(HEAD_EXTRA_KEYS)
    cfg.update({
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "draft_vocab_size": config.vocab_size,
        "torch_dtype": "bfloat16",
    })
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file(head.vllm_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})


def build_target(cfg: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import Llama4ForCausalLM

    model = Llama4ForCausalLM(target_config(cfg, tokenizer))
    gain = cfg["target"].get("layer_output_gain", 1.0)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, cfg["target"]["embedding_std"])
        # Layers that write more into the residual stream make the final hidden state (the
        # feature the head receives) carry context the head cannot rebuild from tokens alone.
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                param.mul_(gain)
    return model.eval()


def spread_norms(head: EagleHead, log_std: float, gen: torch.Generator) -> None:
    """Give every RMSNorm of the head a non-uniform weight before training.

    A norm left at unit weight is invisible (argmax is scale-invariant), so a vLLM that failed to
    load it would pass; with spread weights that the rest of the head is trained around, a norm
    at its initial value of ones costs acceptance.
    """
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight")):
                param.copy_(torch.exp(torch.randn(param.shape, generator=gen) * log_std))


# --------------------------------------------------------------------------------------------
# data from the target


def _encode_chat(tokenizer: Any, chat: list[dict[str, Any]]) -> list[int]:
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@torch.no_grad()
def greedy(target: Any, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations, batched by prompt length (no padding, so no mask subtleties)."""
    from transformers import DynamicCache

    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        by_len.setdefault(len(ids), []).append(i)
    out: list[list[int]] = [[] for _ in prompt_ids]
    for _, idx in sorted(by_len.items()):
        ids = torch.tensor([prompt_ids[i] for i in idx])
        cache = DynamicCache(config=target.config)
        logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        gen = []
        for _ in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            gen.append(nxt)
            logits = target(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        cont = torch.cat(gen, dim=1).tolist()
        for j, i in enumerate(idx):
            out[i] = cont[j]
    return out


@torch.no_grad()
def features(target: Any, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The target's final (normed) hidden states: what vLLM hands an EAGLE head."""
    feats = []
    for s in seqs:
        h = target.model(input_ids=torch.tensor([s])).last_hidden_state[0]
        feats.append(h.float())
    return feats


@torch.no_grad()
def context_dependence(target: Any, tokenizer: Any, n: int, rng: random.Random) -> dict[str, Any]:
    """How often the greedy next token changes when only earlier context changes.

    Pairs of random token sequences share their last 1 token but differ before it; a target
    that only looked at its last token would give the same next token for every pair.
    """
    specials = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in specials]
    differ = 0
    for _ in range(n):
        last = rng.choice(vocab)
        a = [rng.choice(vocab) for _ in range(12)] + [last]
        b = [rng.choice(vocab) for _ in range(12)] + [last]
        la = target(input_ids=torch.tensor([a])).logits[0, -1].argmax().item()
        lb = target(input_ids=torch.tensor([b])).logits[0, -1].argmax().item()
        differ += int(la != lb)
    return {"pairs": n, "next_token_differs": differ, "ratio": differ / n}


# --------------------------------------------------------------------------------------------
# training and measuring the head


def train_head(head: EagleHead, target: Any, seqs: list[list[int]], feats: list[torch.Tensor],
               cfg: dict[str, Any], rng: torch.Generator) -> list[float]:
    tr = cfg["training"]
    emb = target.model.embed_tokens.weight.detach().float()
    lm_head = target.lm_head.weight.detach().float()
    # Inputs at position p: embed(tok[p+1]) and feature(p); targets: tok[p+2] and feature(p+1).
    n = len(seqs)
    length = max(len(s) for s in seqs) - 2
    tok_in = torch.zeros(n, length, dtype=torch.long)
    tok_out = torch.full((n, length), -100, dtype=torch.long)
    f_in = torch.zeros(n, length, emb.shape[1])
    f_out = torch.zeros(n, length, emb.shape[1])
    mask = torch.zeros(n, length)
    for i, (s, f) in enumerate(zip(seqs, feats, strict=True)):
        m = len(s) - 2
        tok_in[i, :m] = torch.tensor(s[1:-1])
        tok_out[i, :m] = torch.tensor(s[2:])
        f_in[i, :m] = f[: m]
        f_out[i, :m] = f[1: m + 1]
        mask[i, :m] = 1
    opt = torch.optim.AdamW(head.parameters(), lr=tr["learning_rate"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=tr["learning_rate"],
                                                total_steps=tr["steps"], pct_start=0.1)
    losses = []
    head.train()
    t0 = time.monotonic()
    for step in range(tr["steps"]):
        b = torch.randint(0, n, (tr["batch_size"],), generator=rng)
        fin = f_in[b]
        fin = fin + tr["feature_noise_std"] * torch.randn(fin.shape, generator=rng)
        h = head(emb[tok_in[b]], fin)
        logits = h @ lm_head.T
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok_out[b].reshape(-1))
        m = mask[b].unsqueeze(-1)
        fl = (F.smooth_l1_loss(h, f_out[b], reduction="none") * m).sum() / (m.sum() * h.shape[-1])
        # Second drafting step: the head's own feature in place of the target's (as vLLM drafts).
        h2 = head(emb[tok_out[b].clamp(min=0)][:, :-1], h[:, :-1])
        logits2 = h2 @ lm_head.T
        ce2 = F.cross_entropy(logits2.reshape(-1, logits2.shape[-1]),
                              tok_out[b][:, 1:].reshape(-1))
        loss = ce + ce2 + tr["feature_loss_weight"] * fl
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == tr["steps"] - 1:
            _log(f"head step {step + 1}/{tr['steps']}: loss {loss.item():.3f} "
                 f"(ce {ce.item():.3f}, ce2 {ce2.item():.3f}, feature {fl.item():.4f}) "
                 f"{time.monotonic() - t0:.0f}s")
    head.eval()
    return losses


@torch.no_grad()
def simulate_acceptance(head: EagleHead, target: Any, prompt_lens: list[int],
                        seqs: list[list[int]], feats: list[torch.Tensor], k: int,
                        feature_source: str = "target") -> dict[str, Any]:
    """Replay greedy speculative decoding as vLLM's EAGLE proposer does it, against the target's
    own greedy sequences: draft ``k`` tokens from each verification point, accept the matching
    prefix, move on by accepted + 1. Returns drafts, accepted per position and the mean
    acceptance length (1 + accepted / drafts, vLLM's definition).

    The head is causal, so instead of a KV cache each drafting step re-runs it over the true
    inputs before the verification point plus the drafted ones (same outputs, simpler).
    ``feature_source="embedding"`` feeds the token embedding in place of the target's feature:
    an ablation that shows whether the head uses the features at all.
    """
    emb = target.model.embed_tokens.weight.detach().float()
    lm_head = target.lm_head.weight.detach().float()
    drafts = 0
    per_pos = [0] * k
    for n, s, f in zip(prompt_lens, seqs, feats, strict=True):
        toks = torch.tensor(s)
        feat = f if feature_source == "target" else emb[toks]
        # Inputs at position p: (embed(tok[p+1]), feature(p)), as vLLM shifts them.
        e_in, f_in = emb[toks[1:]], feat[:-1]
        full = head(e_in.unsqueeze(0), f_in.unsqueeze(0))[0]
        j = n  # tok[n] is the first generated token (sampled by the target's prefill)
        while j + 1 < len(s):
            h = full[j - 1]
            d = int((h @ lm_head.T).argmax())
            e_seq, f_seq = e_in[:j], f_in[:j]
            accepted = 0
            for step in range(k):
                if j + 1 + step >= len(s) or d != s[j + 1 + step]:
                    break
                accepted += 1
                per_pos[step] += 1
                if step + 1 == k:
                    break
                e_seq = torch.cat([e_seq, emb[d].unsqueeze(0)])
                f_seq = torch.cat([f_seq, h.unsqueeze(0)])
                h = head(e_seq.unsqueeze(0), f_seq.unsqueeze(0))[0, -1]
                d = int((h @ lm_head.T).argmax())
            drafts += 1
            j += accepted + 1
    accepted_total = sum(per_pos)
    return {
        "drafts": drafts,
        "accepted_per_position": per_pos,
        "accepted": accepted_total,
        "mean_acceptance_length": 1 + accepted_total / drafts if drafts else 0.0,
    }


def bypassed(head: EagleHead) -> EagleHead:
    """A copy whose decoder layer adds nothing (attention and MLP outputs zeroed)."""
    h = copy.deepcopy(head)
    for layer in h.body.layers:
        layer.self_attn.o_proj.weight.data.zero_()
        layer.feed_forward.down_proj.weight.data.zero_()
    return h


# --------------------------------------------------------------------------------------------
# entry point


def generate(out: Path, *, eval_prompts: int = 100, eval_tokens: int = 32, k: int = 3) -> Pair:
    """Build the pair into ``out`` atomically (``files.staged_folder``: all of it or nothing)."""
    cfg = spec()
    seed = cfg["seed"]
    torch.manual_seed(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    timings: dict[str, float] = {}
    with files.staged_folder(out) as tmp:
        t = time.monotonic()
        tokenizer = build_tokenizer(tmp / "target", cfg, rng)
        target = build_target(cfg, tokenizer)
        target.generation_config.eos_token_id = tokenizer.eos_token_id
        target.to(torch.bfloat16).save_pretrained(tmp / "target")
        # Measure and train on what vLLM will run: the weights as saved (bf16), in float32.
        target.float()
        timings["target_s"] = time.monotonic() - t

        t = time.monotonic()
        tr = cfg["training"]
        train_chats = []
        for i in range(tr["prompts"] // 32):
            train_chats += prompts.chat_prompts(PROMPT_SET, 32, random_seed=seed + 1 + i)
        train_ids = [_encode_chat(tokenizer, c) for c in train_chats]
        _log(f"target: greedy continuations of {len(train_ids)} training prompts")
        conts = greedy(target, train_ids, tr["continuation_tokens"])
        seqs = [p + c for p, c in zip(train_ids, conts, strict=True)]
        feats = features(target, seqs)
        timings["training_data_s"] = time.monotonic() - t

        t = time.monotonic()
        hcfg = head_config(cfg, target.config)
        random_head = EagleHead(hcfg).eval()
        spread_norms(random_head, cfg["head"].get("norm_weight_log_std", 0.0), gen)
        head = copy.deepcopy(random_head)
        losses = train_head(head, target, seqs, feats, cfg, gen)
        timings["head_training_s"] = time.monotonic() - t

        t = time.monotonic()
        eval_chats = prompts.chat_prompts(PROMPT_SET, eval_prompts)
        eval_ids = [_encode_chat(tokenizer, c) for c in eval_chats]
        eval_conts = greedy(target, eval_ids, eval_tokens)
        eval_seqs = [p + c for p, c in zip(eval_ids, eval_conts, strict=True)]
        eval_feats = features(target, eval_seqs)
        lens = [len(p) for p in eval_ids]
        measured = {
            "trained": simulate_acceptance(head, target, lens, eval_seqs, eval_feats, k),
            "layer_bypassed": simulate_acceptance(bypassed(head), target, lens, eval_seqs,
                                                  eval_feats, k),
            "embedding_for_feature": simulate_acceptance(head, target, lens, eval_seqs,
                                                         eval_feats, k, "embedding"),
            "random": simulate_acceptance(random_head, target, lens, eval_seqs, eval_feats, k),
        }
        ctx = context_dependence(target, tokenizer, 200, rng)
        distinct = len({tuple(c) for c in eval_conts})
        timings["measure_s"] = time.monotonic() - t

        save_head(head, hcfg, tmp / "head")
        save_head(random_head, hcfg, tmp / "random-head")
        for d in ("head", "random-head"):
            tokenizer.save_pretrained(tmp / d)
        manifest = {
            "fingerprint": fingerprint(),
            "seed": seed,
            "torch": torch.__version__,
            "spec": cfg,
            "prompt_set": PROMPT_SET,
            "simulated_acceptance": {"num_speculative_tokens": k, "prompts": eval_prompts,
                                     "max_tokens": eval_tokens, **measured},
            "context_dependence": ctx,
            "distinct_greedy_continuations": {"prompts": eval_prompts, "distinct": distinct},
            "final_training_loss": losses[-1],
            "timings": timings,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return Pair(out)


def ensure(out: Path | None = None) -> Pair:
    """The cached pair for the current fingerprint, generated if absent."""
    out = out or default_cache_dir()
    if (out / MANIFEST).is_file():
        return Pair(out)
    _log(f"generating the tiny Llama-4 pair into {out} (about 2 minutes on 2 cores)")
    return generate(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m validate.synth", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder (default: the cache)")
    ap.add_argument("--force", action="store_true", help="regenerate even if cached")
    args = ap.parse_args(argv)
    out = args.out or default_cache_dir()
    pair = generate(out) if args.force else ensure(out)
    print(json.dumps({"pair": str(pair.root), **{k: pair.manifest[k] for k in (
        "simulated_acceptance", "context_dependence", "distinct_greedy_continuations",
        "timings")}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
