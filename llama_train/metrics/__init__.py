"""What a run measures and records, and how it is read back. Imports nothing itself.

    tracking.py  Tracker: metrics.jsonl always, W&B and TensorBoard when enabled (rank 0)
    meter.py     peak memory and wall time per phase (llama-bench memory, a simulated rank)
    plot.py      llama-plot: a run's curves from its metrics.jsonl

The files' formats are :mod:`llama_train.records`' (other programs read them); MFU's
denominator, the device's peak FLOP/s, is :mod:`llama_train.engine.flops`'.
"""
