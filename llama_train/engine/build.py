"""The model allocated and initialised for its ZeRO stage, and the one call to
``deepspeed.initialize`` that wraps it into an :class:`~llama_train.engine.wrapper.Engine`."""

from __future__ import annotations

from typing import Any, Dict

import torch

from llama_train.engine.distributed import leads, simulated
from llama_train.engine.sequence import gradient_factor
from llama_train.engine.wrapper import Engine


def build_model(model_args, ds_config: Dict[str, Any], device: torch.device,
                seed: int, mpu: Any = None, float8: Any = None) -> torch.nn.Module:
    """The model, allocated and initialised once, ready for :func:`initialize`.

    ZeRO-3: constructed on the meta device inside ``deepspeed.zero.Init``, which partitions each
    module as ``to_empty`` materialises it, so no rank ever holds more than one module's
    parameters whole; then each parameter is gathered alone, initialised on rank 0 by
    ``Transformer.init_param`` and scattered back. Other stages: materialised on ``device`` and
    initialised there. Either way the weights depend on ``seed`` only (not on the stage, world
    size or dtype), so every configuration starts from the same model. ``mpu``: the
    sequence-parallel groups, from which DeepSpeed's config counts data-parallel ranks (ZeRO-3
    still partitions over every rank). ``float8``: the ``float8`` config group; enabled, the
    block linears become torchao ``Float8Linear`` modules holding the same parameters
    (:func:`llama_train.engine.float8.convert`), before ``deepspeed.initialize`` registers ZeRO-3's
    hooks on the module tree."""
    from llama_train.engine.float8 import convert

    model = _build(model_args, ds_config, device, seed, mpu)
    if float8 is not None:
        convert(model, float8)
    return model


def _build(model_args, ds_config: Dict[str, Any], device: torch.device, seed: int,
           mpu: Any) -> torch.nn.Module:
    from llama_train.model import Transformer

    if ds_config["zero_optimization"]["stage"] != 3:
        return Transformer(model_args, device=device, seed=seed)
    import deepspeed
    import torch._dynamo  # noqa: F401

    # zero.Init replaces torch.Tensor.__new__ while it is open, and torch._dynamo, when first
    # imported (a meta-device op can trigger it), refuses a Tensor.__new__ with another signature
    # (seen with offload, where nothing else had imported it yet): import it before.
    # The dtype comes from ds_config (bf16/fp16/fp32). Not passed explicitly: DeepSpeed 0.19.8's
    # Init turns an explicit dtype into bf16 on a CPU accelerator (an operator-precedence slip in
    # Init._set_dtype), which rounded fp32 weights to bf16.
    with deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=mpu):
        model = Transformer(model_args, device="meta")
        model.to_empty(device=device)  # partitions module by module (DeepSpeed's skip_init path)
    model.tie_weights()
    first = leads()  # rank 0 (or a simulated rank) writes, the others get its values
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if first:
                model.init_param(name, p, seed)
    model.reset_rope()
    return model


