import shutil
import tempfile

import pytest
import torch

from rlhf_async.log import configure_logging


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _logs():
    # structlog may still be bound to a stream an earlier test captured (and closed by
    # now); a module that wants quieter logs overrides this fixture
    configure_logging("warning")


@pytest.fixture()
def ipc_dir():
    """A short directory for ipc:// sockets (unix socket paths are limited to ~100 bytes)."""
    d = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """SFT and reward-model artefacts shared by every test of the session: the cache is
    keyed by what trains them and written atomically, so tests that train the same tiny
    SFT/RM train it once (a test about training them uses a cache of its own)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def one_thread():
    """Node processes run one torch thread; an in-process run compared with them must too,
    since a different thread count changes float reduction order (and Adam magnifies it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
