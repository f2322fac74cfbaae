#!/usr/bin/env bash
# tensorfold, mlx-lm's CPU backend and llama.cpp's CPU backend on the same machine, in one go:
# prompt processing (pp) and decode (tg) tokens/s of each, and the ratios.
#
#   bash bench/compare_cpu.sh                       # qwen3.5-0.8b, pp512, tg128, 3 repetitions
#   PRESET=qwen3.5-2b bash bench/compare_cpu.sh
#   PP=512 TG=128 REPS=3 THREADS=2 bash bench/compare_cpu.sh
#   MLX_PP=32 MLX_TG=4 MLX_REPS=1              # mlx-lm's sizes (its CPU path is slow: see below)
#
# Everything third-party is downloaded and built into bench/.third_party (git-ignored; delete it
# to start over); the script is rerunnable and reuses what is there:
# - a Python venv with mlx==0.32.4, mlx-cpu==0.32.4, mlx-lm, and the GGUF converter's needs;
# - llama.cpp from the source vendored in the llama-cpp-python sdist (PyPI), built with cmake
#   from pip and the machine's g++ (llama-bench, llama-quantize), CPU only;
# - the synthetic checkpoints (`tensorfold synth`): the MLX 4-bit one for tensorfold and mlx-lm,
#   the hf/ bf16 one converted with llama.cpp's convert_hf_to_gguf.py --outtype f16 --no-mtp,
#   then llama-quantize ... Q4_0 for llama.cpp. MLX_DIR / HF_DIR use existing checkpoints.
#
# Writes bench/results/<date>-cpu-compare-<preset>.{md,json} (date, machine, commit, figures).
#
# What is compared: tensorfold and mlx-lm run the same MLX affine 4-bit (group 64, bf16 scales
# and biases) weights with float32 activations; llama.cpp runs Q4_0 (4.5 bits per weight, the
# tied embedding / LM head in Q6_K as llama-quantize chooses) and quantizes activations to 8
# bits for its matrix products. Decode is from an empty context for all three. mlx-lm's CPU
# backend takes about a minute per 4-token forward of the 0.8B model on a 2-core machine, so it
# runs a shorter prompt and fewer tokens (MLX_PP, MLX_TG); its tokens/s are per token all the
# same, and the results say which sizes each engine ran.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${COMPARE_DIR:-$ROOT/bench/.third_party}
PRESET=${PRESET:-qwen3.5-0.8b}
PP=${PP:-512}
TG=${TG:-128}
REPS=${REPS:-3}
MLX_PP=${MLX_PP:-32}
MLX_TG=${MLX_TG:-4}
MLX_REPS=${MLX_REPS:-1}
THREADS=${THREADS:-$(nproc)}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
SHARED=${TENSORFOLD_SHARED:-$ROOT/../shared}
TOKENIZER=${TOKENIZER:-$SHARED/tokenizers/qwen3.5/tokenizer.json}
mkdir -p "$WORK"
log() { echo "== $*" >&2; }

# --- tensorfold --------------------------------------------------------------------------
log "building tensorfold"
cargo build --release -q
TF=$ROOT/target/release/tensorfold

# --- models ------------------------------------------------------------------------------
MLX_DIR=${MLX_DIR:-$WORK/models/$PRESET-mlx}
HF_DIR=${HF_DIR:-$WORK/models/$PRESET-hf}
mkdir -p "$WORK/models"
if [ ! -f "$MLX_DIR/config.json" ]; then
  log "synth $PRESET (MLX 4-bit) -> $MLX_DIR"
  "$TF" synth --preset "$PRESET" "$MLX_DIR" --tokenizer "$TOKENIZER"
fi
if [ ! -f "$HF_DIR/config.json" ]; then
  log "synth $PRESET (hf bf16) -> $HF_DIR"
  "$TF" synth --preset "$PRESET" --layout hf "$HF_DIR" --tokenizer "$TOKENIZER"
fi

# --- Python: mlx-lm and the GGUF converter -----------------------------------------------
VENV=$WORK/venv
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
PY=$VENV/bin/python
if ! "$PY" -c "import mlx_lm, mlx.core, numpy, sentencepiece, transformers, torch" 2>/dev/null; then
  log "installing mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm and the converter's packages"
  "$PY" -m pip install -q --upgrade pip
  # torch: convert_hf_to_gguf.py imports it (PyPI's Linux wheel brings the CUDA libraries).
  "$PY" -m pip install -q "mlx==0.32.4" "mlx-cpu==0.32.4" mlx-lm numpy sentencepiece protobuf safetensors transformers torch
