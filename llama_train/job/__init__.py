"""The training job, from a composed config to the end of the run; its entry point is
:mod:`llama_train.train` (``llama-train``, ``python -m llama_train.train``). This package imports
nothing itself: importing one of its modules never loads the Hydra app.

Before a process group exists:
    config_source.py  where the primary config comes from (the package's, a rerun's saved one)
    sweep.py          --multirun: each job's directory, every job's config checked first
    plan.py           plan_job: config + runtime -> JobPlan (layout, batch, experiment, resume)
    preflight.py      Preflight: the plan, the output dir claimed (runlock), data prepared,
                      the resume's checkpoint judged (resume), logging
    dry_run.py        trainer.dry_run / --cfg job: the plan printed, nothing run
    runlock.py        one job per output directory (<output_dir>/.lock)
    resume.py         ResumeCheck: can this checkpoint continue this run
    simulation.py     comm.simulate_ranks: one rank of an N-rank job, measured
The run:
    build.py          resolve_job, build_job -> Components (model, engine, data, tracker, ...)
    trainer.py        Trainer: the loop; start()
    train_module.py   TrainModule: one global batch (micro-batches, accumulation, the step)
    train_state.py    TrainState: the loop's progress, carried by every checkpoint
    optim.py          AdamW parameter groups, the learning-rate schedule
    recovery.py       bad steps: skip, roll back, abort
    faults.py         fault injection (hooks), naming a lost rank
    progress.py       the console's pace: throughput, ETA
    compile_watch.py  trainer.compile's log lines
    run_files.py      what rank 0 alone writes: config.yaml, run_info.json, sample.txt
    summary.py        what a run says when it ends
"""
