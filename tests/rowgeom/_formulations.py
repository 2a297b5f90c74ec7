"""Trace rowgeom with one of its two formulations fixed, whatever this process's device count.

rowgeom picks the formulation when a function is traced: the XLA:CPU one (`rowgeom._cpu`) in a
process with one CPU device, the masked one everywhere else. `traced_as("masked")` lets a
one-device test check the masked formulation end to end (the 8-device checks in
`_sharded_checks.py` run it for real); `traced_as("cpu")` the other way round. Call (compile)
the function inside the block: rowgeom's own jitted helpers are cleared on entry and exit so
that no trace of the other formulation is reused.
"""

import contextlib

from rowgeom import _cpu, _geometry

FORMULATIONS = ("cpu", "masked")
_JITTED = (_geometry._bounds, _geometry._bounds_and_sum, _geometry._row_diameter)


@contextlib.contextmanager
def traced_as(name):
    assert name in FORMULATIONS, name
    saved = _cpu.one_cpu_device
    _cpu.one_cpu_device = lambda: name == "cpu"
    for fn in _JITTED:
        fn.clear_cache()
    try:
        yield
    finally:
        _cpu.one_cpu_device = saved
        for fn in _JITTED:
            fn.clear_cache()
