"""trainer.async_save in this process (one rank, the real Trainer and DeepSpeed engine): the
loop blocks only for the copy to host memory, the files are those a synchronous save writes,
the loop trains on while a slow write is in flight, the next save waits for it (at most one in
flight), and a write that fails stops the run at the next save. Kill -9 during a background
write, a rank lost in one, and the same checks across 2 ranks under ZeRO-2 and ZeRO-3 go through
the launcher: tests/checkpoint/test_checkpoint.py and tests/engine/test_zero3.py.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import cfg_for, rows, step_rows
from llama_train.checkpoint import CheckpointError, find_latest, verify
from llama_train.engine.wrapper import host_copy
from llama_train.hooks import Hook
from llama_train.train import train

pytestmark = pytest.mark.usefixtures("one_rank")  # conftest.py: a world of one

# torch.save gives every file a random id; everything else must be the same bytes
_SERIALIZATION_ID = ".data/serialization_id"


def _records(path: Path) -> dict:
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist()
                if not n.endswith(_SERIALIZATION_ID)}


def _saved(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return _records(buf)


def test_host_copy_is_a_snapshot_with_the_original_layout():
    flat = torch.randn(64)
    state = {"a": flat[:8], "b": flat[8:28].view(4, 5), "p": torch.nn.Parameter(torch.randn(3)),
             "t": torch.randn(4, 4).t(), "nested": [torch.arange(5), (1, "x")], "lr": 0.5}
    copy = host_copy(state)
    assert _saved(copy) == _saved(state)  # views of one storage still share one, whole
    assert isinstance(copy["p"], torch.nn.Parameter) and copy["t"].stride() == (1, 4)
    flat.add_(1.0)  # training goes on changing the originals
    assert not torch.equal(copy["a"], state["a"])
    assert torch.equal(copy["a"] + 1.0, state["a"])


def test_the_writer_makes_its_own_group_with_the_manager(tmp_path, monkeypatch):
    """An asynchronous manager makes the background writer's gloo group itself, when it is
    built (every rank builds it at the same point of start-up: a collective call), its timeout
    the longer of comm.timeout_s and the write's; a synchronous one makes none."""
    import llama_train.checkpoint.writer as writer
    from llama_train.checkpoint import CheckpointManager

    made = []
    monkeypatch.setattr(writer, "checkpoint_group", lambda timeout_s: made.append(timeout_s)
                        or f"group{len(made)}")
    sync = CheckpointManager(str(tmp_path), 2, True, 0, 1, async_save=False, comm_timeout_s=60)
    assert made == [] and sync.group is None
    short = CheckpointManager(str(tmp_path), 2, True, 0, 1, async_save=True, comm_timeout_s=60)
    long = CheckpointManager(str(tmp_path), 2, True, 0, 1, async_save=True,
                             comm_timeout_s=2 * writer.WRITE_TIMEOUT_S)
    assert made == [writer.WRITE_TIMEOUT_S, 2 * writer.WRITE_TIMEOUT_S]
    assert (short.group, long.group) == ("group1", "group2")
    given = CheckpointManager(str(tmp_path), 2, True, 0, 1, async_save=True, group="mine")
    assert given.group == "mine" and len(made) == 2


def test_an_async_checkpoint_holds_the_bytes_of_a_synchronous_one(tmp_path):
    """ZeRO-1: the model-states file and the optimizer partition, as DeepSpeed writes them."""
    zero = 1
    ckpts = {}
    for mode in ("true", "false"):
        out = tmp_path / f"async_{mode}"
        train(cfg_for(out, f"deepspeed.zero_stage={zero}", "trainer.max_steps=4",
                      "trainer.save_every=2", f"trainer.async_save={mode}"))
        ckpts[mode] = out / "checkpoints" / "step_00000004"
        assert verify(ckpts[mode]) is None
    a, s = ckpts["true"], ckpts["false"]
    files = sorted(p.relative_to(s).as_posix() for d in ("ds", "ranks")
                   for p in (s / d).rglob("*.pt"))
    assert files and files == sorted(p.relative_to(a).as_posix() for d in ("ds", "ranks")
                                     for p in (a / d).rglob("*.pt"))
    for f in files:
        assert _records(a / f) == _records(s / f), f


