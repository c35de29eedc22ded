"""The core every other package stands on: strict config loading and its errors
(`core.config`), content fingerprints and the cache format version (`core.fingerprint`), and
the test-fault hooks (`core.faults`). Imports nothing of the project.

Public surface: `ConfigError` (every bad-input error of a config, a key or a file).
"""

from core.config import ConfigError

__all__ = ["ConfigError"]
