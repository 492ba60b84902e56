"""Resident clusters from the driver, as the looping grids size themselves (run on an H200)."""

import threading

import pytest
import torch

from quack_kernels.primitives import occupancy

pytestmark = pytest.mark.gpu


def test_resident_clusters_from_any_thread_and_bounded_by_sms():
    """The autograd engine's worker thread asks too (it has no current driver context of
    its own); the answer never exceeds what the SMs hold, and falls as CTAs grow."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    occupancy.resident_clusters.cache_clear()
    occupancy._probe_function.cache_clear()
    answers = {}
    worker = threading.Thread(
        target=lambda: answers.update(worker=occupancy.resident_clusters(0, 16, 256, 130 * 1024)))
    worker.start()
    worker.join()
    occupancy.resident_clusters.cache_clear()
    one_per_sm = occupancy.resident_clusters(0, 16, 256, 130 * 1024)
    assert answers["worker"] == one_per_sm
    assert 1 <= one_per_sm <= sms // 16
    small = occupancy.resident_clusters(0, 16, 256, 16 * 1024)
    assert one_per_sm < small <= 8 * sms // 16  # at most 8 CTAs of 256 threads per SM
    assert occupancy.resident_clusters(0, 2, 256, 130 * 1024) <= sms // 2
