"""One process of a multi-process (or the single-process reference) run of the example trainer.

Run by tests/examples/test_multiprocess.py, not collected by pytest:

    python tests/examples/_multiprocess_worker.py \
        PROCESS_ID NUM_PROCESSES PORT DEVICES CORPUS TOKENS WORKDIR

With NUM_PROCESSES > 1 every process joins a coordinator on 127.0.0.1:PORT (process 0 hosts it)
through the trainer's `--distributed auto` (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID` set as a launcher would) with `DEVICES` simulated CPU devices each and gloo CPU
collectives: the code path of a Cloud TPU pod slice, where each host runs the same command and
`jax.distributed` joins the hosts' devices into one global mesh.
"""

import os
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STEPS = 4


def main(argv):
    process_id, num_processes, port, devices = (int(a) for a in argv[:4])
    corpus, tokens, workdir = argv[4:7]
    jax.config.update("jax_num_cpu_devices", devices)
    if num_processes > 1:
        # XLA:CPU needs an explicit cross-process collectives implementation.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # As a launcher describes the processes; the trainer's --distributed auto reads it.
        os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                          JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(process_id))
    from examples.lm import sharding

    sharding.maybe_initialize_distributed("auto")
    assert jax.process_count() == num_processes, jax.process_count()
    assert jax.device_count() == 8 and jax.local_device_count() == devices, jax.devices()

    import numpy as np

    from examples.lm import configs, train

    # Each process reads the rows its devices hold: half of them on the run's mesh, all of them
    # where the tensor axis spans both processes; the global batch is the one batch either way.
    batch = np.arange(8 * 3).reshape(8, 3)
    for shape in ((2, 2, 2), (1, 1, 8), (1, 2, 4)):
        mesh = sharding.make_mesh(*shape)
        lo, hi = sharding.process_rows(len(batch), mesh)
        share = 8 // min(num_processes, shape[0] * shape[1])
        assert (lo, hi) == ((lo // share) * share, (lo // share) * share + share), (shape, lo, hi)
        array = sharding.global_batch(batch[lo:hi], mesh, batch_size=len(batch))
        assert array.shape == batch.shape, (shape, array.shape)
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), batch[shard.index])

    cfg = configs.override(configs.get_config("test"), {
        "data.source": corpus, "data.dir": tokens, "steps": STEPS, "eval.every": 2,
        "checkpoint.every": 2, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    train.train(cfg, workdir, progress=False, print_fn=print)
    print(f"process {jax.process_index()} of {jax.process_count()} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
