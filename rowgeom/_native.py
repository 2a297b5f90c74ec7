"""Native CPU kernels, as XLA FFI custom calls: projected RowNorm (``csrc/rownorm.cc``) and the
row-diameter bracket (``csrc/bracket.cc``).

Contract: `available()` builds the kernels (one shared library) on first use with the system
C++ compiler (``$CXX``, else ``c++``) against the installed jaxlib's FFI headers, caches it under
``$ROWGEOM_CACHE_DIR`` (default ``~/.cache/rowgeom``) keyed by the sources, the jaxlib version,
the compiler and this CPU, registers the targets, and returns True. Without a compiler, or if
the build fails, it warns once (naming the reason and how to silence it) and returns False:
callers then use the XLA formulations, which give the same results more slowly.
``ROWGEOM_NATIVE=0`` turns the kernels off. `rownorm` is the RowNorm call on a 2-D float32
array, its output aliased to its input so a donated input is overwritten in place; `bracket`
returns ``(lower, upper, row_sum)``.

Why hand-written kernels: XLA:CPU runs the reductions the exact algorithm needs at about half
of memory bandwidth, whatever the formulation (docs/benchmarks.md has the numbers).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import numpy as np

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "rownorm.cc", _CSRC / "bracket.cc")
_HEADERS = (_CSRC / "common.h",)
_TARGETS = {"rowgeom_rownorm_cpu": "RowgeomRowNorm", "rowgeom_bracket_cpu": "RowgeomBracket"}
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")
_MAX_THREADS = 8  # memory bandwidth saturates before this; each pass starts its threads anew
_lock = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get("ROWGEOM_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rowgeom"


def _cpu_signature() -> str:
    """`-march=native` code runs only where the CPU has the same features: key the cache on them."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}:{platform.processor()}:{flags}"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _build(compiler: str) -> Path:
    import jaxlib

    key = hashlib.sha256("\0".join([
        *(f.read_text() for f in (*_SOURCES, *_HEADERS)), jaxlib.__version__, compiler,
        " ".join(_FLAGS),
        _cpu_signature(),
    ]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernel; returns None, or why it is not available."""
    if os.environ.get("ROWGEOM_NATIVE", "1") == "0":
        return "ROWGEOM_NATIVE=0"
    compiler = _compiler()
    if compiler is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found; set $CXX)"
    try:
        with _lock:
            lib = ctypes.cdll.LoadLibrary(str(_build(compiler)))
            for target, symbol in _TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: use the XLA formulation
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """True when the native kernel is built and registered (see the module docstring)."""
    why = _load()
    if why is not None and why != "ROWGEOM_NATIVE=0":
        _warn_once(why)
    return why is None


@functools.cache
def _warn_once(why: str) -> None:
    warnings.warn(f"rowgeom: the native CPU kernels (projected RowNorm, the row-diameter "
                  f"bracket) are not available ({why}); using the XLA formulations (same "
                  f"results, about 1.5-2x slower on CPU). Set ROWGEOM_NATIVE=0 to choose that "
                  f"silently.",
                  RuntimeWarning, stacklevel=3)


def threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, _MAX_THREADS))


def rownorm(x: jax.Array, *, tokens_are_rows: bool, num_valid: int, eps: float,
            center_input: bool, center_output: bool) -> jax.Array:
    """The kernel on a 2-D float32 ``x``: ``(V, F)`` when ``tokens_are_rows``, else ``(F, V)``."""
    if x.ndim != 2 or x.dtype != np.float32:
        raise ValueError(f"rownorm kernel: expected a 2-D float32 array, got {x.dtype}{x.shape}")
    call = jax.ffi.ffi_call("rowgeom_rownorm_cpu", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(x, tokens_are_rows=bool(tokens_are_rows), num_valid=np.int64(num_valid),
                eps=np.float32(eps), center_input=bool(center_input),
                center_output=bool(center_output), threads=np.int64(threads()))


def usable() -> bool:
    """Whether to call the kernels: the default backend is the CPU and they are built. An
    accelerator host neither builds nor calls them (callers check the layout themselves)."""
    return jax.default_backend() == "cpu" and available()


def bracket(x3: jax.Array, *, sweeps: int):
    """``(lower, upper, row_sum)`` of an ``(A, V, B)`` float32 view with ``A == 1`` or
    ``B == 1``: `rowgeom._geometry._bounds3` and the sum of the token rows, in float32."""
    a, vocab, b = x3.shape
    rows = a == 1
    flat = x3.reshape(vocab, b) if rows else x3.reshape(a, vocab)
    scalar = jax.ShapeDtypeStruct((), np.float32)
    call = jax.ffi.ffi_call(
        "rowgeom_bracket_cpu",
        (scalar, scalar, jax.ShapeDtypeStruct((b if rows else a,), np.float32)),
        vmap_method="sequential")
    lower, upper, row_sum = call(flat, tokens_are_rows=bool(rows), sweeps=np.int64(sweeps),
                                 threads=np.int64(threads()))
    return lower, upper, row_sum.reshape(a, 1, b)
