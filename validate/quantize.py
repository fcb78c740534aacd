"""The tiny pair's FP8 targets: the generated BF16 target in the released Maverick-FP8 format.

Engine side (torch, safetensors, compressed-tensors; never vLLM). Why: the real run is Maverick
**FP8** beside a BF16 EAGLE head, and the code only a quantized target exercises (FP8 MoE kernels,
loading a BF16 draft beside an FP8 target, the draft's own quantization config) never runs on a
BF16 pair. ``data/fp8_target.toml`` says which modules are quantized and why (its sources), per variant:
Maverick's own set (routed experts FP8) and the same with attention FP8 too, the only form in which
the q/k scale permutation of vLLM's Llama-4 loader runs.

The quantization itself is written here because it is four lines of arithmetic per tensor
(channel-wise absmax scales, a cast to ``float8_e4m3fn``) on a checkpoint that already exists;
llm-compressor would load the model, calibrate and save it again, for the same numbers. The
``quantization_config`` is built from the compressed-tensors package's own preset and models, so
the format is that library's, not a hand-written imitation.

Each FP8 target is written beside the pair's BF16 target (``<pair>/<variant>``), so it shares the
pair's manifest (its revision is the pair's fingerprint) and a golden pins its own weights' hash.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from validate.files import staged_folder
from validate.profiles import GENERATED, GENERATED_FP8

FOLDER = GENERATED_FP8.removeprefix(GENERATED)  # the default variant: Maverick's set
# The largest finite float8_e4m3fn value: a channel's absmax maps onto it.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def spec() -> dict[str, Any]:
    return tomllib.loads(resources.files("validate.data").joinpath("fp8_target.toml").read_text())


def quantization_config(cfg: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    """The checkpoint's ``quantization_config``, from the compressed-tensors preset; ``ignore``:
    the modules that stay BF16, by name."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(cfg["scheme"], list(cfg["targets"]))
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                            ignore=sorted(ignore), quantization_status="compressed")
    return json.loads(json.dumps(qc.model_dump(), default=str)) | {
        "quant_method": "compressed-tensors"}


def variant(folder: str) -> dict[str, Any]:
    """One variant's settings (the shared scheme and targets, its own ``keep_bf16``)."""
    cfg = spec()
    variants = cfg.pop("variants")
    if folder not in variants:
        raise ValueError(f"no FP8 variant {folder!r} in validate/data/fp8_target.toml; "
                         f"its variants: {', '.join(sorted(variants))}")
    return cfg | variants[folder]


def stays_bf16(module: str, cfg: dict[str, Any]) -> bool:
    return any(re.fullmatch(p, module) for p in cfg["keep_bf16"])


def fp8_channelwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, BF16 scale of shape [out, 1]) with weight ~= fp8 * scale per output row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    scale = scale.to(torch.bfloat16)  # stored as the checkpoint stores it; quantize with it
    q = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def linear_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint as nn.Linear weights: transformers saves Llama-4's routed experts fused
    (``experts.gate_up_proj`` [E, hidden, 2 x inter], ``experts.down_proj`` [E, inter, hidden]);
    the FP8 checkpoint stores one expert at a time (``experts.N.gate_proj.weight`` [inter, hidden])."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[-1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :, :inter].T.contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, :, inter:].T.contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].T.contiguous()
        else:
            out[name] = t
    return out


def quantize_state(state: dict[str, torch.Tensor], cfg: dict[str, Any]
                   ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(the FP8 checkpoint's tensors, the linear modules quantized, those kept BF16)."""
    out: dict[str, torch.Tensor] = {}
    quantized, kept = [], []
    for name, t in linear_weights(state).items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and t.ndim == 2 and "embed_tokens" not in module
        if linear and not stays_bf16(module, cfg):
            out[name], out[f"{module}.weight_scale"] = fp8_channelwise(t)
            quantized.append(module)
        else:
            out[name] = t
            kept += [module] if linear else []
    return out, quantized, kept


def write(bf16_target: Path, out: Path, folder: str = FOLDER) -> dict[str, Any]:
    """Writes variant ``folder`` of the FP8 target into ``out`` (whole or not at all) and returns
    its report."""
    from safetensors.torch import load_file, save_file

    cfg = variant(folder)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(bf16_target.glob("*.safetensors")):
        state.update(load_file(f))
    tensors, quantized, kept = quantize_state(state, cfg)
    if not quantized:
        raise ValueError(f"no module of {bf16_target} is quantized by data/fp8_target.toml")
    with staged_folder(out) as tmp:
        for f in bf16_target.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        config = json.loads((bf16_target / "config.json").read_text())
        config["quantization_config"] = quantization_config(cfg, kept)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        report = {"variant": folder, "quantized_modules": len(quantized),
                  "example": quantized[0],
                  "bf16_modules": len(kept), "scheme": cfg["scheme"],
                  "keep_bf16": cfg["keep_bf16"]}
        (tmp / "quantization.json").write_text(json.dumps(report, indent=2))
    return report


def ensure(pair_root: Path, folder: str = FOLDER) -> Path:
    """The pair's FP8 target (variant ``folder``), written from its BF16 target if absent."""
    cfg = variant(folder)  # an unknown variant is refused before anything is written
    out = pair_root / folder
    if not (out / "quantization.json").is_file():
        print(f"[quantize] writing the FP8 target {folder} into {out} (BF16: "
              f"{', '.join(cfg['keep_bf16'])})", file=sys.stderr, flush=True)  # stdout: the JSON
        write(pair_root / "target", out, folder)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from validate import synth

    ap = argparse.ArgumentParser(prog="python -m validate.quantize",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--pair", type=Path, default=None, help="the tiny pair (default: the cache)")
    ap.add_argument("--variant", default=FOLDER, choices=sorted(spec()["variants"]),
                    help="which FP8 target (data/fp8_target.toml)")
    args = ap.parse_args(argv)
    out = ensure(synth.ensure(args.pair).root, args.variant)
    print(json.dumps({"pair": str(out.parent), "fp8_target": str(out),
                      **json.loads((out / "quantization.json").read_text())}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