class Watch(Hook):
    """What the checkpoint directory holds as each step begins."""

    def __init__(self, root: Path):
        self.root, self.seen = root, {}

    def on_step_begin(self, step):
        self.seen[step] = sorted(p.name for p in self.root.glob("*step_*"))


@pytest.mark.slow  # waits out a 6 s write
def test_the_loop_trains_on_while_a_slow_write_is_in_flight(tmp_path, faults, capfd):
    # 6 s: steps 3 and 4 must end inside the write, also on a loaded machine (a full-suite run
    # once took over 3 s for them, and the save of step 4 had nothing left to wait for)
    faults("slow_save:step=2,seconds=6")
    out = tmp_path / "slow"
    watch = Watch(out / "checkpoints")
    train(cfg_for(out, "trainer.max_steps=6", "trainer.save_every=2"), hooks=[watch])
    # steps 3 and 4 ran while step 2's write was in flight; the save of step 4 waited for it
    assert watch.seen[3] == [".tmp-step_00000002"] == watch.seen[4]
    assert watch.seen[5] == ["step_00000002", "step_00000004"] or \
        watch.seen[5] == [".tmp-step_00000004", "step_00000002"]
    saves = {r["step"]: r for r in rows(out) if r.get("event") == "checkpoint"}
    assert sorted(saves) == [2, 4, 6] and all(r["background"] for r in saves.values())
    # the loop did not wait for the 6 s write (its own share, the copy, varies with the load)
    assert saves[2]["durable_s"] >= 6.0 > saves[2]["blocked_s"], saves[2]
    assert saves[4]["waited_s"] > 1.0 and saves[4]["blocked_s"] >= saves[4]["waited_s"]
    assert "waited" in capfd.readouterr().err
    assert sorted(step_rows(out)) == list(range(1, 7))
    assert [p.name for p in sorted((out / "checkpoints").glob("*step_*"))] == \
        ["step_00000002", "step_00000004", "step_00000006"]


def test_a_failed_background_write_stops_the_run_at_the_next_save(tmp_path, faults):
    faults("save_error:step=2,rank=0,errno=ENOSPC")
    out = tmp_path / "enospc"
    with pytest.raises(CheckpointError, match=r"step_00000002 failed \(rank 0: OSError: "
                                              r"\[Errno 28\] No space left"):
        train(cfg_for(out, "trainer.max_steps=8", "trainer.save_every=2"))
    assert max(step_rows(out)) == 4  # within one save interval
    assert find_latest(out / "checkpoints")[0] is None
    assert not list((out / "checkpoints").glob("*step_*"))  # the partial save was removed


def test_snapshots_reuse_their_host_buffers():
    """The second snapshot of a file copies into the buffers of the first (no new allocation,
    whose page faults cost more than the copy); a buffer of another size is replaced."""
    from llama_train.engine.wrapper import _Staging

    pool: dict = {}
    x, y = torch.randn(1000), torch.randn(10)
    first = host_copy({"x": x, "y": y}, _Staging(pool, "optim_states.pt"))
    buffers = [first[k].untyped_storage().data_ptr() for k in ("x", "y")]
    x.add_(1.0)
    second = host_copy({"x": x, "y": torch.randn(20)}, _Staging(pool, "optim_states.pt"))
    assert second["x"].untyped_storage().data_ptr() == buffers[0]
    assert torch.equal(second["x"], x)
    assert second["y"].untyped_storage().data_ptr() != buffers[1]  # another size
    assert sorted(pool) == [("optim_states.pt", 0), ("optim_states.pt", 1)]
