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
