# Source this file (bash): `source scripts/env.sh`
# Activates .venv (ROS 2 kilted wheels from PyPI) and the colcon install/ of
# selectinfer_msgs, so that `python -c "import rclpy, selectinfer_msgs.action"` works,
# in this shell and in every subprocess started from it.
# Run scripts/setup.sh first.

_si_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_si_venv="$_si_root/.venv"
if [ ! -x "$_si_venv/bin/python" ]; then
  echo "scripts/env.sh: $_si_venv missing; run: bash scripts/setup.sh" >&2
  return 1 2>/dev/null || exit 1
fi

# shellcheck disable=SC1091
VIRTUAL_ENV_DISABLE_PROMPT="${VIRTUAL_ENV_DISABLE_PROMPT:-1}" . "$_si_venv/bin/activate"

_si_prepend() {  # _si_prepend VAR DIR : put DIR first in the colon list VAR (once)
  local cur="${!1:-}"
  case ":$cur:" in *":$2:"*) return 0 ;; esac
  export "$1=$2${cur:+:$cur}"
}

# The venv is the ROS "underlay": ament resource index, CMake config files.
_si_prepend AMENT_PREFIX_PATH "$_si_venv"
_si_prepend CMAKE_PREFIX_PATH "$_si_venv"

# The ROS wheels ship shared libraries in site-packages/ros_*.libs and <venv>/lib.
# Their ros_wheels_bootstrapper.pth re-execs every Python once to put them on
# LD_LIBRARY_PATH (in a random order). Set the path here instead, once and in a fixed order,
# and mark the bootstrap as done: no re-exec, and subprocesses (also with a copied env)
# inherit the same working library path.
for _si_d in "$_si_venv"/lib/python3*/site-packages/ros_*.libs; do
  [ -d "$_si_d" ] && _si_prepend LD_LIBRARY_PATH "$_si_d"
done
_si_prepend LD_LIBRARY_PATH "$_si_venv/lib"
export _ROS_WHEELS_BOOTSTRAP_COMPLETE=1

# Overlay: the generated selectinfer_msgs (PYTHONPATH, LD_LIBRARY_PATH, AMENT_PREFIX_PATH).
if [ -f "$_si_root/install/setup.bash" ]; then
  # shellcheck disable=SC1091
  . "$_si_root/install/setup.bash"
else
  echo "scripts/env.sh: $_si_root/install/setup.bash missing; run: bash scripts/setup.sh" >&2
fi

# The repository itself (selectinfer_ros) is imported from the source tree.
_si_prepend PYTHONPATH "$_si_root"

# Keep DDS traffic on this machine unless the caller decided otherwise.
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
export ROS_LOCALHOST_ONLY="${ROS_LOCALHOST_ONLY:-1}"
export RMW_IMPLEMENTATION="${RMW_IMPLEMENTATION:-rmw_fastrtps_cpp}"

unset -f _si_prepend
unset _si_root _si_venv _si_d
