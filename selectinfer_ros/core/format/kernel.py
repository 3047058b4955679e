"""The C kernel library (``kernels/kernel.c`` and the parts it includes: int8 and 4-bit row products, the decode
step of int8 and 4-bit models): built for the CPU at hand, loaded, checked.

The instruction set is chosen from what the CPU lists (``/proc/cpuinfo``): the first of
:data:`ISAS` for this machine whose flags the CPU has (``SELECTINFER_KERNEL_ISA`` names one
to take instead, e.g. ``plain``, the C reference). The library is compiled once with the system
C compiler (``CC``, else ``cc``) into ``<cache>/kernels/``, named by machine, instruction set
and a hash of source, compiler and flags. OpenMP is used where the compiler has it; without
it the library still builds and runs on one thread.

The contract: the C side reports its ABI version and the sizes of the structures it shares
with ctypes (``si_abi``) and the path compiled in (``si_isa``); a library whose answer differs
from the mirrors here is refused, and the callers fall back to float products (the reason is
in :func:`status`).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels") / "kernel.c"  # includes the other files of kernels/


def source_bytes() -> bytes:
    """Every source file of the library (kernel.c includes the others), for the build's hash."""
    return b"".join(f.name.encode() + f.read_bytes() for f in sorted(SOURCE.parent.iterdir())
                    if f.suffix in (".c", ".h"))
ABI_VERSION = 20
ISA_ENV = "SELECTINFER_KERNEL_ISA"

# (name, cpuinfo flags it needs, compiler flags), best first, per machine
_X86_BASE = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = _X86_BASE + ["-mavx512f", "-mavx512bw", "-mavx512vl"]
ISAS: dict[str, list[tuple[str, frozenset[str], list[str]]]] = {
    "x86_64": [
        ("avx512vnni", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                    "avx512_vnni"}),
         _AVX512 + ["-mavx512vnni"]),
        ("avx512bw", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}),
         _AVX512),
        ("avxvnni", frozenset({"avx2", "fma", "f16c", "avx_vnni"}), _X86_BASE + ["-mavxvnni"]),
        ("avx2", frozenset({"avx2", "fma", "f16c"}), _X86_BASE),
        ("plain", frozenset(), ["-DSI_PLAIN"]),
    ],
    "aarch64": [
        ("neon-i8mm", frozenset({"asimddp", "i8mm"}), ["-march=armv8.2-a+dotprod+i8mm"]),
        ("neon-dotprod", frozenset({"asimddp"}), ["-march=armv8.2-a+dotprod"]),
        ("plain", frozenset(), ["-DSI_PLAIN"]),
    ],
}
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-std=c11"]


# -- the structures shared with the C side (mirrors of si_mat, si_layer, si_model) ----------
class Mat(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("ldw", ctypes.c_int64), ("d", ctypes.c_void_p),
                ("ldd", ctypes.c_int64), ("bias", ctypes.c_void_p),  # bias: float32 [n] or None
                ("tiled", ctypes.c_int64)]  # 1: w holds tiles (si_tile_pack), ldw blocks a tile;
    # 2: 4-bit rows interleaved 16 at a time (q4.interleave; d: their heads)


class LayerC(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_void_p) for n in ("in_norm", "post_attn_norm", "pre_mlp_norm",
                                                "post_mlp_norm", "q_norm", "k_norm")]
                + [(n, Mat) for n in ("q", "k", "v", "o")]
                + [(n, ctypes.c_void_p) for n in ("k_cache", "v_cache", "cos", "sin")]
                + [("window", ctypes.c_int64)]
                # gu, gu_scale: [n_loaded, 2, H], [n_loaded, 2]; token (int8): the gate rows and
                # scales, up, up_scale the up rows and scales (planar), else None
                + [(n, ctypes.c_void_p) for n in ("gu", "gu_scale", "up", "up_scale", "down",
                                                  "down_scale")]
                + [("down_ld", ctypes.c_int64), ("n_active", ctypes.c_int64),
                   # 4-bit records (None: none), row stride, active prefix; with gu too: tiered
                   ("rec", ctypes.c_void_p), ("rec_ld", ctypes.c_int64),
                   ("rec_active", ctypes.c_int64),
                   # 1: the records held in groups of 32 slots (q4.GroupedRecords; rec_ld unused)
                   ("rec_grouped", ctypes.c_int64)]
                # per-token selection: token 1 (int8: gate/up planar, down neuron-major [n_active,
                # H]), the two
                # thresholds, kept: int64 the kept neurons are added to, candidates: int64 the
                # candidates (up row read) are added to (None: not counted)
                + [("token", ctypes.c_int64), ("gate_thr", ctypes.c_float),
                   ("act_thr", ctypes.c_float), ("kept", ctypes.c_void_p),
                   ("candidates", ctypes.c_void_p),
                   # 1: gu and down hold their rows as tiles (si_tile_pack; down_ld: slots)
                   ("tiled", ctypes.c_int64),
                   # rows computing different neurons of the prefix: float32 [slots, mask_ld],
                   # row b's activations times mask[ModelC.slots[b]] (None: no masks)
                   ("mask", ctypes.c_void_p), ("mask_ld", ctypes.c_int64),
                   ("rec_mask", ctypes.c_void_p), ("rec_mask_ld", ctypes.c_int64)])


