"""The files other programs read, defined once: ``run_info.json`` and ``metrics.jsonl``.

The trainer and the tracker write them through this module; ``llama-plan fit``, the scaling
study, ``llama-plot``, the benchmarks and the tests read them through it. Change a key here and
every reader sees it; add one and old files still read (optional fields default to None).

``run_info.json`` (:class:`RunInfo`): what a run is, written at its start and again at its end
with ``final_val_loss`` and ``final_step``. One JSON object, ``indent=1``.

``metrics.jsonl``: one JSON object per line, appended as the run goes (docs/tracking.md):

* a **step record** (:class:`StepRecord`): ``{"step": N, "time": unix seconds (3 decimals),
  <metric>: value, ...}``: a training step's loss, lr, throughput..., or an evaluation's
  val_loss, val_ppl, ... (a line of its own, at the same step). Values went through
  ``util.jsonable``: a non-finite float is the string "nan", "inf" or "-inf".
* an **event record** (:class:`EventRecord`): ``{"step": N, "time": ..., "event": name,
  <field>: value, ...}``: checkpoint, resume, rollback, skipped_step, spike, data_skipped,
  source_epoch.

A record is the JSON object itself (a dict, keys in file order), so a line reads back to the
record that wrote it and writes back to the same bytes; the classes add the named accessors.
A line that is not a complete JSON object (the last one of a killed run) is skipped by readers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Union

from llama_train.paths import replace_file
from llama_train.util import jsonable

RUN_INFO_FILE = "run_info.json"
METRICS_FILE = "metrics.jsonl"  # the default of tracking.metrics_file

STEP, TIME, EVENT = "step", "time", "event"  # the keys every metrics.jsonl line may have
VAL_LOSS = "val_loss"

PathLike = Union[str, Path]


# ---------------------------------------------------------------------------------------------
# Credentials of the environment never reach a saved file (docs/reliability.md)
# ---------------------------------------------------------------------------------------------

# An environment variable holds a credential when its name ends in KEY or has one of these
# parts (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD, GITHUB_TOKEN_RO): every
# name config.is_secret_key calls a secret, and more.
_SECRET_ENV_PARTS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
# Shorter values are flags ("1", "true", TOKENIZERS_PARALLELISM=false), not credentials, and
# replacing them inside other text would mangle it.
_MIN_SECRET_CHARS = 6


def secret_env_values() -> List[tuple]:
    """``(value, name)`` of every environment variable holding a credential by its name, at
    least _MIN_SECRET_CHARS long, longest value first."""
    import os

    def secret(name: str) -> bool:
        n = name.upper().replace("-", "_")
        return n.endswith("KEY") or any(part in n for part in _SECRET_ENV_PARTS)

    found = [(v, k) for k, v in os.environ.items() if len(v) >= _MIN_SECRET_CHARS and secret(k)]
    return sorted(found, key=lambda vk: -len(vk[0]))


def scrub_secret_values(obj: Any, secrets: Optional[List[tuple]] = None) -> Any:
    """``obj`` with every credential of the environment (secret_env_values) replaced, inside
    any string, by ``$NAME``: what ``${oc.env:HF_TOKEN}`` (or a shell's ``$HF_TOKEN``) put into
    a value whose key names no secret. Through nested dicts and lists. ``$NAME`` is no OmegaConf
    interpolation: a saved config read back never resolves it."""
    secrets = secret_env_values() if secrets is None else secrets
    if isinstance(obj, str):
        for value, name in secrets:
            if value in obj:
                obj = obj.replace(value, f"${name}")
        return obj
    if isinstance(obj, dict):
        return {k: scrub_secret_values(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub_secret_values(v, secrets) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# run_info.json
# ---------------------------------------------------------------------------------------------

@dataclass
class RunInfo:
    """What ``run_info.json`` holds. Every field is written, in this order; ``final_val_loss``
    and ``final_step`` only once the run has ended (``final_step`` set)."""

    params: Dict[str, int]
    """llama_train.model.count_params: {"total", "embedding", "non_embedding"}."""
    model_args: Dict[str, Any]
    """dataclasses.asdict(ModelArgs)."""
    flop_budget: Optional[float]
    """scaling.flops of an ``experiment=...`` run (groups IsoFLOP curves), else None."""
    tokens: int
    """Training tokens of the whole run: max_steps x tokens per step."""
    global_batch: int
    seq_len: int
    max_steps: int
    flops_per_token: float
    """Training FLOPs per token (llama_train.model.flops_per_token)."""
    flops: float
    """Training FLOPs of the whole run: flops_per_token x tokens."""
    peak_flops: Dict[str, Any]
    """What MFU is measured against: {"value": FLOP/s, "source": how it was found}."""
    command: Optional[str]
    """The llama-train command that reruns this run alone."""
    count: Optional[str] = None
    """scaling.count of an ``experiment=...`` run: which parameter count its budget C = 6 N D
    was planned on ("total" or "non_embedding"); ``llama-plan fit`` fits on that one by default."""
    epoch_tokens: Optional[int] = None
    """Tokens in one pass over the train split: the fit models a run that reads more than that
    (repeated tokens, Muennighoff et al. 2023)."""
    final_val_loss: Optional[float] = None
    """The last evaluation's val_loss (None: the data has no validation split)."""
    final_step: Optional[int] = None
    """The step the run ended at; None while it runs (and then neither final_* is written)."""
    simulation: Optional[Dict[str, Any]] = None
    """A simulated rank's report (``comm.simulate_ranks``, llama_train.job.simulation): per phase
    the peak memory, seconds and the planner's figure; the checkpoint's bytes. Written only by
    a simulated run."""

    _FINAL = ("final_val_loss", "final_step")

    def to_dict(self) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.final_step is None:
            for k in self._FINAL:
                del out[k]
        if self.simulation is None:
            del out["simulation"]
        return out

    def write(self, path: PathLike) -> None:
        """The file, whole (a symlink at ``path`` is replaced, never written through), with
        every credential of the environment in it (the command may carry one a shell
        expanded) replaced by ``$NAME`` (scrub_secret_values)."""
        replace_file(path, json.dumps(scrub_secret_values(self.to_dict()), indent=1))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunInfo":
        """From a parsed run_info.json: a field the file lacks (older or partial files) is None,
        a key this code does not know is ignored. ValueError if ``data`` is not an object."""
        if not isinstance(data, Mapping):
            raise ValueError(f"run_info.json holds a {type(data).__name__}, not a JSON object")
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})

    @classmethod
    def read(cls, path: PathLike) -> "RunInfo":
        """json.JSONDecodeError if the file is not JSON, ValueError if not an object."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def final_val_loss_of(cls, output_dir: PathLike) -> Optional[float]:
        """The final val_loss a finished run recorded in ``output_dir`` (None: none recorded,
        or a run_info.json that cannot be read)."""
        try:
            return cls.read(Path(output_dir) / RUN_INFO_FILE).final_val_loss
        except (OSError, ValueError, TypeError):
            return None

    @property
    def finished(self) -> bool:
        """Written at the run's end (a run that was killed has only the start's)."""
        return self.final_step is not None


# ---------------------------------------------------------------------------------------------
# metrics.jsonl
# ---------------------------------------------------------------------------------------------

class Record(dict):
    """One line of metrics.jsonl: the JSON object itself, with named accessors."""

    @property
    def step(self) -> int:
        return self.get(STEP, 0)

    @property
    def time(self) -> Optional[float]:
        return self.get(TIME)

    @property
    def event(self) -> Optional[str]:
        """The event's name; None for a step record."""
        return self.get(EVENT)

    @property
    def fields(self) -> Dict[str, Any]:
        """Everything but step, time and event: a step's metric values, an event's fields."""
        return {k: v for k, v in self.items() if k not in (STEP, TIME, EVENT)}

    def number(self, key: str) -> Optional[float]:
        """The value of ``key`` if it is a number (a bool is not), else None; "nan"/"inf"
        strings (how jsonable writes non-finite floats) are not numbers here."""
        v = self.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def to_line(self) -> str:
        """The line metrics.jsonl holds for this record (with its newline)."""
        return json.dumps(self) + "\n"


