"""The core every other package stands on: strict config loading and its errors
(`core.config`), content fingerprints and the cache format version (`core.fingerprint`).
Imports nothing of the project."""
