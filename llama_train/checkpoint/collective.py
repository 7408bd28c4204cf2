"""The ranks' agreement on a checkpoint: every rank learns what any rank found (a failed write,
a refused save), so all raise the same error or none does. Over the default group, or over the
background writer's own group (:func:`llama_train.checkpoint.writer.writer_group`)."""

from __future__ import annotations

from typing import Any, List


def _gather(value: Any, group: Any = None) -> List[Any]:
    """Every rank's ``value`` (rank order), over ``group`` (None: the default group)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=group)
    return values


def _agree(error: Any, group: Any = None) -> Any:
    """All ranks learn whether any rank failed (and the first message)."""
    failed = [e for e in _gather(error, group) if e]
    return failed[0] if failed else None
