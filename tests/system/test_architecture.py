"""The map against the territory (docs/architecture.md): who imports whom inside llama_train/,
and the files other programs read (llama_train.records) keeping their format.

The import graph is read from the source (AST; no module is imported, no process started):
every ``import`` and ``from ... import``, at module level and inside functions alike (an import
inside a function is still a dependency, only a later one), relative imports resolved, ``from
pkg import name`` counted as an import of ``pkg.name`` when that is a module.
"""

from __future__ import annotations

import ast
import json
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Set

import pytest

# tests/system/ -> the repo (not helpers.REPO: this file imports nothing of the package)
PACKAGE = Path(__file__).resolve().parents[2] / "llama_train"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

# Import cycles between modules of files this change could not touch (name sets of a strongly
# connected component). Each entry is a known debt: fix the cycle and delete it here.
ALLOWED_CYCLES_TODO: Set[FrozenSet[str]] = set()


@dataclass
class Module:
    name: str
    path: Path
    internal: Set[str] = field(default_factory=set)  # llama_train modules it imports
    external: Set[str] = field(default_factory=set)  # every other dotted name it imports


def _module_name(path: Path) -> tuple:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _imported_names(tree: ast.AST, name: str, is_pkg: bool) -> Set[str]:
    """Every dotted name ``tree`` imports, absolute; ``from m import x`` gives m and m.x."""
    here = name.split(".") if is_pkg else name.split(".")[:-1]  # the package `.` refers to
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
    return out


def build_graph() -> Dict[str, Module]:
    files = sorted(PACKAGE.rglob("*.py"))
    mods: Dict[str, Module] = {}
    for path in files:
        name, _ = _module_name(path)
        mods.setdefault(name, Module(name, path))  # x.py beside x/ (in the middle of a move): one
    for path in files:
        name, is_pkg = _module_name(path)
        for dotted in _imported_names(ast.parse(path.read_text(), str(path)), name, is_pkg):
            parts = dotted.split(".")
            while parts and ".".join(parts) not in mods:  # the longest prefix that is a module
                parts.pop()
            target = ".".join(parts)
            if target and dotted.split(".")[0] == "llama_train":
                if target != name:
                    mods[name].internal.add(target)
            else:
                mods[name].external.add(dotted)
    return mods


def strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's components with more than one node (each one holds at least one cycle)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def a_cycle(graph: Dict[str, Set[str]], comp: List[str]) -> List[str]:
    """The shortest cycle through the first node of ``comp``: a path that ends where it starts."""
    start, inside = comp[0], set(comp)
    prev: Dict[str, Optional[str]] = {start: None}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for w in sorted(graph[v] & inside):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return path[::-1] + [start]
            if w not in prev:
                prev[w] = v
                todo.append(w)
    return comp + comp[:1]


def component(module: str) -> str:
    """What a cycle between packages is counted on: llama_train.<x> (a subpackage or a module)."""
    return ".".join(module.split(".")[:2])


def describe(graph: Dict[str, Set[str]], comps: List[List[str]]) -> str:
    return "\n".join("  " + " -> ".join(a_cycle(graph, c)) + f"   (component: {', '.join(c)})"
                     for c in comps)


@pytest.fixture(scope="module")
def mods() -> Dict[str, Module]:
    return build_graph()


def test_graph_sees_the_imports(mods):
    """The reader itself: relative imports resolve, function-level imports count."""
    assert "llama_train.model" in mods and "llama_train.data.loader" in mods
    assert "llama_train.util" in mods["llama_train.data.loader"].internal  # absolute, module level
    assert "llama_train.data.packed" in mods["llama_train.data.loader"].internal  # relative
    assert "torch" in mods["llama_train.model.transformer"].external
    # the model package's lazy half: an import inside its module __getattr__
    assert "llama_train.model.transformer" in mods["llama_train.model"].internal
    assert "llama_train.paths" in mods["llama_train.model.args"].internal  # inside list_presets()


