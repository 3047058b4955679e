"""ROS parameters of the nodes, declared from the core's settings (:mod:`selectinfer_ros.core.options`).

Each field of :class:`NodeSettings` / :class:`ManagerSettings` becomes a parameter whose
descriptor carries its type, description, range and ``read_only`` (fields that cannot change
while the node runs), as py_trees_ros declares its parameters; values are validated by the
core's ``coerce`` and ``check``: a bad value is refused when the node is made. The file checks
(model folder, profiles match the model, task) are here too; the nodes run them when they
configure (FAILURE with the reason).
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

from ...core.options import (ManagerSettings, NodeSettings, ParamError, changed, coerce,
                            from_values, kind_of, range_text)
from ...core.serving.server import short

__all__ = ["ManagerSettings", "NodeSettings", "ParamError", "apply_changes", "check_model_files",
           "declare", "embedded_model_path"]


def embedded_model_path(convert: bool = False, log: Callable[[str], None] = lambda s: None,
                        name: str = "") -> Path | None:
    """A packed embedded model, or of the model ``name`` from the catalog (its records do not
    matter to the file checks: every pack of a model has the same fingerprint); ``None`` when
    none is prepared yet and ``convert`` is false, else the default records are packed."""
    from ...core.format import default_model, models
    name = name or default_model.MODEL_ID
    found = models.prepared_pack(name, (default_model.DEFAULT_WEIGHTS, "float"))
    if found is not None or not convert:
        return found
    return models.ensure_packed(name, log, default_model.DEFAULT_WEIGHTS)


def check_model_files(model: str, profiles: str, task: str, need_profiles: bool = True) -> None:
    """The model folder is a packed model, the profiles folder exists and every profile in it
    matches the model; ``task`` (if given) is one of them. Raises ParamError with the reason.
    With ``model`` empty (the embedded model) or a catalog name the checks run only once it is
    fetched and packed (else when it loads)."""
    from ...core.format.models import is_model_name
    from ...core.format.pack import read_manifest
    from ...core.format.paths import default_profiles_dir
    from ...core.selection.profiles import ProfileCatalog
    if model and not is_model_name(model):
        if not Path(model).is_dir():
            raise ParamError(f"model: folder {model} does not exist (nor is it a model name: "
                             f"{', '.join(_names())})")
        path = Path(model)
    else:
        path = embedded_model_path(convert=False, name=model)
        if path is None:
            return  # converted (and then checked) when the model loads
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as e:
        raise ParamError(f"model: {e}") from None
    folder = Path(profiles) if profiles else default_profiles_dir(manifest.model_id)
    if profiles and not folder.is_dir():
        raise ParamError(f"profiles: folder {folder} does not exist")
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        if need_profiles:
            raise ParamError(f"profiles: no task profiles in {folder} for model "
                             f"{manifest.model_id} (load_ratio < 1 needs them); run `selectinfer "
                             f"profile`")
        if task:
            raise ParamError(f"task: {task!r} given but there are no profiles in {folder}")
        return
    try:
        catalog = ProfileCatalog(folder, manifest)
    except (OSError, ValueError) as e:
        raise ParamError(f"profiles: {e}") from None
    if task and task not in catalog.tasks:
        raise ParamError(f"task: unknown task {task!r}; profiles in {folder}: "
                         f"{', '.join(catalog.tasks)}")


def _names() -> list[str]:
    from ...core.format.models import CATALOG
    return list(CATALOG)


def _descriptor(f):
    from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                    ParameterType)
    kind, meta = kind_of(f), f.metadata
    types = {str: ParameterType.PARAMETER_STRING, float: ParameterType.PARAMETER_DOUBLE,
             int: ParameterType.PARAMETER_INTEGER, bool: ParameterType.PARAMETER_BOOL}
    doc = meta.get("doc", "")
    if meta.get("choices"):
        doc += " (one of: " + ", ".join(c or "''" for c in meta["choices"]) + ")"
    d = ParameterDescriptor(description=doc, type=types[kind], read_only=not meta.get("runtime"),
                            additional_constraints="" if meta.get("special") is None else
                            f"{meta['special']} has the meaning given in the description")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and meta.get("special") is None:  # a special value lies outside the range
        if kind is float:
            d.floating_point_range = [FloatingPointRange(from_value=float(lo), to_value=float(
                hi if hi is not None else 1e300), step=0.0)]
        elif kind is int:
            d.integer_range = [IntegerRange(from_value=int(lo), to_value=int(
                hi if hi is not None else 2**62), step=1)]
    return d


def declare(node, cls) -> Any:
    """Declare the fields of ``cls`` as parameters of an rclpy node; returns the validated
    settings, or raises ParamError with the reason. Typing is dynamic so that a value of the wrong
    type gets the core's specific reason (and ``load_ratio: 1`` in a YAML file is taken as 1.0);
    the descriptor still carries the type of the default, the range and read_only."""
    from rclpy.exceptions import InvalidParameterValueException
    values = {}
    for f in fields(cls):
        desc = _descriptor(f)
        desc.dynamic_typing = True
        try:
            value = node.declare_parameter(f.name, f.default, desc).value
        except InvalidParameterValueException as e:  # outside the descriptor's range
            given = getattr(node, "_parameter_overrides", {}).get(f.name)
            if given is not None:
                coerce(f, given.value)  # the core's reason: "load_ratio must be in ..., got 1.7"
            raise ParamError(f"{f.name} {range_text(f)}: {e}") from None
        values[f.name] = coerce(f, value)
    return from_values(cls, values)


def describe(cls) -> dict[str, Any]:
    """Name -> ParameterDescriptor (type, range, read_only) of the fields of ``cls``."""
    return {f.name: _descriptor(f) for f in fields(cls)}


def apply_changes(current, params, node=None) -> tuple[Any, str | None]:
    """Validate rclpy ``params`` (a runtime set request) against ``current`` settings.
    Returns (new settings, None) or (current, reason). With ``node``, a name that is neither a
    setting nor a parameter the node declared (``use_sim_time``, ...) is refused."""
    own = {f.name for f in fields(current)}
    for p in params:
        if p.name not in own and (node is None or not node.has_parameter(p.name)):
            if node is not None:
                return current, (f"{short(p.name)!r} is not a parameter of "
                                 f"{node.get_name()}; its parameters: {', '.join(sorted(own))}")
    try:
        return changed(current, {p.name: p.value for p in params}), None
    except ParamError as e:
        return current, str(e)
