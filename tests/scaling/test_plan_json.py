"""``llama-plan ... --json`` prints the JSON alone on stdout, run as the real console command with
no DS_ACCELERATOR in its environment (DeepSpeed then logs "Setting accelerator to CPU" through a
handler on stdout when model-info imports its estimators)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers import BIN, REPO
from llama_train.scaling import CHINCHILLA


def _plan(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)
    return subprocess.run([str(BIN / "llama-plan"), *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _sweep_csv(path) -> None:
    """Five sizes per budget on Chinchilla's law: enough for ``llama-plan fit``."""
    lines = ["flops,params,non_embedding_params,tokens,val_loss,command"]
    for c in (1e17, 1e18, 1e19):
        n_opt = CHINCHILLA.optimal(c)[0]
        for f in (0.25, 0.5, 1.0, 2.0, 4.0):
            n = n_opt * f
            d = c / (6 * n)
            lines.append(f"{c},{n:.0f},{0.9 * n:.0f},{d:.0f},{CHINCHILLA.loss(n, d):.6f},x")
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("argv", [
    ["model-info", "--model", "tiny", "--zero-stage", "3", "--world-size", "8", "--gpu-mem", "1"],
    ["model-info", "--model", "tiny", "--zero-stage", "1", "--device", "cpu"],
    ["compute-optimal", "--flops", "1e21"],
    ["inference-optimal", "--flops", "1e21", "--inference-tokens", "1e12"],
    ["shape", "--params", "1e8"],
    ["fit", "SWEEP", "--bootstrap", "0", "--bootstrap-a3", "0", "--top-k", "4"],
], ids=["model-info-zero3", "model-info-zero1-cpu", "compute-optimal", "inference-optimal", "shape", "fit"])
@pytest.mark.slow
def test_json_alone_on_stdout_without_ds_accelerator(argv, tmp_path):
    if "SWEEP" in argv:
        _sweep_csv(tmp_path / "runs.csv")
        argv = [str(tmp_path / "runs.csv") if a == "SWEEP" else a for a in argv]
    proc = _plan(*argv, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    json.loads(proc.stdout)  # nothing before or after the JSON


def test_model_info_json_keeps_the_keys_renamed_without_notice(capsys):
    """``meta_param_count`` and ``meta_build_seconds`` left ``model-info --json`` when issue 53
    stopped building the model on the meta device: written again, with the values of what
    replaced them, and named under ``deprecated``."""
    from llama_train.scaling.cli import main

    assert main(["model-info", "--model", "llama3_8b", "--zero-stage", "3", "--world-size", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["meta_param_count"] == out["params"]["total"] == 8_030_261_248
    assert 0 <= out["meta_build_seconds"] < 60
    assert set(out["deprecated"]) == {"meta_param_count", "meta_build_seconds"}
    assert "params.total" in out["deprecated"]["meta_param_count"]
