"""A private local Ray instance keeps its dashboard on loopback (it can submit and stop jobs)."""
import ray

from devharness.executor import ray_utils


def test_a_private_ray_binds_its_dashboard_to_loopback(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_utils.connect(None, world_size=2)
    assert calls and calls[0]["address"] == "local" and calls[0]["dashboard_host"] == "127.0.0.1"
