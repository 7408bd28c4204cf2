"""What the entry points turn into exit 2 with one line: :class:`BadInput`, and
:class:`ConfigError`, its kind for a setting. Anything else that reaches an entry point is a bug,
shown with its traceback (exit 1). Plain Python: imports nothing of the package, so every module
(the config, the model's arguments, the data, the weights) can raise them."""

from __future__ import annotations


class BadInput(ValueError):
    """Bad input from the user: a config value, data, weights, a path, a command-line option.
    The message names what is wrong and the fix; the entry points turn it into exit 2 with that
    one line (llama_train.train.run_job), never a traceback. A ValueError, so callers that catch
    ValueError still catch it; a bare ValueError is not bad input but a bug."""


class ConfigError(BadInput):
    """A configuration that cannot run; the message names the key and the fix."""
