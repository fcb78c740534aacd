"""The tiny pair must make the verdict informative (see validate/synth.py's docstring)."""

from __future__ import annotations

import json
import random

import pytest

from validate import compat, prompts

pytestmark = pytest.mark.e2e  # the generated pair: engine side, minutes to build once
torch = pytest.importorskip("torch", reason="the generator runs on the engine side (nox -s tests)")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> object:
    """These replays run in the test process beside the suite-wide engine runs (conftest.py's
    _background): torch's two threads each wait for the other at every operation while a core is
    taken, so one test took 101 s of CI's time (8 s alone on two threads, 10 s on one); on one
    thread it does not wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(pair):
    from transformers import AutoTokenizer, Llama4ForCausalLM

    model = Llama4ForCausalLM.from_pretrained(pair.target, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(pair.target)


def test_heads_are_in_the_released_format(pair) -> None:
    from safetensors import safe_open

    for head in (pair.head, pair.random_head):
        assert compat.head_problems(head) == []
        cfg = json.loads((head / "config.json").read_text())
        assert cfg["architectures"] == ["Llama4ForCausalLM"]
        assert cfg["model_type"] == "llama4_text"
        with safe_open(head / "model.safetensors", "pt") as f:
            names = set(f.keys())
        assert "model.fc.weight" in names and "model.norm.weight" in names
        assert any(n.startswith("model.layers.0.self_attn.") for n in names)
        assert not any("embed_tokens" in n or "lm_head" in n for n in names), "shared from target"


def test_every_size_shards_at_tp8(pair) -> None:
    assert compat.tp_problems(pair.target, 8) == []
    cfg = json.loads((pair.target / "config.json").read_text())
    assert cfg["moe_layers"] and len(cfg["moe_layers"]) < cfg["num_hidden_layers"], "interleaved"
    assert 0 in cfg["no_rope_layers"] and 1 in cfg["no_rope_layers"], "NoPE and RoPE layers"
    assert cfg["attention_chunk_size"]


def test_greedy_next_token_depends_on_context_not_only_the_last_token(target) -> None:
    from validate.synth import context_dependence

    model, tok = target
    ctx = context_dependence(model, tok, 60, random.Random(7))
    assert ctx["ratio"] >= 0.5, f"only {ctx['next_token_differs']}/60 pairs differ: {ctx}"


def test_chat_template_renders_llama4_turns(target) -> None:
    _, tok = target
    chat = prompts.chat_prompts("seed", 1)[0]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|begin_of_text|><|header_start|>user<|header_end|>")
    assert text.endswith("<|header_start|>assistant<|header_end|>\n\n")


def test_head_predicts_and_its_layer_matters(pair, target) -> None:
    """Acceptance >= 2.0 with 3 tokens, and bypassing the decoder layer costs acceptance."""
    from validate import synth

    model, tok = target
    hcfg = synth.head_config(synth.spec(), model.config)
    head = synth.EagleHead(hcfg)
    from safetensors.torch import load_file

    sd = {k.removeprefix("model."): v.float() for k, v in load_file(pair.head / "model.safetensors").items()}
    head.fc.weight.data.copy_(sd.pop("fc.weight"))
    missing = head.body.load_state_dict(sd, strict=False)
    assert not missing.unexpected_keys
    assert [k for k in missing.missing_keys if "embed_tokens" not in k] == []
    head.eval()
    chats = prompts.chat_prompts(synth.PROMPT_SET, 24)
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
           for c in chats]
    seqs = [p + c for p, c in zip(ids, synth.greedy(model, ids, 32), strict=True)]
    feats = synth.features(model, seqs)
    lens = [len(p) for p in ids]
    trained = synth.simulate_acceptance(head, model, lens, seqs, feats, 3)
    bypass = synth.simulate_acceptance(synth.bypassed(head), model, lens, seqs, feats, 3)
    assert trained["mean_acceptance_length"] >= 2.0, trained
    assert trained["mean_acceptance_length"] - bypass["mean_acceptance_length"] >= 0.3, (
        f"the head's layer adds too little: trained {trained}, layer bypassed {bypass}")


def test_the_host_finds_the_pair_without_torch(pair) -> None:
    """Runs look the pair up on the host side (``launch.cached_pair``) instead of asking the
    generator in a process of its own; both must name this folder, or every run regenerates it."""
    from validate import launch, synth

    assert launch.cached_pair() == synth.default_cache_dir() == pair.root, (
        "launch.cached_pair() must hash what synth.fingerprint() hashes")
