"""A sweep's runs as (N, D, final validation loss) points: read from run directories (each
``run_info.json`` + ``metrics.jsonl``, llama_train.records) or a runs CSV, written back as CSV,
and grouped into IsoFLOP budgets."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from llama_train.records import METRICS_FILE, RUN_INFO_FILE, RunInfo, iter_records, last_val_loss
from llama_train.scaling.laws import ScalingError

# Muennighoff et al. 2023 ("Scaling Data-Constrained Language Models", arXiv:2305.16264, Eq. 5):
# repeated tokens are worth less each epoch, by exp(-R / R_D*), their fitted R_D* = 15.4.
REPEAT_HALF_LIFE = 15.4


@dataclass
class RunPoint:
    run: str
    n_params: float
    tokens: float
    flops: float
    val_loss: float
    budget: Optional[float] = None  # nominal FLOP budget if the run recorded one
    # both counts when known (n_params is one of them), so a CSV can carry either convention
    total_params: Optional[float] = None
    non_embedding_params: Optional[float] = None
    command: str = ""  # how the run was launched (run_info.json "command"), for the CSV
    unique_tokens: Optional[float] = None  # one epoch of the train split (run_info.json "epoch_tokens")
    count: Optional[str] = None  # the count its budget was planned on (run_info.json "count")
    repeat_half_life: float = REPEAT_HALF_LIFE  # R* of the discount (llama-plan fit --repeat-half-life)

    @property
    def effective_tokens(self) -> float:
        """D as fresh-token equivalents: :func:`effective_tokens` of D over the unique tokens."""
        return effective_tokens(self.tokens, self.unique_tokens, self.repeat_half_life)


def effective_tokens(tokens: float, unique: Optional[float], half_life: float = REPEAT_HALF_LIFE) -> float:
    """D' = U + U R* (1 - exp(-R / R*)), R = D / U - 1 the repeated epochs: D itself for one
    epoch or less, or with U unknown. At 2 epochs D' = 1.97 U, at 4 epochs 3.8 U (their finding:
    up to ~4 epochs, repeated tokens are nearly as good as fresh ones). ``half_life`` is R*: a
    smaller one makes repeats worth less (at R* = 1, 2 epochs are worth 1.63 U)."""
    if not unique or tokens <= unique:
        return float(tokens)
    repeats = tokens / unique - 1
    return float(unique * (1 + half_life * (1 - math.exp(-repeats / half_life))))


def final_val_loss(metrics_path: Path) -> Optional[float]:
    """The ``val_loss`` of the last line of metrics.jsonl that has one (None if none); a
    half-written last line of a killed run does not sink the sweep."""
    return last_val_loss(iter_records(metrics_path))


def _opt_float(v: Any) -> Optional[float]:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def collect_runs(sweep_dir: Union[str, Path], params: str = "total") -> Tuple[List[RunPoint], List[Dict[str, str]]]:
    """Every run under ``sweep_dir`` (any depth) that has ``metrics.jsonl`` + ``run_info.json``.

    ``run_info.json`` (written by the trainer): {"params": {"total", "non_embedding"},
    "tokens": total training tokens, "flops": training FLOPs, "model_args": {...}} and optionally
    "flop_budget" (the sweep's nominal budget, used to group IsoFLOP curves) and "command" (kept
    for the CSV). Returns (usable runs, skipped runs with the reason).
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ScalingError(f"sweep_dir {root} is not a directory; pass the folder holding the sweep's run dirs")
    _check_params(params)
    runs: List[RunPoint] = []
    skipped: List[Dict[str, str]] = []
    for metrics in sorted(root.rglob(METRICS_FILE)):
        run_dir = metrics.parent
        name = str(run_dir.relative_to(root)) or "."
        info_path = run_dir / RUN_INFO_FILE
        if not info_path.is_file():
            skipped.append({"run": name, "reason": f"no {RUN_INFO_FILE}"})
            continue
        try:
            info = RunInfo.read(info_path)
        except json.JSONDecodeError as exc:
            skipped.append({"run": name, "reason": f"{RUN_INFO_FILE} is not JSON ({exc})"})
            continue
        except ValueError:  # JSON, but not an object
            info = None
        try:
            n = float(info.params[params])
            tokens = float(info.tokens)
        except (AttributeError, KeyError, TypeError, ValueError):
            skipped.append({"run": name, "reason": f"{RUN_INFO_FILE} lacks params.{params} or tokens"})
            continue
        loss = final_val_loss(metrics)
        if loss is None or not math.isfinite(loss):
            skipped.append({"run": name, "reason": f"no finite val_loss in {METRICS_FILE}"})
            continue
        flops = float(info.flops or 6.0 * n * tokens)
        counts = info.params if isinstance(info.params, dict) else {}
        runs.append(RunPoint(run=name, n_params=n, tokens=tokens, flops=flops, val_loss=loss,
                             budget=float(info.flop_budget) if info.flop_budget is not None else None,
                             total_params=_opt_float(counts.get("total")),
                             non_embedding_params=_opt_float(counts.get("non_embedding")),
                             command=str(info.command or ""), unique_tokens=_opt_float(info.epoch_tokens),
                             count=info.count or _count_from_config(run_dir)))
    return runs, skipped


def _count_from_config(run_dir: Path) -> Optional[str]:
    """scaling.count from the run's config.yaml, for a run_info.json older than its "count"."""
    import yaml

    try:
        scaling = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("scaling") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    count = scaling.get("count") if scaling.get("mode", "none") != "none" else None
    return count if count in ("total", "non_embedding") else None


def _grouping_key(runs: Sequence[RunPoint]):
    """What IsoFLOP groups are made on: every run's nominal budget, or (if one lacks it) FLOPs."""
    if runs and all(r.budget is not None for r in runs):
        return lambda r: r.budget
    return lambda r: r.flops


