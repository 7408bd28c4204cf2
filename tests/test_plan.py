"""One plan (issue 57): :class:`llama_train.layout.ParallelLayout`, the one place the data-parallel
size and a rank's coordinates come from. Fast: no launcher.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from helpers import compose_cfg
from llama_train.config import ConfigError, parallel_layout, validate
from llama_train.layout import ParallelLayout


# -- the layout ------------------------------------------------------------------------------------
def test_four_ranks_two_per_sequence():
    """World 4, parallel.sequence=2: two replicas of two ranks, as the trainer divided before
    (data-parallel rank = rank // N) and as DeepSpeed's groups are cut ([0, 1], [2, 3])."""
    got = [ParallelLayout(4, r, 2) for r in range(4)]
    assert [(lay.data_parallel, lay.dp_rank, lay.sp_rank) for lay in got] == [
        (2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
    assert [lay.dp_rank for lay in got] == [r // 2 for r in range(4)]  # the trainer's old rule
    assert [list(lay.sequence_group) for lay in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    one = ParallelLayout(4, 3)  # no sequence parallelism: every rank its own replica
    assert (one.data_parallel, one.dp_rank, one.sp_rank, list(one.sequence_group)) == (4, 3, 0, [3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        got[0].rank = 1
    for bad in ((3, 0, 2), (4, 4, 2), (0, 0, 1), (4, 0, 0)):
        with pytest.raises(ValueError, match="no such layout"):
            ParallelLayout(*bad)


def test_the_layout_is_deepspeeds_sequence_groups(monkeypatch):
    """DeepSpeed's own ``initialize_sequence_parallel`` (which engine.init_sequence_parallel
    calls), run for each rank of 4 against a stand-in for its comm module, makes the groups and
    group ranks the layout says: the slice a rank trains and the replica whose data it reads."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    from llama_train.engine import sequence_rank

    world, n = 4, 2
    for rank in range(world):
        class Comm:  # torch.distributed's answers for ``rank`` of ``world``; a group: its ranks
            @staticmethod
            def is_initialized():
                return True

            @staticmethod
            def get_world_size(group=None):
                return world if group is None else len(group)

            @staticmethod
            def get_rank(group=None):
                return rank if group is None else list(group).index(rank)

            @staticmethod
            def new_group(ranks):
                return tuple(ranks)

        monkeypatch.setattr(mpu, "dist", Comm)
        monkeypatch.setattr(mpu, "_SEQUENCE_PARALLEL_GROUP", None)
        monkeypatch.setattr(mpu, "_SEQUENCE_DATA_PARALLEL_GROUP", None)
        mpu.initialize_sequence_parallel(sequence_parallel_size=n)
        layout = ParallelLayout(world, rank, n)
        assert mpu.get_sequence_parallel_group() == tuple(layout.sequence_group), rank
        assert sequence_rank(mpu) == layout.sp_rank, rank
        assert mpu.get_sequence_parallel_world_size() == layout.sequence_parallel
        assert layout.dp_rank == mpu.get_sequence_parallel_group()[0] // n == rank // n


# the refusals word for word as config.data_parallel_size raised them before the layout
FIX = "choose parallel.sequence among the common divisors, or 1 to turn it off"
REFUSED = [
    (3, ["parallel.sequence=2"],
     f"parallel.sequence=2 does not divide the 3 rank(s): each group of 2 ranks shares a "
     f"sequence; {FIX}."),
    (2, ["parallel.sequence=2", "trainer.seq_len=63"],
     f"trainer.seq_len=63 is not divisible by parallel.sequence=2: each of the 2 ranks holds an "
     f"equal slice; {FIX} (or change trainer.seq_len)."),
    (4, ["parallel.sequence=4", "model.n_heads=2", "model.n_kv_heads=null"],
     f"model.n_heads=2 is not divisible by parallel.sequence=4: attention gives each rank "
     f"n_heads / 4 heads; {FIX}."),
    (6, ["parallel.sequence=3", "model.n_heads=6", "model.dim=96", "model.n_kv_heads=2",
         "trainer.seq_len=63"],
     f"model.n_kv_heads=2 and parallel.sequence=3: one must divide the other (each rank takes "
     f"n_kv_heads / 3 key/value heads, or with fewer key/value heads than ranks each is copied "
     f"to 3 // n_kv_heads ranks); {FIX}."),
    (2, ["parallel.sequence=2", "comm.simulate_ranks=8"],
     "parallel.sequence=2 with comm.simulate_ranks: a simulated rank has no peers to exchange "
     "sequence slices with; set parallel.sequence=1 to simulate the data-parallel layout."),
]


@pytest.mark.parametrize("world,overrides,message", REFUSED)
def test_the_layouts_refusals_keep_their_words(world, overrides, message):
    cfg = compose_cfg(["model=tiny", *overrides])
    m = cfg.model
    assert ParallelLayout.refusal(world, cfg.parallel.sequence, seq_len=cfg.trainer.seq_len,
                                  n_heads=m.n_heads, kv_heads=m.kv_heads,
                                  simulated=bool(cfg.comm.simulate_ranks)) == message
    for check in (lambda: parallel_layout(cfg, world), lambda: validate(cfg, world, "cpu")):
        with pytest.raises(ConfigError) as e:
            check()
        assert str(e.value) == message


def test_the_layout_needs_nothing_heavy():
    """layout.py imports nothing of the package and neither torch nor DeepSpeed: the config
    (which imports no torch) checks layouts with it."""
    code = ("import sys, llama_train.layout; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'deepspeed') or m.startswith('llama_train.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['llama_train.layout']", out.stdout + out.stderr
