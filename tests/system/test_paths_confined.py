"""Every path a run or a command writes is checked before any work (issue 54).

1. Each path-valued key of a run (tracking.metrics_file, tracking.tensorboard.dir,
   tracking.wandb.dir; trainer.output_dir and data.prepared_dir against checkpoints) resolves,
   through symlinks and ``..``, inside trainer.output_dir and outside its checkpoints/ and
   archive/, or the run is refused (exit 2) before anything is written: the outside target and
   the checkpoint stay byte-identical. The tracker checks again when it starts writing, and
   never writes through a link planted at its file.
2. A simulated rank never writes into a real run's output dir (nor a real job over a
   simulation's files).
10. The commands check their outputs before the work (llama-eval --output, llama-export's
    out_dir), LLAMA_TRAIN_CACHE is refused by name when it cannot be a directory, and a
    --prompt-file that is not UTF-8 is named.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import sys
from pathlib import Path

import pytest

from helpers import TINY, cfg_for, world_of_one
from llama_train.config import ConfigError
from llama_train.train import train

STEPS = ["trainer.max_steps=2", "trainer.save_every=2", "trainer.eval_every=1000",
         "sample.tokens=0"]
CKPT = "checkpoints/step_00000002"


def tree(d: Path) -> dict:
    """Every file under ``d`` (links to directories not followed) and its content's hash."""
    if not d.exists():
        return {}
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and not p.is_symlink()
            and p.name != ".lock"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny real run: 2 steps, its checkpoint at step 2 (one process)."""
    out = tmp_path_factory.mktemp("confined") / "run"
    with world_of_one():
        train(cfg_for(out, *STEPS))
    assert (out / CKPT / "manifest.json").is_file()
    return out


def refused(out: Path, *overrides: str, match: str) -> str:
    """Train into ``out``: must be refused with a ConfigError matching ``match``."""
    with world_of_one(), pytest.raises(ConfigError, match=match) as e:
        train(cfg_for(out, *STEPS, *overrides))
    return str(e.value)


# -- 1. a run's paths ---------------------------------------------------------------------------

def _outside(work: Path) -> Path:
    """A directory beside the output dir holding a file that must never change."""
    d = work / "outside"
    d.mkdir(exist_ok=True)
    (d / "m.jsonl").write_text("precious\n")
    return d


TB, WB = "tracking.tensorboard.enabled=true", "tracking.wandb.mode=offline"
# name -> (links made in the output dir: name -> target under the work dir, overrides
# ({outside}: that directory), the key the refusal names)
TRICKS = {
    "metrics through a symlinked parent": ({"sub": "outside"},
                                           ["tracking.metrics_file=sub/m.jsonl"], "metrics_file"),
    "metrics ../": ({}, ["tracking.metrics_file=../outside/m.jsonl"], "metrics_file"),
    "metrics down then up and out": ({}, ["tracking.metrics_file=a/../../outside/m.jsonl"],
                                     "metrics_file"),
    # link/.. is the link target's parent, as the kernel walks it
    "metrics up through a link": ({"deep": "outside"}, ["tracking.metrics_file=deep/../m.jsonl"],
                                  "metrics_file"),
    "metrics absolute outside": ({}, ["tracking.metrics_file={outside}/m.jsonl"], "metrics_file"),
    "metrics file itself a link": ({"metrics.jsonl": "outside/m.jsonl"}, [], "symlink"),
    "metrics file is config.yaml": ({}, ["tracking.metrics_file=config.yaml"], "config.yaml"),
    "metrics into archive/": ({}, ["tracking.metrics_file=archive/20250101T000000Z/m.jsonl"],
                              "archive"),
    "tensorboard ../": ({}, [TB, "tracking.tensorboard.dir=../outside/tb"], "tensorboard.dir"),
    "tensorboard absolute outside": ({}, [TB, "tracking.tensorboard.dir={outside}/tb"],
                                     "tensorboard.dir"),
    "tensorboard through a symlinked parent": ({"logs": "outside"},
                                               [TB, "tracking.tensorboard.dir=logs/tb"],
                                               "tensorboard.dir"),
    "wandb ../": ({}, [WB, "tracking.wandb.dir=../outside/wb"], "wandb.dir"),
    "wandb absolute outside": ({}, [WB, "tracking.wandb.dir={outside}"], "wandb.dir"),
    "wandb dir a symlink out": ({"wb": "outside"}, [WB, "tracking.wandb.dir=wb"], "wandb.dir"),
    "wandb disabled, dir still outside": ({}, ["tracking.wandb.mode=disabled",
                                               "tracking.wandb.dir=.."], "wandb.dir"),
}


@pytest.mark.parametrize("name", list(TRICKS))
def test_a_path_that_leaves_the_output_dir_is_refused_before_any_write(tmp_path, name):
    links, overrides, key = TRICKS[name]
    out, outside = tmp_path / "out", _outside(tmp_path)
    out.mkdir()
    for link, target in links.items():
        os.symlink(tmp_path / target, out / link)
    before, kept = tree(out), tree(outside)
    msg = refused(out, *[o.replace("{outside}", str(outside)) for o in overrides], match=key)
    assert "Nothing was changed" in msg, msg
    assert tree(out) == before, "the refused run wrote into its output dir"
    assert tree(outside) == kept, "the refused run wrote outside"
    assert sorted(p.name for p in outside.iterdir()) == ["m.jsonl"], "a sink wrote outside"


CHECKPOINT_TRICKS = {
    "metrics into a checkpoint's file": (
        [f"tracking.metrics_file={CKPT}/trainer_state.json"], "tracking.metrics_file"),
    "metrics into checkpoints/": (["tracking.metrics_file=checkpoints/m.jsonl"],
                                  "tracking.metrics_file"),
    "metrics into checkpoints/ by absolute path": (
        ["tracking.metrics_file={out}/" + CKPT + "/m.jsonl"], "tracking.metrics_file"),
    "metrics through a link into a checkpoint": (["tracking.metrics_file=ck/m.jsonl"],
                                                 "tracking.metrics_file"),
    "tensorboard into a checkpoint": (["tracking.tensorboard.enabled=true",
                                       f"tracking.tensorboard.dir={CKPT}"],
                                      "tracking.tensorboard.dir"),
    "wandb into checkpoints/": (["tracking.wandb.mode=offline", "tracking.wandb.dir=checkpoints"],
                                "tracking.wandb.dir"),
}


@pytest.mark.parametrize("name", list(CHECKPOINT_TRICKS))
def test_nothing_is_written_into_a_checkpoint(run, name):
    """The finished run's checkpoint is byte-identical after each refusal (a metrics file at
    its trainer_state.json left it failing its manifest, exit 0)."""
    overrides, key = CHECKPOINT_TRICKS[name]
    overrides = [o.replace("{out}", str(run)) for o in overrides]
    link = run / "ck"
    if "link" in name:
        os.symlink(run / CKPT, link)
    try:
        before = tree(run)
        refused(run, *overrides, match=key)
        assert tree(run) == before
    finally:
        if link.is_symlink():
            link.unlink()
    from llama_train.checkpoint import verify

    verify(run / CKPT)  # raises if its manifest no longer vouches for it


@pytest.mark.parametrize("key", ["trainer.output_dir", "data.prepared_dir"])
def test_no_directory_of_a_run_lies_inside_a_checkpoint(run, tmp_path, key):
    before = tree(run)
    inner = run / CKPT / "inner"
    out = inner if key == "trainer.output_dir" else tmp_path / "out"
    extra = [] if key == "trainer.output_dir" else [f"data.prepared_dir={inner}"]
    refused(out, *extra, match=f"{key}=.*inside the checkpoint")
    assert tree(run) == before and not inner.exists()


def test_the_helper_resolves_links_and_dots(tmp_path):
    """paths.run_path: relative paths are relative to the output dir; what counts is where the
    kernel would write. The output dir may itself be a link."""
    from llama_train.paths import PathRefused, run_path

    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    os.symlink(real, tmp_path / "alias")  # the output dir through a link: allowed
    os.symlink(real / "sub", real / "inner")  # a link that stays inside: allowed
    os.symlink(tmp_path, real / "up")  # a link out
    out = tmp_path / "alias"
    ok = {"metrics.jsonl": out / "metrics.jsonl", "sub/m.jsonl": out / "sub/m.jsonl",
          "inner/m.jsonl": out / "inner/m.jsonl", "sub/../m.jsonl": out / "sub/../m.jsonl",
          str(real / "m.jsonl"): real / "m.jsonl"}
    for value, want in ok.items():
        assert run_path(out, value, "k", "metrics.jsonl") == want
    assert run_path(out, None, "k", "tensorboard", directory=True) == out / "tensorboard"
    assert run_path(out, None, "k", ".", directory=True) == out
    for value in ("../m.jsonl", "up/m.jsonl", "up/real/../x", "/etc/passwd", "sub/../../x",
                  "checkpoints/x", "checkpoints", "archive/a/metrics.jsonl", ".", "sub"):
        with pytest.raises(PathRefused, match=r"k="):
            run_path(out, value, "k", "metrics.jsonl")


def test_a_link_planted_after_preflight_is_refused_when_the_tracker_starts(tmp_path):
    """The tracker checks its paths again before its first write, and never writes through a
    link planted at its file afterwards (O_NOFOLLOW; rewrites replace the link)."""
    from llama_train.config import TrackingConfig
    from llama_train.metrics.tracking import Tracker

    out, victim = tmp_path / "out", _outside(tmp_path)
    (out / "logs").mkdir(parents=True)
    cfg = TrackingConfig(metrics_file="logs/metrics.jsonl")
    cfg.wandb.mode = "disabled"
    t = Tracker(cfg, str(out), rank=0)  # checked: logs/ is a directory inside
    shutil.rmtree(out / "logs")
    os.symlink(victim, out / "logs")  # planted between the check and the start
    with pytest.raises(ConfigError, match="tracking.metrics_file.*through the symlink"):
        t.start()
    (out / "logs").unlink()
    (out / "logs").mkdir()
    t = Tracker(cfg, str(out), rank=0)
    t.start()
    t.log(1, {"loss": 1.0})
    (out / "logs" / "metrics.jsonl").unlink()
    os.symlink(victim / "m.jsonl", out / "logs" / "metrics.jsonl")  # planted mid-run
    with pytest.raises(ConfigError, match="became a symlink.*nothing was written through it"):
        t.log(2, {"loss": 0.5})
    t.rewind(0, 0)  # a rewrite replaces the link, never its target
    assert (victim / "m.jsonl").read_text() == "precious\n"
    assert not (out / "logs" / "metrics.jsonl").is_symlink()
    t.finish()


def test_run_files_are_replaced_never_written_through(tmp_path):
    """config.yaml, run_info.json and sample.txt are written whole (a temporary and a rename):
    a link planted at the name is replaced, its target untouched."""
    from llama_train.paths import replace_file
    from llama_train.records import RunInfo

    victim = _outside(tmp_path) / "m.jsonl"
    for name in ("config.yaml", "run_info.json"):
        os.symlink(victim, tmp_path / name)
    replace_file(tmp_path / "config.yaml", "a: 1\n")
    RunInfo(params={}, model_args={}, flop_budget=None, tokens=1, global_batch=1, seq_len=1,
            max_steps=1, flops_per_token=1.0, flops=1.0, peak_flops={}, command=None
            ).write(tmp_path / "run_info.json")
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "config.yaml").read_text() == "a: 1\n"
    assert not (tmp_path / "run_info.json").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "outside",
                                                         "run_info.json"]  # no temporary left


# -- 2. a simulated rank and a real run never share a directory ----------------------------------

SIM = ["comm.simulate_ranks=4", "comm.simulate_rank=1", "trainer.micro_batch=1"]


@pytest.mark.parametrize("how", [[], ["trainer.resume=never", "trainer.on_existing=overwrite"],
                                 ["trainer.resume=never", "trainer.on_existing=archive"]])
def test_a_simulation_never_writes_into_a_real_run(run, how):
    before = tree(run)
    msg = refused(run, *SIM, *how, match="holds a real run")
    assert "its own trainer.output_dir" in msg and "checkpoints/step_00000002" in msg, msg
    assert tree(run) == before


def test_a_simulation_never_replaces_a_real_run_that_has_not_saved_yet(run, tmp_path):
    """A real run stopped before its first save: its config.yaml, metrics and run_info.json
    (a simulation replaced all three and started a history of its own)."""
    young = tmp_path / "young"
    young.mkdir()
    for name in ("config.yaml", "run_info.json", "metrics.jsonl"):
        shutil.copy(run / name, young / name)
    before = tree(young)
    refused(young, *SIM, match="holds a real run .config.yaml")
    assert tree(young) == before


def test_a_real_job_never_replaces_a_simulations_files(tmp_path):
    """A simulation that has not saved yet (config.yaml with comm.simulate_ranks): a real job
    would start over on its files; only an explicit start-over sets them aside."""
    from llama_train.job.simulation import check_output_dir

    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "config.yaml").write_text("comm:\n  simulate_ranks: 4\n  simulate_rank: 1\n")
    (sim / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "rank_loss": 7.0}\n')
    before = tree(sim)
    msg = refused(sim, match="holds a simulated rank's run")
    assert "simulated rank 1 of 4" in msg and "trainer.on_existing=archive" in msg, msg
    assert tree(sim) == before
    check_output_dir(cfg_for(sim, "trainer.resume=never", "trainer.on_existing=archive"), False)
    check_output_dir(cfg_for(sim, *SIM), True)  # the same simulation continues its own


# -- 10. the commands' outputs -------------------------------------------------------------------

@pytest.fixture
def fake_eval(monkeypatch):
    """llama-eval's evaluation, instant: the calls it got."""
    import lm_eval.utils

    from llama_train.inference import downstream

    calls = []

    def evaluate(*args, **kwargs):
        calls.append(args)
        return {"source": "fake", "results": {"t": {"acc,none": 0.5}}, "n-samples": {"t": 3}}

    monkeypatch.setattr(downstream, "evaluate", evaluate)
    monkeypatch.setattr(downstream, "device_and_dtype", lambda a: ("cpu", "fp32"))
    monkeypatch.setattr(lm_eval.utils, "make_table", lambda res: "table")
    return calls