class ModelC(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("hidden", "n_heads", "n_kv", "head_dim", "cap",
                                               "max_k")]
                + [("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("act", ctypes.c_int),
                   ("teams", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("h", "q", "kv", "att", "scores", "gu", "a",
                                                  "xq", "xd", "xs",
                                                  "idx",  # int32 [2 * max_k]
                                                  "cnt",  # int64 [teams + 1]
                                                  "cand")]  # int64 [teams]
                # rows of a batch the scratch holds (row strides: see scratch_sizes)
                + [("batch", ctypes.c_int64),
                   ("prep", ctypes.c_void_p),  # uint8: activations prepared (see scratch_sizes)
                   ("part", ctypes.c_void_p),  # 4-bit records' partial down sums per thread
                   ("slots", ctypes.c_void_p)])  # int64 [batch]: row b's mask row (its KV slot)


def scratch_sizes(max_k: int, teams: int, cap: int, batch: int) -> dict[str, int]:
    """Elements of each scratch buffer of :class:`ModelC` for ``batch`` rows (si_model's row
    strides: h, q, att, a ``max_k``; kv, gu ``2 max_k``; xq ``max_k + 32`` bytes; xd, xs
    ``max_k / 32 + 2``; prep ``(max_k / 64 + 2) * 128`` bytes: C's prep_bytes; part ``teams *
    max_k``)."""
    nb = max_k // 32 + 2
    return dict(h=batch * max_k, q=batch * max_k, kv=batch * 2 * max_k, att=batch * max_k,
                scores=teams * cap, gu=batch * 2 * max_k, a=batch * max_k,
                xq=batch * (max_k + 32), xd=batch * nb, xs=batch * nb, idx=2 * max_k,
                cnt=teams + 1, cand=teams, prep=batch * (max_k // 64 + 2) * 128,
                part=batch * teams * max_k)


STRUCT_SIZES = (ctypes.sizeof(Mat), ctypes.sizeof(LayerC), ctypes.sizeof(ModelC))


class KernelError(RuntimeError):
    """The kernel cannot be used: no compiler, a failed build, or a library that breaks the
    contract."""


@dataclass(frozen=True)
class Kernel:
    lib: ctypes.CDLL
    isa: str
    openmp: bool
    path: Path

    def describe(self) -> str:
        threads = "OpenMP threads" if self.openmp else "no OpenMP in the compiler: 1 thread"
        return f"int8 kernel ({self.isa}, {threads})"


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (x86 ``flags``, aarch64 ``Features``); empty if unreadable."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_description(cpuinfo: str | Path = "/proc/cpuinfo", with_kernel: bool = True) -> str:
    """The CPU as a figure should name it: model name, x86 family/model, and the kernel's path
    (``AMD EPYC (family 25 model 1), kernel avx2``)."""
    info: dict[str, str] = {}
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or info.get("Hardware") or platform.processor() or platform.machine()
    if "cpu family" in info:
        name += f" (family {info['cpu family']} model {info.get('model', '?')})"
    if not with_kernel:
        return name
    k = kernel()
    if k is None:
        return f"{name}, kernel none"
    t = tuning()
    fetch = f", 4-bit fetch {t['pf_half']}/2" if k.lib.si_q4g_pays() else ""
    return f"{name}, kernel {k.isa}{fetch}"


def candidates(machine: str | None = None, flags: set[str] | None = None,
               forced: str | None = None) -> list[tuple[str, list[str]]]:
    """``(name, compiler flags)`` of the paths this CPU runs, best first (a compiler that does
    not know a path's flags gets the next); only ``forced`` (a name of :data:`ISAS`, which the
    CPU must have) when given."""
    machine = machine or platform.machine()
    machine = {"AMD64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    flags = cpu_flags() if flags is None else flags
    table = ISAS.get(machine, [("plain", frozenset(), ["-DSI_PLAIN"])])
    if forced:
        for name, need, cflags in table:
            if name == forced:
                if not need <= flags:
                    raise KernelError(f"{ISA_ENV}={forced}: this CPU lacks "
                                      f"{', '.join(sorted(need - flags))}")
                return [(name, cflags)]
        raise KernelError(f"{ISA_ENV}={forced}: not one of "
                          f"{', '.join(n for n, _, _ in table)} on {machine}")
    return [(name, cflags) for name, need, cflags in table if need <= flags]


def check_abi(lib: ctypes.CDLL, version: int = ABI_VERSION,
              sizes: tuple[int, ...] = STRUCT_SIZES) -> None:
    """Refuse (:class:`KernelError`) a library whose ABI version or structure sizes differ from
    ``version`` and ``sizes`` (this module's mirrors)."""
    if not hasattr(lib, "si_abi"):
        raise KernelError("the kernel library has no si_abi (built from an older source)")
    f = lib.si_abi
    f.restype, f.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    got = (ctypes.c_int64 * 3)()
    v = f(got, 3)
    names = ("si_mat", "si_layer", "si_model")
    bad = [f"{n} {g} bytes in C, {s} in Python" for n, g, s in zip(names, got, sizes) if g != s]
    if v != version or bad:
        raise KernelError(f"kernel ABI mismatch: version {v} in C, {version} in Python"
                          + (f"; {'; '.join(bad)}" if bad else ""))


def _compile(cc: str, cflags: list[str], out: Path) -> str | None:
    """Compile into ``out``; None, or the compiler's complaint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        res = subprocess.run([cc, *cflags, str(SOURCE), "-o", str(tmp), "-lm"],
                             capture_output=True, text=True)
    except OSError as e:
        return f"cannot run the C compiler {cc!r} ({e.strerror or e})"
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"{cc} failed: {res.stderr.strip()[-400:]}"
    os.replace(tmp, out)
    return None


def load(cc: str | None = None, isa: str | None = None, cache: Path | None = None,
         extra_flags: tuple[str, ...] = ()) -> Kernel:
    """Build (once per cache) and load the kernel for this CPU; :class:`KernelError` says why
    not. ``cc``, ``isa`` default to ``$CC`` and ``$SELECTINFER_KERNEL_ISA``."""
    from .paths import cache_root
    cc = cc or os.environ.get("CC") or "cc"
    cache = cache or cache_root() / "kernels"
    machine = platform.machine()
    errors = []
    for name, isa_flags in candidates(forced=isa or os.environ.get(ISA_ENV) or None):
        for openmp in (True, False):
            cflags = BASE_FLAGS + (["-fopenmp"] if openmp else []) + isa_flags + list(extra_flags)
            tag = hashlib.sha256(source_bytes() + " ".join([cc] + cflags).encode()
                                 ).hexdigest()[:16]
            out = cache / f"selectinfer_kernel-{machine}-{name}-{tag}.so"
            failed = out.with_suffix(".failed")  # this compiler cannot build it: not again
            if not out.exists():
                err = failed.read_text() if failed.exists() else _compile(cc, cflags, out)
                if err is not None:
                    if err.startswith("cannot run"):  # no compiler: nothing else to try
                        raise KernelError(err)
                    errors.append(f"{name}{'' if openmp else ' without OpenMP'}: {err}")
                    failed.parent.mkdir(parents=True, exist_ok=True)
                    failed.write_text(err)
                    continue
            return _open(out, name)
    raise KernelError("; ".join(errors[-2:]) if errors else "no build")


def _open(out: Path, name: str) -> Kernel:
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as e:
        raise KernelError(f"cannot load {out.name}: {e}") from e
    check_abi(lib)
    lib.si_isa.restype = ctypes.c_char_p
    built = lib.si_isa().decode()
    if built != name:
        raise KernelError(f"kernel built as {built!r}, not {name!r}: the compiler did not take "
                          f"the flags for {name}")
    lib.si_openmp.restype = ctypes.c_int
    f = lib.si_linear_i8
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.si_tile_pays.restype = ctypes.c_int
    lib.si_tile_bytes.restype = ctypes.c_int64
    lib.si_tile_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    f = lib.si_tile_pack
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_int]
    for fn in ("si_tile_rows", "si_tile_put_rows", "si_tile_cols", "si_tile_put_cols"):
        f = getattr(lib, fn)  # (tiles, N, K, ids int64 [n], n, int8 rows)
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_int64, ctypes.c_void_p]
    f = lib.si_tile_linear
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    f = lib.si_linear_q4
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_int]
    f = lib.si_linear_q4il  # (x, M, K, nibbles, heads, N, y, threads): q4.interleave's layout
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.si_q4g_pays.restype = ctypes.c_int
    lib.si_q4g_bytes.restype = ctypes.c_int64
    lib.si_q4g_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    for fn in ("si_q4g_put", "si_q4g_get"):  # (groups, k, H, ids int64 [n], n, records [n, bytes])
        f = getattr(lib, fn)
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_int64, ctypes.c_void_p]
    f = lib.si_q4g_linear  # (x, M, H, groups, k, out [M, k, 2], threads)
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    f = lib.si_q4g_down  # (a, M, k, groups, H, y [M, H], threads)
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.si_tune.restype, lib.si_tune.argtypes = ctypes.c_int, [ctypes.c_int]
    f = lib.si_q4g_calibrate  # (H, groups, pf_half, repeats) -> seconds of the best pass
    f.restype = ctypes.c_double
    f.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    f = lib.si_axpy_q4
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_int]
    return Kernel(lib, name, bool(lib.si_openmp()), out)


# -- the fetch, tuned by measuring --------------------------------------------------------
PF_ENV = "SELECTINFER_KERNEL_PF"  # 0-4: the 4-bit groups' fetch setting, no calibration
PF_CHOICES = (0, 1, 2, 3)  # si_pf_half: none, half, all of a step's lines, half as many again
CALIBRATE_H = 1536  # the calibration's groups: Qwen2.5 1.5B's rows, ~96 MB (beyond an L3)
CALIBRATE_BYTES = 96 << 20


def calibrate(k: Kernel, choices=PF_CHOICES, hidden: int = CALIBRATE_H,
              nbytes: int = CALIBRATE_BYTES, repeats: int = 3) -> dict[int, float]:
    """GB/s of the 4-bit groups' MLP product from memory (one row, this thread) at each fetch
    setting, measured (``si_q4g_calibrate``)."""
    n = max(2, nbytes // k.lib.si_q4g_bytes(32, hidden))
    out = {}
    for c in choices:
        t = k.lib.si_q4g_calibrate(hidden, n, c, repeats)
        if t <= 0:
            raise KernelError(f"si_q4g_calibrate failed ({t})")
        out[c] = n * k.lib.si_q4g_bytes(32, hidden) / t / 1e9
    return out


def tune(k: Kernel, cache: Path | None = None) -> dict:
    """Set the fetch of the 4-bit groups (si_tune) to the fastest setting measured on this CPU:
    ``$SELECTINFER_KERNEL_PF`` when set, else the choice cached for this CPU model, instruction
    set and library in ``<cache>/kernels/tuning.json``, else a calibration (~0.5 s, once per
    CPU model) whose result is cached. Returns ``{"pf_half", "source", "gbps"}``."""
    if not k.lib.si_q4g_pays():  # the groups are not used on this path
        return {"pf_half": k.lib.si_tune(-1), "source": "default (no groups)", "gbps": {}}
    forced = os.environ.get(PF_ENV)
    if forced:
        if forced not in {str(c) for c in range(5)}:
            raise KernelError(f"{PF_ENV}={forced!r}: not one of 0-4")
        return {"pf_half": k.lib.si_tune(int(forced)), "source": PF_ENV, "gbps": {}}
    from .paths import cache_root
    path = (cache or cache_root() / "kernels") / "tuning.json"
    key = f"{cpu_model()} | {k.isa} | {k.path.name}"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if not isinstance(entry, dict) or entry.get("pf_half") not in PF_CHOICES:
        gbps = calibrate(k)
        entry = {"pf_half": max(gbps, key=gbps.get), "gbps": {str(c): round(v, 2) for c, v in gbps.items()}}
        # entries of libraries no longer built here go (one per source change otherwise)
        known = {n: e for n, e in known.items() if (k.path.parent / n.rsplit(" | ", 1)[-1]).exists()
                 or " | " not in n}
        known[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        os.replace(tmp, path)
        source = "calibrated"
    else:
        source = "cached"
    return {"pf_half": k.lib.si_tune(int(entry["pf_half"])), "source": source,
            "gbps": entry.get("gbps", {})}


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU model as /proc/cpuinfo names it (model name, x86 family / model)."""
    return cpu_description(cpuinfo, with_kernel=False)


_lock = threading.Lock()
_kernel: Kernel | None = None
_error: str | None = None
_tuning: dict = {}


def kernel() -> Kernel | None:
    """This process's kernel (built on first use), or None (the reason is in :func:`status`)."""
    global _kernel, _error
    with _lock:
        if _kernel is None and _error is None:
            try:
                _kernel = load()
                _tuning.update(tune(_kernel))
            except KernelError as e:
                _kernel, _error = None, str(e)
        return _kernel


def tuning() -> dict:
    """This process's fetch setting of the 4-bit groups (:func:`tune`), once the kernel is up."""
    kernel()
    return dict(_tuning)


def status() -> str:
    """Which path int8 CPU products take: the kernel and its instruction set, or the float
    fallback and why."""
    k = kernel()
    return k.describe() if k is not None else f"float fallback ({_error})"
