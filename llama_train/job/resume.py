"""Can this checkpoint continue this run? The one owner of resume compatibility.

Which config keys define a run and which may change between launches is declared on the config
fields themselves (:mod:`llama_train.policy`); this module reads those marks and compares a
checkpoint with the run about to start. Beyond the config, three things can never change within
a run, whatever ``trainer.allow_config_change`` says: the global batch as resolved (the data
order is a function of it), the model's weight shapes, and the tokenizer that encoded the data.
Everything here reads files only, so preflight decides before the data and the process group.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_train import policy
from llama_train.config import Config, ConfigError, flatten, to_container

if typing.TYPE_CHECKING:
    from llama_train.checkpoint.meta import CheckpointMeta

log = logging.getLogger("llama_train")

Change = Tuple[str, Any, Any]  # (key, checkpoint's value, this run's value)


class ResumeRefused(ConfigError):
    """The checkpoint cannot continue this run under this config; the message lists every
    difference and the fix. Raised on every rank alike (all read the same files)."""


@dataclass
class ResumeCheck:
    """What a resume that may go ahead changes: ``changes`` {key: [old, new]} (logged and
    recorded in the ``resume`` event), and whether the checkpoint must be loaded through
    DeepSpeed's universal format because the world size changed under ZeRO."""

    checkpoint: Path
    changes: Dict[str, List[Any]] = field(default_factory=dict)
    universal: bool = False
    # seconds spent before the load: picking and verifying the checkpoint, converting it to
    # the universal format (recorded in the ``resume`` event)
    seconds: Dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# The policy, read from the config dataclasses


