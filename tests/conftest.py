"""Eight fake CPU devices for every test, set before JAX starts its backend."""

import collections
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


# The files that take longest, longest first (measured alone; pyproject runs the suite on two
# workers that take whole files). Started first, a long file does not run alone at the end while
# the other worker idles, as with xdist's own order (most tests first), which puts them last.
LONGEST_FIRST = ("test_multiprocess.py", "test_faults.py", "test_demo.py", "test_fsdp.py",
                 "test_pipeline.py", "test_dynamic.py", "test_checkpoint.py", "test_parity.py",
                 "test_conversations.py", "test_cli.py", "test_stages.py")


def pytest_configure(config) -> None:
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items) -> None:
  """LONGEST_FIRST, then the other files, most tests first; each file's tests in their order."""
  counts = collections.Counter(item.path.name for item in items)

  def rank(item) -> tuple:
    name = item.path.name
    if name in LONGEST_FIRST:
      return (0, LONGEST_FIRST.index(name), "")
    return (1, -counts[name], name)
  items.sort(key=rank)
