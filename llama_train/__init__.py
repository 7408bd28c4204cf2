"""llama_train: distributed LLaMA pretraining on DeepSpeed."""

__version__ = "0.1.0"
