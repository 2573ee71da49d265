"""The fixtures the GPU tests use, apart from conftest.py: the device machines lack the services'
packages (grpc_health, moto, ...) that conftest.py imports, so GPU runs load only this:
`pytest --noconftest -p tests.torch_fixtures -m gpu tests/...` (docs/performance.md, "GPU suite")."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One-token decode steps gain little from a second thread, and when other processes share the
    two cores, torch's threads wait on each other (a module ran 20-50x slower that way). A module
    asks for it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
