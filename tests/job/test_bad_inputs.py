"""Bad input, through the real entry point: `llama-train`'s ``main()`` (Hydra, preflight, the
trainer), in this process as a world of one. Each row is a mistake a user makes; each must end
with the documented exit code and one message naming the key (or file) and the fix, never a
traceback, and must leave the output directory as it was (docs/reliability.md, "Bad input").

The in-process config table (every group's own checks, before any process group) is in
test_config.py; hung ranks, locks and corrupt checkpoints through the launcher are in
test_hang.py and test_integrity.py.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import asdict
from pathlib import Path

import re

import pytest
import torch

from helpers import TINY, free_port, run_main, tiny_prepared
from llama_train import train as train_mod
from llama_train.model import ModelArgs
from llama_train.records import read_metrics, step_records


pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one


def llama_train(argv, monkeypatch, capsys) -> tuple[int, str]:
    """``llama-train <argv>`` in this process: (exit code, stderr + stdout)."""
    return run_main(argv, monkeypatch, capsys)


def tree(d: Path) -> dict:
    """Every file under ``d`` with its content's hash: "left as it was" means equal trees."""
    if not d.exists():
        return {}
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (6 steps, checkpoints at 3 and 6) to resume, and files to misuse."""
    work = tmp_path_factory.mktemp("bad_inputs")
    out = work / "run"
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(sys, "argv", ["llama-train", *TINY, f"trainer.output_dir={out}",
                                 "trainer.save_every=3"])
        mp.setenv("HYDRA_FULL_ERROR", "0")
        mp.setenv("MASTER_PORT", str(free_port()))
        train_mod.main()
    finally:
        mp.undo()
    (work / "notes.txt").write_text("not a checkpoint\n")
    (work / "empty_dir").mkdir()
    other = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048)
    torch.save({"model_args": asdict(other), "model": {}}, work / "other_shape.pt")
    return work, out


def _cases(work: Path, out: Path):
    notes, step6 = work / "notes.txt", out / "checkpoints" / "step_00000006"
    run = [f"trainer.output_dir={out}"]
    elsewhere = [f"trainer.output_dir={work / 'fresh'}"]
    return [
        # (name, argv, exit code, fragments the message must hold)
        # -- composing the command line (Hydra) --
        ("typo in a key", ["trainer.max_step=5"], 2, ["did you mean trainer.max_steps?"]),
        ("typo in a group", ["modle.dim=64"], 2, ["did you mean model.dim?"]),
        ("typo in a nested key", ["tracking.wandb.mod=offline"], 2,
         ["tracking.wandb.mode"]),
        ("unknown key forced with +", ["+trainer.foo=1"], 2, ["'trainer.foo'", "max_steps"]),
        ("wrong type", ["trainer.max_steps=many"], 2, ["trainer.max_steps=many", "Integer"]),
        ("bool for a list", ["trainer.allow_config_change=true"], 2,
         ["trainer.allow_config_change"]),
        ("unknown model preset", ["model=llama4_1t"], 2, ["model=llama4_1t", "llama3_8b"]),
        ("misspelt experiment", ["experiment=compute_optimall"], 2,
         ["did you mean experiment=compute_optimal?"]),
        ("unknown group option", ["trainer=nope"], 2, ["trainer=nope", "default"]),
        ("unparsable override", ["trainer.max_steps=5,"], 2, ["cannot parse", "key=value"]),
        ("a run's config from a directory not there",
         ["--config-dir", str(work / "no_run"), "--config-name", "config"], 2,
         ["no_run", "give --config-dir a directory that exists"]),
        # -- values each group checks (a sample; test_config.py has the full table) --
        ("negative micro batch", ["trainer.micro_batch=-1"], 2, ["trainer.micro_batch"]),
        ("choice out of range", ["trainer.on_existing=keep"], 2, ["trainer.on_existing"]),
        ("heads do not divide dim", ["model.dim=100", "model.n_heads=3"], 2, ["model.n_heads"]),
        ("missing data", ["data.source=/no/such/corpus.jsonl"], 2, ["/no/such/corpus.jsonl"]),
        ("malformed fault spec", ["LLAMA_TRAIN_FAULTS=explode:step=1"], 2, ["unknown fault"]),
        ("mixture: a negative weight", ["data.mixture=[{name:a,source:builtin,weight:-1}]"],
         2, ["data.mixture[0] (a): weight=-1"]),
        ("mixture: all weights 0", ["data.mixture=[{name:a,source:builtin,weight:0},"
                                    "{name:b,source:builtin,weight:0}]"], 2,
         ["all 2 weights are 0"]),
        ("mixture: one name twice", ["data.mixture=[{name:a,source:builtin},"
                                     "{name:a,source:builtin}]"], 2,
         ["data.mixture[1] (a): name 'a' is also data.mixture[0]'s"]),
        ("mixture: a typo in an entry", ["data.mixture=[{name:a,sourse:builtin}]"], 2,
         ["unknown key 'sourse'", "did you mean source?"]),
        ("mixture: a missing source", ["data.mixture=[{name:a,source:builtin},"
                                       "{name:web,source:/no/such/web.jsonl}]"], 2,
         ["data.mixture[1] (web", "/no/such/web.jsonl"]),
        # -- numbers out of their range (issue 54, class 6; every key: test_bounds.py) --
        ("a million simulated ranks", ["comm.simulate_ranks=1000000"], 2,
         ["comm.simulate_ranks=1000000 must be in [0, 65536]"]),
        ("a shard per token", ["data.shard_tokens=1"], 2, ["data.shard_tokens=1 must be in"]),
        ("DeepSpeed printing every 0 steps", ["deepspeed.steps_per_print=0"], 2,
         ["deepspeed.steps_per_print=0"]),
        ("every step a spike", ["recovery.spike_factor=0.5"], 2, ["recovery.spike_factor=0.5"]),
        # -- numbers that are not numbers, samples that cannot be drawn (issue 29) --
        ("an infinite lr", ["optim.lr=inf"], 2, ["optim.lr=inf is not a finite number"]),
        ("a NaN lr", ["optim.lr=nan"], 2, ["optim.lr=nan is not a finite number"]),
        ("a NaN weight decay", ["optim.weight_decay=nan"], 2, ["optim.weight_decay=nan"]),
        ("a NaN peak_flops", ["trainer.peak_flops=nan"], 2, ["trainer.peak_flops=nan"]),
        ("a NaN sample temperature", ["sample.temperature=nan"], 2, ["sample.temperature=nan"]),
        ("sample.top_k=0", ["sample.top_k=0"], 2, ["sample.top_k=0", "null"]),
        ("a negative sample.top_k", ["sample.top_k=-3"], 2, ["sample.top_k=-3"]),
        ("an empty sample prompt", ["sample.prompt=''"], 2, ["sample.prompt is empty"]),
        ("a sample longer than the model", ["sample.tokens=300"], 2,
         ["sample.tokens=300", "model.max_seq_len=256"]),
        ("prompt + sample longer than the model",
         ["sample.tokens=250", "sample.prompt='The quick brown fox jumps over the lazy dog'"], 2,
         ["sample.tokens=250 exceeds model.max_seq_len=256"]),
        ("WANDB_MODE set but empty", ["WANDB_MODE=", "tracking.wandb.mode=offline"], 2,
         ["WANDB_MODE=''", "offline"]),
        ("WANDB_MODE misspelt", ["WANDB_MODE=ofline", "tracking.wandb.mode=offline"], 2,
         ["WANDB_MODE='ofline'"]),
        # -- paths the run writes (issue 29) --
        ("metrics file climbing out", ["tracking.metrics_file=../victim/x.jsonl"], 2,
         ["tracking.metrics_file='../victim/x.jsonl' leaves trainer.output_dir"]),
        ("metrics file climbing out, overwrite",
         [*run, "tracking.metrics_file=../notes.txt", "trainer.resume=never",
          "trainer.on_existing=overwrite"], 2, ["leaves trainer.output_dir"]),
        ("an outside metrics file that holds records",
         [f"tracking.metrics_file={notes}", *elsewhere], 2,
         ["tracking.metrics_file=", "leaves trainer.output_dir"]),
        # -- the machine --
        ("cuda without a GPU", ["trainer.device=cuda"], 2, ["trainer.device=cuda", "auto"]),
        ("output_dir under a file", [f"trainer.output_dir={notes}/out"], 2,
         ["trainer.output_dir", "Not a directory"]),
        # -- weights and checkpoints --
        ("init_from a text file", [f"trainer.init_from={notes}", *elsewhere], 2,
         ["trainer.init_from", "llama-import"]),
        ("init_from a dir without config.json",
         [f"trainer.init_from={work / 'empty_dir'}", *elsewhere], 2,
         ["trainer.init_from", "config.json"]),
        ("init_from another shape", [f"trainer.init_from={work / 'other_shape.pt'}",
                                     *elsewhere], 2, ["dim=64", "matching model preset"]),
        ("resume a regular file", [f"trainer.resume={notes}", *elsewhere], 2,
         ["is a file, not a checkpoint"]),
        ("resume a missing path", ["trainer.resume=/no/such/step_00000001", *elsewhere], 2,
         ["trainer.resume"]),
        ("resume with another model.dim", [*run, "model.dim=256"], 2,
         ["model shape", "dim=128", "dim=256", "Nothing was changed"]),
        ("another model.dim even if allowed",
         [*run, "model.dim=256", "trainer.allow_config_change=[model.dim]"], 2,
         ["model shape", "a new shape is a new run"]),
        ("resume with another lr", [*run, "optim.lr=1e-3"], 2,
         ["optim.lr", "trainer.allow_config_change=[optim.lr]"]),
        ("resume=never in a used dir", [*run, "trainer.resume=never"], 2,
         ["one output_dir holds one history", "trainer.on_existing=archive"]),
        ("resume a directory that is not a checkpoint",
         [f"trainer.resume={work / 'empty_dir'}", *elsewhere], 2,
         ["trainer.resume"]),
        ("explicit resume of another run's checkpoint with another seed",
         [f"trainer.resume={step6}", "trainer.seed=7", *elsewhere], 2, ["trainer.seed"]),
        # -- experiments --
        ("a plan that reads the data ~9 times", ["experiment=compute_optimal",
                                                  "scaling.flops=3e13", *elsewhere], 2,
         ["times, more than scaling.max_epochs=4", "lower scaling.flops"]),
        ("experiment without val split",
         ["experiment=compute_optimal", "scaling.flops=1e12", "data.val_fraction=0",
          *elsewhere], 2, ["data.val_fraction"]),
    ]


@pytest.mark.slow
def test_bad_input_table(finished, monkeypatch, capsys):
    """Every row: the exit code, the message, no traceback, and nothing written."""
    work, out = finished
    before = tree(out)
    failures = []
    cases = _cases(work, out)
    for name, argv, want, fragments in cases:
        env = [a for a in argv if a.split("=", 1)[0] in ("LLAMA_TRAIN_FAULTS", "WANDB_MODE")]
        with monkeypatch.context() as mp:
            for e in env:
                mp.setenv(*e.split("=", 1))
            if name == "cuda without a GPU" and torch.cuda.is_available():
                continue
            code, text = llama_train([*TINY, f"trainer.output_dir={work / 'scratch'}",
                                      *[a for a in argv if a not in env]], mp, capsys)
        errors = [line for line in text.splitlines() if line.startswith("llama-train: error:")]
        problems = []
        if code != want:
            problems.append(f"exit {code}, want {want}")
        if "Traceback" in text:
            problems.append("a traceback")
        if len(errors) != 1:
            problems.append(f"{len(errors)} 'llama-train: error:' lines")
        missing = [f for f in fragments if not any(f in e for e in errors)]
        if missing:
            problems.append(f"message lacks {missing}")
        if problems:
            failures.append(f"{name}: {'; '.join(problems)}\n    " + "\n    ".join(
                errors or text.splitlines()[-8:]))
    assert len(cases) >= 25
    assert not failures, "\n".join(failures)
    assert tree(out) == before, "a refused command changed the finished run's files"
    assert (work / "notes.txt").read_text() == "not a checkpoint\n"  # outside: never touched
    assert not (work / "fresh" / "checkpoints").exists()


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, monkeypatch, capsys):
    """trainer.dry_run=true: shape, parameters, tokens, steps, epochs, FLOPs and a time estimate,
    then exit 0: no process group, no output directory, no data preparation."""
    import torch.distributed as dist

    tiny_prepared()  # the epochs need the data
    out = tmp_path / "never"
    code, text = llama_train([*TINY, f"trainer.output_dir={out}", "experiment=compute_optimal",
                              "scaling.flops=3e13", "trainer.dry_run=true"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    for needle in ("dry run (trainer.dry_run=true)", "compute_optimal (fit chinchilla): C=3e+13",
                   "parameters: ", "tokens/step", "steps: ", "epochs of the train split",
                   "FLOPs: ", "estimated time: ", f"output: {out}",
                   # issue 28 item 4: one resolved plan, engine, memory, data, masking, budget
                   "engine: DeepSpeed ZeRO-0, fp32 on cpu, no offload",
                   "memory per rank (planner, peak in ", "GiB (this host's memory, 1 rank(s)",
                   "data: builtin (first 600 documents)",
                   "attention: causal over the whole packed window (trainer.document_mask=false)",
                   "x the budget scaling.flops=3e+13, which is 6 N D with N="):
        assert needle in text, (needle, text[-3000:])
    assert re.search(r"\n    fits: [0-9.]+ GiB against [0-9.]+ GiB", text), text[-3000:]
    planned = re.search(r"tokens, (\d+) steps", text)  # the plan's log line: the steps trained
    assert planned and f"steps: {int(planned[1]):,} (" in text, text[-3000:]
    assert not out.exists() and not dist.is_initialized()
    # data that is not prepared yet is not prepared by a dry run
    code, text = llama_train([*TINY, f"trainer.output_dir={out}", "trainer.dry_run=true",
                              "data.max_documents=7"], monkeypatch, capsys)
    assert code == 0 and "unknown (not prepared yet" in text, text[-3000:]
    # --cfg job: the config the run trains with (the plan applied, interpolations resolved);
    # Hydra's printed the composed one (the preset's shape, trainer.max_steps=150, ${sci:...})
    code, text = llama_train([*TINY, "experiment=compute_optimal", "scaling.flops=3e13",
                              "--cfg", "job"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    import yaml

    shown = yaml.safe_load(text[text.index("# llama-train --cfg job"):])
    assert shown["trainer"]["max_steps"] == int(planned[1])
    assert shown["trainer"]["output_dir"] == "outputs/compute_optimal/C3e13"
    assert f"(dim {shown['model']['dim']}, {shown['model']['n_layers']} layers" in text
    # a 70B model on this machine: ZeRO-3, the mixture's sources and weights, document masking
    code, text = llama_train([f"trainer.output_dir={out}", "trainer.dry_run=true",
                              "model=llama2_70b", "deepspeed.zero_stage=3", "data=mixture",
                              "trainer.document_mask=true"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    for needle in ("engine: DeepSpeed ZeRO-3", "does NOT fit: ", "a mixture of 2 sources",
                   "prose: builtin (weight 3, 75.0% of the tokens)",
                   "code: stdlib (weight 1, 25.0% of the tokens",
                   "stopped at document boundaries (trainer.document_mask=true)"):
        assert needle in text, (needle, text[-3000:])


def test_warmup_past_the_end_is_said(tmp_path, monkeypatch, capsys):
    code, text = llama_train([*TINY, f"trainer.output_dir={tmp_path}", "trainer.max_steps=3",
                           "optim.warmup_steps=5"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert "WARNING optim.warmup_steps=5 >= trainer.max_steps=3" in text


@pytest.mark.slow  # prepares its own data (a tokenizer without a val split)
def test_no_validation_split_means_no_evaluation(tmp_path, monkeypatch, capsys):
    """data.val_fraction=0 is supported: the run trains, says there is no evaluation, and
    logs no val_loss."""
    code, text = llama_train([*TINY, f"trainer.output_dir={tmp_path}", "trainer.max_steps=2",
                           "data.val_fraction=0"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r.step for r in step_records(records, "loss")] == [1, 2]
    assert not any("val_loss" in r for r in records)
    assert "no validation split, so there is no evaluation" in text


@pytest.mark.slow
def test_multirun_jobs_get_their_own_directories(tmp_path, monkeypatch, capsys):
    """A --multirun sweep: each job trains in <output_dir>/<its swept values>, so job 1 never
    resumes job 0's checkpoint; rerunning the sweep continues each job in its own directory."""
    sweep = tmp_path / "sweep"
    argv = ["--multirun", *TINY, "trainer.max_steps=3", "optim.lr=1e-3,3e-4",
            f"trainer.output_dir={sweep}", f"hydra.sweep.dir={tmp_path / 'hydra'}"]
    code, text = llama_train(argv, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    jobs = {p.name: p for p in sweep.iterdir() if p.is_dir()}
    assert set(jobs) == {"optim.lr=0.001", "optim.lr=0.0003"}, sorted(jobs)
    for name, d in jobs.items():
        cfg = (d / "config.yaml").read_text()
        assert f"lr: {name.split('=')[1]}" in cfg or f"lr: {float(name.split('=')[1])}" in cfg
        steps = [r.step for r in step_records(read_metrics(d / "metrics.jsonl"), "loss")]
        assert steps == [1, 2, 3], (name, steps)
    # the same sweep, longer: each job resumes its own checkpoint
    code, text = llama_train([a.replace("max_steps=3", "max_steps=4") for a in argv],
                             monkeypatch, capsys)
    assert code == 0, text[-3000:]
    for d in jobs.values():
        steps = [r.step for r in step_records(read_metrics(d / "metrics.jsonl"), "loss")]
        assert steps == [1, 2, 3, 4], (d.name, steps)


@pytest.mark.slow
def test_refusals_come_before_the_data_and_the_process_group(finished, monkeypatch, capsys,
                                                             tmp_path):
    """What can be checked from the config and the files is checked before data preparation and
    the process group (which can take minutes on a new corpus or a big job): a backend this
    machine lacks, a resume the checkpoint's config refuses, a directory another job holds."""
    import os
    import subprocess
    import time

    import torch.distributed as dist

    import llama_train.data as data_mod

    work, out = finished
    reached = []

    def no_prepare(*a, **k):
        reached.append("prepare_data")
        raise RuntimeError("data preparation reached")

    monkeypatch.setattr(data_mod, "prepare_data", no_prepare)
    run = [f"trainer.output_dir={out}"]
    cases = [
        ("resume with another lr", run + ["optim.lr=1e-3"], ["optim.lr"]),
        ("resume with another shape", run + ["model.dim=256"], ["model shape"]),
        ("resume with a micro-batch that cannot make the global batch",
         run + ["trainer.micro_batch=4"], ["global batch of 2 sequences", "trainer.micro_batch=4"]),
        ("resume with another global batch", run + ["trainer.global_batch=4"],
         ["global batch", "2 -> 4", "unset to keep the checkpoint's"]),
        ("explicit resume, another seed",
         [f"trainer.resume={out / 'checkpoints' / 'step_00000006'}", "trainer.seed=7",
          f"trainer.output_dir={tmp_path / 'fresh'}"], ["trainer.seed"]),
    ]
    if not torch.cuda.is_available():
        cases.append(("nccl on a CPU machine", ["comm.backend=nccl",
                                                f"trainer.output_dir={tmp_path / 'x'}"],
                      ["comm.backend=nccl", "gloo"]))
    locked = tmp_path / "locked"
    hold = ("import sys, time; from llama_train.job.runlock import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(locked)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "MASTER_ADDR": "10.9.9.9"})
    try:
        assert holder.stdout.readline().strip() == "held"
        cases.append(("a directory another job holds", [f"trainer.output_dir={locked}"],
                      [f"pid {holder.pid}"]))
        for name, argv, fragments in cases:
            t0 = time.monotonic()
            code, text = llama_train([*TINY, *argv], monkeypatch, capsys)
            errors = [line for line in text.splitlines() if line.startswith("llama-train: error:")]
            assert code == 2 and len(errors) == 1 and "Traceback" not in text, (name, text[-2000:])
            assert all(f in errors[0] for f in fragments), (name, errors)
            assert not reached and not dist.is_initialized(), (name, reached)
            print(f"{name}: refused in {time.monotonic() - t0:.2f} s", file=sys.__stderr__)
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------------------------------------
# Issue 29: holes an adversarial pass found (paths, refused resumes, forks, disks, sweeps)


def _error_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("llama-train: error:")]


@pytest.mark.parametrize("link", [".lock", "config.yaml", "run_info.json", "metrics.jsonl",
                                  "checkpoints"])
def test_a_symlink_in_the_output_dir_is_refused(link, tmp_path, monkeypatch, capsys):
    """A link planted where the run writes one of its own files (``.lock`` once truncated its
    target to 0 bytes, ``config.yaml`` overwrote it): exit 2 naming the link, target intact."""
    tiny_prepared()
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim"
    if link == "checkpoints":
        victim.mkdir()
        (victim / "keep.txt").write_text("precious\n")
    else:
        victim.write_text("precious\n")
    (out / link).symlink_to(victim)
    code, text = llama_train([*TINY, f"trainer.output_dir={out}", "trainer.max_steps=2"],
                             monkeypatch, capsys)
    errors = _error_lines(text)
    assert code == 2 and len(errors) == 1 and "Traceback" not in text, text[-2000:]
    assert f"{out / link} is a symlink" in errors[0], errors
    if link == "checkpoints":
        assert [p.name for p in victim.iterdir()] == ["keep.txt"]
    else:
        assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in out.iterdir()) == [link]


