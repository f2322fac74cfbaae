#!/usr/bin/env bash
# tensorfold beside llama.cpp on the GPU machine (the `device` tool), in one call: llama.cpp's
# CUDA build runs in the background while tensorfold's own figures are taken, then llama.cpp
# runs the same synthetic checkpoint (converted to GGUF, quantized to Q4_0) through
# llama-bench (prompt processing, batch-1 decode) and llama-batched-bench (many sequences
# decoding together, the batched runtime's comparison).
#
# SERVE=1 adds the servers: tensorfold serve (bench/load.sh: the bar against its own bench, then
# guidellm) while llama.cpp builds, then llama.cpp's llama-server on the same GGUF under the same
# guidellm scenario. PRODUCTS (default "int f32") lists the product forms tensorfold's figures
# are taken in; the first one serves. WHILE_BUILDING: a command run on the GPU after tensorfold's
# figures, while llama.cpp is still building.
#
# Carried folder $D (default .device): tensorfold.xz (release build), shared.tar.xz (the
# tokenizer at least), llama.tar.xz (llama.cpp's source: the tree vendored in the
# llama-cpp-python sdist, `bench/device-compare.sh pack` makes it here), commit (the commit
# built), cache.tar.xz (optional: kernels compiled ahead, as bench/device-serve.sh says); with
# SERVE=1 also .whl/ (bench/serve-wheels.sh). Writes $OUT/summary.txt and the logs.
#
#   bash bench/device-compare.sh pack     # here: $D/llama.tar.xz from the PyPI sdist
#   bash bench/device-compare.sh          # there: all of it, synthetic 2b
#   SERVE=1 bash bench/device-compare.sh  # ... and both servers under guidellm
#   PRESET=0.8b LEVELS=1,8 bash bench/device-compare.sh
#   PRESET=35b-a3b LAYERS=8 bash bench/device-compare.sh   # fewer layers at the real widths
set -uo pipefail
D=${D:-.device}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}

if [ "${1:-}" = pack ]; then
  set -e
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp"
  tar -C "$tmp" -xzf "$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
  src="$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
  # What the build and the converter need; tests, docs, other back ends and examples stay behind.
  tar -C "$src" -cJf "$D/llama.tar.xz" --exclude='./ggml/src/ggml-vulkan' --exclude='./ggml/src/ggml-sycl' --exclude='./ggml/src/ggml-metal' \
    --exclude='./ggml/src/ggml-hexagon' --exclude='./ggml/src/ggml-et' --exclude='./ggml/src/ggml-cann' --exclude='./ggml/src/ggml-musa' \
    --exclude='./ggml/src/ggml-opencl' --exclude='./docs' --exclude='./media' --exclude='./models' --exclude='./tests' --exclude='./benches' \
    --exclude='./examples' .
  rm -rf "$tmp"
  ls -la "$D/llama.tar.xz"
  exit 0
fi