def _optional_inner(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def policy_of(key: str, root: type = Config) -> str:
    """The mark that governs ``key`` (``trainer.max_steps``): the mark of the deepest marked
    field on its path, else :data:`policy.DEFINES_RUN` (also for keys the schema lacks)."""
    typ: Any = root
    for part in key.split("."):
        if not dataclasses.is_dataclass(typ):
            break
        fields = {f.name: f for f in dataclasses.fields(typ)}
        if part not in fields:
            break
        mark = fields[part].metadata.get(policy.KEY)
        if mark is not None:
            return mark
        typ = _optional_inner(typing.get_type_hints(typ).get(part))
    return policy.DEFINES_RUN


def keys_with(mark: str) -> List[str]:
    """Every key of the schema that ``mark`` governs (docs and tests list them from here)."""
    from llama_train.config import config_keys

    return [k for k in config_keys() if policy_of(k) == mark]


def _same(old, new) -> bool:
    """Equal, or a YAML boolean saved before its key took strings (trainer.compile: false ->
    "false", issue 55) spelling the same choice."""
    return old == new or (isinstance(old, bool) and isinstance(new, str)
                          and str(old).lower() == new.lower())


def config_changes(saved: dict, current: dict) -> Tuple[List[Change], List[Change]]:
    """(run-defining, may-change) differences between a checkpoint's config and this run's.
    Keys the checkpoint does not have (it predates them) and per-launch keys are not compared."""
    old, new = flatten(saved), flatten(current)
    defining: List[Change] = []
    safe: List[Change] = []
    for key in sorted(new):
        if key not in old or _same(old[key], new[key]):
            continue
        mark = policy_of(key)
        if mark == policy.PER_LAUNCH:
            continue
        (safe if mark == policy.MAY_CHANGE else defining).append((key, old[key], new[key]))
    return defining, safe


# ------------------------------------------------------------------------------------------------
# The check


def _saved_config(ckpt: Path) -> dict:
    from omegaconf import OmegaConf

    cfg_file = Path(ckpt) / "config.yaml"
    return to_container(OmegaConf.load(cfg_file)) if cfg_file.is_file() else {}


def _shape_change(saved_model: Optional[dict], model: dict) -> List[Change]:
    """[(field, checkpoint's, ours)] where the checkpoint's model has other weight shapes."""
    from llama_train.model import ModelArgs

    if not saved_model:
        return []
    try:
        theirs = ModelArgs.from_dict(saved_model)
    except (TypeError, ValueError):  # written by another version: the load itself will tell
        return []
    return [(n, old, new) for n, new, old in ModelArgs.from_dict(model).shape_differences(theirs)]


def _sets_shape(change: Change, saved_model: dict) -> bool:
    """Whether a ``model.*`` change alone gives the checkpoint's model other weight shapes (it
    is then reported once, as part of the shape change)."""
    key, _, new = change
    if not key.startswith("model."):
        return False
    try:
        return bool(_shape_change(saved_model, {**saved_model, key[len("model."):]: new}))
    except (TypeError, ValueError):  # a value the model refuses alone: part of the shape change
        return True


def check_resume(ckpt: Path, saved_state: "CheckpointMeta | Dict[str, Any]",
                 run_config: Dict[str, Any], world_size: int, global_batch: int,
                 allowed: Sequence[str], tokenizer_sha: Optional[str] = None,
                 simulate: Optional[Tuple[int, int]] = None) -> ResumeCheck:
    """Whether ``ckpt`` (its ``trainer_state.json`` already read: ``saved_state``, a
    :class:`~llama_train.checkpoint.meta.CheckpointMeta` or the file's dict) continues this
    run. Run-defining changes not in ``allowed`` refuse it with all of them listed; a changed
    global batch, model shape or tokenizer (``tokenizer_sha``: of this run's data; None where
    not known yet) always does, and so does a checkpoint of a simulated rank for anything but
    the same simulation (``simulate``: this launch's (N, rank), or None for a real job).
    Raises :class:`ResumeRefused`; returns what goes ahead."""
    from llama_train.checkpoint.meta import CheckpointMeta

    saved = CheckpointMeta.of(saved_state)
    saved_cfg = _saved_config(ckpt)
    defining, safe = config_changes(saved_cfg, run_config)
    hard: List[Change] = []
    if saved.global_batch != global_batch:
        hard.append(("global batch (sequences per step, as resolved; leave trainer.global_batch "
                     "and trainer.global_batch_tokens unset to keep the checkpoint's, "
                     "gradient accumulation adapts)", saved.global_batch, global_batch))
    hard += _tokenizer_change(ckpt, tokenizer_sha)
    hard += _simulation_change(saved, simulate, world_size)
    shape = _shape_change(saved_cfg.get("model"), run_config["model"])
    if shape:  # no allow_config_change can load these weights
        hard.append(("model shape (the checkpoint's weights would not load)",
                     ", ".join(f"{n}={old}" for n, old, _ in shape),
                     ", ".join(f"{n}={new}" for n, _, new in shape)))
        defining = [c for c in defining if not _sets_shape(c, saved_cfg["model"])]
    allowed = [a.strip() for a in allowed]
    refused = [c for c in defining if not any(c[0] == a or c[0].startswith(a + ".")
                                              for a in allowed)]
    if refused or hard:
        raise ResumeRefused(_refusal(ckpt, refused, hard))
    return ResumeCheck(Path(ckpt), {k: [old, new] for k, old, new in [*safe, *defining]},
                       saved.world_size != world_size and saved.zero_stage > 0)


def _simulation_change(saved: "CheckpointMeta", simulate: Optional[Tuple[int, int]],
                       world_size: int) -> List[Change]:
    """A simulated rank's checkpoint holds that rank's shard only: only the same simulation
    continues it. A simulation may continue a real checkpoint of its world size (its rank's
    shard is there); another world size would need every rank's shards converted."""
    theirs = saved.simulated
    ours = {"ranks": simulate[0], "rank": simulate[1]} if simulate else None
    if theirs == ours:
        return []
    if theirs is None:
        if saved.world_size == world_size:
            return []
        return [("world size (a simulated rank continues a real checkpoint of its own world "
                 "size only)", saved.world_size, world_size)]
    what = "a real job" if ours is None else f"simulated rank {ours['rank']} of {ours['ranks']}"
    return [("simulation (a simulated rank's checkpoint holds that rank's shard only; only "
             "the same comm.simulate_ranks and comm.simulate_rank continue it)",
             f"simulated rank {theirs['rank']} of {theirs['ranks']}", what)]


def check_tokenizer(ckpt: Path, tokenizer_sha: Optional[str]) -> None:
    """The tokenizer of this run's data (known once the data is prepared) against the one the
    checkpoint was trained with."""
    hard = _tokenizer_change(ckpt, tokenizer_sha)
    if hard:
        raise ResumeRefused(_refusal(ckpt, [], hard))


def _checkpoint_tokenizer(ckpt: Path) -> Path:
    """The tokenizer file a checkpoint keeps: tokenizer.model (a SentencePiece model, or the
    bytes of a Hugging Face tokenizer.json: data.Tokenizer tells them by content), or
    tokenizer.json."""
    for name in ("tokenizer.model", "tokenizer.json"):
        if (Path(ckpt) / name).is_file():
            return Path(ckpt) / name
    return Path(ckpt) / "tokenizer.model"


def _tokenizer_change(ckpt: Path, tokenizer_sha: Optional[str]) -> List[Change]:
    from llama_train.data.tokenizer import file_sha256

    theirs = _checkpoint_tokenizer(ckpt)
    if theirs.is_file() and tokenizer_sha and file_sha256(theirs) != tokenizer_sha:
        return [("tokenizer sha256 (of the data)", file_sha256(theirs)[:12], tokenizer_sha[:12])]
    return []


def _refusal(ckpt: Path, refused: List[Change], hard: List[Change]) -> str:
    listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in [*hard, *refused])
    fix = []
    if refused:
        keys = ",".join(k for k, _, _ in refused)
        fix.append(f"to change them on purpose add trainer.allow_config_change=[{keys}]")
    if any(k.startswith("simulation") for k, _, _ in hard):
        fix.append("give each simulation (comm.simulate_ranks) its own trainer.output_dir")
    if any(not k.startswith("simulation") for k, _, _ in hard):
        fix.append(f"a changed model shape, global batch or tokenizer cannot continue this "
                   f"run: keep them (for the tokenizer, prepare the data with "
                   f"data.tokenizer={_checkpoint_tokenizer(ckpt)}); a new shape is a new run")
    fix.append("or start a new trainer.output_dir (or trainer.resume=never with "
               "trainer.on_existing=archive)")
    return (f"checkpoint {ckpt} was trained with another run-defining config: {listed}. Nothing "
            f"was changed. {'; '.join(fix)}.")


def log_changes(check: ResumeCheck) -> None:
    """Say what a resume changes (rank 0)."""
    if not check.changes:
        return
    log.warning("resuming %s with changed settings: %s", check.checkpoint,
                "; ".join(f"{k}: {old!r} -> {new!r}"
                          + ("" if policy_of(k) == policy.MAY_CHANGE else " (allowed)")
                          for k, (old, new) in check.changes.items()))
