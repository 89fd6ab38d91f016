"""Eight fake CPU devices for every test, set before JAX starts its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
  """One digits build shared by the whole session (built on first use, offline)."""
  return str(tmp_path_factory.mktemp("digits"))