OUT=${OUT:-/tmp/out}
PRESET=${PRESET:-2b}
LEVELS=${LEVELS:-1,8,32,64}
PRODUCTS=${PRODUCTS:-int f32}
SERVE=${SERVE:-0}
mkdir -p "$OUT" /tmp/tf/models /tmp/tf/cache /tmp/llama
xz -dc $D/tensorfold.xz > /tmp/tf/tensorfold && chmod +x /tmp/tf/tensorfold
tar -C /tmp/tf -xJf $D/shared.tar.xz
[ -f $D/cache.tar.xz ] && tar -C /tmp/tf/cache -xJf $D/cache.tar.xz
if [ "$SERVE" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
TF=/tmp/tf/tensorfold
export TENSORFOLD_SHARED=/tmp/tf/shared TENSORFOLD_CACHE=/tmp/tf/cache
S=$OUT/summary.txt
t0=$(date +%s)
log() { echo "== $* ($(( $(date +%s) - t0 )) s)" | tee -a "$S"; }
log "$(date -u +%FT%TZ) commit $(cat $D/commit 2>/dev/null) preset $PRESET${LAYERS:+, $LAYERS layers}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$S"

# llama.cpp: CUDA back end for this GPU only, the three tools wanted.
tar -C /tmp/llama -xJf $D/llama.tar.xz
( cmake -S /tmp/llama -B /tmp/llama/build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=$([ "$SERVE" = 1 ] && echo ON || echo OFF) > "$OUT/llama-build.log" 2>&1 &&
  cmake --build /tmp/llama/build -j "$(( $(nproc) - 2 ))" --target llama-bench llama-batched-bench llama-quantize $([ "$SERVE" = 1 ] && echo llama-server) >> "$OUT/llama-build.log" 2>&1
  echo "exit $?" >> "$OUT/llama-build.log" ) &
BUILD=$!

log "synth qwen3.5-$PRESET (mlx 4-bit for tensorfold, hf bf16 for llama.cpp's converter)"
L=${LAYERS:+--layers $LAYERS}
$TF synth --preset qwen3.5-$PRESET $L --tokenizer $TENSORFOLD_SHARED/tokenizers/qwen3.5/tokenizer.json /tmp/tf/models/$PRESET 2>&1 | tail -1 | tee -a "$S"
$TF synth --preset qwen3.5-$PRESET $L --layout hf --tokenizer $TENSORFOLD_SHARED/tokenizers/qwen3.5/tokenizer.json /tmp/tf/models/$PRESET-hf 2>&1 | tail -1 | tee -a "$S"
# The GGUF conversion (Python, mostly one core) runs beside the build and tensorfold's figures.
( PYTHONPATH=/tmp/llama/gguf-py python3 /tmp/llama/convert_hf_to_gguf.py /tmp/tf/models/$PRESET-hf --outtype f16 --no-mtp --outfile /tmp/llama/m-f16.gguf > "$OUT/convert.log" 2>&1
  rm -rf /tmp/tf/models/$PRESET-hf ) &
CONVERT=$!

for pr in $PRODUCTS; do
  log "tensorfold bench --concurrency $LEVELS --products $pr (128-token prompts, 128 generated)"
  $TF bench -m /tmp/tf/models/$PRESET --device cuda --products $pr --concurrency $LEVELS -p 128 -n 128 ${CONC_ARGS:-} --json "$OUT/tf-concurrency-$pr.json" > "$OUT/tf-concurrency-$pr.txt" 2>&1
  grep -vE "^  repeat|^measuring" "$OUT/tf-concurrency-$pr.txt" | tail -60 | tee -a "$S"
done
for pr in $PRODUCTS; do
  log "tensorfold bench --products $pr: prompt 512 and 4096, decode at context 0"
  $TF bench -m /tmp/tf/models/$PRESET --device cuda --products $pr -p 512,4096 -c 0 -n 128 -r 3 --json "$OUT/tf-bench-$pr.json" > "$OUT/tf-bench-$pr.txt" 2>&1
  grep -E "^(pp|tg)" "$OUT/tf-bench-$pr.txt" | tail -6 | tee -a "$S"
done
if [ "$SERVE" = 1 ]; then
  log "tensorfold serve --products ${PRODUCTS%% *}: the bar against its bench, then guidellm (bench/load.sh)"
  TENSORFOLD_PRODUCTS=${PRODUCTS%% *} TF=$TF DEVICE=cuda BAR=1,64 LEVELS=$LEVELS PROMPT=128 GEN=128 REPS=${REPS:-1} REQUESTS=${REQUESTS:-16,64,192,384} \
    SECONDS_PER_LEVEL=${SECONDS_PER_LEVEL:-40} OUT=/tmp/tf/load-tf timeout 300 bash bench/load.sh /tmp/tf/models/$PRESET > "$OUT/load-tensorfold.txt" 2>&1
  grep -vE "^commit|^model| up " "$OUT/load-tensorfold.txt" | tail -16 | tee -a "$S"
fi

# WHILE_BUILDING: more GPU work for the minutes llama.cpp still compiles (it uses only the CPUs).
if [ -n "${WHILE_BUILDING:-}" ]; then
  log "while llama.cpp builds: $WHILE_BUILDING"
  bash -c "$WHILE_BUILDING" > "$OUT/while-building.txt" 2>&1
fi
log "waiting for llama.cpp's build"
wait $BUILD
tail -2 "$OUT/llama-build.log" | tee -a "$S"
# Batch-1 decode again now that the build no longer holds the cores: a token's graph launch and
# wait are host work, and the compiler's jobs delay them
# (bench/results/2026-12-07-h100-snapshots-overlap-02ca0ef.md).
for pr in $PRODUCTS; do
  log "tensorfold bench --products $pr: tg128 at context 0, the build done"
  $TF bench -m /tmp/tf/models/$PRESET --device cuda --products $pr -p 16 -c 0 -n 128 -r 5 2>&1 | grep -E "^tg" | tee -a "$S"
done
B=/tmp/llama/build/bin
log "convert to GGUF f16 (waiting), quantize Q4_0"
wait $CONVERT
tail -1 "$OUT/convert.log" | tee -a "$S"
$B/llama-quantize /tmp/llama/m-f16.gguf /tmp/llama/m-q4_0.gguf Q4_0 > "$OUT/quantize.log" 2>&1
tail -1 "$OUT/quantize.log" | tee -a "$S"
log "llama-bench: pp512, pp4096, tg128"
$B/llama-bench -m /tmp/llama/m-q4_0.gguf -ngl 99 -fa 1 -p 512,4096 -n 128 -r 3 -o md > "$OUT/llama-bench.md" 2>"$OUT/llama-bench.err"
cat "$OUT/llama-bench.md" | tee -a "$S"
log "llama-batched-bench: 128-token prompts, 128 generated, $LEVELS sequences"
$B/llama-batched-bench -m /tmp/llama/m-q4_0.gguf -ngl 99 -fa on -c 20000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl $LEVELS > "$OUT/llama-batched.txt" 2>&1
grep -E "^\|" "$OUT/llama-batched.txt" | tee -a "$S"
if [ "$SERVE" = 1 ]; then
  # One slot per stream of the largest level, each with room for its 256 tokens.
  n=$(echo "$LEVELS" | tr ',' '\n' | sort -n | tail -1)
  log "llama-server (-np $n, continuous batching), guidellm (bench/load.sh URL=)"
  $B/llama-server -m /tmp/llama/m-q4_0.gguf -ngl 99 -fa on -np "$n" -c $(( n * 320 )) -b 2048 -ub 512 --host 127.0.0.1 --port 18080 > "$OUT/llama-server.log" 2>&1 &
  LS=$!
  for _ in $(seq 1 240); do curl -sf http://127.0.0.1:18080/health > /dev/null && break; sleep 0.5; done
  URL=http://127.0.0.1:18080 LEVELS=$LEVELS PROMPT=128 GEN=128 REQUESTS=${REQUESTS:-16,64,192,384} SECONDS_PER_LEVEL=${SECONDS_PER_LEVEL:-40} \
    OUT=/tmp/tf/load-llama timeout 240 bash bench/load.sh /tmp/tf/models/$PRESET > "$OUT/load-llama.txt" 2>&1
  grep -vE "^commit|^model| up " "$OUT/load-llama.txt" | tail -8 | tee -a "$S"
  kill $LS; wait $LS 2>/dev/null
  tar -C /tmp/tf -cJf "$OUT/load.tar.xz" load-tf load-llama 2>/dev/null
fi
log "done"
