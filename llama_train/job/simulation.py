"""A simulated rank (``comm.simulate_ranks=N``): what one rank of an N-rank job allocates and
how long its phases take, measured on the real code path in one process, beside the planner.

The trainer runs as usual on a :class:`~llama_train.comm.simulate.MirrorGroup`; this module
measures it: each phase's peak memory and wall time (:class:`llama_train.metrics.meter.PeakMeter`:
VmHWM on CPU, the CUDA allocator's peaks on a GPU) for build, initialize, the forward,
backward and optimizer step of the first ``MEASURED_STEPS`` steps, the checkpoint save and a
load of it; the checkpoint's bytes of this rank and of rank 0; the time from the command to the
end of the first step. Beside each phase: the planner's prediction for the same settings
(:func:`llama_train.scaling.memory.rank_peak_memory`, what ``llama-plan model-info`` prints).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from llama_train.bounds import SIMULATE_MAX_RANKS as MAX_RANKS  # (why: there)
from llama_train.metrics.meter import PeakMeter, process_age_s

log = logging.getLogger("llama_train")

MEASURED_STEPS = 3  # the first steps measured phase by phase (step 1 allocates AdamW's state)

# measured phase -> the planner's phases it is compared with (the largest of them)
PLANNED = {"build": ("build",), "initialize": ("initialize",), "forward": ("forward",),
           "backward": ("backward", "backward end"), "step": ("step", "all-gather"),
           "save": ("save",), "load": ("load",)}


def start_warning(world: int, rank: int) -> str:
    """What a simulated run says first."""
    return (f"comm.simulate_ranks={world}: this process runs rank {rank} of a {world}-rank job "
            f"alone. Collectives are answered as if every other rank held what this one holds: "
            f"memory, partition sizes, phase times and the checkpoint shard are this rank's, but "
            f"loss, val_loss and grad_norm are not the job's (recorded as rank_loss and "
            f"rank_val_loss). Switched off: W&B, rollbacks on bad steps, the hang watchdog, "
            f"the text sample.")


class Simulation:
    """The measurements of one simulated rank; :meth:`report` gathers them."""

    def __init__(self, rt, cfg, model_args, plan, precision: str, layout):
        from llama_train import engine as eng

        self.rt, self.cfg, self.model_args, self.plan = rt, cfg, model_args, plan
        self.layout = layout  # the plan's (plan.plan_job): the planner is asked for its world
        self.precision = precision
        ds = cfg.deepspeed
        eng.warm_up(ds.offload_optimizer or ds.offload_params)  # not in the idle baseline
        self.meter = PeakMeter(rt.device)
        self.steps_done = 0
        self.first_step = 0  # the step the run starts from (a resume's)
        self.training = True
        self.to_first_step_s: Optional[float] = None
        self.checkpoint: Optional[Dict[str, Any]] = None
        from llama_train.comm import counting

        self.traffic = counting.start()  # what MirrorGroup is asked, from here on

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.meter.start()
        yield
        self.meter.stop(name)

    def step_phase(self, what: str):
        """A forward, backward or optimizer step: measured during the first steps' training."""
        if not self.training or self.steps_done >= MEASURED_STEPS:
            return contextlib.nullcontext()
        return self.phase(f"step{self.first_step + self.steps_done + 1} {what}")

    def step_done(self) -> None:
        self.steps_done += 1
        if self.steps_done == 1:
            self.to_first_step_s = process_age_s()

    def saved(self, ckpt: Path) -> None:
        """The first checkpoint's bytes: this rank's own files, and rank 0's (which a real job
        writes once, whatever N)."""
        if self.checkpoint is not None:
            return
        mine = (f"zero_pp_rank_{self.rt.rank}_", f"rank_{self.rt.rank:05d}.pt")
        own = rank0 = 0
        for f in Path(ckpt).rglob("*"):
            if f.is_file():
                size = f.stat().st_size
                if any(m in f.name for m in mine):
                    own += size
                else:
                    rank0 += size
        self.checkpoint = {"path": str(ckpt), "rank_bytes": own, "rank0_bytes": rank0,
                           "job_bytes": self.rt.world_size * own + rank0}

    # -- the report --------------------------------------------------------------------------
    def report(self) -> Dict[str, Any]:
        peak = self.meter.report()
        # CUDA: the peak is max_memory_allocated above idle; the caching allocator's
        # max_memory_reserved above idle (what the device must really have) beside it
        cuda = self.meter.cuda
        measured = [{"phase": name, "peak_bytes": m[self.meter.key],
                     "seconds": m["seconds"] / m.get("count", 1),
                     **({"reserved_bytes": m["max_reserved_above_idle"],
                         "max_allocated": m["max_allocated"], "max_reserved": m["max_reserved"]}
                        if cuda else {})}
                    for name, m in self.meter.phases.items()]
        idle = self.meter.idle
        report = {"ranks": self.rt.world_size, "rank": self.rt.rank,
                  "device": self.rt.device_type, "measure": peak["measure"],
                  "idle_bytes": idle["allocated"] if cuda else idle["rss"],
                  **({"idle_reserved_bytes": idle["reserved"], "peak_reserved_bytes":
                      max(r["reserved_bytes"] for r in measured)} if cuda else {}),
                  "phases": measured,
                  "peak_bytes": peak["peak_above_idle"], "peak_phase": peak["peak_phase"],
                  "checkpoint": self.checkpoint, "first_step": self.first_step + 1,
                  "command_to_first_step_s": self.to_first_step_s}
        report["traffic"] = traffic_beside_the_plan(self.traffic.to_dict(), self.cfg,
                                                    self.model_args, self.plan, self.precision,
                                                    self.layout)
        return beside_the_plan(report, self.cfg, self.model_args, self.plan, self.precision,
                               self.layout)


