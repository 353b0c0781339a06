"""Which card NVML reads for the GPU a process sees (``orchestrator/device/nvml.py``). NVML itself
needs a GPU: the acceptance run reads it (``bench/gpu_acceptance.py``)."""

import pytest
import torch

from orchestrator.device.nvml import gpu_info, visible_device


def test_the_visible_index_is_mapped_to_the_card_cuda_visible_devices_names():
    assert visible_device(0, None) == 0 and visible_device(1, "") == 1  # every card visible
    assert visible_device(0, "3,1") == 3 and visible_device(1, "3, 1") == 1  # Ray's indices
    uuid = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
    assert visible_device(0, uuid) == uuid and visible_device(1, "2,GPU-8932f937") == "GPU-8932f937"
    assert visible_device(0, "MIG-0a1b2c3d") == "MIG-0a1b2c3d"  # NVML's card would be the wrong memory: none read


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine: NVML answers")
def test_without_a_gpu_nothing_is_read():
    assert gpu_info(0) is None
