"""The persistent compilation cache (compile_cache.py) and the step programs compiled ahead
(precompile.py)."""

import concurrent.futures
import json
import os
import subprocess
import sys
import threading

import jax
import pytest
from jax import monitoring

from mimo_jax import compile_cache, precompile
from mimo_jax.data import av_digits, digits, loader
from mimo_jax.step import Step
from tests.helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process: a program compiled with the cache at argv[1]; prints the cache hits it saw.
_PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
from mimo_jax import compile_cache
hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event.endswith("/cache_hits") else None)
path = compile_cache.enable(sys.argv[1])
jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(jnp.ones(64)).block_until_ready()
print(json.dumps({"path": path, "hits": len(hits),
                  "bound": jax.config.jax_compilation_cache_max_size}))
"""


def _compile_in_process(cache: str, xla_flags: str, **extra) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu",
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env.pop(compile_cache.ENV, None)
  env.pop(compile_cache.MAX_SIZE_ENV, None)  # the suite's own (conftest): jax's default here
  env.update(extra)
  out = subprocess.run([sys.executable, "-c", _PROGRAM, cache], env=env, capture_output=True,
                       text=True, check=True, timeout=300)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _entries(cache) -> set[str]:
  return {f for f in os.listdir(cache) if f.endswith("-cache")}


def test_second_process_hits_the_cache_and_other_flags_miss(tmp_path):
  cache = str(tmp_path / "xla")
  flags = os.environ.get("XLA_FLAGS", "")
  first = _compile_in_process(cache, flags)
  assert first["path"] == cache and first["hits"] == 0
  written = _entries(cache)
  assert written, "the first process wrote no cache entry"
  # Bounded, so that jax locks the directory around every read and write (shared by processes).
  assert first["bound"] == compile_cache.MAX_BYTES
  assert os.path.exists(os.path.join(cache, ".lockfile"))
  second = _compile_in_process(cache, flags)
  assert second["hits"] == len(written) and _entries(cache) == written  # every program read
  level = "1" if "--xla_backend_optimization_level=1" not in flags else "2"
  other = _compile_in_process(cache, f"{flags} --xla_backend_optimization_level={level}")
  assert other["hits"] == 0 and len(_entries(cache)) > len(written)
  # A size the environment gives is kept, unbounded included.
  assert _compile_in_process(cache, flags, **{compile_cache.MAX_SIZE_ENV: "-1"})["bound"] == -1


def test_where_the_cache_is(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.default_dir() == str(tmp_path / "mimo_jax" / "xla")
  # The built-in tasks' data goes beside it.
  assert digits.default_dir() == str(tmp_path / "mimo_jax" / "digits")
  assert av_digits.default_dir() == str(tmp_path / "mimo_jax" / "av_digits")
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert compile_cache.default_dir() == os.path.expanduser("~/.cache/mimo_jax/xla")
  assert digits.default_dir() == os.path.expanduser("~/.cache/mimo_jax/digits")
  # auto keeps the directory jax was given (conftest gives the suite its own).
  assert jax.config.jax_compilation_cache_dir
  assert compile_cache.resolve("auto") == jax.config.jax_compilation_cache_dir
  assert compile_cache.resolve(str(tmp_path / "c")) == str(tmp_path / "c")
  assert compile_cache.resolve("") == ""
  monkeypatch.setenv(compile_cache.ENV, "")
  assert compile_cache.resolve(str(tmp_path / "c")) == ""
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "d"))
  assert compile_cache.resolve("auto") == str(tmp_path / "d")


def test_an_unwritable_cache_directory_names_the_field(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(compile_cache.CompileCacheError, match=r"run\.compile_cache: cannot write"):
    compile_cache.enable(str(blocker / "xla"))


def _bucketed(data_dir):
  """The tiny config on one device with packed rows and row and slot buckets: microbatches of a
  few shapes."""
  cfg = tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1))
  d = cfg.data
  d.seq_len, d.pack_rows, d.row_buckets, d.slot_buckets, d.microbatches = 48, 10, 10, 4, 4
  return cfg


def test_step_programs_compiled_ahead_are_the_ones_the_steps_run(data_dir):
  """Compiled in background threads for batches read ahead, the fused step's programs (one a
  microbatch shape) and those around them (accumulator, norm, update) are the ones the steps then
  call: no step compiles anything, and the steps give what steps that compiled their programs
  when met give."""
  compiled = []
  listener = lambda event, seconds, **kw: compiled.append(kw.get("fun_name", "")) if (
      event == "/jax/core/compile/backend_compile_duration") else None
  fused = lambda: [n for n in compiled if "fused_step" in n]
  cfg = _bucketed(data_dir)
  steps = 1  # its 4 microbatches have 2 shapes
  monitoring.register_event_duration_secs_listener(listener)
  try:
    step = Step.build(cfg)
    assert step.ctx.mode.fused
    state = step.init_state(cfg.train.seed)
    path = loader.build_paths(cfg)["train"]
    ds = loader.train_dataset(cfg, path, step.ctx.groups)
    said = []
    compiler = precompile.Compiler(step, threads=2, say=said.append)
    ahead = precompile.Ahead(iter(ds[s] for s in range(steps + 5)), compiler, depth=1, limit=steps)
    ahead.close = lambda: None  # a plain iterator has nothing to close
    losses = []
    for _ in range(steps):
      batch, keys = next(ahead)
      compiler.wait(keys)
      before = list(compiled)
      state, metrics = step.train_step(state, batch)
      assert compiled == before  # this step compiled no program (they were all compiled ahead)
      losses.append(float(jax.device_get(metrics["loss"])))
    with pytest.raises(StopIteration):  # nothing read (or compiled) past the run's steps
      next(ahead)
    shapes = {(int(b.text.rows_sent[m]), int(b.slots["vision"].sent[m]))
              for b in (ds[s] for s in range(steps)) for m in range(cfg.data.microbatches)}
    assert len(shapes) > 1 and compiler.shapes == len(shapes) == len(fused()) == len(said)
    compiler.close()
  finally:
    monitoring.unregister_event_duration_listener(listener)
  plain = Step.build(cfg)
  state = plain.init_state(cfg.train.seed)
  for s in range(steps):
    state, metrics = plain.train_step(state, ds[s])
    assert float(jax.device_get(metrics["loss"])) == losses[s]


def test_while_compiling_pad_runs_a_microbatch_on_a_compiled_shape_that_holds_it(data_dir):
  """run.while_compiling=pad: while a microbatch's own program compiles, the step sends it padded
  to the full shape (compiled first, alone), which compiles nothing more and gives the loss and
  gradient norm of the unpadded step up to float32 rounding; the other shapes compile once the
  first step has ended, and then the microbatch goes as it is. With run.autotune=false (as configs/vlm.py:tuned pads) the programs
  compiled ahead carry XLA's heuristic-kernel options and are still the ones the steps call."""
  cfg = _bucketed(data_dir)
  cfg.run.autotune = False
  step = Step.build(cfg)
  state = step.init_state(cfg.train.seed)
  ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)
  compiler = precompile.Compiler(step, threads=2, say=lambda line: None, pad=True)
  gate, compile_ = threading.Event(), compiler._compile
  compiler._compile = lambda x, number: compile_(x, number) if number == 1 or gate.wait() else 0
  parked = threading.Semaphore(0)

  class Parking(threading.Event):
    def wait(self, timeout=None):
      parked.release()
      return super().wait(timeout)
  compiler._first_step = Parking()
  batch = ds[0]
  keys = compiler.keys(batch)
  padded_batch, used, padded = compiler.fit(batch, keys)
  rows = padded_batch.text.tokens_rl.shape[1] // step.ctx.groups
  assert padded == batch.microbatches and len(set(used)) == 1 and set(used).isdisjoint(keys)
  assert list(padded_batch.text.rows_sent) == [rows] * batch.microbatches
  assert list(batch.text.rows_sent) != list(padded_batch.text.rows_sent)  # the input is kept
  compiled = []
  listener = lambda event, seconds, **kw: compiled.append(kw.get("fun_name", "")) if (
      event == "/jax/core/compile/backend_compile_duration") else None
  monitoring.register_event_duration_secs_listener(listener)
  try:
    _, padded_metrics = step.train_step(state, padded_batch)
    padded_metrics = jax.device_get(padded_metrics)
    assert not [n for n in compiled if "fused_step" in n]  # the full shape's program ran
  finally:
    monitoring.unregister_event_duration_listener(listener)
  # The other shapes start once the first step has ended (on a restart each would load from the
  # cache beside it): released, they wait for it.
  gate.set()
  for _ in range(min(len(set(keys)), 2)):  # each of the 2 threads holds one
    assert parked.acquire(timeout=60)
  assert not compiler.ready(keys)
  compiler.first_step_ended()
  compiler.wait(keys)
  same, used, padded = compiler.fit(batch, keys)
  assert padded == 0 and same is batch and used == keys
  _, metrics = step.train_step(step.init_state(cfg.train.seed), batch)  # the first was donated
  metrics = jax.device_get(metrics)
  for name in ("loss", "grad_norm"):
    assert float(padded_metrics[name]) == pytest.approx(float(metrics[name]), rel=1e-6)
  compiler.close()


