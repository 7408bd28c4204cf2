"""llama-generate: sampling from our checkpoint and from its Hugging Face export (issue 28)."""

from __future__ import annotations

import io
import os
import stat
import sys

import pytest
import torch

from helpers import trained_and_exported
from llama_train.hf import export_main, import_main
from llama_train.inference.generate import load, main as generate_main

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 steps of the tiny model, a checkpoint at step 4, exported to Hugging Face format."""
    return trained_and_exported(tmp_path_factory.mktemp("gen"), 4)


def _greedy_without_cache(model, ids, n, eos):
    """The reference: the whole sequence through the model for every new token."""
    ids = list(ids)
    new = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            if nxt == eos:
                break
            ids.append(nxt)
            new.append(nxt)
    return new


def _gen(capsys, *argv):
    generate_main([str(a) for a in argv])
    return capsys.readouterr()


def test_greedy_from_our_checkpoint_is_the_uncached_argmax(run, capsys):
    out, _ = run
    res = _gen(capsys, out, "--prompt", "The module", "--max-new-tokens", 12,
               "--temperature", 0)
    loaded = load(str(out))
    tok = loaded.tokenizer
    ids = tok.encode("The module", bos=loaded.add_bos, eos=False)
    new = _greedy_without_cache(loaded.model, ids, 12, tok.eos_id)
    assert new and res.out == "The module" + tok.decode(ids + new)[len(tok.decode(ids)):] + "\n"
    assert "step 4 of" in loaded.source and "step_00000004" in loaded.source
    # the account on stderr: new tokens, seconds, tokens/s, how, where from
    assert "new tokens in" in res.err and "tokens/s; greedy; cpu fp32) from step 4 of" in res.err


def test_our_checkpoint_and_its_export_generate_the_same_text(run, capsys):
    out, hf = run
    settings = ["--prompt", "The", "--prompt", "In the beginning of a long", "--max-new-tokens",
                10, "--temperature", 0.9, "--top-k", 20, "--seed", 7]
    ours = _gen(capsys, out, *settings)
    theirs = _gen(capsys, hf, *settings)
    assert ours.out == theirs.out and ours.out.count("\n") == 2
    assert "Hugging Face model" in theirs.err
    # sampling is reproducible from the seed, and another seed samples something else
    assert _gen(capsys, out, *settings).out == ours.out
    assert _gen(capsys, out, *settings[:-1], 8).out != ours.out


def test_top_k_1_and_a_tiny_top_p_are_greedy(run, capsys):
    out, _ = run
    common = [out, "--prompt", "The", "--max-new-tokens", 8]
    greedy = _gen(capsys, *common, "--temperature", 0).out
    assert _gen(capsys, *common, "--temperature", 1.5, "--top-k", 1).out == greedy
    assert _gen(capsys, *common, "--temperature", 1.5, "--top-p", 1e-6).out == greedy


def test_prompt_file_interactive_and_a_llama_import_file(run, capsys, tmp_path, monkeypatch):
    out, hf = run
    f = tmp_path / "prompt.txt"
    f.write_text("The function")
    from_file = _gen(capsys, out, "--prompt-file", f, "--max-new-tokens", 6, "--temperature", 0)
    direct = _gen(capsys, out, "--prompt", "The function", "--max-new-tokens", 6,
                  "--temperature", 0)
    assert from_file.out == direct.out
    monkeypatch.setattr(sys, "stdin", io.StringIO("The function\n\nThe\n"))
    inter = _gen(capsys, out, "-i", "--max-new-tokens", 6, "--temperature", 0)
    lines = inter.out.splitlines()
    assert len(lines) == 2 and lines[0] == direct.out.rstrip("\n")
    assert inter.err.count("new tokens in") == 2
    # llama-import's .pt has weights only: the tokenizer is asked for, then used
    pt = tmp_path / "model.pt"
    import_main([str(hf), str(pt)])
    with pytest.raises(SystemExit) as e:
        _gen(capsys, pt, "--prompt", "The function")
    assert e.value.code == 2 and "pass --tokenizer" in capsys.readouterr().err
    imported = _gen(capsys, pt, "--tokenizer", hf / "tokenizer.model", "--prompt",
                    "The function", "--max-new-tokens", 6, "--temperature", 0)
    assert imported.out == direct.out


@pytest.mark.parametrize("argv,code,says", [
    (["{tmp}/nowhere"], 2, "does not exist"),
    (["{tmp}"], 2, "checkpoint"),
    (["{out}", "--max-new-tokens", "100000"], 2, "exceeds model.max_seq_len"),
    (["{out}", "--top-p", "2"], 2, "--top-p=2.0 must be in (0, 1]"),
    (["{out}", "--device", "cuda"], 2, "no CUDA device here"),
], ids=["missing", "not-a-checkpoint", "too-long", "bad-top-p", "no-gpu"])
def test_bad_input_is_one_line_and_exit_2(run, capsys, tmp_path, argv, code, says):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    out, _ = run
    argv = [a.format(tmp=tmp_path, out=out) for a in argv]
    with pytest.raises(SystemExit) as e:
        generate_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code and says in err, err
    assert "Traceback" not in err


def test_export_names_its_step_and_writes_readable_files(run, capsys, tmp_path):
    out, _ = run
    old = os.umask(0o022)
    try:
        export_main([str(out), str(tmp_path / "hf")])
    finally:
        os.umask(old)
    said = capsys.readouterr().out
    assert said.startswith("exported step 4 (") and "step_00000004" in said
    for f in (tmp_path / "hf").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
