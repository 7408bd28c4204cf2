"""How the ranks of a job share the work: :class:`ParallelLayout`, the one place the
data-parallel size and a rank's coordinates are derived from the world, the rank and
``parallel.sequence``.

Plain Python (no torch, no DeepSpeed, nothing of the package): the config (``config.py``) checks
a layout through :meth:`ParallelLayout.refusal` before any process group exists, and everything
after it (the plan, the trainer, the data loader's shares, the dry run's printout, the
benchmarks) reads the layout instead of dividing again.

The convention is DeepSpeed's (``deepspeed.runtime.sequence_parallel.parallel_state_sp``, which
``engine/sequence.py`` asks for the groups): the sequence groups are consecutive ranks,
``[0, N), [N, 2N), ...``, so rank r trains slice ``r % N`` of every sequence of data-parallel
replica ``r // N``. Another axis (ZeRO++'s hpZ partitions, ``deepspeed.zeropp.hpz_partition_size``:
also groups of consecutive ranks) would be one more field and its coordinates here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParallelLayout:
    """``world`` ranks, this one ``rank``, ``sequence_parallel`` consecutive ranks sharing each
    sequence (DeepSpeed-Ulysses; 1: off)."""

    world: int
    rank: int = 0
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        if (self.world < 1 or self.sequence_parallel < 1 or self.world % self.sequence_parallel
                or not 0 <= self.rank < self.world):
            raise ValueError(f"no such layout: rank {self.rank} of {self.world} with "
                             f"{self.sequence_parallel} rank(s) per sequence group")

    @property
    def data_parallel(self) -> int:
        """How many different micro-batches a step trains at once: ranks / sequence_parallel."""
        return self.world // self.sequence_parallel

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: which share of each global batch it reads."""
        return self.rank // self.sequence_parallel

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sequence group: which slice of each sequence it holds."""
        return self.rank % self.sequence_parallel

    @property
    def sequence_group(self) -> range:
        """The ranks that share this rank's sequences (DeepSpeed's sequence-parallel group)."""
        first = self.dp_rank * self.sequence_parallel
        return range(first, first + self.sequence_parallel)

    @staticmethod
    def refusal(world: int, sequence_parallel: int, *, seq_len: int, n_heads: int,
                kv_heads: int, simulated: bool) -> Optional[str]:
        """Why ``sequence_parallel`` ranks per sequence cannot train this model on ``world``
        ranks (the message names the key and the fix), or None."""
        n = sequence_parallel
        if n == 1:
            return None
        fix = "choose parallel.sequence among the common divisors, or 1 to turn it off"
        if world % n:
            return (f"parallel.sequence={n} does not divide the {world} rank(s): each "
                    f"group of {n} ranks shares a sequence; {fix}.")
        if seq_len % n:
            return (f"trainer.seq_len={seq_len} is not divisible by "
                    f"parallel.sequence={n}: each of the {n} ranks holds an equal slice; "
                    f"{fix} (or change trainer.seq_len).")
        if n_heads % n:
            return (f"model.n_heads={n_heads} is not divisible by parallel.sequence={n}: "
                    f"attention gives each rank n_heads / {n} heads; {fix}.")
        if kv_heads % n and n % kv_heads:
            return (
                f"model.n_kv_heads={kv_heads} and parallel.sequence={n}: one must divide the other "
                f"(each rank takes n_kv_heads / {n} key/value heads, or with fewer key/value heads "
                f"than ranks each is copied to {n} // n_kv_heads ranks); {fix}.")
        if simulated:
            return (f"parallel.sequence={n} with comm.simulate_ranks: a simulated rank has "
                    f"no peers to exchange sequence slices with; set parallel.sequence=1 "
                    f"to simulate the data-parallel layout.")
        return None