def test_a_run_that_ends_before_its_first_step_compiles_no_more_shapes(data_dir):
  """With pad, a run stopped (or failed) before its first step ended closes its compiler: the
  shapes waiting for the first step never compile (a process exit would wait for them)."""
  cfg = _bucketed(data_dir)
  step = Step.build(cfg)
  ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)
  said = []
  compiler = precompile.Compiler(step, threads=2, say=said.append, pad=True)
  keys = compiler.keys(ds[0])
  compiler.fit(ds[0], keys)  # waits for the full shape
  compiler.close()
  for key in set(keys):
    with pytest.raises(concurrent.futures.CancelledError):
      compiler._futures[key].result(timeout=60)
  concurrent.futures.wait([compiler._rest], timeout=60)  # compiled, or stopped by the close
  assert len(compiler.seconds) == 1 and len(said) == 1, said  # the full shape's alone


def test_padding_on_a_gpu_needs_heuristic_kernels_and_one_process(data_dir):
  """Autotuning compiles time kernels on the GPU behind the padded steps: refused, naming the
  fields; CPUs have nothing to time. Several processes would each pad by their own compiles."""
  from mimo_jax.config import ConfigError
  from mimo_jax.validation import validate_backend
  cfg = _bucketed(data_dir)
  cfg.run.while_compiling = "pad"
  with pytest.raises(ConfigError, match=r"run\.while_compiling.*run\.autotune=false"):
    validate_backend(cfg, "gpu")
  validate_backend(cfg, "cpu")
  cfg.run.autotune = False
  validate_backend(cfg, "gpu")
  with pytest.raises(ConfigError, match=r"run\.while_compiling: pad runs in one process only"):
    validate_backend(cfg, "gpu", processes=2)  # each would pad by its own compiles


