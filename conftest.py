"""Repo-level pytest plugins: shared pipeline fixtures."""

pytest_plugins = ["tests.pipeline_fixtures"]
