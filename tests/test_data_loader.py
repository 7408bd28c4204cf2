"""TrainLoader / val_batches: exact global order, rank split, resume across world sizes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llama_train.data import DataConfig, DataError, PackedTokens, TrainLoader, prepare_data, train_tokenizer, val_batches
from llama_train.data.loader import IndexPermutation

SEQ = 16
SEED = 7


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    import pydoc_data.topics

    root = tmp_path_factory.mktemp("loader")
    topics = pydoc_data.topics.topics
    docs = [topics[k] for k in sorted(topics)[:25]]
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = train_tokenizer(docs, 512, root / "tok")
    cfg = DataConfig(source=str(src), tokenizer=tok, prepared_dir=str(root / "prepared"),
                     val_fraction=0.2, num_proc=1, shard_tokens=5000, streaming=True)
    return prepare_data(cfg, 512).dir


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


def test_val_batches_split_across_ranks(prepared):
    tokens = np.asarray(PackedTokens(prepared, "val")[:], dtype=np.int64)
    n_windows = (len(tokens) - 1) // SEQ
    one = list(val_batches(prepared, SEQ, 4, None, 0, 1))
    assert len(one) == n_windows // 4
    x0, y0 = one[0]
    assert torch.equal(x0[1], torch.from_numpy(tokens[SEQ : 2 * SEQ]))
    assert torch.equal(y0[1], torch.from_numpy(tokens[SEQ + 1 : 2 * SEQ + 1]))
    for world in (2, 3):
        per_rank = [list(val_batches(prepared, SEQ, 4, 5, r, world)) for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == min(5, len(one) // world)
        merged = [per_rank[j % world][j // world] for j in range(world * len(per_rank[0]))]
        for (x, y), (rx, ry) in zip(merged, one):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    again = val_batches(prepared, SEQ, 4, 3, 1, 2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, again))  # deterministic, re-iterable
    with pytest.raises(DataError, match="val_fraction"):
        val_batches(prepared, len(tokens), 1, None, 0, 1)
