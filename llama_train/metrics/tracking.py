"""Metrics and experiment tracking: ``metrics.jsonl`` always, W&B and TensorBoard when enabled.
Rank 0 only.

This is the one place that decides which rank writes; the training loop calls it on every rank.

``metrics.jsonl`` holds one line per logged step of the run as it finally went, plus ``event``
lines (checkpoint, resume, skipped_step, spike, rollback, ...); every line has the wall-clock
``time`` it was written (unix seconds); the records are defined in llama_train.records. Its
length at each checkpoint travels in the checkpoint, so a resume cuts the file back to exactly
what it was then, and a rollback cuts it back but keeps the events that explain why. W&B gets the same records against a ``step`` axis of its own (steps
may repeat after a rollback; W&B's own step counter never goes back). TensorBoard gets the same
scalars against ``step``; a resume or rollback opens a new event file with ``purge_step`` so
TensorBoard hides what the abandoned steps wrote (docs/tracking.md).
"""

from __future__ import annotations

import atexit
import errno
import logging
import netrc
import os
import secrets
import shlex
import string
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from llama_train.config import ConfigError, TrackingConfig, WandbConfig
from llama_train.paths import PathRefused, replace_file, run_path
from llama_train.records import EVENT, EventRecord, Record, StepRecord, parse_line

log = logging.getLogger("llama_train")


# .netrc machines a W&B key may be stored under: wandb < 0.30's default server, and the default
# of newer ones (wandb 0.31's `wandb login` writes the key for its base URL, by default
# https://api.forge.coreweave.com); WANDB_BASE_URL's host is added for a server of one's own.
WANDB_NETRC_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


