"""Studies built on the example language model (`examples/lm`): drivers that train many runs and
write reports under `docs/results/`. Run each as a module, e.g. `python -m studies.scale_ladder`."""
