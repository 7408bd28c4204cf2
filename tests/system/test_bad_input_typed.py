"""Issue 57: bad input is typed (llama_train.errors). A BadInput (ConfigError, DataError,
WeightsError, PathRefused, ScalingError, FaultSpecError, ...) reaching an entry point is exit 2
with one line; any other exception, a bare ValueError included, is a bug: it keeps its
traceback and the interpreter's exit 1. Before, every ValueError was exit 2 with one line, so a
bug looked like a config error and showed no traceback.

Fast: nothing here trains; the entry point is stopped before the data and the process group.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO, TINY, run_main
from llama_train import train as train_mod
from llama_train.errors import BadInput, ConfigError


def _error_classes():
    from llama_train.checkpoint import NotACheckpoint
    from llama_train.data.errors import DataChanged, DataError
    from llama_train.engine.distributed import RendezvousError
    from llama_train.hf import NotALlamaModel
    from llama_train.job.faults import FaultSpecError
    from llama_train.job.resume import ResumeRefused
    from llama_train.model.weights import WeightsError
    from llama_train.paths import PathRefused
    from llama_train.scaling.laws import ScalingError

    return [ConfigError, DataError, DataChanged, WeightsError, NotALlamaModel, PathRefused,
            ScalingError, FaultSpecError, RendezvousError, ResumeRefused, NotACheckpoint]


def test_every_user_input_error_is_bad_input_and_still_a_value_error():
    for cls in _error_classes():
        assert issubclass(cls, BadInput), cls
        assert issubclass(cls, ValueError), cls  # `except ValueError` callers keep working
    assert not issubclass(ValueError, BadInput)  # a bare ValueError is a bug, not bad input


def test_config_error_is_one_class_wherever_it_is_imported_from():
    import llama_train.config as config
    from llama_train.errors import ConfigError as there

    assert config.ConfigError is there is ConfigError
    assert "ConfigError" in config.__all__


@pytest.mark.parametrize("fields, fragment", [
    (dict(dim=100, n_heads=3), "model.dim=100 is not divisible by model.n_heads=3"),
    (dict(dim=96, n_heads=32), "odd head_dim"),
    (dict(dim=64, n_heads=4, n_kv_heads=3), "model.n_kv_heads=3"),
    (dict(dim=0), "model.dim=0 must be a positive integer"),
    (dict(norm_eps=float("nan")), "model.norm_eps=nan"),
    (dict(tie_embeddings="yes"), "model.tie_embeddings='yes' must be true or false"),
    (dict(rope_scaling={"type": "yarn"}), "model.rope_scaling.type='yarn'"),
    (dict(rope_scaling={"factr": 8}), "unknown key(s) model.rope_scaling.factr"),
])
def test_model_args_checks_raise_config_error(fields, fragment):
    from llama_train.model.args import ModelArgs

    with pytest.raises(ConfigError) as e:
        ModelArgs(**{"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, **fields})
    assert fragment in str(e.value)


def test_model_presets_and_comm_settings_raise_config_error(tmp_path):
    from llama_train.comm import CommConfig, check_backend, normalize_nccl_algo
    from llama_train.model.args import ModelArgs, load_preset

    with pytest.raises(ConfigError, match="unknown model config key"):
        ModelArgs.from_dict({"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "dmi": 1})
    with pytest.raises(ConfigError, match="unknown model preset 'nope'"):
        load_preset("nope")
    bad = tmp_path / "m.yaml"
    bad.write_text("dim: 100\nn_layers: 2\nn_heads: 3\nvocab_size: 256\n")
    with pytest.raises(ConfigError, match=f"{bad}: model.dim=100"):
        load_preset(bad)
    with pytest.raises(ConfigError, match="comm.backend='mpi'"):
        CommConfig(backend="mpi")
    with pytest.raises(ConfigError, match="comm.simulate_ranks=1"):
        CommConfig(simulate_ranks=1)
    with pytest.raises(ConfigError, match="unknown NCCL algorithm"):
        normalize_nccl_algo("Spiral")
    with pytest.raises(ConfigError, match="comm.backend=nccl needs CUDA"):
        check_backend(CommConfig(backend="nccl"), "cpu")


def test_hugging_face_files_raise_weights_error(tmp_path):
    from llama_train.hf import from_hf_config, import_hf
    from llama_train.model.weights import WeightsError

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 192, "vocab_size": 256}
    for cfg, fragment in (({**base, "model_type": "mistral"}, "model_type='mistral'"),
                          ({k: v for k, v in base.items() if k != "vocab_size"},
                           "lacks 'vocab_size'"),
                          ({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                           "RoPE scaling of type 'yarn'"),
                          ({**base, "rms_norm_eps": "tiny"}, "rms_norm_eps='tiny' is not a number")):
        with pytest.raises(WeightsError, match=fragment):
            from_hf_config(cfg)
    with pytest.raises(ConfigError, match="model.num_attention_heads|model.n_heads"):
        from_hf_config({**base, "num_attention_heads": 3})  # ModelArgs' own check
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(WeightsError, match="not a config object"):
        import_hf(tmp_path)


def test_internal_invariants_stay_plain_value_errors():
    """A caller's mistake inside the package is a bug, shown with its traceback: not BadInput."""
    import torch

    from llama_train.model import ModelArgs, Transformer
    from llama_train.model.ops import sample_next_token

    with pytest.raises(ValueError) as e:
        sample_next_token(torch.zeros(1, 4), temperature=-1.0)
    assert not isinstance(e.value, BadInput)
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=8))
    with pytest.raises(ValueError) as e:
        model(torch.zeros(4, dtype=torch.long))  # not (batch, seq_len)
    assert not isinstance(e.value, BadInput)
    with pytest.raises(BadInput, match="exceeds model.max_seq_len=8"):  # the user's prompt
        model.generate([[1] * 6], max_new_tokens=3)