def group_budgets(runs: Sequence[RunPoint], rel_tol: float = 0.15) -> List[Tuple[float, List[RunPoint]]]:
    """IsoFLOP groups: runs whose ``flop_budget`` (or, if any run lacks one, FLOPs) agree within rel_tol."""
    key = _grouping_key(runs)
    out: List[Tuple[float, List[RunPoint]]] = []
    cur: List[RunPoint] = []

    def close() -> None:
        keys = [key(x) for x in cur]  # one nominal budget stays exact; mixed ones: their geometric mean
        c = keys[0] if len(set(keys)) == 1 else float(np.exp(np.mean(np.log(keys))))
        out.append((float(c), list(cur)))

    for r in sorted(runs, key=key):
        if cur and key(r) > key(cur[0]) * (1 + rel_tol):
            close()
            cur = []
        cur.append(r)
    if cur:
        close()
    return out


def load_runs(path: Union[str, Path], params: str = "total") -> Tuple[List[RunPoint], List[Dict[str, str]]]:
    """A sweep directory (:func:`collect_runs`) or a CSV file (:func:`load_runs_csv`)."""
    p = Path(path)
    if p.is_file():
        return load_runs_csv(p, params=params)
    if p.is_dir():
        return collect_runs(p, params=params)
    raise ScalingError(f"{p} is neither a sweep directory nor a CSV file")



# ---------------------------------------------------------------------------------------------
# CSV: one row per run
# ---------------------------------------------------------------------------------------------

CSV_COLUMNS = ("flops", "params", "non_embedding_params", "tokens", "val_loss", "command")
# written and read back, optional on input: unique_tokens (one epoch; the fit discounts repeats),
# count (the parameter count each budget was planned on: llama-plan fit's default --params)
CSV_EXTRA_COLUMNS = ("run", "train_flops", "unique_tokens", "count")


def _num(x: Optional[float]) -> str:
    return "" if x is None else repr(float(x))  # repr round-trips a float exactly


def write_runs_csv(runs: Sequence[RunPoint], path: Union[str, Path], params: str = "total") -> Path:
    """Write runs as CSV_COLUMNS (+ run, train_flops).

    ``flops`` is the key :func:`group_budgets` groups on (the nominal budget when every run has
    one, else the measured FLOPs), so reading the file back groups, and therefore fits, identically;
    measured FLOPs go to ``train_flops``. ``params`` names the convention of ``n_params``, used only
    to fill a count a RunPoint does not carry separately.
    """
    _check_params(params)
    key = _grouping_key(runs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS + CSV_EXTRA_COLUMNS)
        for r in runs:
            total = r.total_params if r.total_params is not None else (r.n_params if params == "total" else None)
            non_emb = (r.non_embedding_params if r.non_embedding_params is not None
                       else (r.n_params if params == "non_embedding" else None))
            w.writerow([_num(key(r)), _num(total), _num(non_emb), _num(r.tokens),
                        _num(r.val_loss), r.command or "", r.run, _num(r.flops), _num(r.unique_tokens),
                        r.count or ""])
    return path


def load_runs_csv(path: Union[str, Path], params: str = "total") -> Tuple[List[RunPoint], List[Dict[str, str]]]:
    """Runs from a CSV with columns flops, params, non_embedding_params, tokens, val_loss, command.

    ``flops`` is the nominal budget the runs are grouped on; ``params`` is the total count.
    Extra columns are ignored except ``run`` (a name), ``train_flops`` (measured FLOPs),
    ``unique_tokens`` and ``count`` (CSV_EXTRA_COLUMNS).
    Rows with a missing, non-numeric or non-positive value are skipped with the reason, as
    :func:`collect_runs` skips incomplete runs.
    """
    path = Path(path)
    _check_params(params)
    if not path.is_file():
        raise ScalingError(f"{path} is not a file")
    col = "params" if params == "total" else "non_embedding_params"
    need = ("flops", col, "tokens", "val_loss")
    runs: List[RunPoint] = []
    skipped: List[Dict[str, str]] = []
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in need if c not in header]
        if missing:
            raise ScalingError(f"{path}: no column(s) {', '.join(missing)} in the header {header}; a runs CSV has "
                               f"{','.join(CSV_COLUMNS)} (extra columns allowed)")
        for lineno, cells in enumerate(reader, start=2):
            if not any(c.strip() for c in cells):
                continue
            row = {h: (cells[i].strip() if i < len(cells) else "") for i, h in enumerate(header)}
            name = row.get("run") or f"line{lineno}"
            vals = {k: _opt_float(row[k] or None) for k in need}
            bad = [k for k, v in vals.items() if v is None or not math.isfinite(v) or v <= 0]
            if bad:
                skipped.append({"run": name, "reason": f"line {lineno}: {', '.join(bad)} missing, not a number or <= 0"})
                continue
            train_flops = _opt_float(row.get("train_flops") or None)
            runs.append(RunPoint(run=name, n_params=vals[col], tokens=vals["tokens"],
                                 flops=train_flops if train_flops else vals["flops"], val_loss=vals["val_loss"],
                                 budget=vals["flops"], total_params=_opt_float(row.get("params") or None),
                                 non_embedding_params=_opt_float(row.get("non_embedding_params") or None),
                                 command=row.get("command", ""),
                                 unique_tokens=_opt_float(row.get("unique_tokens") or None),
                                 count=row.get("count") if row.get("count") in ("total", "non_embedding") else None))
    return runs, skipped


def _check_params(params: str) -> None:
    if params not in ("total", "non_embedding"):
        raise ScalingError(f"params={params!r}: use 'total' (Chinchilla's convention) or 'non_embedding'")
