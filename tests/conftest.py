import pytest

from devharness.model.builtin import write_hf_checkpoint


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """The synthetic tiny Llama written as a Hugging Face checkpoint (config.json + safetensors + tokenizer)."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-hf"))




@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance per test module that asks for it (starting one costs seconds)."""
    import ray
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
