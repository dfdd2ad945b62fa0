"""The median time of a callable on the current CUDA stream, for the
bench scripts that time single ops (conv_variants.py, batch_norm_shapes.py)."""

import statistics

import torch


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    """warmup untimed calls, then the median of reps calls, each timed with
    CUDA events and waited for before the next."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
