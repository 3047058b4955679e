"""Where things live: the model cache, profiles and prompt sets (source checkout or installed share)."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # selectinfer_ros/
REPO_ROOT = PACKAGE_ROOT.parent
DATA_DIR = PACKAGE_ROOT / "data"


def cache_root() -> Path:
    """Folder that holds converted models and compiled kernels: ``SELECTINFER_CACHE``, else
    ``$XDG_CACHE_HOME/selectinfer``, else ``~/.cache/selectinfer``."""
    env = os.environ.get("SELECTINFER_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "selectinfer"


def share_dir() -> Path | None:
    """``share/selectinfer_ros`` of an ament install, if there is one."""
    try:
        from ament_index_python.packages import get_package_share_directory
        return Path(get_package_share_directory("selectinfer_ros"))
    except Exception:  # not installed through ament (plain checkout)
        return None


def profiles_root() -> Path:
    """``SELECTINFER_PROFILES`` or the repo's ``profiles/`` or the installed share's."""
    env = os.environ.get("SELECTINFER_PROFILES")
    if env:
        return Path(env)
    if (REPO_ROOT / "profiles").is_dir():
        return REPO_ROOT / "profiles"
    share = share_dir()
    return share / "profiles" if share else REPO_ROOT / "profiles"


def default_profiles_dir(model_id: str) -> Path:
    return profiles_root() / model_id
