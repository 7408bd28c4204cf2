"""Exact, resumable, data-parallel loading of packed tokens.

The sample stream is defined globally, independent of how many ranks read it:

    window w          = tokens[w*L : w*L + L + 1]         (L = seq_len; x = w[:-1], y = w[1:])
    windows per epoch   n = (ntokens - 1) // L
    global sample k   = window perm_{k // n}(k % n)       (perm_e: a permutation of [0, n) fixed
                                                            by (seed, epoch e); epochs chain forever)
    global batch b    = samples [b*G, (b+1)*G)            (G = global_batch)
    rank r of D       = the contiguous slice [b*G + r*G/D, b*G + (r+1)*G/D),
                        yielded as G/(D*M) micro-batches of M

So ranks never overlap or leave gaps, and the stream does not depend on D or M: a run can resume
on another world size or micro-batch and see exactly the same data. The permutation is a keyed
Feistel network evaluated per index (O(1) memory, no state to replay), so resuming at sample k
costs nothing and is identical on any machine and numpy version.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import signal
import weakref

import logging
import os
from typing import Iterator, Optional, Union

import numpy as np
import torch
from torch.utils.data import DataLoader

from .errors import DataChanged, DataError, DataInterrupted
from .packed import PackedTokens
from .workers import (_close_if_alive, _dead_workers, _death_of, _defer_worker_signal_errors,
                      _describe_state, _init_worker, _unwrap_worker_error)
from llama_train import watchdog
from llama_train.util import splitmix64

log = logging.getLogger(__name__)

_ROUNDS = 6


class DataWorkerDied(DataInterrupted):
    """A DataLoader worker of this rank died under the job: killed by a signal (SIGKILL from the
    kernel's out-of-memory killer, SIGSEGV, SIGBUS, ...), exited with an error code, or ran out
    of memory (MemoryError). Exit 6 (llama_train.train), at once, naming the worker, the signal
    or code, the likely cause and the settings that use less memory; the checkpoints are intact."""

    exit_code = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, vectorized on uint64 (wraps mod 2**64 by design)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class IndexPermutation:
    """A pseudo-random permutation of [0, n) keyed by (seed, epoch), evaluated per index.

    A balanced Feistel network on the smallest even number of bits covering n is a bijection of
    [0, 2**bits); "cycle walking" (re-applying it while the result is >= n) restricts it to a
    bijection of [0, n). The domain is < 4n, so the expected number of walks is < 4.
    """

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError("IndexPermutation needs n >= 1")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        base = splitmix64(splitmix64(seed) ^ (epoch * 0x9E3779B97F4A7C15))
        self.keys = [np.uint64(splitmix64(base + r + 1)) for r in range(_ROUNDS)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        y = self._round_trip(np.asarray(idx, dtype=np.uint64))
        out = y >= self.n
        while out.any():
            y[out] = self._round_trip(y[out])
            out = y >= self.n
        return y.astype(np.int64)


class _Windows:
    """Maps global sample ids to windows and reads them; lives in the DataLoader workers."""

    def __init__(self, tokens: PackedTokens, seq_len: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.n = (len(tokens) - 1) // seq_len
        self._perm: dict[int, IndexPermutation] = {}

    def window_ids(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.int64)
        epochs, pos = np.divmod(samples, self.n)
        out = np.empty_like(samples)
        for e in np.unique(epochs):
            sel = epochs == e
            perm = self._perm.get(int(e))
            if perm is None:
                if len(self._perm) > 4:
                    self._perm.clear()
                perm = self._perm[int(e)] = IndexPermutation(self.n, self.seed, int(e))
            out[sel] = perm(pos[sel])
        return out

    def read(self, window_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.seq_len
        rows = self.tokens.windows([int(w) * L for w in window_ids], L + 1)  # checked, unchanged
        w = torch.from_numpy(rows.astype(np.int64))  # (B, L+1)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # x, y: (B, L)

    def __getitem__(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(self.window_ids(samples))


class _MixtureWindows:
    """Global sample ids -> windows of a mixture's sources (data/mixture.py): sample k reads
    window ``perm_s(i)`` of source s, where (s, i) = Allocation.assign(k) and each source runs
    its own epochs of its own shuffle."""

    def __init__(self, meta: dict, seq_len: int, seed: int, split: str = "train",
                 verify: bool = False):
        from .mixture import Allocation, source_seed

        self.names = [s["name"] for s in meta["sources"]]
        self.weights = [float(s["weight"]) for s in meta["sources"]]
        self.parts = []
        for s in meta["sources"]:
            tokens = PackedTokens(s["dir"], split, verify=verify)
            if s["weight"] > 0 and len(tokens) < seq_len + 1:
                raise DataError(f"data.mixture source {s['name']!r}: its {split!r} split has "
                                f"{len(tokens)} tokens, fewer than seq_len+1={seq_len + 1} for "
                                f"one window: lower seq_len or give it more data")
            self.parts.append(_Windows(tokens, seq_len, source_seed(seed, s["name"]))
                              if len(tokens) > seq_len else None)
        self.alloc = Allocation(self.weights, seed)
        self.seq_len = seq_len
        self.n = sum(p.n for p, w in zip(self.parts, self.weights) if w > 0)

    def __getitem__(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        src, idx = self.alloc.assign(np.asarray(samples, dtype=np.int64))
        x = torch.empty(len(src), self.seq_len, dtype=torch.int64)
        y = torch.empty_like(x)
        for s in np.unique(src):
            sel = np.flatnonzero(src == s)
            part = self.parts[int(s)]
            x[sel], y[sel] = part.read(part.window_ids(idx[sel]))
        return x, y  # (B, seq_len) each

    def counts(self, samples: int) -> dict:
        """Windows each source gave to the first ``samples`` global samples."""
        return dict(zip(self.names, self.alloc.counts(samples)))

    def epochs(self, samples: int) -> dict:
        """The epoch each (weighted) source is in after ``samples`` global samples."""
        return {n: c // p.n for (n, c), p in zip(self.counts(samples).items(), self.parts)
                if p is not None and c > 0}


class _RankSampler:
    """Infinite stream of this rank's micro-batches, as arrays of global sample ids."""

    def __init__(self, global_batch: int, micro_batch: int, dp_rank: int, dp_world: int):
        self.G, self.M, self.r, self.D = global_batch, micro_batch, dp_rank, dp_world
        self.start = 0  # global sample the next iteration starts at

    def __iter__(self) -> Iterator[np.ndarray]:
        per_rank = self.G // self.D
        base = self.start
        while True:
            lo = base + self.r * per_rank
            for m in range(per_rank // self.M):
                yield np.arange(lo + m * self.M, lo + (m + 1) * self.M, dtype=np.int64)
            base += self.G


def _check_positive(**kw: int) -> None:
    for k, v in kw.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise DataError(f"{k}={v!r} must be a positive integer")


class TrainLoader:
    """Infinite iterator of (x, y) LongTensors (micro_batch, seq_len) for one data-parallel rank.

    `state_dict()["consumed_samples"]` counts the global samples of the complete global batches
    yielded so far (= optimizer steps x global_batch); `load_state_dict` jumps to any global
    sample position without reading the skipped data, on any world size / micro batch.

    `data_timeout_s` (the trainer passes comm.timeout_s): a wait for the next micro-batch that
    outlives it stops the rank with exit 5 (watchdog.Deadline), naming the rank, the step and
    the workers' state, the workers SIGKILLed first: a stopped worker, or a read hung on a file
    system, would otherwise hang the job without a word (its heartbeat runs on). A shard that
    changes under the job stops it with DataChanged (exit 3) naming the rank and the step.
    """

    def __init__(
        self,
        prepared_dir: Union[str, os.PathLike],
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 1234,
        num_workers: int = 1,
        pin_memory: bool = False,
        split: str = "train",
        verify: bool = False,
        prefetch_factor: int = 4,
        data_timeout_s: Optional[float] = None,
    ):
        _check_positive(seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch, dp_world=dp_world)
        if not 0 <= dp_rank < dp_world:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        if global_batch % (dp_world * micro_batch):
            raise DataError(
                f"global_batch={global_batch} is not divisible by micro_batch={micro_batch} x "
                f"data-parallel world size {dp_world} = {micro_batch * dp_world}: change "
                "global_batch or micro_batch so that global_batch = micro_batch x world x grad_accum"
            )
        from .mixture import read_mixture_meta

        self.prepared_dir = str(prepared_dir)
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.global_batch, self.micro_batch = int(global_batch), int(micro_batch)
        self.dp_rank, self.dp_world = int(dp_rank), int(dp_world)
        mixture = read_mixture_meta(prepared_dir)
        self.mixture: Optional[_MixtureWindows] = None
        if mixture is not None:  # data.mixture: windows drawn from several sources by weight
            self.tokens = None
            self._windows = self.mixture = _MixtureWindows(mixture, self.seq_len, self.seed,
                                                           split, verify)
            self.fingerprint = mixture["stream_fingerprint"]
        else:
            self.tokens = PackedTokens(prepared_dir, split, verify=verify)
            if len(self.tokens) < seq_len + 1:
                raise DataError(
                    f"the {split!r} split of {prepared_dir} has {len(self.tokens)} tokens, fewer "
                    f"than seq_len+1={seq_len + 1} needed for one window: lower seq_len or use "
                    f"more data")
            # identity of the token stream itself (not of paths or mtimes): the same data
            # prepared elsewhere, or with another shard size, resumes exactly
            info = self.tokens.meta["splits"][split]
            self.fingerprint = info.get("sha256") or self.tokens.meta["fingerprint"]
            self._windows = _Windows(self.tokens, self.seq_len, self.seed)
        self.consumed_samples = 0
        self.num_workers = int(num_workers)
        self._killed_workers = False  # by _stalled: their deaths are the deadline's to report
        self._sampler = _RankSampler(self.global_batch, self.micro_batch, self.dp_rank, self.dp_world)
        pin = bool(pin_memory) and torch.cuda.is_available()
        self._loader = DataLoader(
            self._windows,
            batch_size=None,  # the sampler yields whole micro-batches
            sampler=self._sampler,
            num_workers=num_workers,
            pin_memory=pin,
            persistent_workers=num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            worker_init_fn=_init_worker if num_workers > 0 else None,
        )
        self._generation = 0
        self._deadline = (watchdog.Deadline("data loader", data_timeout_s, self.dp_rank,
                                            self._stalled) if data_timeout_s else None)
        if num_workers > 0:  # workers ignore SIGTERM, so they must be stopped before exit
            atexit.register(_close_if_alive, weakref.ref(self))

    def close(self) -> None:
        """Stop the background workers (sentinel + join, not a signal: they ignore SIGTERM)."""
        it = getattr(self._loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self._loader._iterator = None

    def _stalled(self) -> str:
        """What the rank waits on, for the deadline's line; every worker SIGKILLed, since a
        stopped one ignores SIGTERM until continued and would outlive the rank. Runs in the
        deadline's thread while the loop still waits."""
        it = getattr(self._loader, "_iterator", None)
        workers = list(getattr(it, "_workers", None) or [])
        if not workers:
            return ("data.num_workers=0: this process reads the shards itself and one read has "
                    "not returned (a hung file system or disk?); its stack is below")
        said = []
        self._killed_workers = True
        for w in workers:
            said.append(f"pid {w.pid}, which {_describe_state(w.pid)}")
            try:
                os.kill(w.pid, signal.SIGKILL)
            except OSError:
                pass
        return (f"no batch came from its DataLoader worker{'s' if len(said) > 1 else ''}: "
                f"{'; '.join(said)}; killed (SIGKILL)")

    # --- facts -----------------------------------------------------------------------------
    @property
    def num_windows(self) -> int:
        """Windows (samples) per epoch."""
        return self._windows.n

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch // (self.dp_world * self.micro_batch)

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_windows

    def mixture_tokens(self) -> Optional[dict]:
        """data.mixture: tokens each source has given to the steps so far ({name: tokens})."""
        if self.mixture is None:
            return None
        return {n: c * self.seq_len for n, c in self.mixture.counts(self.consumed_samples).items()}

    def mixture_epochs(self) -> Optional[dict]:
        """data.mixture: the epoch each source is in ({name: epoch}, 0 = its first pass)."""
        return None if self.mixture is None else self.mixture.epochs(self.consumed_samples)

    def global_sample_windows(self, samples: np.ndarray) -> np.ndarray:
        """Window ids of global samples (for tests and debugging)."""
        return self._windows.window_ids(np.asarray(samples))

    # --- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Start at `consumed_samples` (a partially yielded global batch is yielded again)."""
        self._generation += 1
        self._sampler.start = self.consumed_samples
        it = iter(self._loader)
        if self.num_workers > 0:
            _defer_worker_signal_errors()  # torch's SIGCHLD handler is installed by now
        return self._run(self._generation, self.consumed_samples, it)

    def _run(self, gen: int, start: int, it) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        per_step = self.micro_batches_per_step
        count = 0
        deadline = self._deadline or contextlib.nullcontext()
        while True:
            if gen != self._generation:  # checked before next(): never steal the new iterator's batch
                raise RuntimeError("TrainLoader was repositioned or re-iterated; use the new iterator")
            try:
                with deadline:
                    batch = next(it)
            except DataError as e:  # e.g. a shard failing its sha256 check in a worker
                raise self._where(_unwrap_worker_error(e)) from None
            except Exception as e:
                # a worker that died shows up as whatever the read of its batch ran into
                # (ConnectionResetError, torch's "exited unexpectedly", a MemoryError of its own)
                died = self._worker_died(it, e)
                if died is None:
                    raise
                raise died from None
            count += 1
            if count % per_step == 0:  # this micro-batch completes a global batch
                self.consumed_samples = start + (count // per_step) * self.global_batch
            yield batch

    def _worker_died(self, it, e: BaseException) -> Optional[DataWorkerDied]:
        """The error that ended a read, as the death of one of this rank's workers, or None
        where no worker died (or the deadline killed them: it reports that itself)."""
        if self.num_workers == 0 or self._killed_workers:
            return None
        oom = isinstance(e, MemoryError) and "in DataLoader worker process" in str(e)
        dead = _dead_workers(it, wait_s=0.0 if oom else 2.0)
        if not dead and not oom:
            return None
        step, _ = watchdog.position()
        at = f" at step {step}" if step is not None else ""
        if dead:
            index, pid, code = dead[0]
            how, cause = _death_of(code)
            who = f"DataLoader worker {index} (pid {pid})"
        else:
            head = str(e).strip().splitlines()[0] if str(e).strip() else ""
            who = head[len("Caught MemoryError in "):].rstrip(".") if head.startswith(
                "Caught MemoryError in ") else "a DataLoader worker"
            how, cause = "ran out of memory (MemoryError)", "the host has no memory left"
        others = (f" ({len(dead) - 1} more of its workers died with it)"
                  if len(dead) > 1 else "")
        g = self.global_batch
        return DataWorkerDied(
            f"rank {self.dp_rank}'s {who} {how}{at}{others}: {cause}. To use less host memory: "
            f"fewer data.num_workers (now {self.num_workers}; 0 reads the data in the rank "
            f"itself), a smaller trainer.micro_batch (now {self.micro_batch}; with "
            f"trainer.global_batch={g} the global batch stays {g}), trainer.async_save=false "
            f"(no host copy of a checkpoint), fewer ranks on this host. Then relaunch: it "
            f"resumes from the last complete checkpoint.")

    def _where(self, e: DataError) -> DataError:
        """A shard that changed under the job: say which rank stopped, at which step (the
        loop's, as the watchdog has it), before training on the changed data."""
        if not isinstance(e, DataChanged):
            return e
        step, _ = watchdog.position()
        at = f" at step {step}" if step is not None else ""
        return type(e)(f"{e}; rank {self.dp_rank} stopped{at}, before training on it")

    # --- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "consumed_samples": int(self.consumed_samples),
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "data_fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Reposition at state["consumed_samples"] (also: skip ahead by passing a larger value).

        seq_len and seed must match (they define the windows and their order); a different
        global_batch is fine (the stream continues at the same sample, batches shift with it).
        With strict=False a different seed/data is accepted (the run continues at the same index
        of a different stream: not exact, but sometimes wanted).
        """
        if "consumed_samples" not in state:
            raise DataError(f"loader state has no 'consumed_samples' (keys: {sorted(state)})")
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise DataError(f"loader state consumed_samples={consumed} must be >= 0")
        if int(state.get("seq_len", self.seq_len)) != self.seq_len:
            raise DataError(
                f"cannot resume: the checkpoint's data loader used seq_len={state['seq_len']} but "
                f"this run uses seq_len={self.seq_len}; windows would differ. Use the same seq_len "
                "or start the data from scratch (do not load the loader state)"
            )
        if strict:
            if int(state.get("seed", self.seed)) != self.seed:
                raise DataError(
                    f"cannot resume exactly: the checkpoint's data seed={state['seed']} but this run's "
                    f"data.seed={self.seed}; set data.seed={state['seed']} (or load_state_dict(strict=False))"
                )
            fp = state.get("data_fingerprint")
            if fp is not None and fp != self.fingerprint:
                raise DataError(
                    f"cannot resume exactly: the checkpoint was trained on prepared data "
                    f"{fp[:10]} but this run reads {self.fingerprint[:10]} ({self.prepared_dir}); "
                    "use the same data settings (or load_state_dict(strict=False))"
                )
        old_g = state.get("global_batch")
        if old_g is not None and int(old_g) != self.global_batch:
            log.info("resuming with global_batch=%d (checkpoint: %s); the sample stream continues "
                     "at sample %d", self.global_batch, old_g, consumed)
        self.consumed_samples = consumed
        self._generation += 1  # invalidate running iterators

    def skip_samples(self, n: int) -> None:
        """Jump ahead by n global samples (rollback-and-skip past bad data)."""
        self.load_state_dict({**self.state_dict(), "consumed_samples": self.consumed_samples + int(n)})


class EvalSet:
    """The evaluation set of one rank: defined by the config alone, the first ``sequences``
    windows of the split (all of them if it has fewer), window w evaluated by rank
    w % dp_world, in batches of at most ``batch_size`` rows. So every window is evaluated exactly
    once whatever the micro-batch, world size or ZeRO stage, and a token-weighted mean over the
    ranks' sums is the same number (before: ``trainer.eval_batches`` micro-batches per rank, a set
    that grew with both). Every rank yields the same number of batches, as ZeRO-3 needs (it gathers
    each layer with all ranks); a rank whose share has run out yields one padding row whose
    targets are all -100 (ignored by the loss). Re-iterable, with a length."""

    def __init__(self, prepared_dir, seq_len: int, batch_size: int, sequences: int,
                 dp_rank: int = 0, dp_world: int = 1, split: str = "val"):
        _check_positive(seq_len=seq_len, batch_size=batch_size, dp_world=dp_world,
                        sequences=sequences)
        if not 0 <= dp_rank < dp_world:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        self.tokens = PackedTokens(prepared_dir, split)
        n_windows = (len(self.tokens) - 1) // seq_len if len(self.tokens) > 0 else 0
        if n_windows == 0:
            raise DataError(
                f"the {split!r} split of {prepared_dir} has {len(self.tokens)} tokens, fewer than "
                f"one window of seq_len={seq_len} + 1: raise data.val_fraction or lower seq_len")
        self.sequences = min(int(sequences), n_windows)
        self.mine = np.arange(dp_rank, self.sequences, dp_world)  # this rank's window ids
        most = math.ceil(self.sequences / dp_world)  # the largest share of a rank
        self.n_batches = math.ceil(most / batch_size)
        self._windows = _Windows(self.tokens, seq_len, seed=0)
        self.seq_len, self.batch_size = seq_len, batch_size

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b in range(self.n_batches):
            ids = self.mine[b * self.batch_size:(b + 1) * self.batch_size]
            if len(ids):
                yield self._windows.read(ids)  # x, y: (rows, seq_len)
            else:
                yield (torch.zeros(1, self.seq_len, dtype=torch.int64),
                       torch.full((1, self.seq_len), -100, dtype=torch.int64))


def eval_set(prepared_dir, seq_len: int, batch_size: int, sequences: int, dp_rank: int = 0,
             dp_world: int = 1) -> EvalSet:
    """This rank's batches of the validation set; see EvalSet."""
    return EvalSet(prepared_dir, seq_len, batch_size, sequences, dp_rank, dp_world)


def eval_sets(prepared_dir, seq_len: int, batch_size: int, sequences: int, dp_rank: int = 0,
              dp_world: int = 1) -> list:
    """[(name, weight, EvalSet)]: one unnamed set of weight 1, or for data.mixture one per
    source, ``sequences`` shared in proportion to the weights (at least 1 each; a source of
    weight 0 is evaluated on sequences / number of sources), so the weighted mean of the sources'
    losses is the mixture's loss."""
    from .mixture import read_mixture_meta

    mixture = read_mixture_meta(prepared_dir)
    if mixture is None:
        return [(None, 1.0, EvalSet(prepared_dir, seq_len, batch_size, sequences, dp_rank,
                                    dp_world))]
    srcs = mixture["sources"]
    total = sum(float(s["weight"]) for s in srcs)
    out = []
    for s in srcs:
        share = float(s["weight"]) / total if s["weight"] > 0 else 1.0 / len(srcs)
        n = max(1, round(sequences * share))
        try:
            out.append((s["name"], float(s["weight"]),
                        EvalSet(s["dir"], seq_len, batch_size, n, dp_rank, dp_world)))
        except DataError as e:
            raise DataError(f"data.mixture source {s['name']!r}: {e}") from None
    return out
