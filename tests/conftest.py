"""Eight fake CPU devices for every test, set before JAX starts its backend."""

import atexit
import collections
import fcntl
import json
import os
import pathlib
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same small programs (and subprocesses inherit this): share compilations.
# Made once, by the process that starts the session (pytest-xdist's workers inherit it), and removed
# when that process exits.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mimo_jax_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Every process writes the shared cache alike, unbounded (mimo_jax/compile_cache.py): a bounded
# writer among unbounded ones fails to add entries, with a warning on stderr.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite is dominated by compiling many small programs; cheaper LLVM passes compile them faster,
# and XLA's classic CPU emitters compile a tiny step in about half the time of its newer fusion
# emitters (the same HLO, run as fast at these sizes).
# Its matmuls are tiny and eight fake devices share two cores: one thread each runs them faster.
# On CPUs only: XLA for GPUs knows no such options (`JAX_PLATFORMS=cuda` runs the GPU tests).
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true "
                        "--xla_cpu_multi_thread_eigen=false --xla_cpu_use_fusion_emitters=false")

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import bf16_config, run_steps, tiny_config  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
  """One digits build shared by the whole session (built on first use, offline)."""
  return str(tmp_path_factory.mktemp("digits"))


def _shared_trajectory(tmp_path_factory, name: str, make_config, steps: int = 4) -> list[dict]:
  """`make_config()`'s first `steps` steps, each step's loss and grad_norm, trained once a
  session: the workers of one session share them through a file (JSON holds the float32 values
  exactly), the first to need them training them while the others wait."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # the session's folder, above each worker's own
  path = pathlib.Path(shared) / f"{name}.json"
  with open(f"{path}.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      path.write_text(json.dumps([{"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}
                                  for m in run_steps(make_config(), steps)[0]]))
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def single_reference(data_dir, tmp_path_factory) -> list[dict]:
  """The tiny config's first 4 steps on one device, each step's loss and grad_norm: the
  trajectory that the parity tests of several files compare with."""
  return _shared_trajectory(tmp_path_factory, "single_reference", lambda: tiny_config(
      data_dir, vision=(0, 1, 1), language=(0, 1, 1)))


@pytest.fixture(scope="session")
def bf16_reference(data_dir, tmp_path_factory) -> list[dict]:
  """The tiny config's first 4 steps on one device computing in bfloat16 (its defaults
  otherwise: no FP8, gradients folded), each step's loss and grad_norm: the run that
  test_fp8.py, test_fp8_delayed.py and test_fold.py each compare with."""
  return _shared_trajectory(tmp_path_factory, "bf16_reference", lambda: bf16_config(data_dir))


# The files that take longest, longest first (measured in a whole run of the suite on two workers
# of a 2-core machine). Started first, a long file does not run alone at the end while the other
# worker idles, as with xdist's own order (most tests first), which puts them last.
LONGEST_FIRST = ("test_pipeline.py", "test_multiprocess.py", "test_faults.py", "test_demo.py",
                 "test_lora_dropout.py", "test_fsdp.py", "test_audio_parity.py",
                 "test_fp8_delayed.py", "test_av_demo.py", "test_dynamic.py", "test_parity.py",
                 "test_checkpoint.py", "test_head_loss.py", "test_conversations.py", "test_hf.py",
                 "test_lora.py", "test_optim.py", "test_lora_resume.py", "test_tools_bench.py",
                 "test_fp8.py", "test_stages.py", "test_hf_tools.py", "test_recipe.py",
                 "test_generate.py", "test_audio_hf.py", "test_convert_audio.py", "test_cli.py",
                 "test_tool_faults.py", "test_convert_faults.py", "test_reorder.py",
                 "test_schedule.py", "test_compile.py")


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