def load_full_state(model: torch.nn.Module, state: Dict[str, torch.Tensor],
                    zero_stage: int) -> None:
    """``model.load_state_dict(state, strict=True)``, also for a ZeRO-3-partitioned model: each
    parameter is gathered alone, rank 0 copies its value in and DeepSpeed scatters it back."""
    if zero_stage != 3:
        model.load_state_dict(state, strict=True)
        return
    import deepspeed

    names = dict(model.named_parameters())
    missing = sorted(set(names) - set(state))
    unexpected = sorted(set(state) - set(names) - _tied_aliases(model))
    if missing or unexpected:
        raise RuntimeError(f"state dict does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    first = leads()  # rank 0 (or a simulated rank) writes, the others get its values
    with torch.no_grad():
        for name, p in names.items():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if first:
                    if tuple(state[name].shape) != tuple(p.shape):
                        raise RuntimeError(f"{name}: shape {tuple(state[name].shape)} in the "
                                           f"state dict, {tuple(p.shape)} in the model")
                    p.copy_(state[name])


def _tied_aliases(model: torch.nn.Module) -> set:
    """Names a state dict may carry for a tied parameter that ``named_parameters`` lists once."""
    return {n for n, _ in model.named_parameters(remove_duplicate=False)}


def compile_blocks(model: torch.nn.Module, zero_stage: int) -> None:
    """``torch.compile`` each transformer block's forward, in place (parameter names stay those
    of the plain model). The forward, not the module's call: module hooks run around the graph,
    not inside it. ZeRO-3 hooks every submodule (a graph break at each of them, and guards on
    each module's ``ds_id`` that recompiled per Linear): its blocks become DeepSpeed leaf modules,
    each gathered whole by the block's own hooks. Then every block runs one forward graph and
    one backward graph, compiled once and shared by all blocks."""
    if zero_stage == 3:
        from deepspeed.utils import set_z3_leaf_module

        for block in model.layers:
            set_z3_leaf_module(block, True)
    for block in model.layers:
        block.forward = torch.compile(block.forward)


def compiled_ds_config(ds_config: Dict[str, Any]) -> None:
    """``ds_config`` for compiled blocks, in place: under ZeRO-3, DeepSpeed's memory-efficient
    linear off unless ``deepspeed.extra`` sets it. zero.Init swaps ``F.linear`` for its
    autograd.Function, which traced into a block saves what a plain linear does (the parameter,
    released and gathered again as before) but keeps AOT autograd's cache from storing the
    graph, so every start compiled it again."""
    zero = ds_config["zero_optimization"]
    if zero["stage"] == 3:
        zero.setdefault("memory_efficient_linear", False)


def initialize(model: torch.nn.Module, param_groups, ds_config: Dict[str, Any],
               mpu: Any = None) -> Engine:
    """The one call to ``deepspeed.initialize``; ``mpu``: the sequence-parallel groups of
    :func:`llama_train.engine.sequence.init_sequence_parallel` (None: data parallel only)."""
    import deepspeed

    ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups,
                                       config=ds_config, mpu=mpu)
    if simulated():  # the only process of its job also writes what DeepSpeed's rank 0 writes
        ds.save_non_zero_checkpoint = True
    if ds.dp_world_size == 1 and ds_config["zero_optimization"]["stage"] == 0:
        # Nothing to reduce: skip DeepSpeed's flatten/all-reduce/copy-back of every gradient
        # (3.5% of a `small` step on one rank, docs/performance.md).
        ds.enable_backward_allreduce = False
    stage = ds_config["zero_optimization"]["stage"]
    return Engine(ds, stage, gradient_factor(stage, mpu))


def preload_deepspeed(offload: bool) -> None:
    """Import the DeepSpeed code that :func:`build_model` and :func:`initialize` load on first
    use, for measurement tools that read an idle baseline before building (``llama-bench
    memory``): DeepSpeed's ZeRO and mixed-precision optimizer modules (and Muon, which ZeRO
    imports in initialize), and with ``offload`` DeepSpeed's CPU Adam extension, loaded and
    stepped once on a throwaway parameter. None of it depends on the model under test."""
    import importlib

    for mod in ("deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2",
                "deepspeed.runtime.bf16_optimizer", "deepspeed.runtime.fp16.unfused_optimizer",
                "deepspeed.runtime.fp16.fused_optimizer", "deepspeed.runtime.zero.partition_parameters",
                # imported (and its kernels compiled) by is_zero_supported_optimizer: ~43 MiB
                "deepspeed.runtime.zero.muon.muon_optimizer"):
        importlib.import_module(mod)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.zeros(8)
        DeepSpeedCPUAdam([p]).step()


def warm_up(offload: bool) -> None:
    """Load the code every rank runs, for measurement tools that read an idle baseline before
    building (``llama-bench memory``, a simulated rank): torch._dynamo (torch loads it lazily on
    the first nn.init or fused-AdamW call; inside ``deepspeed.zero.Init``, which patches tensor
    constructors, that import fails with "Signature mismatch ... new_tensor", which bites with
    offload where nothing imported it before), :func:`preload_deepspeed`, and one AdamW step of
    a throwaway 2-layer model in plain torch (torch's CPU kernels and thread pools). None of it
    depends on the model under test."""
    import gc

    import torch._dynamo  # noqa: F401

    from llama_train.model import ModelArgs, Transformer

    preload_deepspeed(offload)
    net = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=16))
    opt = torch.optim.AdamW(net.parameters())
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            x = torch.randint(0, 256, (1, 16))
            _, loss = net(x, x)
        loss.backward()
        opt.step()
    del net, opt
    gc.collect()
