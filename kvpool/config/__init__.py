"""One configuration tree for every kvpool command and library: `tree` is the model (its
sections and each default, once), `load` fills it from a file, the `KVPOOL_*` environment and
flags. docs/configuration.md shows the whole tree; `kvpool config show` the one in effect."""

from kvpool.config.load import (CONFIG_ENV, ROOT_ENV, current_settings, describe, env_names, load_settings, read_env,
                                use_settings)
from kvpool.config.tree import (DEFAULT_EVICTION, SECTIONS, PoolSection, Settings, UpWorker, default, parse_size,
                                read_secret_file)

__all__ = ["CONFIG_ENV", "ROOT_ENV", "DEFAULT_EVICTION", "SECTIONS", "PoolSection", "Settings", "UpWorker",
           "current_settings", "default", "describe", "env_names", "load_settings", "parse_size", "read_env",
           "read_secret_file", "use_settings"]
