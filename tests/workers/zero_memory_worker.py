"""Under the deepspeed launcher: the optimizer-state bytes DeepSpeed really holds per rank for
ZeRO 1, 2 and 3 (fp32, CPU), next to llama-plan model-info's analytic figure. Prints JSON lines."""

import json
import sys

import torch

sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]

from _lines import say  # noqa: E402

from llama_train import engine as eng  # noqa: E402
from llama_train.comm import CommConfig  # noqa: E402
from llama_train.config import BatchPlan, DeepSpeedConfig, OptimConfig  # noqa: E402
from llama_train.job.optim import param_groups  # noqa: E402
from llama_train.model import load_preset  # noqa: E402
from llama_train.proc import exit_skipping_teardown  # noqa: E402
from llama_train.scaling import model_memory  # noqa: E402

rt = eng.detect_runtime("cpu")
eng.init_distributed(CommConfig(), rt.device_type)
args = load_preset("tiny")
for stage in (1, 2, 3):
    plan = BatchPlan(rt.world_size, 1, 1, rt.world_size, 16)
    cfg = eng.build_ds_config(DeepSpeedConfig(zero_stage=stage), OptimConfig(), plan, "cpu",
                              model_dim=args.dim)
    model = eng.build_model(args, cfg, rt.device, seed=0)
    engine = eng.initialize(model, param_groups(model, OptimConfig()), cfg)
    x = torch.randint(0, args.vocab_size, (1, 17))
    _, loss = engine(x[:, :-1], x[:, 1:])
    engine.backward(loss)
    engine.step()  # Adam moments exist only after the first step
    measured = engine.opt_state_bytes()
    analytic = model_memory(args, stage, rt.world_size, dtype="fp32")["optimizer_states"]
    say(json.dumps({"rank": rt.rank, "stage": stage, "measured": measured, "analytic": analytic}))
    engine.destroy()
    del engine, model
torch.distributed.barrier()  # the store's host (rank 0) must not exit while a peer still uses it
torch.distributed.destroy_process_group()
exit_skipping_teardown(0)
