"""The FP8 targets (profiles tiny-fp8, tiny-fp8-attn): Maverick's code paths and checkpoint format,
in miniature, and the quantized paths their breakages need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from validate import profiles, quantize, sensitivity, synth  # noqa: E402
from validate.contract import BadInput  # noqa: E402

MAVERICK = json.loads((Path(__file__).parent / "data" / "maverick-text-config.json").read_text())


def _tiny_target_config() -> dict:
    ids = SimpleNamespace(bos_token_id=0, eos_token_id=4, pad_token_id=5)
    return synth.target_config(synth.spec(), ids).to_dict()


def test_tiny_target_takes_every_code_path_maverick_takes() -> None:
    tiny = _tiny_target_config()
    same = ["interleave_moe_layer_step", "num_experts_per_tok", "use_qk_norm",
            "tie_word_embeddings", "hidden_act"]
    wrong = {k: (tiny.get(k), MAVERICK[k]) for k in same if tiny.get(k) != MAVERICK[k]}
    assert not wrong, f"the tiny target leaves Maverick's code path at (tiny, Maverick): {wrong}"
    assert bool(tiny["attn_temperature_tuning"]) == MAVERICK["attn_temperature_tuning"]
    assert tiny["attention_chunk_size"], "chunked local attention (Maverick: 8192)"
    assert tiny["num_local_experts"] > 1, "routed experts"
    assert tiny["intermediate_size"] != tiny["intermediate_size_mlp"], \
        "experts and dense layers of different widths, as Maverick's (8192 vs 16384)"
    period = MAVERICK["no_rope_layers_period"]
    assert tiny["no_rope_layers"] == period * (len(tiny["no_rope_layers"]) // len(period)), \
        "every fourth layer NoPE (global attention), as Maverick's"
    rope = tiny.get("rope_parameters") or {}
    assert MAVERICK["rope_scaling"] is None and rope.get("rope_type") in (None, "default"), \
        f"Maverick has no RoPE scaling; the tiny target has {rope}"
    moe = [i for i in range(tiny["num_hidden_layers"])
           if (i + 1) % tiny["interleave_moe_layer_step"] == 0]
    assert moe and len(moe) < tiny["num_hidden_layers"], "MoE layers interleaved with dense ones"


def _state(e: int = 2, h: int = 64, inter: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return {
        "model.embed_tokens.weight": r(16, h), "lm_head.weight": r(16, h),
        "model.norm.weight": r(h),
        "model.layers.0.self_attn.q_proj.weight": r(h, h),
        "model.layers.0.feed_forward.gate_proj.weight": r(2 * inter, h),
        "model.layers.0.feed_forward.down_proj.weight": r(h, 2 * inter),
        "model.layers.1.feed_forward.router.weight": r(e, h),
        "model.layers.1.feed_forward.shared_expert.up_proj.weight": r(inter, h),
        "model.layers.1.feed_forward.experts.gate_up_proj": r(e, h, 2 * inter),
        "model.layers.1.feed_forward.experts.down_proj": r(e, inter, h),
    }


def test_only_the_routed_experts_are_fp8_one_expert_at_a_time() -> None:
    state = _state()
    out, quantized, _ = quantize.quantize_state(state, quantize.variant("target-fp8"))
    assert sorted(quantized) == sorted(
        f"model.layers.1.feed_forward.experts.{e}.{p}" for e in range(2)
        for p in ("gate_proj", "up_proj", "down_proj")), quantized
    for name, t in out.items():
        fp8 = t.dtype == torch.float8_e4m3fn
        assert fp8 == (".experts." in name and name.endswith(".weight")), \
            f"{name} is {t.dtype}: Maverick-FP8 quantizes the routed experts only"
    scale = out["model.layers.1.feed_forward.experts.1.gate_proj.weight_scale"]
    assert scale.shape == (32, 1) and scale.dtype == torch.bfloat16, "per output channel"
    # Dequantized, each expert is the BF16 expert it came from (FP8 E4M3: 3 mantissa bits).
    gate = state["model.layers.1.feed_forward.experts.gate_up_proj"][1, :, :32].T.float()
    w = out["model.layers.1.feed_forward.experts.1.gate_proj.weight"].float() * scale.float()
    rel = ((w - gate).norm() / gate.norm()).item()
    assert rel < 0.05, f"dequantized expert 1 differs from the BF16 one by {rel:.3f} (relative)"
    down = state["model.layers.1.feed_forward.experts.down_proj"][0].T.float()
    w = (out["model.layers.1.feed_forward.experts.0.down_proj.weight"].float()
         * out["model.layers.1.feed_forward.experts.0.down_proj.weight_scale"].float())
    assert ((w - down).norm() / down.norm()).item() < 0.05, "down_proj is [hidden, inter] per expert"


def test_the_config_is_compressed_tensors_fp8_dynamic_naming_each_bf16_module() -> None:
    cfg = quantize.variant("target-fp8")
    _, _, kept = quantize.quantize_state(_state(), cfg)
    qc = quantize.quantization_config(cfg, kept)
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["strategy"], group["weights"]["num_bits"], group["weights"]["type"]) \
        == ("channel", 8, "float")
    assert group["input_activations"]["dynamic"] and \
        group["input_activations"]["strategy"] == "token"
    # By name, so that a head's layers (numbered after the target's) are on no list.
    assert qc["ignore"] == sorted([
        "lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.feed_forward.gate_proj",
        "model.layers.0.feed_forward.down_proj", "model.layers.1.feed_forward.router",
        "model.layers.1.feed_forward.shared_expert.up_proj"]), qc["ignore"]


def test_the_attention_variant_differs_from_mavericks_set_by_attention_alone() -> None:
    base, with_attn = (quantize.quantize_state(_state(), quantize.variant(v))[1]
                       for v in ("target-fp8", "target-fp8-attn"))
    assert sorted(set(with_attn) - set(base)) == ["model.layers.0.self_attn.q_proj"], with_attn
    assert set(base) <= set(with_attn), "every module Maverick's set quantizes stays FP8"
    with pytest.raises(ValueError, match=r"no FP8 variant 'target-fp8-x'.*target-fp8-attn"):
        quantize.variant("target-fp8-x")


def _vllm_permuted(name: str, w: torch.Tensor, config: SimpleNamespace) -> torch.Tensor:
    """vLLM's own q/k permutation for rotary (Llama4ForCausalLM.permute_qk_weight_for_rotary),
    as it loads one checkpoint tensor."""
    llama4 = pytest.importorskip("vllm.model_executor.models.llama4")
    fn = llama4.Llama4ForCausalLM.permute_qk_weight_for_rotary
    return fn(SimpleNamespace(config=config), name, w)[1]


@pytest.mark.e2e
def test_unpermuted_qk_scales_change_the_tiny_targets_queries(pair) -> None:
    """Why fp8-qk-scales-not-permuted can FAIL on tiny-fp8-attn: on this pair's own q_proj, vLLM's
    loader keeps weight and scale rows together (dequantized, the permuted BF16 weight within FP8's
    error), and scales left in checkpoint order put other rows' scales on them, far off."""
    from safetensors.torch import load_file

    target = quantize.ensure(pair.root, "target-fp8-attn")
    config = SimpleNamespace(**json.loads((target / "config.json").read_text()))
    state = load_file(target / "model.safetensors")
    name = next(k for k in state if k.endswith("self_attn.q_proj.weight"))
    w, s = state[name], state[name.replace(".weight", ".weight_scale")]
    assert w.dtype == torch.float8_e4m3fn and s.shape == (w.shape[0], 1), (w.dtype, s.shape)
    bf16 = load_file(pair.root / "target" / "model.safetensors")[name].float()
    truth = _vllm_permuted(name, bf16, config)
    w_p = _vllm_permuted(name, w.float(), config)
    right = w_p * _vllm_permuted(name.replace(".weight", ".weight_scale"), s.float(), config)
    wrong = w_p * s.float()
    err = ((right - truth).norm() / truth.norm()).item()
    bad = ((wrong - truth).norm() / truth.norm()).item()
    print(f"q_proj dequantized after vLLM's permutation: {err:.4f} relative error with its "
          f"scales permuted too, {bad:.4f} with them left in checkpoint order")
    assert err < 0.05 and bad > 4 * err, (err, bad)


