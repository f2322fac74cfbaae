"""Make tests/data/quant/: the tiny fixture re-quantized by mlx-lm's own converter in the MLX affine
variants the shared fixtures lack, each with mlx-lm's float32 reference logits and greedy ids.

How the committed data was made (needs network and pip, once):
    python3 -m venv /tmp/mlxvenv
    /tmp/mlxvenv/bin/pip install mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 numpy safetensors
    /tmp/mlxvenv/bin/python tools/make_quant_variants.py ../shared/fixtures/tiny tests/data/quant
with mlx 0.32.4 (CPU backend), mlx-lm 0.32.2, numpy and safetensors as pip resolved them (recorded in
each variant's reference.json).

Variants (source: the bf16 checkpoint FIXTURE/hf, converted with mlx_lm.convert):
    q8-g64   bits 8, group_size 64 everywhere
    q4-g32   bits 4, group_size 32 everywhere
    q4-g128  bits 4, group_size 128 everywhere
    mixed    default bits 4, group_size 64; through mlx-lm's quant_predicate, every mlp.down_proj at
             bits 8 group_size 32 and the attention layer's self_attn.o_proj at bits 8 group_size 128,
             so config.json's `quantization` block carries per-module entries as mlx-lm writes them
             (the embedding, used as the tied LM head, keeps the default).

Each OUT/<variant>/ holds config.json, model.safetensors (+ index) as mlx-lm wrote them, the fixture's
tokenizer.json and tokenizer_config.json, and reference.safetensors:
    ids       [48] int32        the fixture's 12-id prompt, then mlx-lm's greedy continuation (36 ids)
                                on THIS variant, f32 compute (weights upcast to float32 as make_fixtures.py does)
    positions [48] int32        0..48: every row is kept
    mlx_full  [48, 2048] f32    mlx-lm logits of `ids` in one forward pass, f32 compute (asserted
                                bit-equal to its token-by-token pass through the cache)
and reference.json (versions, the smallest top-1/top-2 gap on the greedy steps, the override keys).
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

PROMPT_LEN, GEN = 12, 36


def mixed_predicate(path, module):
    if path.endswith("mlp.down_proj"):
        return {"group_size": 32, "bits": 8}
    if path.endswith("self_attn.o_proj"):
        return {"group_size": 128, "bits": 8}
    return True


VARIANTS = {
    "q8-g64": dict(q_bits=8, q_group_size=64),
    "q4-g32": dict(q_bits=4, q_group_size=32),
    "q4-g128": dict(q_bits=4, q_group_size=128),
    "mixed": dict(q_bits=4, q_group_size=64, quant_predicate=mixed_predicate),
}


def load_f32(mlx_dir):
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load

    model, _ = load(str(mlx_dir))
    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))
    return model


def greedy(model, prompt, n):
    import mlx.core as mx

    cache = model.make_cache()
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits))
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


def logits(model, ids):
    import mlx.core as mx

    full = model(mx.array(ids)[None])[0].astype(mx.float32)
    cache = model.make_cache()
    steps = [model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32) for t in ids]
    return np.array(full), np.array(mx.stack(steps))


def make(name, kw, hf, fixture, out_root, work):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.convert import convert
    from safetensors.numpy import load_file, save_file

    conv = work / name
    convert(str(hf), str(conv), quantize=True, **kw)
    cfg = json.loads((conv / "config.json").read_text())
    overrides = sorted(k for k, v in cfg["quantization"].items() if isinstance(v, dict))
    if name == "mixed":
        assert overrides, "mixed: mlx-lm wrote no per-module entries"
    prompt = [int(x) for x in load_file(str(fixture / "reference.safetensors"))["ids"][:PROMPT_LEN]]
    model = load_f32(conv)
    ids = prompt + greedy(model, prompt, GEN)
    full, step = logits(model, ids)
    assert np.array_equal(full, step), f"{name}: mlx-lm's one-pass and stepwise logits differ"
    top = np.sort(full, axis=-1)
    gaps = (top[:, -1] - top[:, -2])[PROMPT_LEN - 1:-1]

    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in ["config.json", "model.safetensors", "model.safetensors.index.json"]:
        if (conv / f).exists():
            shutil.copy(conv / f, out / f)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(hf / f, out / f)
    save_file({"ids": np.array(ids, dtype=np.int32), "positions": np.arange(len(ids), dtype=np.int32),
               "mlx_full": full.astype(np.float32)}, str(out / "reference.safetensors"))
    meta = {
        "variant": name, "source": f"../shared/fixtures/{fixture.name}/hf",
        "convert": {k: (v.__name__ if callable(v) else v) for k, v in kw.items()},
        "per_module_overrides": {k: cfg["quantization"][k] for k in overrides},
        "made_with": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "numpy": np.__version__},
        "prompt_len": PROMPT_LEN, "generated": GEN,
        "logit_std": float(full.std()),
        "min_top2_gap_on_greedy_steps": float(gaps.min()),
        "same_greedy_as_fixture_q4_g64": ids == [int(x) for x in load_file(str(fixture / "reference.safetensors"))["ids"]],
        "mlx_step_equals_mlx_full": True,
    }
    (out / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta))


def main():
    fixture, out_root = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    names = sys.argv[3:] or list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf = work / "hf"  # the fixture is read-only; mlx-lm reads it from a private copy
        shutil.copytree(fixture / "hf", hf)
        for n in names:
            make(n, VARIANTS[n], hf, fixture, out_root, work)


if __name__ == "__main__":
    main()
