"""Multi-process training: two processes joined by `jax.distributed` equal one 8-device process.

Each process of the multi-process run owns 4 simulated CPU devices; `jax.distributed.initialize`
(coordinator on 127.0.0.1, gloo CPU collectives) joins them into one global 8-device mesh
(data=2, fsdp=2, tensor=2), each process feeds its half of every batch and both write one
checkpoint together. That is the code path of a Cloud TPU pod slice (one process per host). The
reference is a single process with 8 devices and the same mesh; results agree up to float32
reduction order (collectives sum in a different order), not bit for bit.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from _lm_fixtures import deterministic_records

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_multiprocess_worker.py")
STEPS = 4  # as in the worker
# One launch (all its processes together); the test's pytest timeout covers two launches.
LAUNCH_TIMEOUT_S = 200
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 120)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(REPO)}


def _worker(process_id, num_processes, port, devices, root, workdir):
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(process_id), str(num_processes), str(port),
         str(devices), str(root / "corpus"), str(root / "tokens"), str(workdir)],
        env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs, timeout_s=LAUNCH_TIMEOUT_S):
    """Wait for every process of one launch within one deadline; on a failure or a timeout, fail
    with each process's exit status and output tail (the others are killed)."""
    deadline = time.monotonic() + timeout_s
    outs, late = [], False
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0])
            except subprocess.TimeoutExpired:
                late = True
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outs += [p.communicate()[0] for p in procs[len(outs):]]
    if late or any(p.returncode != 0 for p in procs):
        report = "\n".join(f"--- process {i}: exit {p.returncode}\n{out[-3000:]}"
                           for i, (p, out) in enumerate(zip(procs, outs, strict=True)))
        what = f"ran past its {timeout_s} s timeout" if late else "failed"
        pytest.fail(f"a launch of {len(procs)} process(es) {what}\n{report}", pytrace=False)
    return outs


@pytest.fixture(scope="module")
def corpus(lm_corpus):
    # The session's corpus and token cache (conftest's `lm_corpus`): the workers only read it.
    return lm_corpus


def test_two_processes_equal_one(corpus, tmp_path, final_checkpoint):
    multi, single = tmp_path / "two_processes", tmp_path / "one_process"
    port = _free_port()
    # The reference runs beside the two processes (independent runs: a core the two leave idle
    # while one of them compiles or waits for the other is used).
    pair = [_worker(0, 2, port, 4, corpus, multi), _worker(1, 2, port, 4, corpus, multi)]
    reference = [_worker(0, 1, 0, 8, corpus, single)]
    try:
        outs = _finish(pair)
    except BaseException:  # the pair failed: stop the reference too
        for p in reference:
            p.kill()
            p.communicate()
        raise
    assert "8 cpu devices, 2 process(es)" in outs[0], outs[0][-2000:]
    assert "process 0 of 2 done" in outs[0] and "process 1 of 2 done" in outs[1]
    (out,) = _finish(reference)
    assert "8 cpu devices, 1 process(es)" in out

    got, expected = deterministic_records(multi), deterministic_records(single)
    assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
    assert [r.keys() for r in got] == [r.keys() for r in expected]
    for g, e in zip(got, expected, strict=True):
        for key in e:
            np.testing.assert_allclose(g[key], e[key], rtol=2e-5, atol=1e-6,
                                       err_msg=f"step {e['step']} {key}")

    state_m, meta_m = final_checkpoint(multi, STEPS)
    state_s, meta_s = final_checkpoint(single, STEPS)
    assert (meta_m["process_count"], meta_s["process_count"]) == (2, 1)
    assert meta_m["mesh"] == meta_s["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    leaves_m = jax.tree_util.tree_leaves_with_path(state_m["params"])
    leaves_s = jax.tree.leaves(state_s["params"])
    assert len(leaves_m) == len(leaves_s) > 0
    worst = 0.0
    for (path, a), b in zip(leaves_m, leaves_s, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
        worst = max(worst, float(np.max(np.abs(np.asarray(a) - np.asarray(b)))))
    # Both ran the same number of micro-steps and carry the same RNG key.
    assert int(state_m["micro_step"]) == int(state_s["micro_step"]) == STEPS
    np.testing.assert_array_equal(state_m["rng"], state_s["rng"])
    print(f"max |params(2 processes) - params(1 process)| = {worst:.3g}")
