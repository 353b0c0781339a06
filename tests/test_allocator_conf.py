"""What the trials' workers are told of the CUDA caching allocator, and when."""

import pytest

from orchestrator.allocator_conf import import_time_environment


@pytest.fixture
def nothing_exported(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


@pytest.mark.usefixtures("nothing_exported")
def test_only_the_backend_must_be_in_the_workers_environment_when_they_start():
    """PyTorch reads the backend at import, the rest at CUDA's first use (which the trial precedes)."""
    assert import_time_environment("expandable_segments:True") == {}
    assert import_time_environment(None) == {}
    assert import_time_environment("backend:native") == {}
    conf = "backend:cudaMallocAsync"
    assert import_time_environment(conf) == {"PYTORCH_CUDA_ALLOC_CONF": conf}


@pytest.mark.usefixtures("nothing_exported")
def test_a_value_the_user_exported_is_the_one_the_workers_start_with(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    assert import_time_environment("expandable_segments:True") == {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
