"""Eight fake CPU devices for every test, set before JAX starts its backend."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same small programs (and subprocesses inherit this): share compilations.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="mimo_jax_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite is dominated by compiling many small programs; cheaper LLVM passes compile them faster.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
  """One digits build shared by the whole session (built on first use, offline)."""
  return str(tmp_path_factory.mktemp("digits"))
