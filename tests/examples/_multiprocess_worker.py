"""One process of a multi-process (or the single-process reference) run of the example trainer.

Run by tests/examples/test_multiprocess.py, not collected by pytest:

    python tests/examples/_multiprocess_worker.py \
        PROCESS_ID NUM_PROCESSES PORT DEVICES CORPUS TOKENS WORKDIR

With NUM_PROCESSES > 1 every process calls `jax.distributed.initialize` against a coordinator on
127.0.0.1:PORT (process 0 hosts it) with `DEVICES` simulated CPU devices each and gloo CPU
collectives: the code path of a Cloud TPU pod slice, where each host runs the same command and
`jax.distributed` joins the hosts' devices into one global mesh.
"""

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
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                                   num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=120)
    assert jax.process_count() == num_processes, jax.process_count()
    assert jax.device_count() == 8 and jax.local_device_count() == devices, jax.devices()

    from examples.lm import configs, train

    cfg = configs.override(configs.get_config("test"), {
        "data.source": corpus, "data.dir": tokens, "steps": STEPS, "eval.every": 2,
        "checkpoint.every": 2, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    train.train(cfg, workdir, progress=False, print_fn=print)
    print(f"process {jax.process_index()} of {jax.process_count()} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
