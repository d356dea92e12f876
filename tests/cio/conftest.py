import os
import tempfile

import pytest


@pytest.fixture
def ext4_dir():
    """A scratch directory on the ext4 root filesystem (not tmpfs: O_DIRECT alignment shows)."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    d = tempfile.mkdtemp(prefix="fc-cio-", dir=base)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)
