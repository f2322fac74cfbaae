#!/usr/bin/env bash
# tensorfold beside llama.cpp on the GPU machine (the `device` tool), in one call: llama.cpp's
# CUDA build runs in the background while tensorfold's own figures are taken, then llama.cpp
# runs the same synthetic checkpoint (converted to GGUF, quantized to Q4_0) through
# llama-bench (prompt processing, batch-1 decode) and llama-batched-bench (many sequences
# decoding together, the batched runtime's comparison).
#
# Carried folder $D (default .device): tensorfold.xz (release build), shared.tar.xz (the
# tokenizer at least), llama.tar.xz (llama.cpp's source: the tree vendored in the
# llama-cpp-python sdist, `bench/device-compare.sh pack` makes it here), commit (the commit
# built). Writes $OUT/summary.txt and the logs.
#
#   bash bench/device-compare.sh pack     # here: $D/llama.tar.xz from the PyPI sdist
#   bash bench/device-compare.sh          # there: all of it, synthetic 2b
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
mkdir -p "$OUT" /tmp/tf/models /tmp/llama
xz -dc $D/tensorfold.xz > /tmp/tf/tensorfold && chmod +x /tmp/tf/tensorfold
tar -C /tmp/tf -xJf $D/shared.tar.xz
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
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=OFF > "$OUT/llama-build.log" 2>&1 &&
  cmake --build /tmp/llama/build -j "$(( $(nproc) - 2 ))" --target llama-bench llama-batched-bench llama-quantize >> "$OUT/llama-build.log" 2>&1
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

log "tensorfold bench --concurrency $LEVELS (128-token prompts, 128 generated)"
$TF bench -m /tmp/tf/models/$PRESET --device cuda --concurrency $LEVELS -p 128 -n 128 --json "$OUT/tf-concurrency.json" > "$OUT/tf-concurrency.txt" 2>&1
tail -8 "$OUT/tf-concurrency.txt" | tee -a "$S"
log "tensorfold bench: prompt 512 and 4096, decode at context 0"
$TF bench -m /tmp/tf/models/$PRESET --device cuda -p 512,4096 -c 0 -n 128 -r 3 --json "$OUT/tf-bench.json" > "$OUT/tf-bench.txt" 2>&1
grep -E "pp|tg" "$OUT/tf-bench.txt" | tail -6 | tee -a "$S"

log "waiting for llama.cpp's build"
wait $BUILD
tail -2 "$OUT/llama-build.log" | tee -a "$S"
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
log "done"
