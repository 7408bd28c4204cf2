"""Where the jobs of a ``--multirun`` sweep train (issue 53, item 5). Each job trained in
``<trainer.output_dir>/<its swept values>``, and trainer.output_dir defaults to a single run's
``outputs/llama-train``: a sweep nested its jobs inside that run's directory (and Hydra made an
empty ``multirun/<n>`` per job beside them). Now a job trains in Hydra's job directory,
``<hydra.sweep.dir>/<hydra.sweep.subdir>`` = ``multirun/<its swept key=value,...>``, unless the
command line names trainer.output_dir (the sweep's root) or trainer.output_dir differs per job.

Through the real entry point (``main()``: argv, Hydra, the sweep's pre-check), in this process
as a world of one; the layout tests record each job's config instead of training it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import TINY, free_port, run_main
from llama_train import train as train_mod
from llama_train.config import load_config
from llama_train.records import read_metrics, step_records

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one


def llama_train(argv, monkeypatch, capsys, record: bool = False):
    """``llama-train <argv>`` in this process: (exit code, output, each job's output_dir where
    ``record``: the job is then not run, its directory only decided)."""
    dirs = []

    def decide(dcfg, hooks):
        try:
            cfg, _ = train_mod.sweep_job_dir(load_config(dcfg), dcfg)
        except ValueError as e:  # as run_job: one line, exit 2
            train_mod._fail(train_mod.EXIT_BAD_INPUT, e)
        dirs.append(cfg.trainer.output_dir)

    if record:
        monkeypatch.setattr(train_mod, "run_job", decide)
    return (*run_main(argv, monkeypatch, capsys), dirs)


def dirs_under(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()}


@pytest.mark.slow
def test_a_sweep_trains_each_job_in_its_own_hydra_sweep_directory(tmp_path, monkeypatch,
                                                                  capsys):
    """``llama-train -m ... optim.lr=1e-3,2e-3``: each job in ``multirun/optim.lr=<its lr>``,
    nothing in outputs/llama-train (a run's default directory), neither job inside the other,
    no empty directory beside them; the same sweep again, longer, resumes each job."""
    monkeypatch.chdir(tmp_path)
    argv = ["--multirun", *TINY, "trainer.max_steps=2", "optim.lr=1e-3,2e-3"]
    code, text, _ = llama_train(argv, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    sweep = tmp_path / "multirun"
    jobs = {name: sweep / name for name in ("optim.lr=0.001", "optim.lr=0.002")}
    assert not (tmp_path / "outputs").exists(), sorted(dirs_under(tmp_path))
    assert {p.name for p in sweep.iterdir()} == {*jobs, "multirun.yaml"}, sorted(
        dirs_under(tmp_path))
    for name, d in jobs.items():
        assert f"lr: {name.split('=')[1]}" in (d / "config.yaml").read_text()
        assert (d / "checkpoints" / "step_00000002" / "manifest.json").is_file()
        assert not any(p.name.startswith("optim.lr=") for p in d.iterdir()), sorted(
            dirs_under(d))
        assert f"--multirun job {name} trains in its own trainer.output_dir=multirun/{name}" \
            in text
    code, text, _ = llama_train([a.replace("max_steps=2", "max_steps=3") for a in argv],
                                monkeypatch, capsys)
    assert code == 0, text[-3000:]
    for d in jobs.values():
        steps = [r.step for r in step_records(read_metrics(d / "metrics.jsonl"), "loss")]
        assert steps == [1, 2, 3], (d, steps)


@pytest.mark.parametrize("given, want", [
    # the command line names the sweep's root: a directory per job in it, as before
    (["trainer.output_dir=runs/lr"], ["runs/lr/optim.lr=0.001", "runs/lr/optim.lr=0.002"]),
    # trainer.output_dir that differs per job is the job's directory as it is
    (["trainer.output_dir=runs/n${hydra:job.num}"], ["runs/n0", "runs/n1"]),
    (["trainer.output_dir=runs/lr${optim.lr}"], ["runs/lr0.001", "runs/lr0.002"]),
    (["trainer.output_dir=${hydra:runtime.output_dir}"],
     ["{cwd}/multirun/optim.lr=0.001", "{cwd}/multirun/optim.lr=0.002"]),
    # Hydra's own layouts, set with Hydra's keys
    (["hydra.sweep.dir=sweeps/a", "hydra.sweep.subdir=${hydra.job.num}"],
     ["sweeps/a/0", "sweeps/a/1"]),
    (["hydra.sweep.dir=sweeps/b", "hydra.sweep.subdir=${hydra.job.override_dirname}",
      "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(
          o.split("=")[0] for o in TINY) + "]"],
     ["sweeps/b/optim.lr=0.001", "sweeps/b/optim.lr=0.002"]),
], ids=["output_dir-root", "job.num", "swept-key", "runtime.output_dir", "hydra-job.num",
        "hydra-override_dirname"])
def test_where_each_job_of_a_sweep_trains(given, want, tmp_path, monkeypatch, capsys):
    """The documented layouts (docs/reliability.md, "Sweeps"); Hydra creates no directory
    beside the jobs' (an empty ``multirun/<name>`` for a job that trains elsewhere is removed)."""
    monkeypatch.chdir(tmp_path)
    code, text, dirs = llama_train(["--multirun", *TINY, "optim.lr=1e-3,2e-3", *given],
                                   monkeypatch, capsys, record=True)
    assert code == 0, text[-3000:]
    assert dirs == [w.format(cwd=tmp_path) for w in want]
    jobs = [Path(d).relative_to(tmp_path) if Path(d).is_absolute() else Path(d) for d in dirs]
    allowed = {str(p) for d in jobs for p in (d, *d.parents) if str(p) != "."}
    assert dirs_under(tmp_path) <= allowed | {"multirun"}, sorted(dirs_under(tmp_path))


def test_a_sweep_over_a_saved_config_trains_beside_it_not_inside(tmp_path, monkeypatch,
                                                                 capsys):
    """``--config-dir <run> --config-name config -m optim.lr=...``: the saved config names the
    run's own output_dir; the jobs train in ``multirun/<swept>``, not inside that run."""
    from omegaconf import OmegaConf

    from helpers import compose_cfg
    from llama_train.config import to_container

    run = tmp_path / "run"
    run.mkdir()
    saved = to_container(compose_cfg([*TINY, f"trainer.output_dir={run}"]))
    (run / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    code, text, dirs = llama_train(
        ["--multirun", "--config-dir", str(run), "--config-name", "config", "optim.lr=1e-3,2e-3"],
        monkeypatch, capsys, record=True)
    assert code == 0, text[-3000:]
    assert dirs == ["multirun/optim.lr=0.001", "multirun/optim.lr=0.002"]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_a_timestamped_sweep_directory_is_refused_under_the_launcher(tmp_path, monkeypatch,
                                                                     capsys):
    """Hydra's ``multirun/${now:...}``: each rank of the launcher resolves it at its own start,
    a second apart at times, and the ranks of one job would train in two directories."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train_mod, "_check_sweep", lambda *a: None)  # checks for 2 ranks
    code, text, dirs = llama_train(
        ["--multirun", *TINY, "optim.lr=1e-3,2e-3",
         "hydra.sweep.dir=multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}"],
        monkeypatch, capsys, record=True)
    assert (code, dirs) == (2, []), text[-3000:]
    assert "each rank of the launcher resolves ${now:...}" in text, text[-3000:]
