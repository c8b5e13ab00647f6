"""tidyrl: reinforcement-learning post-training where every number adds up.

`import tidyrl` stays light: torch and transformers load only when training starts.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["train", "TrainResult", "Config", "load_config", "make_plan", "__version__"]


def __getattr__(name):  # PEP 562: lazy public API
    if name in ("train", "TrainResult"):
        from tidyrl import api

        return getattr(api, name)
    if name in ("Config", "load_config"):
        from tidyrl import config

        return getattr(config, name)
    if name == "make_plan":
        from tidyrl.plan import make_plan

        return make_plan
    raise AttributeError(f"module 'tidyrl' has no attribute {name!r}")
