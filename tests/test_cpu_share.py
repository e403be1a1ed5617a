"""fastes processes share the cores: each takes cores // (registered processes alive) torch threads."""

import subprocess
import sys

import pytest
import torch

from fastes.engine import cpu_share


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A registry in a fresh cache, on a machine of 4 cores; torch's threads restored afterwards."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("FASTES_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("FASTES_THREADS", raising=False)
    monkeypatch.setattr(cpu_share, "cores", lambda: 4)
    yield tmp_path / "processes"
    cpu_share.unregister()
    torch.set_num_threads(threads)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_alone_a_process_takes_every_core_and_shares_them_with_others(registry):
    cpu_share.register()
    assert torch.get_num_threads() == 4 and len(list(registry.iterdir())) == 1
    others = [sleeper(), sleeper()]
    try:
        for other in others:
            (registry / str(other.pid)).touch()
        assert cpu_share.share_cores(force=True) == 1 and torch.get_num_threads() == 1  # 4 // 3
        others[0].kill()
        others[0].wait()
        assert cpu_share.share_cores(force=True) == 2  # the killed one's file is found stale
        assert not (registry / str(others[0].pid)).exists()
    finally:
        for other in others:
            other.kill()
            other.wait()
    assert cpu_share.share_cores(force=True) == 4
    cpu_share.unregister()
    assert list(registry.iterdir()) == [] and cpu_share.share_cores(force=True) is None


def test_checks_at_most_once_a_second(registry):
    cpu_share.register()
    other = sleeper()
    try:
        (registry / str(other.pid)).touch()
        assert cpu_share.share_cores() == 4  # checked at register a moment ago: not yet again
        assert cpu_share.share_cores(force=True) == 2
    finally:
        other.kill()
        other.wait()


def test_a_users_thread_setting_is_left_alone(registry, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    cpu_share.register()
    assert not registry.exists() and cpu_share.share_cores(force=True) is None
    assert torch.get_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("FASTES_THREADS", "2")
    cpu_share.register()
    assert torch.get_num_threads() == 2 and not registry.exists()
