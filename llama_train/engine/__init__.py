"""The only package that talks to DeepSpeed: config translation and ``deepspeed.initialize``.

Everything DeepSpeed-specific (the JSON config, the accelerator choice, the process group) is
decided here from the Hydra sub-configs, so the model stays plain ``torch.nn`` and the training
loop only sees an engine with ``forward``/``backward``/``step``. One module per job:

    runtime.py        Runtime, detect_runtime: where this process runs (no DeepSpeed)
    distributed.py    init_distributed / shutdown_distributed: the process group, DeepSpeed's
                      comm backend, the patches around its start; checkpoint_group
    ds_config.py      resolve_precision, build_ds_config: our sub-configs -> DeepSpeed's JSON
    build.py          build_model (ZeRO-3 inside deepspeed.zero.Init), load_full_state,
                      compile_blocks (trainer.compile), initialize (the one call to
                      deepspeed.initialize)
    sequence.py       init_sequence_parallel, shard_attention: DeepSpeed-Ulysses sequence
                      parallelism (parallel.sequence)
    wrapper.py        Engine, StepResult: the training loop's view of DeepSpeed's engine
    ds_checkpoint.py  restricted_loads, convert_to_universal, consolidate_fp32
    estimates.py      DeepSpeed's own model-state memory estimators (llama-plan model-info)

Beside them, what else stands between the model and the device, none of it DeepSpeed's:
    flops.py          the device's peak FLOP/s behind MFU (a datasheet figure or a timed
                      matmul), the memory a process holds; re-exported here
    float8.py         float8.enabled: torchao's FP8 linears, applied by build_model

DeepSpeed is imported inside functions only: importing this package does not import it.
"""

from llama_train.engine.build import (build_model, compile_blocks, compiled_ds_config, initialize,
                                      load_full_state, preload_deepspeed, warm_up)
from llama_train.engine.distributed import (STARTUP_TIMEOUT, checkpoint_group, init_distributed,
                                            leads, load_deepspeed, shm_comm_op_loaded,
                                            shutdown_distributed, simulated)
from llama_train.engine.ds_checkpoint import (RESTRICTED_LOAD_ENV, consolidate_fp32,
                                              convert_to_universal, restricted_loads)
from llama_train.engine.ds_config import build_ds_config, resolve_precision
from llama_train.engine.flops import PeakFlops, measure_matmul_flops, memory_stats, peak_flops
from llama_train.engine.runtime import Runtime, deepspeed_version, detect_runtime
from llama_train.engine.sequence import (all_to_all_meter, all_to_all_seconds,
                                         init_sequence_parallel, sequence_rank, shard_attention)
from llama_train.engine.wrapper import Engine, StepResult, unwrap

__all__ = [
    "Runtime", "detect_runtime", "deepspeed_version",
    "init_distributed", "shutdown_distributed", "load_deepspeed", "shm_comm_op_loaded",
    "simulated", "leads", "checkpoint_group",
    "STARTUP_TIMEOUT",
    "resolve_precision", "build_ds_config",
    "build_model", "load_full_state", "compile_blocks", "compiled_ds_config", "initialize",
    "preload_deepspeed", "warm_up",
    "init_sequence_parallel", "sequence_rank", "shard_attention", "all_to_all_meter",
    "all_to_all_seconds",
    "Engine", "StepResult", "unwrap",
    "restricted_loads", "RESTRICTED_LOAD_ENV", "convert_to_universal", "consolidate_fp32",
    "PeakFlops", "peak_flops", "measure_matmul_flops", "memory_stats",
]
