"""The FP8 target (profile tiny-fp8): Maverick's code paths and checkpoint format, in miniature."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from validate import quantize, synth  # noqa: E402

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
    out, quantized, _ = quantize.quantize_state(state, quantize.spec())
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
    _, _, kept = quantize.quantize_state(_state(), quantize.spec())
    qc = quantize.quantization_config(quantize.spec(), kept)
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


PROBE = """
import sys
from vllm import LLM
if __name__ == "__main__":
    LLM(model=sys.argv[1], max_model_len=256, enforce_eager=True, dtype="bfloat16")
"""


@pytest.mark.e2e
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
def test_tiny_fp8_on_cpu_is_refused_in_one_line_with_exit_3(pair, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "validate", "rehearse", "--profile", "tiny-fp8",
                        "--run-dir", str(run)], capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 3, (r.returncode, (r.stdout + r.stderr)[-3000:])
    rec = json.loads((run / "record.json").read_text())
    said = json.dumps(rec)
    assert "no kernel for Maverick's FP8 experts" in said and "runs on a GPU" in said, said[-2000:]
    assert not rec["phases"].get("reference_engine_start"), "refused before any engine started"