def test_llama_eval_creates_a_missing_output_directory(tmp_path, fake_eval, capsys):
    from llama_train.inference.downstream import main as eval_main

    out = tmp_path / "results" / "today" / "res.json"
    eval_main(["ckpt", "--tasks", "t", "--output", str(out)])
    assert fake_eval and '"acc,none": 0.5' in out.read_text()


@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_llama_eval_refuses_an_unwritable_output_before_evaluating(tmp_path, fake_eval, capsys,
                                                                   where):
    from llama_train.inference.downstream import main as eval_main

    (tmp_path / "notes.txt").write_text("x")
    out = tmp_path / "notes.txt" / "res.json" if where == "under_a_file" else tmp_path
    with pytest.raises(SystemExit) as e:
        eval_main(["ckpt", "--tasks", "t", "--output", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not fake_eval, err
    assert err.count("llama-eval: error: --output") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("where", ["read_only", "under_a_file", "a_file"])
def test_llama_export_checks_its_out_dir_before_converting(tmp_path, monkeypatch, capsys, where):
    """A read-only out_dir (EROFS from the probe, as a read-only mount gives even to root),
    one under a file or a file: exit 2 and one line before the checkpoint is read."""
    import llama_train.checkpoint as checkpoint
    import llama_train.paths as paths
    from llama_train.hf import export_main

    def never(*a, **k):
        raise AssertionError("the checkpoint was read before the out_dir was checked")

    monkeypatch.setattr(checkpoint, "resolve_checkpoint", never)
    monkeypatch.setattr(checkpoint, "load_consolidated", never)
    (tmp_path / "notes.txt").write_text("x")
    out = {"read_only": tmp_path / "ro" / "hf", "under_a_file": tmp_path / "notes.txt" / "hf",
           "a_file": tmp_path / "notes.txt"}[where]
    if where == "read_only":
        (tmp_path / "ro").mkdir()

        def read_only(*a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "ro"))

        monkeypatch.setattr(paths.tempfile, "mkstemp", read_only)
    with pytest.raises(SystemExit) as e:
        export_main([str(tmp_path / "ckpt"), str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count("llama-export: error: out_dir") == 1 and "Traceback" not in err, err
    if where == "read_only":
        assert "read-only" in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0555 directory")
def test_llama_export_into_a_mode_0555_directory(tmp_path, capsys):
    from llama_train.hf import export_main

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(SystemExit) as e:
        export_main([str(tmp_path / "ckpt"), str(ro)])
    assert e.value.code == 2 and "out_dir" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["file", "under_a_file", ""])
def test_a_cache_dir_that_cannot_be_one_is_named_before_anything(tmp_path, monkeypatch, value):
    """LLAMA_TRAIN_CACHE a file (or under one, or empty): the variable named, exit 2 from
    llama-train before any directory is made or data read."""
    from llama_train.paths import PathRefused, cache_dir

    (tmp_path / "cache").write_text("not a directory")
    cache = {"file": str(tmp_path / "cache"), "under_a_file": str(tmp_path / "cache" / "sub"),
             "": ""}[value]
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", cache)
    with pytest.raises(PathRefused, match="LLAMA_TRAIN_CACHE="):
        cache_dir()
    out = tmp_path / "out"
    msg = refused(out, match="LLAMA_TRAIN_CACHE=")
    assert "set LLAMA_TRAIN_CACHE to a directory" in msg
    assert not out.exists()


def test_the_entry_point_names_a_bad_cache_in_one_line(tmp_path, monkeypatch, capsys):
    from llama_train import train as train_mod

    (tmp_path / "cache").write_text("x")
    monkeypatch.setenv("LLAMA_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setattr(sys, "argv", ["llama-train", *TINY,
                                      f"trainer.output_dir={tmp_path / 'out'}"])
    with world_of_one(), pytest.raises(SystemExit) as e:
        train_mod.main()
    text = capsys.readouterr()
    errors = [line for line in (text.err + text.out).splitlines()
              if line.startswith("llama-train: error:")]
    assert e.value.code == 2 and len(errors) == 1 and "LLAMA_TRAIN_CACHE=" in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_a_prompt_file_that_is_not_utf8_is_named(tmp_path, monkeypatch, capsys):
    import llama_train.inference.generate as generate

    def never(*a, **k):
        raise AssertionError("the model was loaded before the prompt was read")

    monkeypatch.setattr(generate, "load", never)
    bad = tmp_path / "prompt.txt"
    bad.write_bytes("Caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        generate.main(["ckpt", "--prompt-file", str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert f"--prompt-file {bad} is not UTF-8" in err and "0xe9 at offset 3" in err, err
