"""Make tests/data/moe: a small random Qwen3.5 mixture-of-experts checkpoint with reference outputs.

The approach of ../shared/tools/make_fixtures.py (whose helpers this imports): transformers builds and
randomises the model, the bf16 weights are saved as Qwen releases them (hf/), mlx-lm's own converter
makes the 4-bit layout (mlx-q4/: experts stacked as switch_mlp, the router and the shared-expert gate at
8 bits by mlx-lm's quant predicate), mlx-lm gives the greedy continuation and the mlx_full logits (float32
compute), transformers the hf_full logits (bf16 weights upcast, float32 compute, eager experts), and
../shared/tools/float64_reference.py a float64 forward of each layout (hf_f64, mlx_f64).

Usage: python3 tools/make_moe_fixture.py SHARED_DIR OUT_DIR      (e.g. ../shared tests/data/moe)
Needs: pip install mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 torch transformers
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

SHARED, OUT = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(SHARED / "tools"))
import make_fixtures as mf  # noqa: E402  (randomize, mlx_logits, mlx_greedy, special_base, CHAT_TEMPLATE)

# 4 layers (3 Gated DeltaNet + 1 gated attention), every MLP sparse: 8 experts, top-2, a shared expert.
# transformers' qwen3_5_moe has no dense layers (no mlp_only_layers / decoder_sparse_step).
C = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
         linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
         intermediate_size=0, vocab_size=2048, tie_word_embeddings=True, seed=16, prompt_len=12, gen=36)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128)


def text_config():
    tc = mf.text_config(C)
    tc.pop("intermediate_size")
    tc.update(MOE, model_type="qwen3_5_moe_text", router_aux_loss_coef=0.001)
    return tc


def randomize(model, seed):
    mf.randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 500)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # the fused 3-D experts [E, out, in]: scale by the input width, as make_fixtures does for 2-D weights
            if name.endswith("experts.gate_up_proj"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[2] ** 0.5)
            elif name.endswith("experts.down_proj"):
                p.copy_(mf.OUT_GAIN * torch.randn(p.shape, generator=g) / p.shape[2] ** 0.5)
            elif name.endswith("mlp.gate.weight"):  # router logits spread ~2 so the top-k choice is clear-cut
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def save_hf(model, out, tok_dir):
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        k = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        keep_f32 = k.endswith(("A_log", "linear_attn.norm.weight"))
        sd[k] = (v.float() if keep_f32 else v.to(torch.bfloat16)).contiguous()
    g = torch.Generator().manual_seed(C["seed"] + 1000)
    sd["model.visual.merger.norm.weight"] = torch.ones(32).to(torch.bfloat16)
    sd["mtp.fc.weight"] = torch.randn(C["hidden_size"], 2 * C["hidden_size"], generator=g).to(torch.bfloat16)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    sb = mf.special_base(C)
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text_config(), "tie_word_embeddings": True,
           "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 32, "out_hidden_size": C["hidden_size"]},
           "image_token_id": sb + 12, "video_token_id": sb + 13}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(tok_dir / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "model_max_length": 262144, "chat_template": mf.CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [sb + 2, sb], "do_sample": False}, indent=2))


def build(seed, tok_dir):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from mlx_lm.convert import convert
    if OUT.exists():
        shutil.rmtree(OUT)
    tc = text_config()
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in tc.items() if k not in ("model_type", "dtype")})
    cfg._experts_implementation = "eager"  # the plain per-expert loop of the modelling file
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    randomize(model, seed)
    model = model.to(torch.bfloat16).float()
    save_hf(model, OUT / "hf", tok_dir)
    convert(str(OUT / "hf"), str(OUT / "mlx-q4"), quantize=True, q_group_size=64, q_bits=4)
    return model


def main():
    from safetensors.numpy import save_file
    tok_dir = SHARED / "tokenizers" / "qwen3.5-v2048"
    for seed in range(C["seed"], C["seed"] + 100):
        model = build(seed, tok_dir)
        rng = np.random.default_rng(seed)
        prompt = [int(x) for x in rng.integers(0, mf.special_base(C), C["prompt_len"])]
        gen = mf.mlx_greedy(OUT / "mlx-q4", prompt, C["gen"], f32=True)
        ids = prompt + gen
        full, step = mf.mlx_logits(OUT / "mlx-q4", ids, f32=True)
        top = np.sort(step, axis=-1)
        gaps = top[:, -1] - top[:, -2]
        if gaps[len(prompt) - 1:-1].min() >= mf.MIN_GAP and len(set(gen)) > len(gen) // 2:
            break
    with torch.no_grad():
        hf_full = model(torch.tensor([ids])).logits[0].float().numpy()
    assert np.array_equal(full, step), "mlx-lm's one-pass and stepwise logits differ"
    arrays = {"ids": np.array(ids, dtype=np.int32), "positions": np.arange(len(ids), dtype=np.int32),
              "mlx_full": full.astype(np.float32), "hf_full": hf_full.astype(np.float32)}
    # mlx-lm's 8-bit conversion (group 64) is not shipped, only its float32 logits (mlx_q8_full): a test
    # converts hf/ at 8 bits with tensorfold's converter, which writes the same bytes as mlx_lm.convert.
    from mlx_lm.convert import convert
    q8 = OUT / "mlx-q8"
    convert(str(OUT / "hf"), str(q8), quantize=True, q_group_size=64, q_bits=8)
    q8_full, q8_step = mf.mlx_logits(q8, ids, f32=True)
    assert np.array_equal(q8_full, q8_step), "mlx-lm's one-pass and stepwise 8-bit logits differ"
    arrays["mlx_q8_full"] = q8_full.astype(np.float32)
    if "KEEP_Q8" not in __import__("os").environ:
        shutil.rmtree(q8)
    save_file(arrays, str(OUT / "reference.safetensors"))
    # transformers' float32 chunked Gated DeltaNet drifts (fixtures README): a float64 forward of each layout
    # tells an engine's error from a reference's, so it ships too (hf_f64, mlx_f64, rounded to f32).
    f64 = {}
    for key, layout in (("hf_full", "hf"), ("mlx_full", "mlx-q4")):
        npy = OUT / f"{layout}-f64.npy"
        r = subprocess.run([sys.executable, str(SHARED / "tools" / "float64_reference.py"), str(OUT / layout),
                            str(OUT / "reference.safetensors"), str(npy), key], check=True, capture_output=True, text=True)
        f64[key] = r.stdout.strip()
        arrays[key.replace("_full", "_f64")] = np.load(npy).astype(np.float32)
        npy.unlink()
    save_file(arrays, str(OUT / "reference.safetensors"))
    meta = {"fixture": "moe", "seed": seed, "prompt_len": len(prompt), "generated": C["gen"], **MOE,
            "made_with": {"mlx": __import__("mlx.core").core.__version__, "mlx_lm": __import__("mlx_lm").__version__,
                          "transformers": __import__("transformers").__version__, "torch": torch.__version__},
            "logit_std": float(full.std()), "hf_logit_std": float(hf_full.std()),
            "min_top2_gap_on_greedy_steps": float(gaps[len(prompt) - 1:-1].min()), "distinct_generated": len(set(gen)),
            "float64_reference": f64}
    (OUT / "reference.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