def test_no_import_cycles_between_modules(mods):
    graph = {n: m.internal for n, m in mods.items()}
    comps = strongly_connected(graph)
    new = [c for c in comps if frozenset(c) not in ALLOWED_CYCLES_TODO]
    assert not new, "import cycles between modules of llama_train/:\n" + describe(graph, new)
    stale = ALLOWED_CYCLES_TODO - {frozenset(c) for c in comps}
    assert not stale, f"ALLOWED_CYCLES_TODO lists cycles that are gone: remove {sorted(map(sorted, stale))}"


def test_no_import_cycles_between_packages(mods):
    """Subpackages and top-level modules (scaling/, data/, job/, metrics/, hooks.py, ...) point
    one way: a cycle through two modules of different packages is a cycle of the packages even
    when no single module closes it (scaling.cli -> metrics.plot -> scaling.fit)."""
    graph: Dict[str, Set[str]] = {}
    for n, m in mods.items():
        graph.setdefault(component(n), set()).update(
            component(t) for t in m.internal if component(t) != component(n))
    comps = strongly_connected(graph)
    culprits = []
    for c in comps:
        for n, m in sorted(mods.items()):
            if component(n) in c:
                culprits += [f"{n} -> {t}" for t in sorted(m.internal)
                             if component(t) in c and component(t) != component(n)]
    assert not comps, ("import cycles between packages of llama_train/:\n" + describe(graph, comps)
                       + "\nthrough:\n  " + "\n  ".join(culprits))


def _imports(m: Module, root: str) -> bool:
    return any(x == root or x.startswith(root + ".") for x in m.external)


def test_deepspeed_is_imported_only_by_the_engine(mods):
    outside = sorted(n for n, m in mods.items() if _imports(m, "deepspeed")
                     and n != "llama_train.engine" and not n.startswith("llama_train.engine."))
    assert not outside, (f"{', '.join(outside)} import(s) deepspeed: only llama_train/engine/ may "
                         f"(everything else asks the engine)")


# The layers of docs/architecture.md, top down: a module never imports one of a higher layer.
# Each entry is a module or a package (all its modules); the longest entry that names a module
# decides its layer (job.optim is a foundation inside the loop's job/).
LOOP = {"train", "job", "checkpoint", "metrics.tracking", "inference.sample"}
ENGINE = {"engine"}
FOUNDATION = {"config", "comm", "policy", "records", "util", "proc", "paths", "model", "job.optim",
              "hooks", "engine.flops", "metrics.meter", "watchdog", "data.config", "errors",
              "layout", "bounds"}
LAYERS = {**{n: "loop" for n in LOOP}, **{n: "engine" for n in ENGINE},
          **{n: "foundation" for n in FOUNDATION}}


def _layer(name: str) -> str:
    short = name.removeprefix("llama_train.")
    parts = short.split(".")
    for i in range(len(parts), 0, -1):  # the longest entry first
        entry = ".".join(parts[:i])
        if entry in LAYERS:
            return LAYERS[entry]
    return "other"


def test_dependencies_point_down(mods):
    """Only the benchmarks, which embed it, import the entry point; the engine imports nothing
    of the loop; the foundations (config, model, records, ...) import neither."""
    order = {"loop": 2, "engine": 1, "foundation": 0}
    up = sorted(f"{n} -> {t}" for n, m in mods.items() for t in m.internal
                if _layer(n) in order and _layer(t) in order and order[_layer(t)] > order[_layer(n)])
    assert not up, "imports that point up a layer:\n  " + "\n  ".join(up)
    entry = sorted(n for n, m in mods.items() if "llama_train.train" in m.internal
                   and not n.startswith("llama_train.bench."))
    assert not entry, f"{entry} import llama_train.train (the entry point): only bench/ may"
    assert {_layer(f"llama_train.{n}") for n in LOOP} == {"loop"}
    assert {_layer(f"llama_train.{n}") for n in FOUNDATION} == {"foundation"}
    assert all(f"llama_train.{n}" in mods for n in LAYERS), "a layer names a module that is gone"
    # every module of the job, the model and the engine has its layer
    for pkg, layer in (("job", "loop"), ("checkpoint", "loop"), ("engine", "engine"),
                       ("model", "foundation"), ("config", "foundation"), ("comm", "foundation")):
        assert {_layer(n) for n in mods if n.startswith(f"llama_train.{pkg}.")} <= {layer,
                                                                                  "foundation"}, pkg
    assert {_layer(f"llama_train.{n}") for n in TOP_LEVEL - {"train", "_moved"}} == {"foundation"}