def planned(cfg, model_args, plan, precision: str, layout, device: str,
            gloo_copies: Optional[bool] = False) -> Dict[str, Any]:
    """The planner's phases for one rank of ``layout`` (the plan's ParallelLayout, from
    plan.plan_job) in bytes, or {"error": why} where it has none. A simulated rank's collectives
    are answered in place and copy nothing, so gloo's own copies are not counted by default
    (None: counted on CPU, as for a real rank there)."""
    from llama_train.scaling.memory import rank_peak_memory

    ds = cfg.deepspeed
    try:
        return rank_peak_memory(
            model_args, zero_stage=ds.zero_stage, world_size=layout.world, dtype=precision,
            micro_batch=plan.micro_batch, seq_len=plan.seq_len,
            offload_optimizer=ds.offload_optimizer, offload_params=ds.offload_params,
            device=device, ds=ds, gloo_copies=gloo_copies,
            sequence_parallel=layout.sequence_parallel)
    except ValueError as e:  # ScalingError: settings the planner does not model
        return {"error": str(e)}


def planned_traffic(cfg, model_args, plan, precision: str, layout) -> Dict[str, Any]:
    """:func:`llama_train.scaling.traffic.planned_traffic` for this run's settings (what a rank
    of ``layout``, the plan's ParallelLayout, should send per step), or {"error": why} where it
    has no figure."""
    from llama_train.scaling.traffic import planned_traffic as plan_traffic

    try:
        return plan_traffic(model_args, world_size=layout.world, zero_stage=cfg.deepspeed.zero_stage,
                            dtype=precision, grad_accum=plan.grad_accum,
                            micro_batch=plan.micro_batch, seq_len=plan.seq_len,
                            sequence_parallel=layout.sequence_parallel, ds=cfg.deepspeed,
                            decay_embeddings=cfg.optim.decay_embeddings,
                            decay_norms_and_biases=cfg.optim.decay_norms_and_biases)
    except ValueError as e:  # ScalingError: settings the planner does not model
        return {"error": str(e)}


