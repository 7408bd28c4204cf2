"""Stray entries in ``<output_dir>/checkpoints`` (issue 54, class 5): a user's copy
``step_00000004.bak``, an editor's swap file, ``step_abc``, ``step_4``, a README. Every place
that lists checkpoints (resume discovery, retention, ``trainer.on_existing``, llama-export and
llama-generate given an output dir) ignores them with a warning naming them, and nothing of
llama-train ever deletes them. Before, every resume, export and retention stopped on them:
"invalid literal for int() with base 10: 'abc'" (or '00000004.bak').

In-process (a world of one): one finished tiny run, copied by each test.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from helpers import cfg_for, resumed_from
from llama_train.checkpoint import (CheckpointError, existing_history, find_latest,
                                    resolve_checkpoint)
from llama_train.train import train

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one

STRAY_DIRS = ("step_00000004.bak", "step_abc", "step_4", "step_00000002-old")
STRAY_FILES = (".step_00000004.swp", "README", "step_00000003.tar")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4. Copied by the tests, never written to."""
    out = tmp_path_factory.mktemp("strays") / "run"
    train(cfg_for(out, "trainer.max_steps=4", "trainer.save_every=2", "sample.tokens=0"))
    return out


def _with_strays(finished: Path, dst: Path) -> Path:
    """A copy of the run with stray entries beside its checkpoints; ``step_00000004.bak`` is a
    full copy of the step-4 checkpoint (it verifies: only its name tells it apart)."""
    shutil.copytree(finished, dst)
    root = dst / "checkpoints"
    shutil.copytree(root / "step_00000004", root / "step_00000004.bak")
    for name in STRAY_DIRS[1:]:
        (root / name).mkdir()
        (root / name / "notes.txt").write_text("mine\n")
    for name in STRAY_FILES:
        (root / name).write_text("mine\n")
    return dst


def _strays_intact(out: Path) -> None:
    root = out / "checkpoints"
    for name in STRAY_DIRS[1:]:
        assert (root / name / "notes.txt").read_text() == "mine\n", name
    for name in STRAY_FILES:
        assert (root / name).read_text() == "mine\n", name
    assert (root / "step_00000004.bak" / "manifest.json").is_file()


def test_resume_and_retention_ignore_strays_and_never_delete_them(finished, tmp_path, caplog):
    """resume=auto picks step 4 past the strays, warns naming them; keep_last=1 prunes the
    run's old checkpoints, keeps the one it saved, and leaves every stray (a step_N directory
    holding nothing a save writes too: it is no checkpoint, and never counts as a kept one)."""
    out = _with_strays(finished, tmp_path / "run")
    (out / "checkpoints" / "step_00000099").mkdir()  # a name like ours, but nothing in it

    assert find_latest(out / "checkpoints")[0].name == "step_00000004"
    assert existing_history(str(out), "metrics.jsonl")[:2] == \
        ["checkpoints/step_00000002", "checkpoints/step_00000004"]
    with caplog.at_level(logging.WARNING, logger="llama_train"):
        train(cfg_for(out, "trainer.max_steps=6", "trainer.save_every=2", "trainer.keep_last=1",
                      "sample.tokens=0"))
    assert [Path(p).name for p in resumed_from(out)] == ["step_00000004"]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.glob("step_0000000[0-9]")) == ["step_00000006"]
    assert (root / "step_00000099").is_dir()
    _strays_intact(out)
    for name in (*STRAY_DIRS, *STRAY_FILES):
        assert repr(name) in caplog.text, (name, caplog.text[-2000:])


def test_export_and_generate_given_the_output_dir_skip_strays(finished, tmp_path, capsys):
    from llama_train.hf import export_main
    from llama_train.inference.generate import load

    out = _with_strays(finished, tmp_path / "run")
    assert resolve_checkpoint(str(out)).name == "step_00000004"
    assert resolve_checkpoint(str(out / "checkpoints")).name == "step_00000004"
    export_main([str(out), str(tmp_path / "hf")])
    assert "exported step 4" in capsys.readouterr().out
    assert load(str(out)).source.startswith("step 4 of")
    _strays_intact(out)

    # only strays: no checkpoint is guessed at; the message names them (exit 2)
    only = tmp_path / "only_strays"
    (only / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_00000004.bak",
                    only / "checkpoints" / "step_00000004.bak")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        export_main([str(only), str(tmp_path / "hf2")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "step_00000004.bak" in err and "Traceback" not in err, err


def test_overwrite_deletes_the_run_not_the_strays(finished, tmp_path):
    """trainer.on_existing=overwrite deletes what the run wrote; a stray in checkpoints/ is not
    the run's and stays."""
    out = _with_strays(finished, tmp_path / "run")
    train(cfg_for(out, "trainer.resume=never", "trainer.on_existing=overwrite",
                  "trainer.max_steps=2", "trainer.save_every=2", "sample.tokens=0"))
    root = out / "checkpoints"
    assert sorted(p.name for p in root.glob("step_0000000[0-9]")) == ["step_00000002"]
    _strays_intact(out)


def test_a_stray_with_a_checkpoints_name_is_never_overwritten(finished, tmp_path):
    """A directory no save wrote (or a file) named step_00000006 where the save of step 6
    goes: the save is refused naming it and it is left as it was (before, the directory was
    deleted to make room), the checkpoint of step 4 stays the newest."""
    for kind in ("dir", "file"):
        out = tmp_path / kind
        shutil.copytree(finished, out)
        stray = out / "checkpoints" / "step_00000006"
        if kind == "dir":
            stray.mkdir()
            stray = stray / "notes.txt"
        stray.write_text("mine\n")
        with pytest.raises(CheckpointError, match="step_00000006 exists and is not a checkpoint"):
            train(cfg_for(out, "trainer.max_steps=6", "trainer.save_every=2", "sample.tokens=0"))
        assert stray.read_text() == "mine\n"
        assert find_latest(out / "checkpoints")[0].name == "step_00000004"