# The top level (docs/architecture.md's table of packages): the entry point, the foundations and
# the import hook of the old paths (llama_train._moved; tests/system/test_old_paths.py checks each one at
# run time). Nothing else: the modules of the job, the model, ... live in their packages.
TOP_LEVEL = {"train", "_moved", "errors", "paths", "util", "proc", "records", "layout", "bounds",
             "policy", "hooks", "watchdog"}
PACKAGES = {"bench", "checkpoint", "comm", "config", "data", "engine", "hf", "scaling", "job",
            "model", "metrics", "inference"}


def test_the_top_level_holds_the_entry_point_and_foundations(mods):
    from llama_train._moved import MOVED

    pkgs = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert pkgs == PACKAGES, f"llama_train/ holds the packages {sorted(pkgs)}: list them here and in docs/architecture.md"
    docs = ARCHITECTURE.read_text()
    for pkg in PACKAGES:
        assert f"`{pkg}/`" in docs, f"docs/architecture.md's table of packages lacks {pkg}/"
    files = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert files == TOP_LEVEL, f"llama_train/ holds {sorted(files - TOP_LEVEL)} beside the " \
                               f"foundations: put them in a package (or list them in TOP_LEVEL)"
    assert all(f"llama_train.{n}" in mods for n in TOP_LEVEL)
    # every old path names a module that exists, and none is imported by the package (they warn:
    # new code uses the new ones)
    assert all(new in mods for new in MOVED.values()), sorted(set(MOVED.values()) - set(mods))
    users = sorted(f"{n} -> {t}" for n, m in mods.items() for t in m.internal if t in MOVED)
    assert not users, "modules that import an old (deprecated) path:\n  " + "\n  ".join(users)
    m = mods["llama_train._moved"]
    assert not m.internal, m.internal


def test_errors_is_the_bottom(mods):
    """llama_train.errors (BadInput, ConfigError: what the entry points turn into exit 2) is
    raised from every layer, the torch-free config and model arguments included: it imports
    nothing of the package and nothing outside the standard library."""
    m = mods["llama_train.errors"]
    assert not m.internal, m.internal
    assert m.external <= {"__future__", "__future__.annotations"}, m.external


# llama_train/checkpoint/, bottom up (the order of its table in docs/architecture.md): a module
# imports only those before it, never the package itself (whose __init__ imports them all).
CHECKPOINT = ["errors", "layout", "collective", "disk", "discovery", "meta", "state", "history",
              "choice", "universal", "consolidated", "writer"]


def test_checkpoint_modules_import_only_downward(mods):
    pkg = "llama_train.checkpoint"
    found = sorted(n.removeprefix(pkg + ".") for n in mods if n.startswith(pkg + "."))
    assert found == sorted(CHECKPOINT), f"checkpoint/ holds {found}: list them in CHECKPOINT"
    rank = {f"{pkg}.{m}": i for i, m in enumerate(CHECKPOINT)}
    up = sorted(f"{n} -> {t}" for n in rank for t in mods[n].internal
                if t == pkg or (t in rank and rank[t] >= rank[n]))
    assert not up, "checkpoint/ modules that import one above them:\n  " + "\n  ".join(up)
    assert {_layer(n) for n in rank} == {"loop"}
    documented = re.findall(r"^\| `checkpoint/(\w+)\.py` \|", ARCHITECTURE.read_text(), re.M)
    assert documented == CHECKPOINT, "docs/architecture.md's checkpoint/ table, in this order"


