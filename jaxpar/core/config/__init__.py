"""The configuration: its typed schema, its cross-key checks, the contract of who consumes each key, the mesh spec.

`from jaxpar.core.config import load_config, Config` reads as before; `python -m jaxpar.core.config` prints one.
"""

from jaxpar.core.config.schema import Config, ModelConfig, config_from_dict, load_config  # noqa: F401  the old names