def test_an_archive_symlink_never_moves_the_history_out(finished, tmp_path, monkeypatch, capsys):
    """trainer.on_existing=archive with ``archive`` a link: refused (it moved the history
    outside while the log named the in-dir path); the history stays where it was."""
    import shutil

    _, done = finished
    out = tmp_path / "run"
    shutil.copytree(done, out, ignore=shutil.ignore_patterns(".lock"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "archive").symlink_to(elsewhere)
    before = tree(out)
    code, text = llama_train([*TINY, f"trainer.output_dir={out}", "trainer.resume=never",
                              "trainer.on_existing=archive"], monkeypatch, capsys)
    assert code == 2 and "archive is a symlink" in text and "Traceback" not in text, text[-2000:]
    assert list(elsewhere.iterdir()) == [] and tree(out) == before


def test_a_resume_refused_at_load_leaves_the_run_files(finished, tmp_path, monkeypatch, capsys):
    """A checkpoint that verifies against its manifest but cannot be loaded (a foreign pickle,
    manifest rewritten to match): the job stops and the finished run's config.yaml and
    run_info.json (its final_step/final_val_loss) are as they were."""
    import json
    import pathlib
    import shutil

    from llama_train.checkpoint import write_manifest

    _, done = finished
    out = tmp_path / "run"
    shutil.copytree(done, out, ignore=shutil.ignore_patterns(".lock"))
    ckpt = out / "checkpoints" / "step_00000006"
    torch.save({"module": pathlib.PurePosixPath("/etc/passwd")},
               ckpt / "ds" / "mp_rank_00_model_states.pt")
    write_manifest(ckpt, checksums=True)
    before = tree(out)
    assert json.loads((out / "run_info.json").read_text())["final_step"] == 6
    code, text = llama_train([*TINY, f"trainer.output_dir={out}", "trainer.max_steps=8"],
                             monkeypatch, capsys)
    assert code != 0, text[-2000:]
    assert tree(out) == before, "a resume that failed to load rewrote the run's files"


@pytest.mark.slow
def test_a_forked_run_is_a_new_wandb_run(tmp_path, monkeypatch, capsys):
    """Run B resumed from run A's checkpoint into another output_dir is a new W&B run whose
    config names A's run and checkpoint; A's run id is never written to again."""
    import json

    tiny_prepared()
    a, b = tmp_path / "a", tmp_path / "b"
    wandb = ["tracking.wandb.mode=offline", "trainer.save_every=2", "sample.tokens=0"]
    code, text = llama_train([*TINY, *wandb, f"trainer.output_dir={a}", "trainer.max_steps=2"],
                             monkeypatch, capsys)
    assert code == 0, text[-2000:]
    ckpt = a / "checkpoints" / "step_00000002"
    a_id = json.loads((ckpt / "trainer_state.json").read_text())["tracker"]["wandb_run_id"]
    code, text = llama_train([*TINY, *wandb, f"trainer.output_dir={b}", "trainer.max_steps=3",
                              f"trainer.resume={ckpt}"], monkeypatch, capsys)
    assert code == 0, text[-2000:]
    b_state = json.loads((b / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    b_id = b_state["tracker"]["wandb_run_id"]
    assert a_id and b_id and b_id != a_id
    assert not list(b.glob(f"wandb/offline-run-*/run-{a_id}.wandb"))
    assert len(list(a.glob("wandb/offline-run-*"))) == 1  # A's history: one directory, its own
    runs = list(b.glob(f"wandb/offline-run-*/run-{b_id}.wandb"))  # the run's config is in it
    assert len(runs) == 1, runs
    assert b"forked_from" in runs[0].read_bytes() and a_id.encode() in runs[0].read_bytes()


def test_a_full_disk_while_preparing_data_is_named(tmp_path, monkeypatch, capsys):
    """ENOSPC in data preparation (a real 128 KiB tmpfs as data.prepared_dir): exit 3 naming the
    file, "the disk is full" and the key that puts files there; not blamed on Hydra."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        code, text = llama_train([*TINY, f"trainer.output_dir={tmp_path / 'run'}",
                                  f"data.prepared_dir={disk / 'data'}"], monkeypatch, capsys)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    errors = _error_lines(text)
    assert code == 3 and len(errors) == 1 and "Traceback" not in text, text[-3000:]
    assert "Hydra" not in errors[0] and "the disk is full" in errors[0], errors
    assert str(disk) in errors[0] and "data.prepared_dir" in errors[0], errors


def test_a_sweep_is_checked_whole_before_its_first_job(tmp_path, monkeypatch, capsys):
    """--multirun with one bad point: refused before any job starts, naming the bad job and its
    overrides (the sweep used to run job 0, then stop at job 1 without naming it)."""
    sweep = tmp_path / "sweep"
    code, text = llama_train(["--multirun", *TINY, "trainer.max_steps=2",
                              "optim.lr=1e-3,nan,3e-4", "sample.top_k=5,0",
                              f"trainer.output_dir={sweep}",
                              f"hydra.sweep.dir={tmp_path / 'hydra'}"], monkeypatch, capsys)
    errors = _error_lines(text)
    assert code == 2 and len(errors) == 1 and "Traceback" not in text, text[-2000:]
    assert "4 of the 6 jobs" in errors[0] and "none was started" in errors[0], errors
    assert "optim.lr=nan" in errors[0] and "sample.top_k=0" in errors[0], errors
    assert not sweep.exists()