def test_step_programs_run_data_bound_loops_in_command_buffers_unless_told_not_to(data_dir):
  """run.device_loops adds loops and conditionals to XLA's command buffers, beside the kinds XLA
  records by default and beside run.autotune=false's heuristic kernels, where no module is
  pipelined; XLA accepts the option and a loop whose trip count is data compiles and runs with
  it."""
  import jax.numpy as jnp
  from mimo_jax import programs
  cfg = tiny_config(data_dir)
  kinds = programs.compiler_options(cfg)["xla_gpu_enable_command_buffer"].split(",")
  assert {"WHILE", "CONDITIONAL", "FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN"} <= set(
      kinds)
  assert programs.step_options(Step.build(cfg).ctx) == programs.DEVICE_LOOPS
  assert programs.compiler_options(cfg, pipelined=True) is None
  cfg.run.autotune = False
  assert programs.compiler_options(cfg) == {**programs.HEURISTIC_KERNELS, **programs.DEVICE_LOOPS}
  cfg.run.device_loops = False
  assert programs.compiler_options(cfg) == programs.HEURISTIC_KERNELS
  cfg.run.autotune = True
  assert programs.compiler_options(cfg) is None
  loop = jax.jit(lambda n, x: jax.lax.fori_loop(0, n, lambda i, a: a * 2, x),
                 compiler_options=programs.DEVICE_LOOPS)
  assert float(loop(jnp.int32(5), jnp.float32(1.5))) == 48.0
