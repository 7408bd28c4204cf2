"""``llama-train --config-dir <run dir> --config-name config`` trains the run's saved config.yaml
(issue 53, item 1). Hydra searched the package's configs/ before --config-dir, so the package's
config.yaml (dim 384, 150 steps) shadowed the run's and the rerun trained the defaults.

Through the real entry point (``main()``: argv, Hydra, the multirun pre-check) with the job
replaced by a recorder of the config it was given: composition only, no training.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import TINY, compose_cfg, run_main
from llama_train import train as train_mod
from llama_train.config import load_config, to_container

# a saved run unlike the defaults in every section the rerun must keep
SAVED = [*TINY, "trainer.max_steps=7", "trainer.seed=7", "optim.lr=0.002",
         "data.val_fraction=0.05", "deepspeed.zero_stage=1"]


def llama_train(argv, monkeypatch, capsys):
    """``llama-train <argv>`` in this process, each job recorded instead of run: (exit code,
    output, jobs), a job being its config, run_info's command and Hydra's run settings."""
    from hydra.core.hydra_config import HydraConfig

    jobs = []

    def record(dcfg, hooks):
        hc = HydraConfig.get()
        cfg, _ = train_mod.sweep_job_dir(load_config(dcfg), dcfg)
        jobs.append({"cfg": to_container(cfg), "command": train_mod._job_command(),
                     "hydra": OmegaConf.to_container(OmegaConf.masked_copy(
                         hc, ["run", "sweep", "output_subdir", "job_logging", "hydra_logging"]))
                     | {"chdir": hc.job.chdir}})

    monkeypatch.setattr(train_mod, "run_job", record)
    return (*run_main(argv, monkeypatch, capsys, port=False), jobs)


@pytest.fixture
def saved_run(tmp_path, monkeypatch):
    """A run directory holding the config.yaml a run of SAVED wrote; the commands run in an
    empty directory of their own (Hydra must write nothing there)."""
    run = tmp_path / "run"
    run.mkdir()
    saved = to_container(compose_cfg(SAVED))
    (run / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return run, saved


def with_keys(cfg: dict, **dotted) -> dict:
    out = copy.deepcopy(cfg)
    for key, value in dotted.items():
        *path, last = key.split("__")
        node = out
        for k in path:
            node = node[k]
        node[last] = value
    return out


@pytest.mark.parametrize("layout", ["flags first", "flags last", "short flags", "flag=value"])
def test_a_rerun_trains_the_saved_config(saved_run, tmp_path, layout, monkeypatch, capsys):
    """The rerun's model, data, optimizer, trainer (every section) are the saved run's but for
    the keys overridden; Hydra's run settings are the package's (no outputs/<date>/.hydra, no
    Hydra logging); run_info's command names the saved config, so it reruns the same."""
    run, saved = saved_run
    out = tmp_path / "rerun"
    overrides = [f"trainer.output_dir={out}", "trainer.max_steps=3", "optim.lr=0.001"]
    flags = {"flags first": ["--config-dir", str(run), "--config-name", "config"],
             "flags last": ["--config-dir", str(run), "--config-name", "config"],
             "short flags": ["-cd", str(run), "-cn", "config"],
             "flag=value": [f"--config-dir={run}", "--config-name=config"]}[layout]
    argv = [*overrides, *flags] if layout == "flags last" else [*flags, *overrides]
    code, text, jobs = llama_train(argv, monkeypatch, capsys)
    assert code == 0, text
    [job] = jobs
    want = with_keys(saved, trainer__output_dir=str(out), trainer__max_steps=3, optim__lr=0.001)
    for section in ("model", "data", "optim", "trainer"):
        assert job["cfg"][section] == want[section], section
    assert job["cfg"] == want
    assert job["command"] == (f"llama-train --config-dir {run} --config-name config "
                              + " ".join(overrides))
    code, text, [package_job] = llama_train(overrides, monkeypatch, capsys)
    assert code == 0, text
    assert job["hydra"] == package_job["hydra"]
    assert package_job["command"] == "llama-train " + " ".join(overrides)
    assert list(Path.cwd().iterdir()) == []


