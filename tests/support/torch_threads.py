"""torch on one thread for a test file that runs HF models beside the other pytest worker."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch (lm-eval's HF model) on one thread for this file, then its own count again: on tiny
    matrices, with the other pytest worker busy, a second thread mostly waits, and a forward pass
    takes several times the CPU time of one thread's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
