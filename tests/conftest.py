import os
from pathlib import Path

import pytest

from devharness.model.builtin import write_hf_checkpoint

# The tests run the fast kernels as they ship, whatever `devharness bench kernels --save` chose on this machine: a
# cache of their own (set before any engine, worker or server process starts, so that they inherit it).
os.environ["DEVHARNESS_CACHE"] = str(Path(os.environ.get("DEVHARNESS_CACHE") or Path.home() / ".cache" / "devharness")
                                     / "tests")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """The synthetic tiny Llama written as a Hugging Face checkpoint (config.json + safetensors + tokenizer)."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-hf"))




@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance, shared by every module that asks for it (starting one costs seconds) and
    shut down at the end of the run. A module that needs a Ray of its own (a dashboard, several nodes)
    calls own_ray() first."""
    import ray
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield


def own_ray() -> None:
    """Leave the shared Ray instance, if this process is connected to one."""
    import ray
    if ray.is_initialized():
        ray.shutdown()


def pytest_sessionfinish(session, exitstatus):
    import sys
    if "ray" in sys.modules:
        own_ray()
