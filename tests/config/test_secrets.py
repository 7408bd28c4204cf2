"""scrub_secrets: credentials never reach config.yaml, the checkpoint config or W&B, and nothing
else is hidden (a key is a secret by its whole name, not by containing "token")."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from llama_train.config import Config, is_secret_key, scrub_secrets, to_container


def test_tokenizer_path_survives_to_container():
    cfg = Config()
    cfg.data.tokenizer = "/models/llama/tokenizer.model"
    cfg.data.tokenizer_max_sentences = 123
    out = to_container(cfg)
    assert out["data"]["tokenizer"] == "/models/llama/tokenizer.model"
    assert out["data"]["tokenizer_max_sentences"] == 123
    assert "***" not in repr(out)  # the default config holds no credential at all


@pytest.mark.parametrize("key", ["api_key", "apikey", "API_KEY", "token", "secret", "password",
                                 "hf_token", "HF_TOKEN", "access-token", "aws_secret_key",
                                 "client_secret", "db_password", "wandb_apikey"])
def test_credential_names_are_secret(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["tokenizer", "tokenizer_max_sentences", "max_tokens",
                                 "global_batch_tokens", "tokens_per_step", "eos_token_id",
                                 "keep_last", "monkey", "secretary", "passwords_seen"])
def test_other_names_pass_through(key):
    assert not is_secret_key(key)


def test_to_container_scrubs_nested_dicts_and_lists():
    cfg = OmegaConf.create({
        "wandb": {"api_key": "abc", "project": "p"},
        "hub": {"hf_token": "hf_x", "repo": "me/model"},
        "storage": [{"aws_secret_key": "s3", "bucket": "b"}, {"password": "pw", "user": "u"}],
        "secret": "top",
        "data": {"tokenizer": "/t.model", "max_tokens": 7},
        "nested": {"deeper": {"token": "t", "tokens": [1, 2]}},
    })
    out = to_container(cfg)
    assert out["wandb"] == {"api_key": "***", "project": "p"}
    assert out["hub"] == {"hf_token": "***", "repo": "me/model"}
    assert out["storage"] == [{"aws_secret_key": "***", "bucket": "b"}, {"password": "***", "user": "u"}]
    assert out["secret"] == "***"
    assert out["data"] == {"tokenizer": "/t.model", "max_tokens": 7}
    assert out["nested"] == {"deeper": {"token": "***", "tokens": [1, 2]}}


def test_only_string_values_are_replaced():
    """A secret-named key holding a mapping is walked (its own keys decide), and null stays
    null: there is nothing to hide in either."""
    assert scrub_secrets({"secret": {"name": "n", "password": "p"}, "token": None}) == \
        {"secret": {"name": "n", "password": "***"}, "token": None}


# -- credentials from the environment under any key (issue 54) ---------------------------------

SECRET = "hf_Zq9xExampleCredential123"


def test_an_env_credential_under_any_key_is_saved_as_its_name(monkeypatch):
    """``${oc.env:HF_TOKEN}`` (or a shell's $HF_TOKEN) in a value whose key names no secret:
    the saved value names the variable, never holds its text."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-" + SECRET[::-1])
    cfg = OmegaConf.create({
        "tracking": {"wandb": {"name": "${oc.env:HF_TOKEN}",
                               "group": "g-${oc.env:HF_TOKEN}-x", "tags": ["${oc.env:HF_TOKEN}"]}},
        "data": {"source": "s3://bucket/?key=${oc.env:AWS_SECRET_ACCESS_KEY}"},
    })
    out = to_container(cfg)
    assert out["tracking"]["wandb"] == {"name": "$HF_TOKEN", "group": "g-$HF_TOKEN-x",
                                        "tags": ["$HF_TOKEN"]}
    assert out["data"]["source"] == "s3://bucket/?key=$AWS_SECRET_ACCESS_KEY"
    assert SECRET not in repr(out) and SECRET[::-1] not in repr(out)
    assert OmegaConf.to_container(OmegaConf.create(out), resolve=True) == out  # no new ${...}


def test_flags_and_other_variables_pass_through(monkeypatch):
    """Short values (flags such as TOKENIZERS_PARALLELISM=false) and variables whose name names
    no credential are left alone."""
    from llama_train.records import scrub_secret_values

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MY_TOKEN", "1")
    monkeypatch.setenv("PROJECT_NAME", "alice-project")
    data = {"a": "false", "b": "alice-project", "c": 1, "d": ["x1", None]}
    assert scrub_secret_values(data) == data


def test_run_info_never_holds_a_credential(tmp_path, monkeypatch):
    """run_info.json's command as the shell expanded it (tracking.wandb.name=$HF_TOKEN)."""
    from llama_train.records import RunInfo

    monkeypatch.setenv("HF_TOKEN", SECRET)
    path = tmp_path / "run_info.json"
    RunInfo(params={}, model_args={}, flop_budget=None, tokens=1, global_batch=1, seq_len=1,
            max_steps=1, flops_per_token=1.0, flops=1.0, peak_flops={},
            command=f"llama-train tracking.wandb.name={SECRET}").write(path)
    assert SECRET not in path.read_text()
    assert RunInfo.read(path).command == "llama-train tracking.wandb.name=$HF_TOKEN"


def test_a_run_saves_no_credential_anywhere(tmp_path, monkeypatch):
    """A tiny run whose config interpolates HF_TOKEN: no file it writes (config.yaml, the
    checkpoint's config, run_info.json, metrics) holds the token's text."""
    from helpers import cfg_for, world_of_one
    from llama_train.train import train

    monkeypatch.setenv("HF_TOKEN", SECRET)
    out = tmp_path / "out"
    with world_of_one():
        train(cfg_for(out, "trainer.max_steps=1", "trainer.save_every=1", "sample.tokens=0",
                      "trainer.eval_every=1000", "tracking.wandb.name=${oc.env:HF_TOKEN}"))
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) > 5 and (out / "checkpoints" / "step_00000001" / "config.yaml").is_file()
    leaked = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert "name: $HF_TOKEN" in (out / "config.yaml").read_text()