fi

# --- llama.cpp ---------------------------------------------------------------------------
LLAMA_SRC=$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp
if [ ! -f "$LLAMA_SRC/CMakeLists.txt" ]; then
  log "fetching the llama-cpp-python $LLAMA_CPP_PYTHON sdist (llama.cpp is vendored in it)"
  # (--no-binary for this package only: build dependencies stay wheels.)
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$WORK/sdist"
  tar -C "$WORK" -xzf "$WORK/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
fi
if ! "$PY" -c "import cmake" 2>/dev/null; then
  "$PY" -m pip install -q cmake
fi
CMAKE=$VENV/bin/cmake
LLAMA_BUILD=$WORK/llama-build
if [ ! -x "$LLAMA_BUILD/bin/llama-bench" ] || [ ! -x "$LLAMA_BUILD/bin/llama-quantize" ]; then
  log "building llama-bench and llama-quantize (CPU, native ISA)"
  "$CMAKE" -S "$LLAMA_SRC" -B "$LLAMA_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
  "$CMAKE" --build "$LLAMA_BUILD" --config Release -j "$(nproc)" --target llama-bench llama-quantize >/dev/null
fi
GGUF_F16=$WORK/models/$PRESET-f16.gguf
GGUF_Q4=$WORK/models/$PRESET-q4_0.gguf
if [ ! -f "$GGUF_Q4" ]; then
  if [ ! -f "$GGUF_F16" ]; then
    log "converting $HF_DIR to GGUF f16"
    "$PY" "$LLAMA_SRC/convert_hf_to_gguf.py" "$HF_DIR" --outtype f16 --no-mtp --outfile "$GGUF_F16" >/dev/null
  fi
  log "quantizing to Q4_0"
  "$LLAMA_BUILD/bin/llama-quantize" "$GGUF_F16" "$GGUF_Q4" Q4_0 >/dev/null 2>&1
fi

# --- the runs ----------------------------------------------------------------------------
OUTDIR=$WORK/runs/$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUTDIR"
log "load: $(cut -d' ' -f1-3 /proc/loadavg) (a busy machine makes every figure noise)"

log "tensorfold bench ($THREADS threads)"
"$TF" bench -m "$MLX_DIR" -p "$PP" -c 0 -n "$TG" -r "$REPS" -t "$THREADS" --json "$OUTDIR/tensorfold.json" >"$OUTDIR/tensorfold.txt"

log "llama-bench ($THREADS threads)"
"$LLAMA_BUILD/bin/llama-bench" -m "$GGUF_Q4" -p "$PP" -n "$TG" -r "$REPS" -t "$THREADS" -o json >"$OUTDIR/llama.json" 2>"$OUTDIR/llama.err"

log "mlx-lm (CPU device)"
cat >"$OUTDIR/mlx_bench.py" <<'PYEOF'
import json, statistics, sys
import mlx.core as mx
mx.set_default_device(mx.cpu)
from mlx_lm import load, stream_generate

path, pp, tg, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model, tok = load(path)
vocab = 150000
def ids(n, seed):
    s = seed * 0x9E3779B97F4A7C15 | 1
    out = []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((s >> 33) % vocab)
    return out
def run(prompt, max_tokens):
    last = None
    for r in stream_generate(model, tok, prompt=prompt, max_tokens=max_tokens):
        last = r
    return last
run(ids(4, 1), 1)  # warm-up
pps, tgs = [], []
for r in range(reps):
    pps.append(run(ids(pp, 10 + r), 1).prompt_tps)          # prompt processing
    g = run(ids(1, 20 + r), tg)                              # decode from an empty context
    tgs.append(g.generation_tps)
print(json.dumps({"pp_tps": pps, "tg_tps": tgs, "pp": pp, "tg": tg,
                  "mlx": mx.__version__, "device": str(mx.default_device())}))
PYEOF
"$PY" "$OUTDIR/mlx_bench.py" "$MLX_DIR" "$MLX_PP" "$MLX_TG" "$MLX_REPS" >"$OUTDIR/mlx.json" 2>"$OUTDIR/mlx.err"