def traffic_beside_the_plan(counted: Dict[str, Any], cfg, model_args, plan, precision: str,
                            layout) -> Dict[str, Any]:
    """One step's counted collectives (:func:`llama_train.comm.counting.step_summary`) beside the
    planner's: bytes per kind, and per (phase, kind, group size) whether they are equal."""
    from llama_train.comm.counting import step_summary
    from llama_train.scaling.traffic import by_key

    step = step_summary(counted)
    p = planned_traffic(cfg, model_args, plan, precision, layout)
    want = by_key(p.get("collectives", []))
    got = by_key(step["rows"])
    return {"step": step["step"], "all_steps_equal": step["all_steps_equal"],
            "bytes_per_kind": step["bytes_per_kind"],
            "planned_bytes_per_kind": p.get("bytes_per_kind"),
            "bytes_per_kind_by_step": step.get("bytes_per_kind_by_step"),
            "rows": step["rows"], "planned_rows": p.get("collectives"),
            "equal": bool(want) and want == got, "planner_error": p.get("error")}


def _not_yet(planned: Dict[str, Any], phase: str, zero_stage: int) -> float:
    """What the planner's ``phase`` holds that a fresh run's step 1 does not have yet. Under
    ZeRO-3 DeepSpeed allocates the Adam moments in the first optimizer step (measured:
    llama3_8b at 64 ranks, step 1's backward 0.98 GiB below step 2's), so step 1's forward and
    backward lack them; and its step flattens each gradient partition to 16 bits and converts
    it to fp32 before the moments exist (the 16-bit copy is gone when they are made), so the
    step's peak lacks that copy (measured: 2.32 GiB against 2.60 in step 2)."""
    if zero_stage != 3:
        return 0.0
    terms = planned["phase_terms"].get(phase, {})
    if phase in ("forward", "backward", "backward end"):
        return terms.get("moments", 0.0)
    if phase == "step":
        g = {"fp32": 4.0}.get(planned["dtype"], 2.0)
        return terms.get("step: flat + fp32 grads", 0.0) * g / (g + 4.0)
    return 0.0


def beside_the_plan(report: Dict[str, Any], cfg, model_args, plan, precision: str,
                    layout) -> Dict[str, Any]:
    """``report`` (measured phases) with the planner's figure and the ratio beside each phase,
    and the planner's peak (for ``layout``, the plan's: report["ranks"] ranks)."""
    p = planned(cfg, model_args, plan, precision, layout, report["device"])
    phases = {**p.get("phases", {}), **p.get("checkpoint_phases", {})}
    rows = []
    for row in report["phases"]:
        name = row["phase"]
        figures = [phases[k] - (_not_yet(p, k, cfg.deepspeed.zero_stage)
                                if name.startswith("step1 ") else 0.0)
                   for k in PLANNED.get(name.split(" ")[-1], ()) if k in phases]
        want = max(figures) if figures else None
        rows.append({**row, "planned_bytes": want,
                     "ratio": row["peak_bytes"] / want if want else None})
    return {**report, "phases": rows, "planned_peak_bytes": p.get("total"),
            "planned_peak_phase": p.get("peak_phase"), "planner_error": p.get("error")}


def replan(output_dir: str) -> Dict[str, Any]:
    """A finished simulated run's report (its run_info.json) beside the planner as it is now:
    after a change to the planner, the measurements need not be taken again."""
    import json

    from omegaconf import OmegaConf

    from llama_train.config import Config, load_config
    from llama_train.engine import Runtime
    from llama_train.errors import BadInput
    from llama_train.job.plan import plan_job
    from llama_train.records import RUN_INFO_FILE

    out = Path(output_dir)
    report = json.loads((out / RUN_INFO_FILE).read_text()).get("simulation")
    if not report:
        raise BadInput(f"{out / RUN_INFO_FILE} holds no simulation report: not a finished "
                       f"comm.simulate_ranks run")
    cfg = load_config(OmegaConf.merge(OmegaConf.structured(Config),
                                      OmegaConf.load(out / "config.yaml")))
    from llama_train.engine import resolve_precision

    precision = resolve_precision(cfg.deepspeed, report["device"])
    # the layout and batch the run had (plan_job's "layout" scope: its config is not judged
    # again, a check added since would refuse what the planner still has figures for)
    rt = Runtime(report["device"], report["rank"], 0, report["ranks"], 1, simulated=True)
    job = plan_job(cfg, rt, scope="layout")
    return beside_the_plan(report, cfg, cfg.model, job.batch, precision, job.layout)


