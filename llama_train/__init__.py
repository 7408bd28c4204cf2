"""llama_train: distributed LLaMA pretraining on DeepSpeed."""

from llama_train import _moved

__version__ = "0.1.0"

_moved.install()  # the module paths of before the packages keep working (deprecated)