@pytest.mark.parametrize("choice", ["model=llama3_8b", "+model=llama3_8b", "deepspeed=zero3",
                                    "experiment=compute_optimal"])
def test_a_config_group_on_a_rerun_is_refused(saved_run, choice, monkeypatch, capsys):
    """A saved config.yaml is resolved: it selects no groups, so ``model=llama3_8b`` has nothing
    to replace (Hydra: no match in the defaults list) and ``+model=`` would merge the preset
    into the run's model, keeping the keys it does not set. Refused: exit 2, what to do."""
    run, _ = saved_run
    group = choice.lstrip("+").split("=")[0]
    code, text, jobs = llama_train(
        ["--config-dir", str(run), "--config-name", "config", choice], monkeypatch, capsys)
    assert (code, jobs) == (2, []), text
    errors = [line for line in text.splitlines() if line.startswith("llama-train: error:")]
    assert len(errors) == 1 and "Traceback" not in text, text
    assert errors[0].startswith(f"llama-train: error: {choice}: {run / 'config.yaml'}")
    assert f"{group}.<key>=value" in errors[0], errors[0]


def test_a_sweep_over_a_saved_config(saved_run, tmp_path, monkeypatch, capsys):
    """--multirun on a rerun: every job trains the saved config with its point, in its own
    directory; the pre-check composes the same config (a bad point refused before any job)."""
    run, saved = saved_run
    out = tmp_path / "sweep"
    flags = ["--multirun", "--config-dir", str(run), "--config-name", "config",
             f"trainer.output_dir={out}"]
    code, text, jobs = llama_train([*flags, "optim.lr=0.001,0.003"], monkeypatch, capsys)
    assert code == 0, text
    assert [j["cfg"] for j in jobs] == [
        with_keys(saved, trainer__output_dir=str(out / f"optim.lr={lr}"), optim__lr=lr)
        for lr in (0.001, 0.003)]
    code, text, jobs = llama_train([*flags, "trainer.micro_batch=2,-1"], monkeypatch, capsys)
    assert (code, jobs) == (2, []), text
    assert "1 of the 2 jobs" in text and "trainer.micro_batch=-1" in text, text


def test_config_dir_without_the_config(tmp_path, monkeypatch, capsys):
    """A --config-dir holding no config.yaml: a directory of config groups keeps Hydra's own
    search order (the package's config.yaml, a group from the directory). Named with
    --config-name (a run that never wrote its config.yaml, the directory above the run's), or
    holding no configs at all, it is refused where it trained the defaults."""
    mine = tmp_path / "mine"
    (mine / "model").mkdir(parents=True)
    tiny = (train_mod.CONFIG_DIR / "model" / "tiny.yaml").read_text()
    (mine / "model" / "mine.yaml").write_text(tiny.replace("\ndim: 128\n", "\ndim: 96\n"))
    monkeypatch.chdir(tmp_path)
    code, text, [job] = llama_train(["--config-dir", str(mine), *TINY, "model=mine"],
                                    monkeypatch, capsys)
    assert code == 0, text
    assert job["cfg"] == with_keys(to_container(compose_cfg(TINY)), model__dim=96)
    empty = tmp_path / "no_config"
    empty.mkdir()
    (tmp_path / "runs" / "run").mkdir(parents=True)
    (tmp_path / "runs" / "run" / "config.yaml").write_text("trainer:\n  max_steps: 3\n")
    for d, flags in [(empty, ["--config-name", "config"]), (empty, []),
                     (tmp_path / "runs", ["--config-name", "config"])]:
        code, text, jobs = llama_train(["--config-dir", str(d), *flags], monkeypatch, capsys)
        assert (code, jobs) == (2, []), text
        assert f"--config-dir {d} holds no config.yaml" in text, text