def format_table(r: Dict[str, Any]) -> str:
    """The report as the table printed at the end of a simulated run."""
    gib = 2 ** 30

    def size(b: Optional[float]) -> str:
        return f"{'-':>9}" if b is None else f"{b / gib:9.3f}"

    cuda = "peak_reserved_bytes" in r  # a CUDA rank: the allocator's reserve beside the peak
    measure = (f"{r['measure']} above idle; reserved = torch.cuda.max_memory_reserved above "
               f"idle" if cuda else r["measure"])
    lines = [f"simulated rank {r['rank']} of {r['ranks']} on {r['device']} "
             f"(peak = {measure}, GiB):",
             f"  {'phase':<18} {'peak':>9} {'planned':>9} {'ratio':>6} {'seconds':>9}"
             + (f" {'reserved':>9}" if cuda else "")]
    for row in r["phases"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:6.2f}"
        lines.append(f"  {row['phase']:<18} {size(row['peak_bytes'])} "
                     f"{size(row['planned_bytes'])} {ratio:>6} {row['seconds']:9.2f}"
                     + (f" {size(row.get('reserved_bytes'))}" if cuda else ""))
    planned = r["planned_peak_bytes"]
    ratio = f"{r['peak_bytes'] / planned:6.2f}" if planned else "-"
    lines.append(f"  {'peak (' + r['peak_phase'] + ')':<18} {size(r['peak_bytes'])} "
                 f"{size(planned)} {ratio:>6}"
                 + (f" {'':9} {size(r['peak_reserved_bytes'])}" if cuda else ""))
    if r["planner_error"]:
        lines.append(f"  the planner has no figure: {r['planner_error']}")
    c = r["checkpoint"]
    if c:
        lines.append(f"  checkpoint: this rank's files {c['rank_bytes'] / 2**20:.1f} MiB, rank 0's "
                     f"{c['rank0_bytes'] / 2**20:.1f} MiB; the job's ~{c['job_bytes'] / gib:.2f} GiB")
    t = r.get("traffic")
    if t and t.get("step") is not None:
        lines.append(f"  traffic of step {t['step']} (MB sent by collectives, bytes of the "
                     f"whole buffer; planned by scaling.traffic):")
        want = t.get("planned_bytes_per_kind") or {}
        for kind in sorted(set(t["bytes_per_kind"]) | set(want)):
            got, plan = t["bytes_per_kind"].get(kind), want.get(kind)
            lines.append(f"    {kind:<15} {'-' if got is None else f'{got / 1e6:12.6f}':>12} "
                         f"{'-' if plan is None else f'{plan / 1e6:12.6f}':>12}"
                         f"{'' if got == plan else '  (differs)'}")
        lines.append(f"    per phase, kind and group: "
                     f"{'equal to the plan' if t['equal'] else 'NOT equal to the plan'}"
                     + ("" if t["all_steps_equal"] else "; the steps after the second differ"))
        if t.get("planner_error"):
            lines.append(f"    the planner has no figure: {t['planner_error']}")
    if r["command_to_first_step_s"] is not None:
        lines.append(f"  from the command to the end of step {r['first_step']}: "
                     f"{r['command_to_first_step_s']:.1f} s")
    return "\n".join(lines)


class MeteredEngine:
    """The engine as the loop sees it, with the first steps' forward, backward and optimizer
    step measured (a simulated rank's ``sim``), and the phase each collective belongs to told
    to the traffic counter (``traffic``: :mod:`llama_train.comm.counting`); everything else
    passes through."""

    def __init__(self, engine, sim: Optional[Simulation], traffic=None):
        self._engine, self._sim, self._traffic = engine, sim, traffic

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def _measured(self, what: str):
        return self._sim.step_phase(what) if self._sim is not None else contextlib.nullcontext()

    def _phase(self, name: str) -> None:
        if self._traffic is not None and self._traffic.phase != "eval":
            self._traffic.set_phase(name)

    def __call__(self, x, y, **kwargs):
        self._phase("forward")
        with self._measured("forward"):
            return self._engine(x, y, **kwargs)

    def backward(self, loss) -> None:
        self._phase("backward")
        with self._measured("backward"):
            self._engine.backward(loss)
        self._phase("step")  # the loss all-reduce after the last backward belongs to the step

    def micro_step(self) -> None:
        self._phase("backward")  # DeepSpeed's step between micro-batches (ZeRO-2 reduces here)
        self._engine.micro_step()

    def step(self, nonfinite_loss: bool = False):
        self._phase("step")
        with self._measured("step"):
            result = self._engine.step(nonfinite_loss)
        if self._sim is not None:
            self._sim.step_done()
        if self._traffic is not None:
            self._traffic.step_done()
        return result

    def train(self) -> None:
        if self._sim is not None:
            self._sim.training = True
        if self._traffic is not None:
            self._traffic.set_phase("other")
        self._engine.train()

    def eval(self) -> None:
        if self._sim is not None:
            self._sim.training = False
        if self._traffic is not None:
            self._traffic.set_phase("eval")
        self._engine.eval()


