"""Offline by construction: an `hf:` data source reaches no network whatever the environment
says, and the private Ray instance reports no usage stats."""

from __future__ import annotations

import os
import socket
import types

import datasets.config
import huggingface_hub.constants
import pytest
import ray

from pipelines.ray_env import ensure_ray
from preinfer.data.config import DataConfig
from preinfer.data.corpus import CorpusError
from preinfer.data.tokenization import iter_documents


def test_hf_source_is_offline_even_when_the_environment_says_online(monkeypatch, tmp_path):
    """Not with HF_HUB_OFFLINE=0 in the environment, nor with `datasets` already imported in
    online mode (it reads the variables once, at import): not even a DNS lookup."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(key, "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    tried = []

    def no_network(*args, **kw):
        tried.append(args[:2])
        raise OSError("network access in a test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    src = DataConfig(source="hf:preinfer-test/no-such-dataset")
    with pytest.raises(CorpusError, match="did not resolve offline"):
        next(iter_documents(src))
    assert tried == []
    assert all(os.environ[k] == "1" for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE


@pytest.mark.parametrize("address", [None, "ray://cluster:10001"])
def test_private_ray_instance_sends_no_usage_stats(monkeypatch, address):
    """RAY_USAGE_STATS_ENABLED=0 is set before ray.init starts a private instance (even over a
    1 in the environment); joining a cluster (RAY_ADDRESS) leaves the cluster's setting alone.
    ray.init is stood in for: no Ray is started."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    if address:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(
        ray, "init", lambda **kw: seen.append(os.environ["RAY_USAGE_STATS_ENABLED"])
    )
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: types.SimpleNamespace(get_node_id=lambda: "node"))  # fmt: skip
    ensure_ray(log=lambda *a: None)
    assert seen == (["1"] if address else ["0"])