def test_quantized_path_breakages_run_only_where_their_code_runs() -> None:
    def names(profile: str) -> set[str]:
        return {b.name for b in sensitivity.chosen(None, "full",
                                                   profiles.get(profile).quantized_modules)
                if b.quantized}

    assert names("tiny") == set()
    assert names("tiny-fp8") == {"draft-target-quant-config", "fp8-moe-shard-scales-swapped"}
    assert names("tiny-fp8-attn") == names("tiny-fp8") | {"fp8-qk-scales-not-permuted"}
    assert "attention" not in profiles.get("maverick-tp8").quantized_modules, \
        "Maverick-FP8 leaves attention BF16: the q/k scale breakage would be dead code there"
    with pytest.raises(BadInput, match=r"attention quantized.*has experts quantized.*tiny-fp8-attn"):
        sensitivity.chosen(["fp8-qk-scales-not-permuted"], "full",
                           profiles.get("tiny-fp8").quantized_modules)


PROBE = """
import sys
from vllm import LLM
if __name__ == "__main__":
    LLM(model=sys.argv[1], max_model_len=256, enforce_eager=True, dtype="bfloat16")
"""


@pytest.mark.e2e
@pytest.mark.full  # CI runs the refusal below; this probe of vLLM itself (30 s) runs nightly
def test_vllms_cpu_build_still_cannot_run_maverick_fp8(pair, tmp_path: Path) -> None:
    """The reason tiny-fp8 is GPU-only, tried for real: the day vLLM's CPU build runs this format
    this fails, and the profile should run on CPU too (profiles.toml's device_note says why not)."""
    target = quantize.ensure(pair.root)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    r = subprocess.run([sys.executable, str(script), str(target)], capture_output=True, text=True,
                       timeout=600, check=False, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Unsupported FP8 MoE backend" in out, out[-3000:]


@pytest.mark.e2e
@pytest.mark.parametrize("profile", ["tiny-fp8", pytest.param("tiny-fp8-attn", marks=pytest.mark.full)])
def test_tiny_fp8_on_cpu_is_refused_in_one_line_with_exit_3(pair, tmp_path: Path,
                                                           profile: str) -> None:
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "validate", "rehearse", "--profile", profile,
                        "--run-dir", str(run)], capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 3, (r.returncode, (r.stdout + r.stderr)[-3000:])
    rec = json.loads((run / "record.json").read_text())
    said = json.dumps(rec)
    assert "no kernel for Maverick's FP8 experts" in said and "runs on a GPU" in said, said[-2000:]
    assert not rec["phases"].get("reference_engine_start"), "refused before any engine started"
