"""The simulated rank's process group (llama_train.comm.simulate.MirrorGroup) on every entry
point torch 2.4-2.13 calls, for CPU and CUDA alike.

The first GPU run (torch 2.11) died in ``deepspeed.zero.Init``'s first all-gather: "No backend
type associated with device type cuda". torch 2.11's ``all_gather_into_tensor`` calls
``group._allgather_base`` (2.13: ``all_gather_single``); the group lacked it, so the call fell
through to the C++ ProcessGroup, which looks for a per-device backend this group has none of.
Those lookups need no GPU: on CPU the same fall-through says "device type cpu", and
``_coalescing_manager(group, device=torch.device("cuda"))`` asks for the cuda one directly.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.distributed_c10d import _coalescing_manager

from helpers import world_of_one
from llama_train.comm import simulate

N, R = 8, 3


@pytest.fixture
def group():
    """The default group as rank R of N, ended afterwards."""
    with world_of_one():
        simulate.init(R, N, datetime.timedelta(seconds=30))
        yield dist.distributed_c10d._get_default_group()


def test_every_name_torch_calls_is_the_groups_own():
    """Defined on MirrorGroup itself: none falls through to the C++ ProcessGroup's lookup."""
    inherited = [name for names in simulate.ENTRY_POINTS.values() for name in names
                 if name not in vars(simulate.MirrorGroup)]
    assert inherited == []
    # every name the installed torch's trampoline or Python API calls is among them
    for name in ("allreduce", "allgather", "all_gather_single", "reduce_scatter_single",
                 "all_to_all_single", "broadcast", "barrier"):
        assert hasattr(dist.ProcessGroup, name), name


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_coalescing_manager_runs_for_either_device(group, device):
    """DeepSpeed's coalesced all-gather enters ``_coalescing_manager`` with the tensors' device;
    the group starts and ends the batch itself (no backend looked up for ``device``)."""
    outs = [torch.empty(N), torch.empty(2 * N)]
    with _coalescing_manager(group, device=torch.device(device)):
        dist.all_gather_into_tensor(outs[0], torch.full((1,), 2.0))
        dist.all_gather_into_tensor(outs[1], torch.arange(2.0))
    assert torch.equal(outs[0], torch.full((N,), 2.0))
    assert torch.equal(outs[1], torch.arange(2.0).repeat(N))


def test_the_collectives_under_torch_2_4_to_2_12_names(group):
    """What torch 2.11's all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single and
    their coalesced forms call: each answers as its 2.13 name does."""
    x = torch.arange(4.0)
    out = torch.empty(N * 4)
    group._allgather_base(out, x, c10d.AllgatherOptions()).wait()
    assert torch.equal(out, x.repeat(N))

    opts = c10d.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    big = torch.arange(N * 2.0)
    small = torch.empty(2)
    group._reduce_scatter_base(small, big, opts).wait()
    assert torch.equal(small, big[R * 2:R * 2 + 2] * N)  # N identical contributions, summed

    outs, ins = [torch.empty(N * 2), torch.empty(N)], [torch.ones(2), torch.ones(1)]
    group.allgather_into_tensor_coalesced(outs, ins, c10d.AllgatherOptions()).wait()
    assert all(torch.equal(o, torch.ones_like(o)) for o in outs)
    smalls = [torch.empty(1), torch.empty(2)]
    group.reduce_scatter_tensor_coalesced(smalls, [torch.ones(N), torch.ones(2 * N)],
                                          opts).wait()
    assert all(torch.equal(s, torch.full_like(s, float(N))) for s in smalls)

    a2a = torch.empty(N)
    group.alltoall_base(a2a, torch.arange(N * 1.0), [], [], c10d.AllToAllOptions()).wait()
    assert torch.equal(a2a, torch.arange(N * 1.0))


def test_the_public_api_answers_as_n_mirrored_ranks(group):
    """torch.distributed's own functions on the group (whichever names this torch calls)."""
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(N)))
    m = torch.full((2,), 5.0)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    assert torch.equal(m, torch.full((2,), 5.0))
    r = torch.ones(2)
    dist.reduce(r, dst=0)
    assert torch.equal(r, torch.full((2,), float(N)))
    gathered = torch.empty(N * 2)
    dist.all_gather_into_tensor(gathered, torch.tensor([1.0, 2.0]))
    assert torch.equal(gathered, torch.tensor([1.0, 2.0]).repeat(N))
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(N * 2.0))
    assert torch.equal(scattered, torch.arange(R * 2.0, R * 2.0 + 2) * N)
    lst = [torch.empty(2) for _ in range(N)]
    dist.all_gather(lst, torch.tensor([7.0, 8.0]))
    assert all(torch.equal(x, torch.tensor([7.0, 8.0])) for x in lst)
    dist.broadcast(t, src=0)
    dist.barrier()
    objs = [None] * N
    dist.all_gather_object(objs, {"rank": R})
    assert objs == [{"rank": R}] * N