def metered(engine, sim: Optional[Simulation], output_dir: str, rank: int):
    """The engine the loop drives: :class:`MeteredEngine` around it when this rank is simulated
    or counts its traffic (``comm.count_traffic``: the counts written to
    :func:`llama_train.comm.counting.traffic_file` after each step), else the engine itself."""
    from llama_train.comm import counting

    traffic = counting.active()
    if sim is None and traffic is None:
        return engine
    if traffic is not None and sim is None:
        traffic.path = counting.traffic_file(output_dir, rank)
    return MeteredEngine(engine, sim, traffic)


class NoSimulation:
    """A real run's answer at each point of the loop where a simulated rank
    (:class:`SimulationReport`) measures, renames or reports: nothing; the loop calls either
    alike (:func:`simulation_of`)."""

    own_share = 1.0  # of each step's tokens, for MFU: all of them
    loss_label = "loss"  # the console's step line
    val_prefix = ""  # the console's evaluation line
    mfu_note = ""  # the start-up line's MFU
    summarizes = True  # the end-of-run account

    def phase(self, name: str):
        return contextlib.nullcontext()

    def metrics(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        return metrics

    def saved(self, ckpt: Path) -> None:
        pass

    def resumed(self, step: int) -> None:
        pass

    def final_val_loss(self, val_loss: Optional[float]) -> Optional[float]:
        return val_loss

    def checkpoint_entry(self) -> Optional[Dict[str, int]]:
        """What a checkpoint says of the rank that saved it (trainer_state.json's
        ``simulated``): nothing, a real rank's checkpoint is the job's."""
        return None

    def report(self, restore, last_good: Optional[Path]) -> Optional[Dict[str, Any]]:
        return None


class SimulationReport(NoSimulation):
    """A simulated rank (``comm.simulate_ranks``) at the loop's points: its phases measured
    (:class:`Simulation`), its losses recorded as its own (:func:`rename_losses`), MFU of its
    share of the tokens, no end-of-run account, and the report at the end."""

    loss_label = "rank_loss (simulated)"
    val_prefix = "(simulated) rank_"
    summarizes = False

    def __init__(self, sim: Simulation):
        self.sim = sim
        world = sim.rt.world_size
        self.own_share = 1 / world
        self.mfu_note = (f" of this simulated rank (its 1/{world} of each step's tokens; "
                         f"tok/s counts the job's tokens at its pace, collectives local) on one "
                         f"device")

    def phase(self, name: str):
        return self.sim.phase(name)

    def metrics(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        return rename_losses(metrics)  # one rank's loss, not the job's

    def saved(self, ckpt: Path) -> None:
        self.sim.saved(ckpt)

    def resumed(self, step: int) -> None:
        self.sim.first_step = step

    def final_val_loss(self, val_loss: Optional[float]) -> Optional[float]:
        return None  # not the job's

    def checkpoint_entry(self) -> Optional[Dict[str, int]]:
        """A simulated rank's checkpoint holds its shard only: it says so, and of which job."""
        return {"ranks": self.sim.rt.world_size, "rank": self.sim.rt.rank}

    def report(self, restore, last_good: Optional[Path]) -> Optional[Dict[str, Any]]:
        """The report: the saved checkpoint (``last_good``) is loaded back first (``restore``)
        if no resume loaded one, so the load is measured too and proven to work."""
        if "load" not in self.sim.meter.phases and last_good is not None:
            restore(last_good)
        report = self.sim.report()
        log.info("%s", format_table(report))
        return report


def simulation_of(sim: Optional[Simulation]) -> NoSimulation:
    """The loop's simulation component: :class:`SimulationReport` for a simulated rank's
    ``sim``, else :class:`NoSimulation`."""
    return SimulationReport(sim) if sim is not None else NoSimulation()


def rename_losses(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """A simulated rank's losses are its own, not the job's: recorded under other names, so
    nothing that reads ``loss`` or ``val_loss`` takes them for the job's."""
    return {(f"rank_{k}" if k in ("loss", "val_loss", "val_ppl") or k.startswith("val_loss/")
             else k): v for k, v in metrics.items()}


def runs_in(output_dir: str) -> Dict[str, List[str]]:
    """Who wrote what an output dir holds, from its files: ``{"real": [...], "simulated":
    [...]}``, each a list of the names that tell (a checkpoint's trainer_state.json has
    ``simulated`` for a simulated rank's; config.yaml has comm.simulate_ranks). A file that
    cannot be read tells nothing (the resume's own checks name it)."""
    import json

    import yaml

    out, found = Path(output_dir), {"real": [], "simulated": []}
    ckpts = out / "checkpoints"
    for p in sorted(ckpts.iterdir()) if ckpts.is_dir() else ():
        # a save's name (checkpoint.step_of), a real directory
        if not (p.name.startswith("step_") and p.name[5:].isdigit()) or p.is_symlink():
            continue
        try:
            state = json.loads((p / "trainer_state.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict):
            found["simulated" if state.get("simulated") else "real"].append(f"checkpoints/{p.name}")
    try:
        saved = yaml.safe_load((out / "config.yaml").read_text())
        comm = saved.get("comm") or {}
        found["simulated" if comm.get("simulate_ranks") else "real"].append(
            "config.yaml" + (f" (simulated rank {comm.get('simulate_rank', 0)} of "
                              f"{comm['simulate_ranks']})" if comm.get("simulate_ranks") else ""))
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        pass
    return found


def check_output_dir(cfg, simulated: bool) -> None:
    """A simulated rank and a real job never share an output dir (issue 54). A simulation
    refuses a directory that holds a real run: it would add its one-rank checkpoint and replace
    the run's config.yaml, metrics and run_info.json, after which the real relaunch was refused.
    A real job refuses one that holds only a simulation's files, unless it sets them aside
    (trainer.resume=never with trainer.on_existing=archive or overwrite); a simulation's
    checkpoints are refused by the resume check (llama_train.job.resume), which names them. From
    files, on every rank, before anything is written. ConfigError naming the fix."""
    from llama_train.config import ConfigError

    t = cfg.trainer
    found = runs_in(t.output_dir)
    if simulated and found["real"]:
        raise ConfigError(
            f"comm.simulate_ranks={cfg.comm.simulate_ranks}: trainer.output_dir={t.output_dir!r} "
            f"holds a real run ({', '.join(found['real'][-3:])}): a simulated rank never writes "
            f"into a real run's directory (it would add a one-rank checkpoint and replace the "
            f"run's config.yaml, metrics and run_info.json). Give the simulation its own "
            f"trainer.output_dir. Nothing was changed.")
    sim_ckpts = any(n.startswith("checkpoints/") for n in found["simulated"])
    setting_aside = t.resume == "never" and t.on_existing != "refuse"
    if (not simulated and found["simulated"] and not found["real"] and not sim_ckpts
            and not setting_aside):
        raise ConfigError(
            f"trainer.output_dir={t.output_dir!r} holds a simulated rank's run "
            f"({', '.join(found['simulated'])}): a real job never continues or replaces a "
            f"simulation's files. Give the real job its own trainer.output_dir, or set the "
            f"simulation aside with trainer.resume=never trainer.on_existing=archive. Nothing "
            f"was changed.")


if __name__ == "__main__":  # python -m llama_train.job.simulation OUTPUT_DIR
    import sys

    print(format_table(replan(sys.argv[1])))
