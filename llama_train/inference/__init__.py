"""A trained model used: text from it and its scores on benchmarks. Imports nothing itself.

    generate.py       llama-generate: load a model (ours or an export), decode with the KV cache
    sample.py         the text sample a run ends with (sample.*), from the training engine
    downstream.py     llama-eval: downstream tasks with lm-evaluation-harness
    lm_eval_model.py  LlamaTrainLM: lm-eval's view of our model (imports lm-eval)
"""
