"""FP8 linear layers (``float8.*``, torchao's float8 training; llama_train/engine/float8.py).

CPU has no FP8 matmuls: every run here sets ``float8.emulate=true`` (torchao casts to float8
e4m3 with dynamic scales and back, then multiplies in high precision), so what is tested is the
numerics and the plumbing (conversion, ZeRO-3, checkpoints, resume, export, refusals), never
the speed. One rank in this process (conftest's one_rank), as tests/job/test_loop.py.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from helpers import TINY, cfg_for, compose_cfg, resumed_from, run, step_rows, tail
from llama_train.config import ConfigError, Float8Config, validate
from llama_train.engine.float8 import convert, skipped
from llama_train.model import Transformer

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one

FP8 = ["float8.enabled=true", "float8.emulate=true", "deepspeed.precision=bf16"]
BF16 = ["deepspeed.precision=bf16"]


def _tiny_args():
    return compose_cfg(TINY).model


def _loss_and_grads(model, x, y):
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_conversion_keeps_parameters_and_state_dict():
    """The block linears become Float8Linear holding the same Parameters: state_dict keys, shapes
    and dtypes identical with FP8 on and off, so checkpoints, export and resume are unchanged."""
    args = _tiny_args()
    plain = Transformer(args, seed=0).to(torch.bfloat16)
    f8 = copy.deepcopy(plain)
    before = {n: id(p) for n, p in f8.named_parameters()}
    names = convert(f8, Float8Config(enabled=True, emulate=True))
    assert len(names) == 7 * args.n_layers  # wq wk wv wo w1 w2 w3 per block; not the output head
    assert all(type(f8.get_submodule(n)).__name__ == "Float8Linear" for n in names)
    assert type(f8.output).__name__ == "OutputHead"
    assert {n: id(p) for n, p in f8.named_parameters()} == before  # the very same Parameters
    a, b = plain.state_dict(), f8.state_dict()
    assert list(a) == list(b)
    assert all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
               for k in a)
    assert convert(copy.deepcopy(plain), Float8Config(enabled=False)) == []


def test_skip_by_name_and_by_alignment():
    cfg = Float8Config(enabled=True, emulate=True, skip=["output", "w2", "layers.0.attention.wq"])
    lin = torch.nn.Linear(64, 128, bias=False, device="meta")
    assert skipped(cfg, "layers.3.feed_forward.w2", lin)
    assert skipped(cfg, "layers.0.attention.wq", lin)
    assert not skipped(cfg, "layers.1.attention.wq", lin)
    assert skipped(cfg, "layers.1.attention.wk", torch.nn.Linear(64, 40, device="meta"))  # 40 % 16
    assert skipped(Float8Config(skip=[]), "output", Transformer(_tiny_args(), device="meta").output)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_loss_and_gradients_stay_close_to_bf16(recipe):
    """Emulated FP8 against the same bf16 model on the same batch (3 seeds, tiny model).

    Measured (torchao 0.18, torch 2.13 CPU): |loss_fp8 - loss_bf16| <= 1.1e-3 (bf16 vs fp32:
    <= 1.4e-4); the largest per-parameter relative gradient error ||g8 - g16|| / ||g16|| 0.12-0.13
    (tensorwise), 0.10 (rowwise), 0.094-0.098 (rowwise_with_gw_hp) (bf16 vs fp32: 0.012):
    e4m3 keeps 3 mantissa bits, a relative rounding of up to 2^-4 per element, on the input, the
    weight and (backward) the output gradient. Tolerances with a ~2x margin: 2.5e-3 on the loss,
    0.25 per parameter; and the whole gradient's cosine with bf16's above 0.99. The FP8 path
    must also differ from bf16 (else nothing was converted)."""
    args = _tiny_args()
    for seed in range(3):
        ref = Transformer(args, seed=seed).to(torch.bfloat16)
        f8 = copy.deepcopy(ref)
        convert(f8, Float8Config(enabled=True, emulate=True, recipe=recipe))
        g = torch.Generator().manual_seed(seed)
        x, y = (torch.randint(0, args.vocab_size, (4, 64), generator=g) for _ in range(2))
        loss16, g16 = _loss_and_grads(ref, x, y)
        loss8, g8 = _loss_and_grads(f8, x, y)
        assert 0 < abs(loss8 - loss16) < 2.5e-3, (seed, loss8, loss16)
        worst = max(((g8[n] - g16[n]).norm() / g16[n].norm()).item() for n in g16)
        assert worst < 0.25, (seed, worst)
        flat8, flat16 = (torch.cat([d[n].flatten() for n in g16]) for d in (g8, g16))
        assert torch.nn.functional.cosine_similarity(flat8, flat16, dim=0).item() > 0.99


def _train(out, *overrides):
    from llama_train.train import train

    summary = train(cfg_for(out, "trainer.max_steps=8", *overrides))
    logged = step_rows(out)
    assert sorted(logged) == list(range(1, 9)) and summary["step"] == 8
    assert logged[8]["loss"] < logged[1]["loss"], {s: r["loss"] for s, r in logged.items()}
    return logged


@pytest.mark.slow
def test_training_with_float8_under_zero0_and_zero3_agrees(tmp_path, capfd):
    """FP8 (emulated) trains under ZeRO-0 and ZeRO-3, where the Float8Linear's weight is a
    partitioned parameter that DeepSpeed's hooks (registered after the swap) gather for forward
    and backward: the same losses within bf16 noise (ZeRO-0 vs ZeRO-3 in plain bf16 differ by
    the order of reductions: 7.0e-3 at most over these 8 steps; FP8 ZeRO-3 vs ZeRO-0: 6.9e-3;
    FP8 vs bf16 under ZeRO-0: 1.8e-3), so 2e-2."""
    zero0 = _train(tmp_path / "zero0", *FP8, "deepspeed.zero_stage=0")
    zero3 = _train(tmp_path / "zero3", *FP8, "deepspeed.zero_stage=3")
    err = capfd.readouterr().err
    assert err.count("float8: 28 linear layers in FP8 (tensorwise, emulated)") == 2
    for step in zero0:
        assert zero3[step]["loss"] == pytest.approx(zero0[step]["loss"], abs=2e-2), step


@pytest.mark.slow
def test_training_with_float8_and_activation_checkpointing(tmp_path, capfd):
    _train(tmp_path / "run", *FP8, "model.activation_checkpointing=true",
           "float8.recipe=rowwise")
    assert "float8: 28 linear layers in FP8 (rowwise, emulated)" in capfd.readouterr().err


@pytest.mark.slow
def test_resume_across_float8_on_to_off_continues_and_logs_it(tmp_path, capfd):
    """The checkpoint holds the same weights and optimizer state either way: a run saved with
    FP8 continues without it (a may_change key: logged, not refused), and its checkpoint
    exports to a model transformers loads."""
    import transformers

    from llama_train.hf import export_main
    from llama_train.train import train

    out = tmp_path / "run"
    train(cfg_for(out, "trainer.max_steps=4", "trainer.save_every=4", *FP8))
    export_main([str(out), str(tmp_path / "hf")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    x = torch.randint(0, hf.config.vocab_size, (1, 16))
    assert torch.isfinite(hf(x).logits).all()
    capfd.readouterr()
    train(cfg_for(out, "trainer.max_steps=8", "trainer.save_every=4", *BF16))
    err = capfd.readouterr().err
    assert len(resumed_from(out)) == 1 and sorted(step_rows(out)) == list(range(1, 9))
    changed = [line for line in err.splitlines() if "changed settings" in line]
    assert changed and "float8.enabled" in changed[0], err[-3000:]
    assert "float8:" not in err  # off: nothing converted


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_float8_needs_bf16(precision):
    cfg = compose_cfg([*TINY, "float8.enabled=true", "float8.emulate=true",
                       f"deepspeed.precision={precision}"])
    with pytest.raises(ConfigError, match=r"deepspeed.precision=bf16"):
        validate(cfg, 1, "cpu")


def test_float8_with_fp16_is_refused_on_gpu_too():
    cfg = compose_cfg([*TINY, *FP8, "deepspeed.precision=fp16"])
    with pytest.raises(ConfigError, match=r"float8.enabled=true needs deepspeed.precision=bf16"):
        validate(cfg, 1, "cuda")


def test_float8_on_cpu_without_emulate_is_refused_by_key():
    cfg = compose_cfg([*TINY, "float8.enabled=true", "deepspeed.precision=bf16"])
    with pytest.raises(ConfigError, match=r"float8.emulate=true"):
        validate(cfg, 1, "cpu")
    validate(compose_cfg([*TINY, *FP8]), 1, "cpu")  # emulated: accepted


def test_bad_float8_keys_fail_while_composing():
    with pytest.raises(ConfigError, match="float8.recipe"):
        compose_cfg([*TINY, "float8.recipe=delayed"])


@pytest.mark.slow
def test_cli_refuses_float8_on_cpu_before_any_process_group(tmp_path):
    """llama-train exits 2 with one line naming the key and the fix, and writes nothing."""
    out, log = tmp_path / "run", tmp_path / "log"
    rc = run([sys.executable, "-m", "llama_train.train", *TINY, f"trainer.output_dir={out}",
              "float8.enabled=true", "deepspeed.precision=bf16"], log, timeout=120, check=False,
             warm=True)
    text = log.read_text()
    assert rc == 2, tail(log)
    assert "float8.emulate=true" in text and "Traceback" not in text, tail(log)
    assert not out.exists()