# ---------------------------------------------------------------------------------------------
# Through llama-train's main(), in this process
# ---------------------------------------------------------------------------------------------


def _raising(exc: BaseException):
    def f(*args, **kwargs):
        raise exc
    return f


def test_a_config_error_in_the_job_is_exit_2_and_one_line(tmp_path, monkeypatch, capsys):
    code, text = run_main([*TINY, f"trainer.output_dir={tmp_path}", "trainer.micro_batch=-1"],
                          monkeypatch, capsys, port=False)
    assert code == 2, text[-3000:]
    assert "llama-train: error: trainer.micro_batch" in text and "Traceback" not in text
    monkeypatch.setattr(train_mod, "preflight", _raising(ConfigError("data.x=1: fix it")))
    code, text = run_main([*TINY, f"trainer.output_dir={tmp_path}"], monkeypatch, capsys,
                          port=False)
    assert code == 2 and "llama-train: error: data.x=1: fix it" in text, text[-3000:]


@pytest.mark.parametrize("exc", [ValueError("bug: an internal check"), KeyError("bug")])
def test_a_bare_value_error_in_the_job_is_a_bug_that_propagates(exc, tmp_path, monkeypatch,
                                                                  capsys):
    """run_job turns BadInput into exit 2; a ValueError of our own code is not the user's input:
    it leaves run_job, Hydra and main() as itself (cli(): the traceback, exit 1)."""
    monkeypatch.setattr(train_mod, "preflight", _raising(exc))
    with pytest.raises(type(exc)) as e:
        run_main([*TINY, f"trainer.output_dir={tmp_path}"], monkeypatch, capsys, port=False)
    assert e.value is exc
    assert "llama-train: error:" not in capsys.readouterr().err


def test_cfg_job_turns_only_bad_input_into_exit_2(monkeypatch, capsys):
    import llama_train.job.dry_run as dry_run

    monkeypatch.setattr(dry_run, "print_job_config", _raising(ConfigError("model.dim=1: no")))
    code, text = run_main([*TINY, "--cfg", "job"], monkeypatch, capsys, port=False)
    assert code == 2 and "llama-train: error: model.dim=1: no" in text, text[-3000:]
    bug = ValueError("bug in print_job_config")
    monkeypatch.setattr(dry_run, "print_job_config", _raising(bug))
    with pytest.raises(ValueError) as e:
        run_main([*TINY, "--cfg", "job"], monkeypatch, capsys, port=False)
    assert e.value is bug


def test_a_sweeps_check_turns_only_bad_input_into_exit_2(tmp_path, monkeypatch, capsys):
    """--multirun checks every job's config first: a ConfigError names the job (exit 2), a bare
    ValueError there is a bug and propagates."""
    import llama_train.job.sweep as sweep_mod  # where the sweep check loads each job's config

    argv = ["--multirun", *TINY, f"trainer.output_dir={tmp_path}", "optim.lr=1e-3,2e-3"]
    monkeypatch.setattr(sweep_mod, "load_config", _raising(ConfigError("optim.lr: no")))
    code, text = run_main(argv, monkeypatch, capsys, port=False)
    assert code == 2 and "2 of the 2 jobs of this --multirun sweep cannot run" in text, text
    bug = ValueError("bug in a check")
    monkeypatch.setattr(sweep_mod, "load_config", _raising(bug))
    with pytest.raises(ValueError) as e:
        run_main(argv, monkeypatch, capsys, port=False)
    assert e.value is bug


# ---------------------------------------------------------------------------------------------
# The command itself (cli()): what the shell sees
# ---------------------------------------------------------------------------------------------

_CLI = """
import sys
import llama_train.train as t
from llama_train.errors import ConfigError

def preflight(cfg):
    raise {exc}

t.preflight = preflight
sys.argv = ["llama-train", *sys.argv[1:]]
t.cli()
"""


@pytest.mark.slow  # an interpreter of its own: not in make test-fast's in-process tier
@pytest.mark.parametrize("exc, code", [
    ('ConfigError("trainer.x=1 cannot run: set trainer.x=2")', 2),
    ('ValueError("bug: an internal invariant")', 1),
])
def test_the_command_exits_2_for_bad_input_and_1_with_a_traceback_for_a_bug(exc, code,
                                                                             tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("HYDRA_FULL_ERROR", None)
    out = subprocess.run([sys.executable, "-c", _CLI.format(exc=exc), *TINY,
                          f"trainer.output_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == code, out.stderr[-3000:]
    if code == 2:
        assert "llama-train: error: trainer.x=1 cannot run: set trainer.x=2" in out.stderr
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
    else:
        assert "Traceback (most recent call last)" in out.stderr, out.stderr[-3000:]
        assert "ValueError: bug: an internal invariant" in out.stderr
        assert "llama-train: error:" not in out.stderr