# --- summary -----------------------------------------------------------------------------
COMMIT=$(git describe --always --dirty --abbrev=12)
DATE=$(date -u +%Y-%m-%d)
mkdir -p bench/results
BASE=bench/results/$DATE-cpu-compare-$PRESET
"$PY" - "$OUTDIR" "$BASE" "$COMMIT" "$PRESET" "$THREADS" <<'PYEOF'
import json, os, statistics, subprocess, sys, datetime
outdir, base, commit, preset, threads = sys.argv[1:6]
tf = json.load(open(f"{outdir}/tensorfold.json"))
ll = json.load(open(f"{outdir}/llama.json"))
mx = json.load(open(f"{outdir}/mlx.json"))
def phase(kind):
    return next(p for p in tf["phases"] if p["kind"] == kind)
tf_pp, tf_tg = phase("prompt"), phase("decode")
ll_pp = next(r for r in ll if r["n_prompt"] > 0 and r["n_gen"] == 0)
ll_tg = next(r for r in ll if r["n_gen"] > 0 and r["n_prompt"] == 0)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
mem = next((l.split(":", 1)[1].strip() for l in open("/proc/meminfo") if l.startswith("MemTotal")), "?")
rows = [
    ("tensorfold", tf_pp["tokens_per_second"]["median"], tf_tg["tokens_per_second"]["median"], f"MLX affine 4-bit g64, f32 activations; pp{tf_pp['tokens']}, tg{tf_tg['tokens']}"),
    ("mlx-lm (CPU)", statistics.median(mx["pp_tps"]), statistics.median(mx["tg_tps"]), f"same MLX checkpoint, mlx {mx['mlx']}, {mx['device']}; ran pp{mx['pp']}, tg{mx['tg']}, {len(mx['pp_tps'])} rep(s)"),
    ("llama.cpp (CPU)", ll_pp["avg_ts"], ll_tg["avg_ts"], f"Q4_0 GGUF from hf/ bf16, build {ll_pp.get('build_commit', '?')}, 8-bit activations in matmuls; pp{ll_pp['n_prompt']}, tg{ll_tg['n_gen']}"),
]
res = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": commit, "machine": {"cpu": cpu, "cores": os.cpu_count(), "memory": mem, "load": open("/proc/loadavg").read().split()[:3]},
    "preset": preset, "threads": int(threads), "pp_tokens": tf_pp["tokens"], "tg_tokens": tf_tg["tokens"],
    "results": [{"engine": n, "pp_tps": p, "tg_tps": t, "notes": note} for n, p, t, note in rows],
    "ratios": {"tensorfold/mlx-lm": {"pp": rows[0][1] / rows[1][1], "tg": rows[0][2] / rows[1][2]},
               "tensorfold/llama.cpp": {"pp": rows[0][1] / rows[2][1], "tg": rows[0][2] / rows[2][2]}},
    "tensorfold_bench": tf, "llama_bench": ll, "mlx_lm": mx,
}
json.dump(res, open(base + ".json", "w"), indent=2)
lines = [f"# CPU comparison: {preset}, {res['date']}", "",
         f"- machine: {cpu}, {os.cpu_count()} cores, {mem} (load at start {' '.join(res['machine']['load'])})",
         f"- tensorfold commit: {commit}; threads: {threads}",
         f"- pp{tf_pp['tokens']}: prompt processing from an empty context; tg{tf_tg['tokens']}: decode from an empty context", "",
         "| engine | pp tok/s | tg tok/s | weights / notes |", "|---|---|---|---|"]
lines += [f"| {n} | {p:.1f} | {t:.1f} | {note} |" for n, p, t, note in rows]
r = res["ratios"]
lines += ["", f"tensorfold / mlx-lm: pp {r['tensorfold/mlx-lm']['pp']:.2f}x, tg {r['tensorfold/mlx-lm']['tg']:.2f}x; "
          f"tensorfold / llama.cpp: pp {r['tensorfold/llama.cpp']['pp']:.2f}x, tg {r['tensorfold/llama.cpp']['tg']:.2f}x", "",
          "tensorfold's own figures (machine bandwidth and FMA peak measured in the same run):", "", "```",
          open(f"{outdir}/tensorfold.txt").read().rstrip(), "```", ""]
open(base + ".md", "w").write("\n".join(lines))
print("\n".join(lines[:12 + len(rows)]))
PYEOF
log "written $BASE.md and $BASE.json"
