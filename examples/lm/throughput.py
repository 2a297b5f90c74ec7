"""Throughput: tokens per second and model-FLOPs utilisation (MFU) against the device's peak.

MFU = (training FLOPs per token, `model.flops_per_token`) x (tokens/s) / (peak FLOP/s of all
devices). Peaks are dense bf16 matrix-multiply rates from the vendors' data sheets, looked up by
`jax.Device.device_kind`; for an unknown device (a CPU, a new chip) MFU is not reported rather
than guessed. A run in float32 compute is still compared with the bf16 peak: MFU says how far the
run is from what the hardware can do.
"""

from __future__ import annotations

import jax

# device_kind prefix (lower case) -> peak dense bf16 FLOP/s per device (one chip / one GPU).
PEAK_FLOPS = {
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,  # v5e
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,  # v6e (Trillium)
    "tpu v6e": 918e12,
    "tpu7x": 2307e12,
    "nvidia h200": 989e12,
    "nvidia h100": 989e12,  # SXM; PCIe parts are lower
    "nvidia gh200": 989e12,
    "nvidia b200": 2250e12,
    "nvidia a100": 312e12,
    "nvidia l4": 121e12,
    "nvidia a10g": 125e12,
}


def peak_flops(device=None) -> float | None:
    """Peak bf16 FLOP/s of `device` (default: the first device), or None when unknown."""
    kind = (device or jax.devices()[0]).device_kind.lower()
    # Longest prefix first, so "tpu v5 lite" wins over "tpu v5".
    for prefix in sorted(PEAK_FLOPS, key=len, reverse=True):
        if kind.startswith(prefix):
            return PEAK_FLOPS[prefix]
    return None


def mfu(tokens_per_sec: float, flops_per_token: float, *, num_devices: int | None = None,
        peak: float | None = None) -> float | None:
    """Model-FLOPs utilisation in [0, 1], or None when the device's peak is unknown."""
    peak = peak_flops() if peak is None else peak
    if peak is None:
        return None
    num_devices = jax.device_count() if num_devices is None else num_devices
    return tokens_per_sec * flops_per_token / (peak * num_devices)
