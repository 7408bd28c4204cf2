"""TrainLoader / eval_set: exact global order, rank split, resume across world sizes."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from helpers import docs_prepared
from llama_train.data import DataConfig, DataError, PackedTokens, TrainLoader, prepare_data, eval_set
from llama_train.data import packed
from llama_train.data.loader import IndexPermutation

SEQ = 16
SEED = 7
BLOCK = 1024  # checksum block of the module's data, in bytes: 512 uint16 tokens
BT = BLOCK // 2


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """10 checksum blocks per 5000-token shard (helpers.docs_prepared)."""
    return docs_prepared(tmp_path_factory.mktemp("loader"), BLOCK)


def take(loader, n_micro):
    it = iter(loader)
    return [next(it) for _ in range(n_micro)]


def stream(prepared, start, n_samples, seq=SEQ, seed=SEED):
    """The reference: global samples [start, start+n) read one by one (dp=1, micro batch 1)."""
    ref = TrainLoader(prepared, seq, 1, 1, 0, 1, seed, num_workers=0)
    ref.load_state_dict({"consumed_samples": start, "seed": seed, "seq_len": seq})
    return torch.cat([x for x, _ in take(ref, n_samples)])


def global_batches(prepared, world, micro, G, steps, start=0, num_workers=0):
    """Rows of `steps` global batches assembled from all ranks: rank 0's rows, then rank 1's..."""
    per_rank = []
    for r in range(world):
        L = TrainLoader(prepared, SEQ, G, micro, r, world, SEED, num_workers=num_workers)
        if start:
            L.load_state_dict({"consumed_samples": start, "seed": SEED, "seq_len": SEQ, "global_batch": G})
        mbs = take(L, steps * G // (world * micro))
        assert L.state_dict()["consumed_samples"] == start + steps * G
        per_rank.append(torch.cat([x for x, _ in mbs]).view(steps, G // world, SEQ))
    return torch.cat(per_rank, dim=1).reshape(steps * G, SEQ)


def test_permutation_is_a_bijection_and_depends_on_seed_and_epoch():
    for n in (1, 2, 3, 5, 16, 17, 1000, 4099):
        for epoch in (0, 1):
            p = IndexPermutation(n, SEED, epoch)(np.arange(n))
            assert np.array_equal(np.sort(p), np.arange(n)), n
    a, b, c = (IndexPermutation(1000, s, e)(np.arange(1000)) for s, e in ((1, 0), (1, 1), (2, 0)))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert abs(np.corrcoef(a, np.arange(1000))[0, 1]) < 0.15  # actually shuffled
    # pure integer arithmetic: the same on every machine and numpy version (resume elsewhere)
    assert IndexPermutation(10, 1234, 0)(np.arange(10)).tolist() == [3, 7, 5, 4, 2, 8, 6, 0, 1, 9]


def test_windows_are_shifted_token_slices(prepared):
    tokens = np.asarray(PackedTokens(prepared, "train")[:], dtype=np.int64)
    L = TrainLoader(prepared, SEQ, 4, 2, 0, 1, SEED, num_workers=0)
    n = (len(tokens) - 1) // SEQ
    assert L.num_windows == n
    it = iter(L)
    for step in range(3):
        for m in range(2):
            x, y = next(it)
            assert x.shape == y.shape == (2, SEQ) and x.dtype == y.dtype == torch.int64
            ids = L.global_sample_windows(np.arange(step * 4 + m * 2, step * 4 + m * 2 + 2))
            for row, w in enumerate(ids):
                assert torch.equal(x[row], torch.from_numpy(tokens[w * SEQ : w * SEQ + SEQ]))
                assert torch.equal(y[row], torch.from_numpy(tokens[w * SEQ + 1 : w * SEQ + SEQ + 1]))
    # every window exactly once per epoch, and epochs chain seamlessly
    e0 = L.global_sample_windows(np.arange(n))
    e1 = L.global_sample_windows(np.arange(n, 2 * n))
    assert np.array_equal(np.sort(e0), np.arange(n)) and np.array_equal(np.sort(e1), np.arange(n))
    assert not np.array_equal(e0, e1)


@pytest.mark.parametrize("world,micro", [(1, 6), (2, 3), (3, 2), (3, 1)])
def test_ranks_cover_the_global_stream_without_overlap_or_gap(prepared, world, micro):
    G, steps = 6, 4
    got = global_batches(prepared, world, micro, G, steps)
    assert torch.equal(got, stream(prepared, 0, G * steps))


def test_stream_crosses_epochs(prepared):
    seq = 512
    n = TrainLoader(prepared, seq, 1, 1, 0, 1, SEED, num_workers=0).num_windows
    assert 3 <= n < 100
    L = TrainLoader(prepared, seq, 4, 2, 1, 2, SEED, num_workers=0)  # rank 1: samples 2,3 of each batch
    steps = (2 * n) // 4 + 2
    got = torch.cat([x for x, _ in take(L, steps)])
    assert L.epoch >= 2 and L.state_dict()["consumed_samples"] == steps * 4
    ref = stream(prepared, 0, steps * 4, seq=seq).view(steps, 4, seq)[:, 2:].reshape(-1, seq)
    assert torch.equal(got, ref)


def test_resume_is_exact_at_any_position_and_world_size(prepared):
    G = 6
    reference = stream(prepared, 0, G * 8)
    # run 3 steps on 2 ranks, checkpoint, resume on 3 ranks / 1 rank with other micro batches
    a = TrainLoader(prepared, SEQ, G, 3, 1, 2, SEED, num_workers=0)
    take(a, 3 * 1)  # 1 micro batch per step on each of 2 ranks
    state = a.state_dict()
    assert state == {"consumed_samples": 3 * G, "seed": SEED, "seq_len": SEQ, "global_batch": G,
                     "data_fingerprint": a.fingerprint}
    for world, micro in ((3, 1), (1, 2), (2, 1)):
        resumed = []
        for r in range(world):
            b = TrainLoader(prepared, SEQ, G, micro, r, world, SEED, num_workers=0)
            b.load_state_dict(state)
            resumed.append(torch.cat([x for x, _ in take(b, 2 * G // (world * micro))]).view(2, G // world, SEQ))
        assert torch.equal(torch.cat(resumed, 1).reshape(-1, SEQ), reference[3 * G : 5 * G]), (world, micro)
    # arbitrary position (not a batch boundary) and a skip forward
    odd = TrainLoader(prepared, SEQ, G, 2, 0, 1, SEED, num_workers=0)
    odd.load_state_dict({"consumed_samples": 7, "seed": SEED, "seq_len": SEQ})
    assert torch.equal(torch.cat([x for x, _ in take(odd, 3)]), reference[7 : 7 + G])
    odd.skip_samples(5)
    assert odd.state_dict()["consumed_samples"] == 7 + G + 5
    assert torch.equal(next(iter(odd))[0], reference[7 + G + 5 : 7 + G + 7])


def test_resume_on_a_copy_with_other_shard_layout(prepared, tmp_path):
    """The data identity in the loader state is the token stream, not paths or shard sizes."""
    root = Path(prepared).parent
    cfg = DataConfig(source=str(root / "docs.jsonl"), tokenizer=str(root / "tok.model"),
                     prepared_dir=str(tmp_path / "elsewhere"), val_fraction=0.2, num_proc=1, shard_tokens=777)
    other = prepare_data(cfg, 512).dir
    a = TrainLoader(prepared, SEQ, 4, 2, 0, 1, SEED, num_workers=0)
    take(a, 6)
    b = TrainLoader(other, SEQ, 4, 4, 0, 1, SEED, num_workers=0)
    b.load_state_dict(a.state_dict())  # strict: same stream, so accepted
    assert torch.equal(next(iter(b))[0], torch.cat([x for x, _ in take(a, 2)]))


def test_partial_global_batch_is_not_counted(prepared):
    L = TrainLoader(prepared, SEQ, 8, 2, 0, 2, SEED, num_workers=0)  # 2 micro batches per step
    it = iter(L)
    first = [next(it) for _ in range(3)]
    assert L.state_dict()["consumed_samples"] == 8
    again = next(iter(L))  # a new iterator restarts at the last complete global batch
    assert torch.equal(again[0], first[2][0])
    with pytest.raises(RuntimeError, match="re-iterated"):
        next(it)


def test_workers_give_the_same_batches(prepared):
    G = 8
    assert torch.equal(global_batches(prepared, 2, 2, G, 3, start=5, num_workers=2),
                       global_batches(prepared, 2, 2, G, 3, start=5, num_workers=0))
    # rollback with persistent workers that have batches prefetched: the new iterator restarts
    # exactly at the restored position
    L = TrainLoader(prepared, SEQ, G, 2, 0, 1, SEED, num_workers=1)
    it = iter(L)
    first = [next(it)[0] for _ in range(4)]
    saved = L.state_dict()
    later = [next(it)[0] for _ in range(8)]
    L.load_state_dict({**saved, "consumed_samples": 0})
    again = iter(L)
    assert all(torch.equal(next(again)[0], x) for x in first + later)


def test_loader_errors(prepared):
    with pytest.raises(DataError, match=r"global_batch=10 is not divisible by micro_batch=2 x .* world size 3"):
        TrainLoader(prepared, SEQ, 10, 2, 0, 3, SEED)
    with pytest.raises(DataError, match="dp_rank=3"):
        TrainLoader(prepared, SEQ, 6, 1, 3, 3, SEED)
    with pytest.raises(DataError, match=r"fewer than seq_len\+1"):
        TrainLoader(prepared, 10**7, 1, 1, 0, 1, SEED)
    L = TrainLoader(prepared, SEQ, 4, 2, 0, 1, SEED, num_workers=0)
    state = {**L.state_dict(), "consumed_samples": 12}
    with pytest.raises(DataError, match="seq_len=32 but this run uses seq_len=16"):
        L.load_state_dict({**state, "seq_len": 32})
    with pytest.raises(DataError, match="data seed=8 .* data.seed=7"):
        L.load_state_dict({**state, "seed": 8})
    with pytest.raises(DataError, match="different|prepared data"):
        L.load_state_dict({**state, "data_fingerprint": "f" * 64})
    L.load_state_dict({**state, "seed": 8}, strict=False)
    assert L.state_dict()["consumed_samples"] == 12
    L.load_state_dict({**state, "global_batch": 8})  # a new global batch is allowed: same stream
    assert L.state_dict()["consumed_samples"] == 12


def test_eval_set_is_the_same_windows_whatever_the_batch_and_world(prepared):
    """The first `sequences` windows of the split, each on exactly one rank, in batches of at
    most batch_size rows; every rank yields the same number of batches (padding rows have all
    targets -100)."""
    tokens = np.asarray(PackedTokens(prepared, "val")[:], dtype=np.int64)
    n_windows = (len(tokens) - 1) // SEQ
    want = {w: tokens[w * SEQ:(w + 1) * SEQ + 1] for w in range(min(7, n_windows))}
    for world in (1, 2, 3):
        for batch in (1, 2, 4):
            seen = []
            per_rank = [list(eval_set(prepared, SEQ, batch, 7, r, world)) for r in range(world)]
            assert len({len(b) for b in per_rank}) == 1  # lockstep
            for rank, batches in enumerate(per_rank):
                for x, y in batches:
                    assert x.shape[0] <= batch
                    for row_x, row_y in zip(x, y):
                        if (row_y == -100).all():
                            continue  # padding
                        w = next(w for w, t in want.items() if np.array_equal(row_x, t[:-1]))
                        assert np.array_equal(row_y, want[w][1:]) and w % world == rank
                        seen.append(w)
            assert sorted(seen) == sorted(want), (world, batch, seen)
    again = eval_set(prepared, SEQ, 2, 5, 1, 2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, again))  # deterministic, re-iterable
    assert eval_set(prepared, SEQ, 2, 10**9, 0, 1).sequences == n_windows  # capped at the split
    with pytest.raises(DataError, match="val_fraction"):
        eval_set(prepared, len(tokens), 1, 4, 0, 1)


# --- shards corrupted in range (same size, valid token ids) -------------------------------------
def corrupt_copy(prepared, dest: Path, shard: str = "train-00001.bin", at: Optional[int] = None) -> Path:
    """A copy of `prepared` whose `shard` has two different tokens swapped: the one at `at`
    (default: the middle) and the next one that differs from it. The same size, every id still
    in the vocabulary, so only a checksum can tell."""
    import shutil

    shutil.copytree(prepared, dest)
    path = dest / shard
    tokens = np.fromfile(path, dtype=np.uint16)
    i = len(tokens) // 2 if at is None else at
    j = next(k for k in range(i + 1, len(tokens)) if tokens[k] != tokens[i])
    tokens[[i, j]] = tokens[[j, i]]
    tokens.tofile(path)
    return path


def consume(loader, n_micro: int) -> None:
    """Read n micro-batches, keeping none (worker batches hold shared-memory file handles)."""
    it = iter(loader)
    for _ in range(n_micro):
        next(it)


def shard_of(tokens: PackedTokens, name: str) -> slice:
    k = [s["file"] for s in tokens.shards].index(name)
    return slice(int(tokens._starts[k]), int(tokens._starts[k + 1]))


def blocks_of(tokens: PackedTokens, lo: int, hi: int) -> set:
    """(shard file, block) of every checksum block holding a token of tokens[lo:hi]."""
    out = set()
    for k, shard in enumerate(tokens.shards):
        a, b = max(lo, int(tokens._starts[k])), min(hi, int(tokens._starts[k + 1]))
        if a < b:
            off = int(tokens._starts[k])
            out |= {(shard["file"], x) for x in range((a - off) // BT, (b - 1 - off) // BT + 1)}
    return out


@pytest.fixture
def checked(monkeypatch):
    """Every block checksum computed in this process, as (shard file, block), and every whole
    shard hashed (the fallback for data without block checksums), as file descriptors."""
    blocks, shards = [], []
    real_verify, real_sha = packed._ShardBlocks.verify, packed._fd_sha256

    def verify(self, tokens, b):
        blocks.append((self.path.name, b))
        return real_verify(self, tokens, b)

    monkeypatch.setattr(packed._ShardBlocks, "verify", verify)
    monkeypatch.setattr(packed, "_fd_sha256", lambda fd: shards.append(fd) or real_sha(fd))
    return blocks, shards


def test_corrupt_block_is_refused_on_its_first_read_and_no_other_block_is(prepared, tmp_path):
    """Per block, not per shard: the blocks around a corrupt one read fine, before and after it;
    every read that touches it (inside, straddling from a checked block into it, straddling
    from it, one token) fails naming the shard, the byte range, both crc32s and the fix."""
    bad = corrupt_copy(prepared, tmp_path / "copy", at=3 * BT + 100)  # block 3 of train-00001
    d = tmp_path / "copy"
    want, got = (zlib.crc32(np.fromfile(path, dtype=np.uint16)[3 * BT : 4 * BT].tobytes())
                 for path in (Path(prepared) / "train-00001.bin", bad))
    clean = PackedTokens(prepared, "train")
    pt = PackedTokens(d, "train")  # opening reads nothing: no cost up front
    s = shard_of(pt, "train-00001.bin").start
    for b in (0, 2, 4, 9):  # the same shard's other blocks, a window each, before the bad one
        w = slice(s + b * BT + 7, s + b * BT + 7 + SEQ + 1)
        assert np.array_equal(pt[w], clean[w])
    for read in (lambda: pt[s + 3 * BT + 5 : s + 3 * BT + 40],   # inside block 3
                 lambda: pt[s + 3 * BT - 8 : s + 3 * BT + 8],    # from block 2 (checked) into 3
                 lambda: pt[s + 4 * BT - 8 : s + 4 * BT + 8],    # from 3 into 4
                 lambda: pt[s + 3 * BT + 1]):                    # one token
        with pytest.raises(DataError) as e:
            read()
        msg = str(e.value)
        # 5000 tokens = 10000 bytes: 9 blocks of 1024 and one of 784
        assert f"shard {bad} fails its crc32 check at bytes {3 * BLOCK}-{4 * BLOCK - 1} (block 3 of 10" in msg
        assert f"train-00001.crc32 says {want:08x}, the bytes hash to {got:08x}" in msg
        assert f"delete {d} and run prepare again" in msg and f"llama-data info {d} --verify" in msg
        assert "\n" not in msg
    for w in (slice(s + 3 * BT - 40, s + 3 * BT), slice(s + 4 * BT, s + 4 * BT + 40)):
        assert np.array_equal(pt[w], clean[w])  # its neighbours, up to its edges, still read
    with pytest.raises(DataError, match="train-00001.bin fails its sha256"):
        PackedTokens(d, "train", verify=True)  # the up-front check still works


def test_a_window_straddling_two_blocks_checks_both_once(prepared, tmp_path, checked):
    import shutil

    blocks, shards = checked
    d = tmp_path / "fresh"  # new inodes: nothing of it checked in this process yet
    shutil.copytree(prepared, d)
    pt = PackedTokens(d, "train")
    s = shard_of(pt, "train-00001.bin").start
    pt[s + 2 * BT - 3 : s + 2 * BT + 3]
    assert blocks == [("train-00001.bin", 1), ("train-00001.bin", 2)]
    pt[s + 2 * BT - 3 : s + 2 * BT + 3], pt[s + BT : s + 3 * BT], pt[s + BT]
    assert len(blocks) == 2  # checked blocks cost nothing more
    pt[s - 2 : s + 2]  # across a shard boundary: the last block of one, the first of the next
    assert blocks[2:] == [("train-00000.bin", 9), ("train-00001.bin", 0)]
    assert shards == []  # no whole shard is hashed


def test_each_block_is_hashed_at_most_once_per_process_and_only_if_read(prepared, tmp_path, checked):
    """The check is off the hot path: one crc32 per block read, however many readers (train
    loader, each evaluation's eval_set, a re-built loader) read it; no shard is hashed whole;
    data.verify=true hashes every shard again and leaves its blocks checked."""
    import shutil

    blocks, shards = checked
    d = tmp_path / "fresh"
    shutil.copytree(prepared, d)
    L = TrainLoader(d, SEQ, 8, 2, 0, 1, SEED, num_workers=0)
    assert blocks == []  # nothing checked before the first read
    next(iter(L))  # one micro-batch: 2 windows, so at most 4 blocks of the ~50
    assert 2 <= len(blocks) <= 4
    consume(L, L.num_windows)  # two epochs: every window read twice
    assert len(blocks) == len(set(blocks))
    assert set(blocks) == blocks_of(L.tokens, 0, L.num_windows * SEQ + 1)
    for _ in range(3):
        list(eval_set(d, SEQ, 2, 10**9))
        consume(TrainLoader(d, SEQ, 8, 2, 0, 1, SEED, num_workers=0), 8)
    assert len(blocks) == len(set(blocks))
    assert {f for f, _ in blocks} == {s["file"] for s in L.tokens.shards + PackedTokens(d, "val").shards}
    assert shards == []
    d2 = tmp_path / "verified"
    shutil.copytree(prepared, d2)
    n_before = len(blocks)
    n_train = len(PackedTokens(d2, "train", verify=True).shards)
    assert len(shards) == n_train
    consume(TrainLoader(d2, SEQ, 8, 2, 0, 1, SEED, num_workers=0), 8)
    assert len(blocks) == n_before  # verified up front: no block check on top


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_stops_at_a_corrupt_block_with_a_one_line_error(prepared, tmp_path, workers):
    """Every window of the stream is read through checked blocks, in a worker or not; the
    worker's error arrives as the DataError itself, not torch's wrapped traceback."""
    corrupt_copy(prepared, tmp_path / "copy")
    L = TrainLoader(tmp_path / "copy", SEQ, 8, 2, 0, 1, SEED, num_workers=workers)
    try:
        with pytest.raises(DataError) as e:
            consume(L, L.num_windows)  # two epochs (micro-batches of 2): every block is read
    finally:
        L.close()
    msg = str(e.value)
    assert "train-00001.bin fails its crc32 check at bytes " in msg and "Traceback" not in msg
    assert "\n" not in msg and (workers == 0 or "DataLoader worker" in msg)


def test_block_checksum_files_are_checked_against_meta(prepared, tmp_path):
    """A .crc32 file is trusted only if its sha256 matches meta.json: an edited or missing one
    stops the first read of its shard (and data.verify) naming the file."""
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    crc = d / "train-00001.crc32"
    raw = bytearray(crc.read_bytes())
    raw[5] ^= 0x01
    crc.write_bytes(bytes(raw))
    pt = PackedTokens(d, "train")
    s0, s1 = shard_of(pt, "train-00000.bin"), shard_of(pt, "train-00001.bin")
    assert len(pt[s0.start : s0.start + 10]) == 10  # another shard reads fine
    with pytest.raises(DataError, match=f"block checksum file {crc} fails its sha256 check.*delete {d}"):
        pt[s1.start + 2 * BT]
    with pytest.raises(DataError, match=f"block checksum file {crc} fails its sha256 check"):
        PackedTokens(d, "train", verify=True)
    crc.unlink()
    with pytest.raises(DataError, match=f"block checksum file {crc} listed in meta.json is missing"):
        PackedTokens(d, "train")[s1.start]
    meta = json.loads((d / "meta.json").read_text())
    for spec in ({"algorithm": "xxh3", "block_bytes": BLOCK}, {"algorithm": "crc32", "block_bytes": 1023}):
        (d / "meta.json").write_text(json.dumps({**meta, "block_checksums": spec}))
        with pytest.raises(DataError, match=f"{d}/meta.json has block_checksums=.* cannot use .*delete {d}"):
            PackedTokens(d, "train")


def test_data_without_block_checksums_falls_back_to_the_shard_check(prepared, tmp_path, checked, caplog):
    """Data prepared before block checksums (no block_checksums in meta.json, no .crc32 files)
    is still accepted as it is (prepare_data does not refuse or re-prepare it) and still never
    trained on if corrupt: each shard's sha256 on its first read. Said once per process."""
    import logging

    blocks, shards = checked
    d = tmp_path / "old"
    bad = corrupt_copy(prepared, d, at=3 * BT + 100)
    meta = json.loads((d / "meta.json").read_text())
    meta.pop("block_checksums", None)
    for split in meta["splits"].values():
        for shard in split["shards"]:
            shard.pop("block_crc32", None)
    for crc in d.glob("*.crc32"):
        crc.unlink()
    (d / "meta.json").write_text(json.dumps(meta))
    root = Path(prepared).parent
    cfg = DataConfig(source=str(root / "docs.jsonl"), tokenizer=str(root / "tok.model"), prepared_dir=str(d),
                     val_fraction=0.2, num_proc=1, shard_tokens=5000, streaming=True)
    assert not prepare_data(cfg, 512).created
    with caplog.at_level(logging.WARNING, logger="llama_train.data.packed"):
        pt = PackedTokens(d, "train")
        PackedTokens(d, "val"), TrainLoader(d, SEQ, 8, 2, 0, 1, SEED, num_workers=0), eval_set(d, SEQ, 2, 2)
    notes = [r.getMessage() for r in caplog.records if r.name == "llama_train.data.packed"]
    assert len(notes) == 1 and f"{d} was prepared without block checksums" in notes[0]
    assert "Prepare it again" in notes[0]
    s0, s1 = shard_of(pt, "train-00000.bin"), shard_of(pt, "train-00001.bin")
    pt[s0.start : s0.start + 10], pt[s0.stop - 10 : s0.stop]
    assert len(shards) == 1 and blocks == []  # the whole shard, once
    with pytest.raises(DataError, match=f"shard {bad} fails its sha256 check.*delete {d}"):
        pt[s1.start : s1.start + 10]  # block 0 of the shard: the whole shard is checked


@pytest.mark.slow
def test_training_stops_on_a_corrupt_shard(prepared, tmp_path):
    """In process, the real trainer on the tiny config: a same-size, in-range corruption of the
    block the first micro-batch reads stops the run with the DataError (the CLI's exit 2)
    before it trains on it."""
    import shutil

    from helpers import cfg_for, rows, world_of_one
    from llama_train.train import train

    cfg = cfg_for(tmp_path / "unused")
    good = prepare_data(cfg.data, vocab_size=cfg.model.vocab_size).dir
    seq = cfg.trainer.seq_len
    first = TrainLoader(good, seq, 1, 1, 0, 1, cfg.data.seed, num_workers=0).global_sample_windows(np.array([0]))[0]
    copy = tmp_path / "prepared"
    shutil.copytree(good, copy)
    corrupt_copy(good, tmp_path / "scratch", "train-00000.bin", at=int(first) * seq + seq // 2)
    shutil.copyfile(tmp_path / "scratch" / "train-00000.bin", copy / "train-00000.bin")
    out = tmp_path / "run"
    with world_of_one(), pytest.raises(DataError) as e:
        train(cfg_for(out, f"data.prepared_dir={copy}"))
    msg = str(e.value)
    assert f"{copy}/train-00000.bin fails its crc32 check at bytes " in msg and "\n" not in msg
    assert not list(out.glob("checkpoints/step_*"))
    assert not (out / "metrics.jsonl").exists() or not [r for r in rows(out) if "loss" in r]
