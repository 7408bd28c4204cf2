"""``python -m llama_train.scaling ...`` = ``llama-plan ...``."""

import sys

from llama_train.scaling.cli import main

sys.exit(main())
