"""trainer.init_from carries its tokenizer (issue 53, item 2): a run started from an export
tokenizes its data with the export's own tokenizer.model, not one trained afresh on the
current data (which gave other ids to the same pieces and trained on them with no error), and
a data.tokenizer that tokenizes otherwise, or no tokenizer at all, is refused before the data
is prepared and the process group starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import cfg_for, tiny_prepared
from llama_train.config import ConfigError
from llama_train.data.tokenizer import file_sha256, train_tokenizer
from llama_train.job.preflight import preflight

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny settings' prepared data (tokenizer trained on the built-in corpus), a tokenizer
    of the same size trained on other text, and untrained tiny weights exported with each
    (llama-export's layout): {"data", "foreign", "hf_foreign", "hf_same", "root"}."""
    import torch
    from pydoc_data import topics

    from llama_train.hf import export_hf
    from llama_train.model import Transformer

    root = tmp_path_factory.mktemp("init_from_tok")
    cfg, prepared = tiny_prepared()
    texts = [topics.topics[k] for k in sorted(topics.topics)]
    foreign = Path(train_tokenizer(texts, cfg.model.vocab_size, root / "foreign"))
    torch.manual_seed(0)
    sd = Transformer(cfg.model).state_dict()
    hf_foreign = export_hf(cfg.model, sd, root / "hf_foreign", tokenizer_model=foreign)
    hf_same = export_hf(cfg.model, sd, root / "hf_same", tokenizer_model=prepared.tokenizer_path)
    assert file_sha256(foreign) != prepared.meta["tokenizer"]["sha256"]
    return {"data": prepared, "foreign": foreign, "hf_foreign": hf_foreign, "hf_same": hf_same,
            "root": root}


def _preflight(out: Path, *overrides: str):
    pf = preflight(cfg_for(out, *overrides))
    pf.release()
    return pf


def test_init_from_tokenizes_the_data_with_the_exports_tokenizer(made, tmp_path):
    """The defect: the data's tokenizer was one trained on the current data (sha 4cf4...), not
    the export's; now the shards are tokenized with the export's tokenizer.model."""
    hf = made["hf_foreign"]
    pf = _preflight(tmp_path / "run", f"trainer.init_from={hf}")
    assert pf.prepared.meta["tokenizer"]["sha256"] == file_sha256(made["foreign"])
    assert pf.cfg.data.tokenizer == str(hf / "tokenizer.model")  # saved with the run's config


def test_data_already_tokenized_with_the_weights_tokenizer_is_kept(made, tmp_path):
    """Continuing on the data that trained the weights reuses it: no second preparation."""
    pf = _preflight(tmp_path / "run", f"trainer.init_from={made['hf_same']}")
    assert pf.prepared.dir == made["data"].dir and not pf.prepared.created
    assert pf.cfg.data.tokenizer is None