@pytest.mark.parametrize("name", ["llama_train.model", "llama_train.model.transformer",
                                  "llama_train.model.ops", "llama_train.model.weights"])
def test_model_knows_no_distribution(mods, name):
    """model/ (the package, whose lazy half is transformer.py, and each of its modules) imports
    neither deepspeed nor torch.distributed, nor does anything of llama_train they import."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += sorted(mods[n].internal)
    bad = sorted(f"{n}: {x}" for n in seen for x in mods[n].external
                 if x.split(".")[0] == "deepspeed" or x == "torch.distributed"
                 or x.startswith("torch.distributed."))
    assert not bad, f"{name} reaches distributed code: {bad}"


def _reach(mods, name: str) -> Set[str]:
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += sorted(mods[n].internal)
    return seen


def test_model_args_imports_no_torch(mods):
    """model/args.py (ModelArgs: the config's model group, ``llama-train --help``) and all it
    imports of llama_train name no torch, not even inside a function; the model package imports
    it at once and the rest lazily (the test below imports it)."""
    bad = sorted(f"{n}: {x}" for n in _reach(mods, "llama_train.model.args")
                 for x in mods[n].external if x.split(".")[0] in ("torch", "deepspeed"))
    assert not bad, bad
    assert "llama_train.model.args" not in mods["llama_train.model.transformer"].external


# ---------------------------------------------------------------------------------------------
# The files other programs read (llama_train.records): one definition, the bytes of before
# ---------------------------------------------------------------------------------------------

RUN_INFO = dict(params={"total": 10, "embedding": 4, "non_embedding": 6}, model_args={"dim": 8},
                flop_budget=None, tokens=1024, global_batch=8, seq_len=64, max_steps=2,
                flops_per_token=1.5e6, flops=1.536e9, peak_flops={"value": 1e12, "source": "x"},
                command="llama-train trainer.max_steps=2", count="total", epoch_tokens=4096)


@pytest.mark.parametrize("final", [{}, {"final_val_loss": 3.25, "final_step": 2},
                                   {"final_val_loss": None, "final_step": 2}])
def test_run_info_writes_what_the_trainer_wrote(tmp_path, final):
    """RunInfo.write is the trainer's json.dumps(info, indent=1): the run's start without the
    final_* keys, its end with both (final_val_loss null without a validation split)."""
    from llama_train.records import RunInfo

    path = tmp_path / "run_info.json"
    RunInfo(**RUN_INFO, **final).write(path)
    assert path.read_text() == json.dumps({**RUN_INFO, **final}, indent=1)
    back = RunInfo.read(path)
    assert back == RunInfo(**RUN_INFO, **final) and back.finished == bool(final)


def test_run_info_reads_partial_and_unknown_keys(tmp_path):
    from llama_train.records import RunInfo

    path = tmp_path / "run_info.json"
    path.write_text(json.dumps({"params": {"total": 5}, "tokens": 7, "added_later": 1}))
    info = RunInfo.read(path)
    assert (info.params, info.tokens, info.flops, info.command, info.final_step) == ({"total": 5}, 7, None,
                                                                                     None, None)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        RunInfo.read(path)
    path.write_text("{")
    with pytest.raises(json.JSONDecodeError):
        RunInfo.read(path)


def test_metrics_lines_keep_their_bytes(tmp_path):
    """A step line is {"step", "time" (ms), metrics...}; an event line {"step", "time", "event",
    fields...}; non-finite values are strings; a line reads back to the record that wrote it."""
    from llama_train.records import (EventRecord, StepRecord, events, iter_records, last_val_loss,
                                     parse_line, read_metrics, step_records)

    step = StepRecord.new(3, {"loss": 2.5, "lr": float("nan"), "mix": {"a": 1}}, now=1700000000.12345)
    assert step.to_line() == '{"step": 3, "time": 1700000000.123, "loss": 2.5, "lr": "nan", "mix": {"a": 1}}\n'
    event = EventRecord.new(3, "rollback", {"to_step": 2, "checkpoint": "c"}, now=1.0)
    assert event.to_line() == '{"step": 3, "time": 1.0, "event": "rollback", "to_step": 2, "checkpoint": "c"}\n'
    assert (event.step, event.event, event.fields) == (3, "rollback", {"to_step": 2, "checkpoint": "c"})
    val = StepRecord.new(4, {"val_loss": 2.0, "val_ppl": 7.4}, now=2.0)
    path = tmp_path / "metrics.jsonl"
    path.write_text(step.to_line() + event.to_line() + val.to_line() + "[1]\n" + '{"step": 5, "lo')
    recs = read_metrics(path)
    assert recs == [step, event, val] and list(iter_records(path)) == recs
    assert [type(r) for r in recs] == [StepRecord, EventRecord, StepRecord]
    assert parse_line(step.to_line().strip()) == step and parse_line('{"step": 5, "lo') is None
    assert step_records(recs, "loss") == [step] and step_records(recs, "lr") == []  # "nan": no number
    assert step_records(recs) == [step, val] and events(recs, "resume") == [] and events(recs) == [event]
    assert last_val_loss(recs) == 2.0 and last_val_loss(recs[:2]) is None


def test_the_entry_point_and_config_import_no_torch():
    """Issue 28: `llama-train --help` took 2.3 s, most of it importing torch for the config
    (ModelArgs lived beside the layers; comm's reference ring came with CommConfig). The entry
    point, the config and the Hydra app must not need it before a job starts."""
    import subprocess
    import sys

    code = ("import sys, llama_train.train, llama_train.config, llama_train.inference.generate, "
            "llama_train.model, llama_train.model.args, llama_train.job, llama_train.metrics; "
            "from llama_train.model import ModelArgs, count_params; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# tests/ mirrors the package (docs/architecture.md, "Tests"): a test file lives in the directory of
# the package it tests, or in system/ (whole-system runs across components, checks of the repo as
# a whole, the entry point and the foundations across every command); tests/ itself holds only
# what they share. pytest imports each file by its basename (no __init__.py: "prepend" mode puts
# its directory on sys.path), so basenames are unique.
TESTS = PACKAGE.parent / "tests"
TEST_DIRS = PACKAGES | {"system"}
SHARED = {"conftest.py", "helpers.py", "hydra_memo.py", "warm_ranks.py",
          "bench_warm_ranks.py"}  # tests/ itself
SHARED_DIRS = {"workers"}  # scripts the tests start, not tests


def test_tests_mirror_the_package():
    files = sorted(p.relative_to(TESTS) for p in TESTS.rglob("*.py")
                   if not set(p.relative_to(TESTS).parts) & (SHARED_DIRS | {"__pycache__"}))
    tests = [p for p in files if p.name.startswith("test_")]
    misplaced = [str(p) for p in tests if len(p.parts) != 2 or p.parts[0] not in TEST_DIRS]
    assert not misplaced, (f"test files outside tests/<package>/ ({sorted(TEST_DIRS)}): move each into "
                           f"the directory of the package it tests, or system/:\n  " + "\n  ".join(misplaced))
    others = sorted(str(p) for p in files if not p.name.startswith("test_"))
    assert others == sorted(SHARED), f"tests/ holds {others}: tests are test_*.py in tests/<package>/"
    names = [p.name for p in tests]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    dirs = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    assert dirs == TEST_DIRS | SHARED_DIRS, sorted(dirs ^ (TEST_DIRS | SHARED_DIRS))
    documented = set(re.findall(r"`tests/(\w+)/`", ARCHITECTURE.read_text()))
    assert documented >= TEST_DIRS, f"docs/architecture.md's Tests lacks {sorted(TEST_DIRS - documented)}"
