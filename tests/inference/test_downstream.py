"""llama-eval: lm-evaluation-harness on our checkpoint, no export step (issue 28, item 8).

Hub datasets cannot be fetched here, so the tasks are lm-eval tasks over local JSON files (its
``dataset_path: json``): a multiple-choice task (log-likelihoods of choices), a perplexity task
(rolling log-likelihoods) and a generation task. The scores our model class gives on a
checkpoint must equal those lm-eval's own HF backend gives on the checkpoint's export.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from helpers import trained_and_exported
from llama_train.inference.downstream import evaluate, main as eval_main

# a world of one (conftest.py); slow: lm-eval runs each task on two backends (~30 s)
pytestmark = [pytest.mark.usefixtures("one_rank"), pytest.mark.slow]

MC = [("The statement that defines a function is", [" def", " class", " import"], 0),
      ("A loop over the items of a sequence uses", [" for", " while", " with"], 0),
      ("To leave a loop early, use", [" return", " break", " pass"], 1),
      ("An exception is raised with", [" raise", " try", " assert"], 0),
      ("The value of an empty list is", [" []", " {}", " None"], 0),
      ("A module is brought in with", [" import", " from", " as"], 0)]
PPL = ["The for statement is used to iterate over the elements of a sequence.",
       "Functions are defined with the def keyword, followed by the function name and the "
       "parenthesized list of formal parameters. " * 6,
       "A class definition creates a class object."]
GEN = [("Python is a", "n"), ("The def keyword", " defines")]


def _task(root, name, rows, body):
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\n{body}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    _task(root, "lt_choice", [{"q": q, "choices": c, "gold": g} for q, c, g in MC],
          "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
          "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    _task(root, "lt_ppl", [{"text": t} for t in PPL],
          "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
          "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
          "  - metric: bits_per_byte\n")
    _task(root, "lt_gen", [{"prompt": p, "answer": a} for p, a in GEN],
          "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
          "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 6\n  do_sample: false\n"
          "metric_list:\n  - metric: exact_match\n")
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny model trained 8 steps, and its export."""
    return trained_and_exported(tmp_path_factory.mktemp("eval"), 8)


def _scores(res, task):
    return {k: v for k, v in res["results"][task].items()
            if isinstance(v, float) and not k.endswith("_stderr,none")}


def test_our_scores_on_a_checkpoint_equal_lm_evals_hf_backend_on_its_export(run, tasks):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out, hf = run
    names = ["lt_choice", "lt_ppl"]
    ours = evaluate(str(out), names, include_path=str(tasks), batch_size=4)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={hf},dtype=float32,device=cpu", tasks=names,
        task_manager=TaskManager(include_path=str(tasks)), batch_size=4, log_samples=False)
    for task in names:
        a, b = _scores(ours, task), _scores(theirs, task)
        assert a.keys() == b.keys() and a, (a, b)
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-4), (task, k, a[k], b[k])
    assert ours["results"]["lt_ppl"]["word_perplexity,none"] > 1
    assert "step 8 of" in ours["source"]


def test_the_cli_runs_generation_tasks_and_writes_json(run, tasks, tmp_path, capsys):
    out, _ = run
    path = tmp_path / "res.json"
    eval_main([str(out), "--tasks", "lt_gen,lt_choice", "--include-path", str(tasks),
               "--output", str(path)])
    printed = capsys.readouterr().out
    assert "lt_gen" in printed and "exact_match" in printed and "step 8 of" in printed
    saved = json.loads(path.read_text())
    assert 0.0 <= saved["results"]["lt_gen"]["exact_match,none"] <= 1.0
    assert set(saved["results"]) == {"lt_gen", "lt_choice"}
    with pytest.raises(SystemExit) as e:
        eval_main([str(out), "--tasks", "no_such_task", "--include-path", str(tasks)])
    assert e.value.code == 2 and "unknown task(s) ['no_such_task']" in capsys.readouterr().err


def test_llama_eval_says_what_it_is_doing(run, tasks, capsys, monkeypatch):
    """Issue 53: llama-eval printed nothing until its table; lm-eval's request-building bars
    aside, a real task ran silent for minutes. Now a line per phase, one per kind of request
    with its count per task, a progress line at least every PROGRESS_EVERY_S (30 s; 0 here:
    after each batch or request) and one at its end, all on stderr."""
    import llama_train.inference.lm_eval_model as lm_model

    monkeypatch.setattr(lm_model, "PROGRESS_EVERY_S", 0.0)
    out, _ = run
    eval_main([str(out), "--tasks", "lt_choice,lt_ppl,lt_gen", "--include-path", str(tasks),
               "--batch-size", "4"])
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("llama-eval: ")]
    assert err[0].startswith(f"llama-eval: loading {out} (cpu, fp32)")
    assert err[1].startswith("llama-eval: loaded step 8 of")
    assert err[1].endswith("indexing lm-eval's tasks")
    assert re.match(r"llama-eval: lm-eval knows \d+ tasks", err[2])
    assert err[3].startswith("llama-eval: evaluating lt_choice, lt_ppl, lt_gen")
    kinds = {"loglikelihood": ("requests", "lt_choice 18", [4, 8, 12, 16]),  # 6 x 3 choices
             "loglikelihood_rolling": ("documents", "lt_ppl 3", [1, 2]),
             "generate_until": ("requests", "lt_gen 2", [1])}
    for kind, (unit, per_task, steps) in kinds.items():
        total = per_task.split()[-1]
        assert f"llama-eval: {kind}: {total} {unit} ({per_task})" in err, (kind, err)
        done = [int(m[1]) for m in (re.match(rf"llama-eval: {kind}: (\d+)/{total} {unit} in \d+s, "
                                             rf"about \d+s left", line) for line in err) if m]
        assert done == steps, (kind, err)
        assert any(re.match(rf"llama-eval: {kind}: {total} {unit} done in [\d.]+s", line)
                   for line in err), (kind, err)
    assert re.match(r"llama-eval: evaluated 3 task\(s\) in [\d.]+s", err[-1])
    assert not any(k in captured.out for k in ("loading", "done in", "knows"))  # stdout: results