def test_a_data_tokenizer_that_tokenizes_otherwise_is_refused(made, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        _preflight(out, f"trainer.init_from={made['hf_foreign']}",
                   f"data.tokenizer={made['data'].tokenizer_path}")
    msg = str(e.value)
    assert "data.tokenizer=" in msg and "trainer.init_from=" in msg and "Leave" in msg
    assert "piece" in msg
    assert not out.exists() or not any(out.iterdir())  # refused before anything was written


def test_a_data_tokenizer_with_the_same_pieces_is_accepted(made, tmp_path):
    """The same file elsewhere, or the same model whose trainer bookkeeping (where it was
    trained) differs, tokenizes alike; one piece changed does not."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from llama_train.hf import check_init_from_tokenizer

    hf, vocab = str(made["hf_foreign"]), 2048
    copy = tmp_path / "copy.model"
    shutil.copyfile(made["foreign"], copy)
    assert check_init_from_tokenizer(hf, str(copy), vocab) == str(copy)
    m = pb.ModelProto()
    m.ParseFromString(made["foreign"].read_bytes())
    m.trainer_spec.model_prefix = "/elsewhere/tok"
    moved = tmp_path / "moved.model"
    moved.write_bytes(m.SerializeToString())
    assert file_sha256(moved) != file_sha256(made["foreign"])
    assert check_init_from_tokenizer(hf, str(moved), vocab) == str(moved)
    m.pieces[300].piece = "▁changed"
    changed = tmp_path / "changed.model"
    changed.write_bytes(m.SerializeToString())
    with pytest.raises(ConfigError, match="piece 300 is '▁changed'"):
        check_init_from_tokenizer(hf, str(changed), vocab)

    pf = _preflight(tmp_path / "run", f"trainer.init_from={hf}", f"data.tokenizer={copy}")
    assert pf.prepared.meta["tokenizer"]["sha256"] == file_sha256(made["foreign"])


def test_weights_without_a_tokenizer_need_data_tokenizer(made, tmp_path):
    """A llama-import .pt holds weights only, an HF directory may hold no tokenizer.model:
    refused unless data.tokenizer names the tokenizer the weights were trained with."""
    from llama_train.hf import import_main

    pt = tmp_path / "imported.pt"
    import_main([str(made["hf_foreign"]), str(pt)])
    bare = tmp_path / "hf_bare"
    shutil.copytree(made["hf_foreign"], bare)
    (bare / "tokenizer.model").unlink()
    tiktoken = tmp_path / "hf_tiktoken"  # Llama 3's tokenizer.model is no SentencePiece model
    shutil.copytree(bare, tiktoken)
    (tiktoken / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")
    for weights in (pt, bare, tiktoken):
        with pytest.raises(ConfigError, match="carries no tokenizer.*data.tokenizer="):
            _preflight(tmp_path / "run", f"trainer.init_from={weights}")
    pf = _preflight(tmp_path / "run", f"trainer.init_from={pt}",
                    f"data.tokenizer={made['foreign']}")
    assert pf.prepared.meta["tokenizer"]["sha256"] == file_sha256(made["foreign"])


def test_a_prepared_dir_of_another_tokenizer_is_refused(made, tmp_path):
    """data.prepared_dir named explicitly, holding shards of the current data's own tokenizer:
    it would have been read as is."""
    with pytest.raises(ConfigError, match="data.prepared_dir=.*another data.prepared_dir"):
        _preflight(tmp_path / "run", f"trainer.init_from={made['hf_foreign']}",
                   f"data.prepared_dir={made['data'].dir}")


def test_a_tokenizer_smaller_than_the_embedding_is_refused(made, tmp_path):
    """llama-export accepts a tokenizer smaller than model.vocab_size; the data's ids must fit
    the embedding exactly, so the run is refused naming trainer.init_from."""
    from pydoc_data import topics

    from llama_train.hf import export_hf, read_init_from

    args, sd = read_init_from(str(made["hf_foreign"]), with_weights=True)
    small = train_tokenizer([topics.topics[k] for k in sorted(topics.topics)[:40]], 1024,
                            tmp_path / "small")
    hf = export_hf(args, sd, tmp_path / "hf_small", tokenizer_model=small)
    with pytest.raises(ConfigError, match="init_from=.*1024 pieces.*vocab_size=2048"):
        _preflight(tmp_path / "run", f"trainer.init_from={hf}")


def test_a_run_from_an_export_trains_and_resumes_with_its_tokenizer(made, tmp_path):
    """One step from the export: the checkpoint carries the export's tokenizer; the same
    command resumes it (the data is the same on every launch)."""
    from llama_train.checkpoint import resolve_checkpoint
    from llama_train.train import train

    out, hf = tmp_path / "run", made["hf_foreign"]
    args = (f"trainer.init_from={hf}", "trainer.save_every=1", "sample.tokens=0")
    train(cfg_for(out, *args, "trainer.max_steps=1"))
    assert file_sha256(resolve_checkpoint(out) / "tokenizer.model") == \
        file_sha256(made["foreign"])
    train(cfg_for(out, *args, "trainer.max_steps=2"))
    assert resolve_checkpoint(out).name == "step_00000002"


# -- the dry run shows init_from's tokenizer (issue 57: the dry run is the run's plan) ----------
def test_the_dry_run_and_cfg_job_show_the_tokenizer_the_run_uses(made, tmp_path, capsys):
    """The dry run and --cfg job of a start from an export name the export's tokenizer as
    data.tokenizer, said as the run logs it (they printed the config without it: the data a
    dry run described was not the data the run then tokenized), and prepare nothing."""
    from helpers import TINY, launch_vars_restored
    from llama_train.job.dry_run import dry_run, print_job_config

    hf, out = made["hf_foreign"], tmp_path / "run"
    tok, sha = hf / "tokenizer.model", file_sha256(made["foreign"])
    with launch_vars_restored():
        dry_run(cfg_for(out, f"trainer.init_from={hf}", "trainer.dry_run=true"))
    text = capsys.readouterr().out
    said = (f"trainer.init_from={hf}: tokenizing the data with its tokenizer {tok} (sha256 "
            f"{sha[:12]}), the one its weights were trained with")
    assert f"\n  {said}\n" in text, text
    assert f"\n    tokenizer: {tok} (data.tokenizer)\n" in text, text
    assert not out.exists()
    with launch_vars_restored():
        print_job_config([*TINY, "trainer.micro_batch=4", f"trainer.output_dir={out}",
                          f"trainer.init_from={hf}"])
    shown = capsys.readouterr().out
    assert f"\n# {said}\n" in shown and f"\n  tokenizer: {tok}\n" in shown, shown
