import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_and_auto_kernels():
    """These tests run many small torch ops; on a shared 2-core machine OpenMP's intra-op threads
    oversubscribe and each small op costs milliseconds (measured: 20x slower under load with 2
    threads), so the conventional tests run single-threaded and restore the setting after."""
    from fasttomo.kernels import dispatch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    dispatch.configure("auto")
    dispatch.reset_counters()
    yield
    torch.set_num_threads(n)
    dispatch.configure("auto")
    dispatch.reset_counters()
