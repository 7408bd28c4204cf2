"""data.mixture: the weighted stream, one tokenizer, per-source shards, and the errors."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from llama_train.data import DataConfig, DataError, TrainLoader, eval_sets, prepare_data
from llama_train.data.mixture import Allocation, MixtureEntry, read_mixture_meta

SEQ = 16
SEED = 7


def _write(path, docs, column="text"):
    path.write_text("".join(json.dumps({column: d}) + "\n" for d in docs))
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import pydoc_data.topics

    root = tmp_path_factory.mktemp("mixture")
    topics = pydoc_data.topics.topics
    keys = sorted(topics)
    prose = _write(root / "prose.jsonl", [topics[k] for k in keys[:30]])
    code = _write(root / "code.jsonl", [topics[k].upper() for k in keys[30:90]], "content")
    empty = _write(root / "empty.jsonl", ["", "", ""])
    return root, prose, code, empty


def mixture_cfg(root, prose, code, weights=(3.0, 1.0), **kw):
    entries = [{"name": "prose", "source": prose, "weight": weights[0]},
               {"name": "code", "source": code, "weight": weights[1], "text_column": "content"}]
    return DataConfig(mixture=entries, val_fraction=0.2, num_proc=1, streaming=True, **kw)


@pytest.fixture(scope="module")
def mixed(sources, tmp_path_factory):
    root, prose, code, _ = sources
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLAMA_TRAIN_CACHE", str(tmp_path_factory.mktemp("cache")))
        return prepare_data(mixture_cfg(root, prose, code), vocab_size=512)


@pytest.mark.parametrize("weights", [(3, 1), (0.5, 0.3, 0.2), (1, 0, 2, 5, 1)])
def test_allocation_is_exact_and_proportional(weights):
    """counts(n) is what assign() does to the first n samples; each source's samples are its
    indices 0, 1, 2... in order; after 300 windows every share is within 1% of its weight."""
    a = Allocation(weights, seed=SEED)
    src, idx = a.assign(np.arange(3000))
    for n in (1, 7, 300, 2999, 3000):
        assert a.counts(n) == np.bincount(src[:n], minlength=len(weights)).tolist()
    for s in range(len(weights)):
        assert (idx[src == s] == np.arange((src == s).sum())).all()
    total = sum(weights)
    for n in range(300, 3001, 50):
        shares = np.array(a.counts(n)) / n
        assert np.abs(shares - np.array(weights) / total).max() < 0.01, (n, shares)
    assert a.counts(10**12)[0] > 0  # closed form: no replay, no overflow at 1e12 samples
    other = Allocation(weights, seed=SEED + 1)
    assert other.assign(np.arange(100))[0].tolist() != src[:100].tolist()


def test_mixture_prepares_each_source_once_with_one_tokenizer(mixed, sources, monkeypatch,
                                                              tmp_path):
    root, prose, code, _ = sources
    meta = read_mixture_meta(mixed.dir)
    assert [s["name"] for s in meta["sources"]] == ["prose", "code"]
    sha = meta["tokenizer"]["sha256"]
    for s in meta["sources"]:
        sub = json.loads((tmp_path.parent / s["dir"] / "meta.json").read_text())
        assert sub["tokenizer"]["sha256"] == sha  # one tokenizer for every source
        assert s["dir"].rsplit("/", 1)[1].startswith(s["name"] + "-")
    # another mixture of the same sources with that tokenizer: the sources' shards are reused
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "cache2"))
    again = prepare_data(mixture_cfg(root, prose, code, weights=(1.0, 1.0),
                                     tokenizer=mixed.tokenizer_path), vocab_size=512)
    dirs = [s["dir"] for s in again.meta["sources"]]
    assert [s["weight"] for s in again.meta["sources"]] == [1.0, 1.0]
    first = [s["dir"] for s in meta["sources"]]
    names = [d.rsplit("/", 1)[1] for d in dirs]
    assert names == [d.rsplit("/", 1)[1] for d in first]  # same settings hash
    # and preparing the same mixture again finds it
    assert not prepare_data(mixture_cfg(root, prose, code, weights=(1.0, 1.0),
                                        tokenizer=mixed.tokenizer_path), 512).created


def test_stream_is_weighted_and_independent_of_world_size(mixed):
    G = 8
    one = TrainLoader(mixed.dir, SEQ, G, 2, 0, 1, SEED, num_workers=0)
    it = iter(one)
    rows = torch.cat([next(it)[0] for _ in range(4 * 20)])  # 20 steps of 8 windows
    two = []
    for r in range(2):
        L = TrainLoader(mixed.dir, SEQ, G, 4, r, 2, SEED, num_workers=0)
        itr = iter(L)
        two.append([next(itr)[0] for _ in range(20)])
    assembled = torch.cat([torch.cat([two[0][s], two[1][s]]) for s in range(20)])
    assert torch.equal(rows, assembled)
    counts = one.mixture_tokens()
    assert one.consumed_samples == 160 and sum(counts.values()) == 160 * SEQ
    assert abs(counts["prose"] / (160 * SEQ) - 0.75) < 0.01
    # resume at step 11 on another micro-batch: the same windows from there on
    again = TrainLoader(mixed.dir, SEQ, G, 1, 0, 1, SEED, num_workers=0)
    again.load_state_dict({**one.state_dict(), "consumed_samples": 80})
    it2 = iter(again)
    assert torch.equal(torch.cat([next(it2)[0] for _ in range(80)]), rows[80:])
    # the windows come from the right sources: the code source is upper case
    from llama_train.data import Tokenizer

    tok = Tokenizer(mixed.tokenizer_path)
    src, _ = one.mixture.alloc.assign(np.arange(160))
    for row, s in zip(rows[:40], src[:40]):
        text = tok.decode(row.tolist())
        letters = [c for c in text if c.isalpha()]
        upper = sum(c.isupper() for c in letters) / max(1, len(letters))
        assert (upper > 0.9) == (s == 1), (s, text)


def test_a_source_runs_out_and_starts_its_next_epoch(mixed):
    L = TrainLoader(mixed.dir, SEQ, 8, 8, 0, 1, SEED, num_workers=0)
    code = L.mixture.parts[1].n  # windows of the small source
    need = int(code * 4 * 1.1) // 8 * 8  # it gets 1/4 of the samples
    L.load_state_dict({**L.state_dict(), "consumed_samples": need})
    counts = L.mixture.counts(need)
    assert L.mixture_epochs() == {n: counts[n] // p.n for n, p in zip(L.mixture.names,
                                                                     L.mixture.parts)}
    assert L.mixture_epochs()["code"] == 1
    x, _ = next(iter(L))  # reading on into the next epoch works
    assert x.shape == (8, SEQ)


def test_eval_sets_per_source(mixed):
    sets = eval_sets(mixed.dir, SEQ, 4, 8, 0, 1)
    assert [(n, w) for n, w, _ in sets] == [("prose", 3.0), ("code", 1.0)]
    assert [s.sequences for _, _, s in sets] == [6, 2]


@pytest.mark.parametrize("entries, fragment", [
    ([{"name": "a", "source": "builtin", "weight": -1}], "data.mixture[0] (a): weight=-1"),
    ([{"name": "a", "source": "builtin", "weight": 0}, {"name": "b", "source": "x.jsonl",
                                                         "weight": 0}], "all 2 weights are 0"),
    ([{"name": "a", "source": "builtin"}, {"name": "a", "source": "builtin"}],
     "data.mixture[1] (a): name 'a' is also data.mixture[0]'s"),
    ([{"name": "web text", "source": "builtin"}], "name='web text'"),
    ([{"name": "a", "source": ""}], "data.mixture[0] (a): source is empty"),
    ([{"name": "a", "source": "builtin", "wieght": 2}], "unknown key(s) ['wieght']"),
    ([{"name": "a", "source": "builtin", "weight": "lots"}], "weight='lots'"),
])
def test_wrong_entries_are_refused_naming_them(entries, fragment):
    with pytest.raises(DataError) as err:
        DataConfig(mixture=entries)
    assert fragment in str(err.value)


def test_a_source_without_text_is_refused_naming_it(sources, tmp_path, monkeypatch):
    root, prose, _, empty = sources
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path))
    cfg = DataConfig(mixture=[MixtureEntry("prose", prose, 1.0), MixtureEntry("blank", empty, 1.0)],
                     num_proc=1, streaming=True)
    with pytest.raises(DataError, match=r"data.mixture\[1\] \(blank, source=.*empty.jsonl'\) "
                                        r"has no text"):
        prepare_data(cfg, 512)
    missing = replace(cfg, mixture=[MixtureEntry("gone", str(root / "nope.jsonl"), 1.0)])
    with pytest.raises(DataError, match=r"data.mixture\[0\] \(gone"):
        prepare_data(missing, 512)
    # the advice names the entry's own key (it said data.text_column, a key of no effect here)
    wrong = replace(cfg, mixture=[MixtureEntry("prose", prose, 1.0),
                                  MixtureEntry("code", prose, 1.0, text_column="content")])
    with pytest.raises(DataError) as err:
        prepare_data(wrong, 512)
    assert "data.mixture.1.text_column" in str(err.value)
    assert "data.text_column" not in str(err.value), str(err.value)


# --- through training ---------------------------------------------------------------------------


def _mixture_override(code: str, small: str) -> str:
    """data.mixture on the command line: the built-in corpus 3 : an upper-case source 1 : a
    source of a few windows 2 (it runs out within a few steps)."""
    return (f"data.mixture=[{{name:builtin,source:builtin,weight:3}},"
            f"{{name:code,source:'{code}',weight:1,text_column:content}},"
            f"{{name:small,source:'{small}',weight:2}}]")


@pytest.fixture(scope="module")
def small(sources):
    """4 documents of ~150 tokens: one held out, ~7 training windows of 64."""
    import pydoc_data.topics

    root = sources[0]
    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[-6:])
    return _write(root / "small.jsonl", [text[i * 600:(i + 1) * 600] for i in range(4)])


WEIGHTS = {"builtin": 3, "code": 1, "small": 2}
MIXED = ["trainer.eval_every=3", "trainer.save_every=2", "trainer.document_mask=true"]


def _check_records(records, steps, weights):
    trained = [r for r in records if "loss" in r]
    assert [r["step"] for r in trained] == steps
    for r in trained:  # every record: cumulative tokens per source, adding up to the tokens
        mt = r["mixture_tokens"]
        assert set(mt) == set(weights) and sum(mt.values()) == r["tokens"], r
    vals = [r for r in records if "val_loss" in r]
    assert vals
    for r in vals:  # the mixture's val_loss is the sources' weighted as training draws them
        assert r["mixture_tokens"] == next(t["mixture_tokens"] for t in trained
                                           if t["step"] == r["step"])
        want = sum(w * r[f"val_loss/{n}"] for n, w in weights.items()) / sum(weights.values())
        assert r["val_loss"] == pytest.approx(want, rel=1e-9)


@pytest.mark.slow
def test_mixture_with_document_mask_trains_in_process(sources, small, tmp_path, capfd):
    """A world of one: the records, per-source validation, and a source that runs out starts
    its next epoch and the run says so."""
    from helpers import cfg_for, rows, world_of_one
    from llama_train.train import train

    _, _, code, _ = sources
    with world_of_one():
        result = train(cfg_for(tmp_path, _mixture_override(code, small), *MIXED,
                               "trainer.max_steps=6"))
    assert result["step"] == 6
    records = rows(tmp_path)
    _check_records(records, [1, 2, 3, 4, 5, 6], WEIGHTS)
    events = [r for r in records if r.get("event") == "source_epoch"]
    assert events and events[0]["source"] == "small" and events[0]["epoch"] == 1, events
    assert "data.mixture: source small was read through; it starts epoch 1" in capfd.readouterr().err


@pytest.fixture(scope="module")
def by_stage(sources, small, tmp_path_factory):
    """ZeRO-0, 1 and 2: three jobs of one --multirun launch (one process group for the three,
    as a user's sweep): stage -> its job's directory."""
    from helpers import train as launch

    _, _, code, _ = sources
    root = tmp_path_factory.mktemp("mixture_stages")
    launch(root / "sweep", ["--multirun", _mixture_override(code, small), *MIXED,
                            "trainer.max_steps=3", "deepspeed.zero_stage=0,1,2",
                            f"hydra.sweep.dir={root / 'hydra'}"])
    return {s: root / "sweep" / f"deepspeed.zero_stage={s}" for s in (0, 1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_mixture_with_document_mask_through_the_launcher(stage, by_stage):
    """2 ranks through the deepspeed launcher, ZeRO-0/1/2 (ZeRO-3: the resume test below)."""
    from helpers import metrics

    _check_records(metrics(by_stage[stage]), [1, 2, 3], WEIGHTS)


@pytest.mark.slow
def test_mixture_zero3_resumes_exactly_after_a_rank_dies(sources, small, tmp_path):
    """2 ranks, ZeRO-3, mixture + document mask: rank 1 dies without warning (os._exit, as
    kill -9) as step 5 begins; the relaunch resumes the newest complete checkpoint and every
    loss equals the uninterrupted run's bit for bit. That is step 4 if its background write
    (trainer.async_save) was done before the death, else step 2: a write in flight dies with
    its rank and never counts. The same checkpoint also resumes on 1 rank (another world size:
    the same windows, losses within the reduction-order tolerance)."""
    import shutil

    from helpers import assert_losses_close, losses, metrics, one_process, train as launch
    from llama_train.checkpoint import find_latest

    _, _, code, _ = sources
    args = [_mixture_override(code, small), *MIXED, "trainer.max_steps=6",
            "deepspeed.zero_stage=3"]
    ref, cut, one = tmp_path / "ref", tmp_path / "cut", tmp_path / "one"
    launch(ref, args)
    assert launch(cut, args, env={"LLAMA_TRAIN_FAULTS": "exit:step=5,rank=1"},
                  check=False) != 0
    assert max(losses(cut)) == 4
    newest, _ = find_latest(cut / "checkpoints")
    k = int(newest.name.split("_")[1])
    assert k in (2, 4), newest
    shutil.copytree(newest, tmp_path / "stepk")
    launch(cut, args)
    assert losses(cut) == losses(ref)
    _check_records(metrics(ref), [1, 2, 3, 4, 5, 6], WEIGHTS)
    trained = {r["step"]: r["mixture_tokens"] for r in metrics(ref) if "loss" in r}
    resumed = {r["step"]: r["mixture_tokens"] for r in metrics(cut) if "loss" in r}
    assert resumed == trained
    one_process(one, [*args, f"trainer.resume={tmp_path / 'stepk'}"], tmp_path / "one.log")
    on_one = {r["step"]: r for r in metrics(one) if "loss" in r}
    assert sorted(on_one) == list(range(k + 1, 7))
    assert_losses_close({s: v["loss"] for s, v in on_one.items()},
                        {s: v for s, v in losses(ref).items() if s > k}, 2e-4)
    assert {s: v["mixture_tokens"] for s, v in on_one.items()} == {
        s: v for s, v in trained.items() if s > k}