class StepRecord(Record):
    """``{"step", "time", <metric>: value, ...}``: a training step or an evaluation."""

    @classmethod
    def new(cls, step: int, metrics: Mapping[str, Any], now: float) -> "StepRecord":
        return cls({STEP: step, TIME: round(now, 3), **{k: jsonable(v) for k, v in metrics.items()}})


class EventRecord(Record):
    """``{"step", "time", "event": name, <field>: value, ...}``."""

    @classmethod
    def new(cls, step: int, name: str, fields: Mapping[str, Any], now: float) -> "EventRecord":
        return cls({STEP: step, TIME: round(now, 3), EVENT: name,
                    **{k: jsonable(v) for k, v in fields.items()}})


def parse_line(line: str) -> Optional[Record]:
    """The record of one line, or None for a line that is not a whole JSON object (an empty
    line, or the last line of a run killed while writing it)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    return EventRecord(obj) if EVENT in obj else StepRecord(obj)


def iter_records(path: PathLike) -> Iterator[Record]:
    """The records of a metrics.jsonl file in order, broken lines skipped."""
    with open(path) as fh:
        for line in fh:
            rec = parse_line(line)
            if rec is not None:
                yield rec


def read_metrics(path: PathLike) -> List[Record]:
    return list(iter_records(path))


def step_records(records: Iterable[Record], key: Optional[str] = None) -> List[StepRecord]:
    """The step records; with ``key``, only those where it holds a number (``"loss"``: the
    training steps, ``"val_loss"``: the evaluations)."""
    return [r for r in records if isinstance(r, StepRecord) and (key is None or r.number(key) is not None)]


def events(records: Iterable[Record], *kinds: str) -> List[EventRecord]:
    """The event records, of the given kinds only if any are given."""
    return [r for r in records if isinstance(r, EventRecord) and (not kinds or r.event in kinds)]


def last_val_loss(records: Iterable[Record]) -> Optional[float]:
    """The ``val_loss`` of the last record that has one (None if none): a run's final
    validation loss."""
    last = None
    for r in records:
        if r.get(VAL_LOSS) is not None:
            last = float(r[VAL_LOSS])
    return last
