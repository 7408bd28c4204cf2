"""Sequence parallelism (``parallel.sequence=N``, DeepSpeed-Ulysses) through the real launcher,
fp32 on CPU ranks over gloo: N ranks sharing each sequence train what one rank trains with the
same global batch, step by step (loss, gradient norm, validation loss) within 1e-5.

Three launches check it all: 2 ranks with N=2 (one data-parallel replica) under ZeRO-3 with
document masking (documents crossing the ranks' slices) and activation checkpointing; 4 ranks
with N=2 (two replicas) under ZeRO-1 with one key/value head (fewer than N: each is copied to
both ranks); and the first run resumed from its step-5 checkpoint with N=1 (another layout of
the same 2 ranks), which continues it exactly. The references run in this process, on one rank.
The config checks that refuse a layout before any process group are in the fast tier below.
"""

from __future__ import annotations

import pytest

from helpers import (assert_losses_close, cfg_for, compose_cfg, copy_at_step, losses, metrics,
                     resumed_from, train, world_of_one)
from llama_train.config import ConfigError, validate

TOL = 1e-5
STEPS = 10
COMMON = [f"trainer.max_steps={STEPS}", "trainer.eval_every=5", "trainer.document_mask=true",
          "trainer.micro_batch=2"]
TWO = [*COMMON, "deepspeed.zero_stage=3", "model.activation_checkpointing=true",
       "trainer.save_every=5"]
FOUR = [*COMMON, "deepspeed.zero_stage=1", "model.n_kv_heads=1"]


def _by_step(out, key):
    return {r["step"]: r[key] for r in metrics(out) if r.get(key) is not None}


def _same_run(a, b, steps=None):
    """Losses, gradient norms (relative) and validation losses of ``a`` and ``b`` agree."""
    la, lb = losses(a), losses(b)
    if steps is not None:
        la, lb = ({k: v for k, v in d.items() if k in steps} for d in (la, lb))
    assert len(la) == (len(steps) if steps is not None else STEPS)
    assert_losses_close(la, lb, TOL)
    ga, gb = _by_step(a, "grad_norm"), _by_step(b, "grad_norm")
    for k in la:
        assert ga[k] == pytest.approx(gb[k], rel=TOL), (k, ga[k], gb[k])
    va, vb = _by_step(a, "val_loss"), _by_step(b, "val_loss")
    if steps is not None:
        va, vb = ({k: v for k, v in d.items() if k in steps} for d in (va, vb))
    assert va and va.keys() == vb.keys()
    assert_losses_close(va, vb, TOL)


def _one_rank(out, *overrides):
    from llama_train.train import train as train_in_process

    with world_of_one():
        train_in_process(cfg_for(out, *overrides))
    return out


@pytest.mark.slow
def test_ranks_sharing_sequences_train_what_one_rank_trains(tmp_path):
    # 2 ranks, N=2: one replica holding each sequence in two halves (global batch 2)
    two = tmp_path / "two"
    train(two, [*TWO, "parallel.sequence=2"], nprocs=2)
    ref2 = _one_rank(tmp_path / "ref2", *COMMON)
    _same_run(two, ref2)

    # 4 ranks, N=2: two replicas (global batch 2 x 2), a K/V head shared by both halves
    four = tmp_path / "four"
    train(four, [*FOUR, "parallel.sequence=2"], nprocs=4)
    ref4 = _one_rank(tmp_path / "ref4", *COMMON, "model.n_kv_heads=1", "trainer.global_batch=4")
    _same_run(four, ref4)

    # the 2-rank run resumed at step 5 with N=1: the same ranks as two replicas of micro-batch 1
    again = copy_at_step(two, tmp_path / "again", 5)
    train(again, [*TWO, "parallel.sequence=1", "trainer.micro_batch=1", "trainer.resume=auto"],
          nprocs=2)
    assert len(resumed_from(again)) == 1
    _same_run(again, two, steps=range(6, STEPS + 1))


@pytest.mark.parametrize("world,overrides,key", [
    (3, ["parallel.sequence=2"], "parallel.sequence=2 does not divide the 3 rank"),
    (2, ["parallel.sequence=2", "trainer.seq_len=63"], "trainer.seq_len=63 is not divisible"),
    (4, ["parallel.sequence=4", "model.n_heads=2", "model.n_kv_heads=null"],
     "model.n_heads=2 is not divisible by parallel.sequence=4"),
    (6, ["parallel.sequence=3", "model.n_heads=6", "model.dim=96", "model.n_kv_heads=2",
         "trainer.seq_len=63"],
     "model.n_kv_heads=2 and parallel.sequence=3"),
    (2, ["parallel.sequence=2", "comm.simulate_ranks=8"], "comm.simulate_ranks"),
])
def test_layouts_that_cannot_work_are_refused_with_the_key(world, overrides, key):
    cfg = compose_cfg(["model=tiny", *overrides])
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(".", r"\.")):
        validate(cfg, world, "cpu")


def test_the_global_batch_counts_data_parallel_replicas():
    cfg = compose_cfg(["model=tiny", "parallel.sequence=2", "trainer.micro_batch=2",
                       "trainer.seq_len=64"])
    plan = validate(cfg, 8, "cpu")
    assert (plan.world_size, plan.global_batch, plan.grad_accum) == (4, 8, 1)
    with pytest.raises(ConfigError, match="parallel.sequence=0"):
        compose_cfg(["parallel.sequence=0"])
