"""The native CPU kernel of projected RowNorm (``csrc/rownorm.cc``), an XLA FFI custom call.

Contract: `available()` builds the kernel on first use with the system C++ compiler (``$CXX``,
else ``c++``) against the installed jaxlib's FFI headers, caches the shared library under
``$ROWGEOM_CACHE_DIR`` (default ``~/.cache/rowgeom``) keyed by the source, the jaxlib version, the
compiler and this CPU, registers it, and returns True. Without a compiler, or if the build fails,
it warns once (naming the reason and how to silence it) and returns False: callers then use the
XLA formulation, which gives the same result more slowly. ``ROWGEOM_NATIVE=0`` turns the kernel
off. `rownorm` is the custom call on a 2-D float32 array, its output aliased to its input so a
donated input is overwritten in place.

Why a hand-written kernel: XLA:CPU runs the reductions the exact algorithm needs at about half
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

_SOURCE = Path(__file__).parent / "csrc" / "rownorm.cc"
_TARGET = "rowgeom_rownorm_cpu"
_SYMBOL = "RowgeomRowNorm"
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
        _SOURCE.read_text(), jaxlib.__version__, compiler, " ".join(_FLAGS), _cpu_signature(),
    ]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"rownorm-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
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
            jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)),
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
    warnings.warn(f"rowgeom: the native CPU kernel of projected RowNorm is not available "
                  f"({why}); using the XLA formulation (same result, about 1.5-2x slower on "
                  f"CPU). Set ROWGEOM_NATIVE=0 to choose that silently.",
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
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(x, tokens_are_rows=bool(tokens_are_rows), num_valid=np.int64(num_valid),
                eps=np.float32(eps), center_input=bool(center_input),
                center_output=bool(center_output), threads=np.int64(threads()))