def wandb_api_key_present() -> bool:
    """Whether W&B would find an API key: ``WANDB_API_KEY``, or a .netrc entry (``$NETRC``,
    else ``~/.netrc``) for one of the hosts above. Decides ``tracking.wandb.mode: null``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    hosts = list(WANDB_NETRC_HOSTS)
    if os.environ.get("WANDB_BASE_URL"):
        hosts.append(urlsplit(os.environ["WANDB_BASE_URL"]).netloc)
    try:
        found = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc"))
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return any(found.authenticators(h) is not None for h in hosts if h)


# What wandb 0.31 accepts in WANDB_MODE (its Settings.mode); anything else fails wandb.init
# with a pydantic "validation error for Settings" that names no variable.
WANDB_ENV_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")


def check_wandb_env(cfg: TrackingConfig) -> None:
    """W&B reads WANDB_MODE from the environment even when the config sets the mode: refuse a
    value it would reject (an empty one included) by name, before the process group."""
    mode = os.environ.get("WANDB_MODE")
    if mode is None or resolve_wandb_mode(cfg.wandb.mode) == "disabled":
        return
    if mode not in WANDB_ENV_MODES:
        raise ConfigError(
            f"the environment variable WANDB_MODE={mode!r} is not a W&B mode: unset it, or set "
            f"it to one of {', '.join(WANDB_ENV_MODES[:3])} (tracking.wandb.mode sets the "
            f"mode of this run).")


# wandb.init waits 90 s by default (its Settings.init_timeout) for a server it cannot reach,
# then raises; an online run falls back to offline after at most this (WANDB_INIT_TIMEOUT
# overrides it). A server that cannot be reached at all (a name that does not resolve, a
# connection refused, no route) is found by a TCP probe in WANDB_PROBE_TIMEOUT_S.
WANDB_INIT_TIMEOUT_S = 20.0
WANDB_PROBE_TIMEOUT_S = 5.0
_PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def wandb_init_timeout() -> float:
    try:
        value = float(os.environ.get("WANDB_INIT_TIMEOUT", WANDB_INIT_TIMEOUT_S))
    except ValueError:
        return WANDB_INIT_TIMEOUT_S
    return value if value > 0 else WANDB_INIT_TIMEOUT_S


def wandb_unreachable() -> Optional[str]:
    """Why W&B's server (its base URL: WANDB_BASE_URL, ``wandb login --host``, else W&B's
    default) cannot be reached from this host, or None when a TCP connection to it opens, or a
    proxy stands between (then wandb.init's own timeout decides)."""
    import socket

    import wandb

    settings = wandb.setup().settings  # W&B's own reading of its environment and files
    if any(os.environ.get(k) for k in _PROXY_ENV) or settings.https_proxy or \
            settings.http_proxy:
        return None
    url = urlsplit(str(settings.base_url))
    if not url.hostname:
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    where = f"{url.scheme}://{url.hostname}:{port}"
    try:
        socket.create_connection((url.hostname, port), timeout=WANDB_PROBE_TIMEOUT_S).close()
    except socket.gaierror as e:
        return f"{url.hostname} does not resolve: {e.strerror}"
    except socket.timeout:
        return f"{where} did not answer within {WANDB_PROBE_TIMEOUT_S:g}s"
    except OSError as e:
        return f"{where}: {e.strerror or e}"
    return None


def resolve_wandb_mode(mode: Optional[str]) -> str:
    if mode is not None:
        return mode
    return "online" if wandb_api_key_present() else "offline"


DEFAULT_WANDB_PROJECT = "llama_train"


def resolve_wandb_target(cfg: WandbConfig) -> Tuple[str, Optional[str]]:
    """(project, entity) of the W&B run: the config's where given, else ``WANDB_PROJECT`` /
    ``WANDB_ENTITY`` (how a W&B user sets them for every tool), else our project name and no
    entity (W&B's default: the API key's). Passed to wandb.init explicitly, so what the log
    says is what W&B got."""
    project = cfg.project or os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT
    return project, cfg.entity or os.environ.get("WANDB_ENTITY") or None


def offline_run_dirs(wandb_dir: Path, run_id: str) -> List[Path]:
    """Every offline directory W&B wrote for ``run_id`` under ``wandb_dir`` (``<dir>/wandb``),
    oldest first. Each start of the run (the first and every resume) adds one:
    ``offline-run-<YYYYMMDD_HHMMSS>-<id>``, with ``-1``, ``-2``... when two start in the same
    second. Matched by the ``run-<id>.wandb`` file inside, which names the run exactly."""
    dirs = [p.parent for p in Path(wandb_dir).glob(f"offline-run-*/run-{run_id}.wandb")]
    return sorted(dirs, key=lambda d: d.name)


def wandb_sync_command(dirs: List[Path]) -> str:
    """One ``wandb sync`` command for all of a run's offline directories (checked with wandb
    0.31: it takes several run directories and uploads those of one run in order of start
    time; ``--sync-all`` no longer exists)."""
    return "wandb sync " + " ".join(shlex.quote(str(Path(d).resolve())) for d in dirs)


# Names in the output dir that only the run itself writes there (checkpoint.RUN_FILES, the lock,
# the default W&B and TensorBoard directories): tracking.metrics_file may not be one of them.
RESERVED = ("config.yaml", "run_info.json", "sample.txt", ".lock", "wandb", "tensorboard")


def tracking_paths(cfg: TrackingConfig, output_dir: Any) -> Dict[str, Path]:
    """Where the tracker writes, by the key that puts it there: ``tracking.metrics_file``
    (default metrics.jsonl), ``tracking.tensorboard.dir`` (default tensorboard) and
    ``tracking.wandb.dir`` (default the output dir; W&B writes ``<dir>/wandb/``). Each is
    relative to trainer.output_dir (or absolute) and must resolve, through symlinks and
    ``..``, inside it and outside its checkpoints/ and archive/ (paths.run_path), whether or
    not its sink is enabled: ConfigError naming the key otherwise."""
    try:
        return _tracking_paths(cfg, output_dir)
    except PathRefused as e:
        raise ConfigError(str(e)) from None


def _tracking_paths(cfg: TrackingConfig, output_dir: Any) -> Dict[str, Path]:
    return {
        "tracking.metrics_file": run_path(output_dir, cfg.metrics_file, "tracking.metrics_file",
                                          "metrics.jsonl", reserved=RESERVED),
        "tracking.tensorboard.dir": run_path(output_dir, cfg.tensorboard.dir,
                                             "tracking.tensorboard.dir", "tensorboard",
                                             directory=True),
        "tracking.wandb.dir": run_path(output_dir, cfg.wandb.dir, "tracking.wandb.dir", ".",
                                       directory=True),
    }


def _number(v: Any) -> Optional[float]:
    """A value TensorBoard can plot (ints, floats, NaN included), else None. metrics.jsonl's
    "nan", "inf" and "-inf" (util.jsonable) count as the numbers they stand for."""
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class Tracker:
    """``log(step, metrics)`` appends a JSON line and forwards to W&B and TensorBoard; ``event``
    records checkpoints, resumes and rollbacks. Its state (the W&B run id, the file's length)
    travels in checkpoints."""

    # Whether this process was asked to stop (Ctrl-C, SIGTERM): Trainer.fit sets it. Stopping a
    # launched job takes W&B's service down with it, and that is no longer worth a warning.
    stopping: Callable[[], bool] = staticmethod(lambda: False)

    def __init__(self, cfg: TrackingConfig, output_dir: str, rank: int,
                 run_config: Optional[Dict[str, Any]] = None, lead: Optional[bool] = None):
        """``lead``: whether this process writes (default: rank 0; a simulated rank does)."""
        self.cfg = cfg
        self.enabled = rank == 0 if lead is None else lead
        self.output_dir = Path(output_dir)
        # each relative to output_dir and confined to it (checked in preflight, again in start)
        paths = tracking_paths(cfg, output_dir)
        self.metrics_path = paths["tracking.metrics_file"]
        self.run_config = run_config or {}
        self.run_id: Optional[str] = None
        self._wandb = None
        self.wandb_dir: Optional[Path] = None  # where W&B puts its run directories
        self.mode = resolve_wandb_mode(cfg.wandb.mode)
        self.offline_because: Optional[str] = None  # an online run W&B's server never saw
        self.lines = 0  # complete lines in metrics.jsonl
        self._resume_lines: Optional[int] = None
        self.tb_dir = paths["tracking.tensorboard.dir"]
        self.wandb_base = paths["tracking.wandb.dir"]  # W&B writes <this>/wandb/
        self._tb = None  # torch.utils.tensorboard.SummaryWriter on rank 0
        if cfg.tensorboard.enabled:  # every rank checks, so all of them stop together
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError as e:
                raise ConfigError(f"tracking.tensorboard.enabled=true needs the tensorboard "
                                  f"package ({e}); pip install tensorboard") from None

    # -- state carried in checkpoints -----------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"wandb_run_id": self.run_id, "metrics_lines": self.lines if self.enabled else None}

    def load_state_dict(self, state: Dict[str, Any], forked_from: Optional[str] = None) -> None:
        """The tracker's state from a checkpoint. ``forked_from``: the checkpoint belongs to
        another run (another output_dir), so this is a new run: a new W&B run whose config names
        the original's run id and the checkpoint, never the original's run."""
        if forked_from is None:
            self.run_id = state.get("wandb_run_id") or self.run_id
            self._resume_lines = state.get("metrics_lines")
            return
        self.run_config = {**self.run_config, "forked_from": {
            "wandb_run_id": state.get("wandb_run_id"), "checkpoint": forked_from}}
        self._resume_lines = None  # the other run's line count says nothing about this file

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, resume_step: Optional[int] = None, checkpoint: Optional[str] = None) -> None:
        """Open the sinks. On resume, cut the file back to what it held when the checkpoint was
        written (and that checkpoint's own event), so lines written after it by the run that
        died are replaced by the lines of the run that continues."""
        if not self.enabled:
            return
        tracking_paths(self.cfg, self.output_dir)  # a link planted since preflight: refused
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            if self.metrics_path.exists():
                self.metrics_path.unlink()  # a fresh run starts a fresh history
            self.lines = 0
        elif self._resume_lines is not None:
            self._cut(self._resume_lines, keep=lambda r: r.event == "checkpoint"
                      and r.get("path") == checkpoint, keep_first_only=True)
        else:  # a checkpoint from before line counts were saved: cut by step
            rows = self._read()
            self._write([line for line, r in rows if r is not None and r.step <= resume_step])
        if self.cfg.tensorboard.enabled:
            # fresh: hide whatever an earlier start left in the directory; resume: what the run
            # that died wrote after the checkpoint
            self._open_tensorboard(0 if resume_step is None else resume_step + 1)
        if self.mode != "disabled":
            self._start_wandb(resume=resume_step is not None)
        if self._wandb is not None or self._tb is not None:
            atexit.register(self._at_exit)  # an error before finish(): flush, say how to sync

    def rewind(self, lines: Optional[int], step: int) -> None:
        """After a rollback to a checkpoint: drop what was logged after it except event lines
        (the skipped steps, the spike, the rollback stay on record)."""
        if not self.enabled:
            return
        if lines is None:  # old checkpoint: fall back to steps
            rows = self._read()
            self._write([line for line, r in rows if r is not None
                         and (r.step <= step or r.event is not None)])
        else:
            self._cut(lines, keep=lambda r: r.event is not None)
        if self._tb is not None:
            self._open_tensorboard(step + 1)

    def _read(self) -> List[Tuple[str, Optional[Record]]]:
        """(line, its record) of every line; None for a line cut by a kill -9 (kept lines are
        written back as they were, byte for byte)."""
        if not self.metrics_path.exists():
            return []
        return [(line, parse_line(line)) for line in self.metrics_path.read_text().splitlines()]

    def _cut(self, lines: int, keep, keep_first_only: bool = False) -> None:
        rows = self._read()
        kept = [line for line, r in rows[:lines] if r is not None]
        for line, r in rows[lines:]:  # a background save's event comes steps after its step
            if r is not None and keep(r):
                kept.append(line)
                if keep_first_only:
                    break
        self._write(kept)

    def _write(self, lines) -> None:
        replace_file(self.metrics_path, "".join(k + "\n" for k in lines))  # never through a link
        self.lines = len(lines)

    def _open_tensorboard(self, purge_step: int) -> None:
        """A new event file whose first record tells TensorBoard to hide every earlier record
        at ``purge_step`` or later (SummaryWriter's ``purge_step``: a SessionLog.START). Then
        the events metrics.jsonl kept at those steps (a rollback's spike, skipped steps, the
        rollback itself) are written again, so TensorBoard shows what the file shows."""
        from torch.utils.tensorboard import SummaryWriter

        if self._tb is not None:
            self._tb.close()
        self.tb_dir.mkdir(parents=True, exist_ok=True)
        _after_newest_event_file(self.tb_dir)
        self._tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge_step)
        for _, r in self._read():
            if r is not None and r.event is not None and r.step >= purge_step:
                self._tb_event(r.step, r.event, r.fields, r.time)

    def _start_wandb(self, resume: bool) -> None:
        import wandb

        w = self.cfg.wandb
        if self.run_id is None:
            alphabet = string.ascii_lowercase + string.digits  # W&B's own id alphabet
            self.run_id = "".join(secrets.choice(alphabet) for _ in range(8))
        wandb_dir = self.wandb_base
        wandb_dir.mkdir(parents=True, exist_ok=True)
        project, entity = resolve_wandb_target(w)

        def init(mode: str, **settings: Any):
            return wandb.init(
                project=project,
                entity=entity,
                name=w.name,
                group=w.group,
                tags=list(w.tags) or None,
                dir=str(wandb_dir),
                id=self.run_id,
                resume="allow",
                mode=mode,
                config=self.run_config,
                settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                        **settings),
            )

        unreachable = wandb_unreachable() if self.mode == "online" else None
        if self.mode == "online" and unreachable is None:
            timeout = wandb_init_timeout()
            try:
                self._wandb = init("online", init_timeout=timeout)
            except wandb.errors.Error as e:  # CommError after init_timeout, a refused key, ...
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                unreachable = (f"wandb.init failed within {timeout:g}s (WANDB_INIT_TIMEOUT): "
                               f"{type(e).__name__}: {first[:300]}")
                # W&B's service still holds the run id of the attempt: a fresh service for
                # the offline run ("run ID ... is in use" otherwise)
                wandb.teardown()
        if unreachable is not None:
            # No network on a compute node is common: train on, log offline, upload later
            self.offline_because = unreachable
            log.warning(
                "wandb: cannot log online (%s): this run logs to W&B offline instead, and its "
                "end prints the `wandb sync` command that uploads it; "
                "tracking.wandb.mode=offline skips the attempt, =disabled turns W&B off",
                unreachable)
            self.mode = "offline"
        if self._wandb is None:
            self._wandb = init(self.mode)
        try:  # W&B's own choice (<dir>/wandb, or <dir>/.wandb where that exists)
            self.wandb_dir = Path(self._wandb.settings.wandb_dir)
        except (AttributeError, TypeError):
            self.wandb_dir = wandb_dir / "wandb"
        # Our step can repeat (resume, rollback); W&B's own must grow: plot against "step".
        self._wandb.define_metric("step")
        self._wandb.define_metric("*", step_metric="step")
        log.info("wandb: run %s (%s, project %s%s) in %s", self.run_id, self.mode, project,
                 f", entity {entity}" if entity else "", wandb_dir)

    # -- logging ---------------------------------------------------------------------------
    def _append(self, record: Record) -> None:
        # O_NOFOLLOW: a link planted at the file's name fails the write, never is followed
        try:
            fd = os.open(self.metrics_path,
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise ConfigError(
                f"{self.metrics_path} (tracking.metrics_file) became a symlink to "
                f"{os.readlink(self.metrics_path)} while the run wrote it: nothing was written "
                f"through it. Remove the link and relaunch: the run resumes from its last "
                f"checkpoint.") from None
        with os.fdopen(fd, "a") as f:
            f.write(record.to_line())
            f.flush()
        self.lines += 1

    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        now = time.time()
        if EVENT in metrics:  # an event's line only, as event() writes it (which sends the counters)
            fields = {k: v for k, v in metrics.items() if k != EVENT}
            self._append(EventRecord.new(step, metrics[EVENT], fields, now))
            return
        self._append(StepRecord.new(step, metrics, now))
        # a dict of numbers (mixture_tokens: {source: tokens}) goes to the dashboards as
        # one series per key, <name>/<key>
        metrics = {**{k: v for k, v in metrics.items() if not isinstance(v, dict)},
                   **{f"{k}/{kk}": vv for k, v in metrics.items() if isinstance(v, dict)
                      for kk, vv in v.items()}}
        if self._wandb is not None:
            self._to_wandb({"step": step, **{k: v for k, v in metrics.items()
                                             if isinstance(v, (int, float))}})
        if self._tb is not None:
            for k, v in metrics.items():
                x = _number(v)
                if x is not None:
                    self._tb.add_scalar(k, x, step, walltime=now)

    def event(self, step: int, name: str, **fields: Any) -> None:
        if not self.enabled:
            return
        self._append(EventRecord.new(step, name, fields, time.time()))
        if self._wandb is not None:  # a counter per event kind, its numeric fields beside it
            self._to_wandb({"step": step, f"event/{name}": 1,
                            **{f"event/{name}/{k}": v for k, v in fields.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}})
        if self._tb is not None:
            self._tb_event(step, name, fields, None)
            if name == "checkpoint":
                self._tb.flush()  # on disk with the checkpoint: a resume purges only later steps
        log.info("[step %d] %s %s", step, name, fields or "")

    def _tb_event(self, step: int, name: str, fields: Dict[str, Any],
                  walltime: Optional[float]) -> None:
        """The same tags as W&B's: ``event/<name>`` = 1 and ``event/<name>/<field>``."""
        self._tb.add_scalar(f"event/{name}", 1.0, step, walltime=walltime)
        for k, v in fields.items():
            x = _number(v)
            if x is not None:
                self._tb.add_scalar(f"event/{name}/{k}", x, step, walltime=walltime)

    # -- the end ---------------------------------------------------------------------------
    def sync_hint(self) -> Optional[str]:
        """For an offline W&B run: which directories hold it and the one command that uploads
        them all (None for online or disabled runs, or when no directory is found)."""
        if self.mode != "offline" or self.run_id is None or self.wandb_dir is None:
            return None
        dirs = offline_run_dirs(self.wandb_dir, self.run_id)
        if not dirs:
            return None
        why = ("tracking.wandb.mode=offline" if self.cfg.wandb.mode == "offline"
               else f"it could not log online at start: {self.offline_because}"
               if self.offline_because else "no W&B API key was found")
        many = (f"{len(dirs)} directories, one per start of the run (each resume adds one); "
                f"wandb sync uploads them in order into the one run"
                if len(dirs) > 1 else "1 directory; each resume adds another")
        return (f"wandb: run {self.run_id} was logged offline ({why}): {many}. Upload it "
                f"(network access and a W&B API key needed) with:\n  {wandb_sync_command(dirs)}")

    def finish(self) -> None:
        """Close the sinks. An offline W&B run ends by saying how to upload it."""
        atexit.unregister(self._at_exit)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            try:
                run.finish()
            except _service_errors() as e:
                self._service_lost(e)
                return
            hint = self.sync_hint()
            if hint:
                log.info(hint)

    def _to_wandb(self, data: Dict[str, Any]) -> None:
        try:
            self._wandb.log(data)
        except _service_errors() as e:
            self._wandb = None
            self._service_lost(e)

    def _service_lost(self, e: BaseException) -> None:
        """W&B's service process died under us. The deepspeed launcher, stopping a job on
        Ctrl-C or SIGTERM, sends SIGTERM to every process under each rank, W&B's service too,
        while the rank itself finishes its step and saves. Training must not fail for it:
        one line, and W&B's own exit hook is disarmed so it prints no traceback."""
        import wandb

        try:
            wandb.teardown()  # unregisters W&B's exit hook first, then fails to reach the service
        except _service_errors():
            pass
        hint = self.sync_hint()
        if self.stopping():
            # Ctrl-C or SIGTERM under the deepspeed launcher: it SIGTERMs every process under
            # each rank, W&B's service too, as the rank saves. What W&B wrote is on disk: the
            # upload command, as at the end of any offline run, instead of a warning.
            log.info("%s", hint or f"wandb: run {self.run_id} stopped with the job before W&B "
                     f"could finish it; `wandb sync {self.wandb_dir}/run-*-{self.run_id}` "
                     f"uploads what did not reach W&B")
            return
        where = hint or (f"its local files in {self.wandb_dir} can be uploaded "
                         f"with `wandb sync`" if self.wandb_dir else "")
        log.warning("wandb: its service process is gone (%s: %s): W&B logging stops here; "
                    "metrics.jsonl keeps every step. %s", type(e).__name__, e, where)

    def _at_exit(self) -> None:
        """The process ends without finish() (an error): keep what TensorBoard buffered and
        print the sync command. W&B's own exit hook, which runs after this one, closes its run."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            hint = self.sync_hint()
            if hint:
                log.warning("the run stopped before its end; what it logged so far: %s", hint)


def _service_errors() -> tuple:
    """What W&B raises when its service process is gone: the broken socket (an OSError such as
    ConnectionResetError), or one of its own errors."""
    import wandb.errors

    return (OSError, wandb.errors.Error)


def _after_newest_event_file(d: Path) -> None:
    """TensorBoard reads a directory's event files in name order, and a name starts with its
    creation second: a file created in the same second as the previous one could sort before
    it (its purge would then come first). Waits (< 1 s, rarely: rollbacks) for the next second."""
    newest = 0
    for p in d.glob("events.out.tfevents.*"):
        try:
            newest = max(newest, int(p.name.split(".")[3]))
        except (IndexError, ValueError):
            continue
    now = time.time()
    if int(now) == newest:
        time.sleep(newest + 1 - now + 0.01)
