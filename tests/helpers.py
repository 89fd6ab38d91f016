"""Small configs and runners shared by the tests."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import types

import jax
import numpy as np

from mimo_jax import precompile
from mimo_jax.config import Config
from mimo_jax.data import loader
from mimo_jax.data.layout import Layout
from mimo_jax.data.tokenizer import IMG
from mimo_jax.encoders.vision import ImageSlots
from mimo_jax.step import Step
from mimo_jax.validation import validate
from tests.configs import tiny

# Image tokens each `<image>` of tests/fixtures/chat's processor references expands to: an 8 x 8
# image in patches of 4, every patch (tools/chat_fixtures.py writes the references with it).
CHAT_IMAGE_TOKENS = 4


def tiny_config(data_dir: str, **topo) -> Config:
  """tests/configs/tiny.py; `topo` maps module -> (offset, dp, tp[, pp[, virtual]])."""
  cfg = tiny.get_config(topology_arg(**topo))
  cfg.data.dir = data_dir
  return cfg


def bf16_config(data_dir: str) -> Config:
  """The tiny config on one device computing in bfloat16, its defaults otherwise (no FP8,
  gradients folded): conftest.py's bf16_reference trains it."""
  cfg = tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1))
  cfg.model.dtype = "bfloat16"
  return cfg


def topology_arg(**topo) -> str:
  """The tiny config's argument for a topology, e.g. vision=0/4/1,language=4/2/2."""
  return ",".join(f"{name}={'/'.join(str(v) for v in spec)}" for name, spec in topo.items())


def run_steps(cfg: Config, steps: int, batches=None) -> tuple[list[dict], Step, dict, dict]:
  """Runs `steps` optimizer steps.

  Returns host metrics per step, the step, the final state and the initial parameters (host).
  """
  validate(cfg, len(jax.devices()))
  step = Step.build(cfg)
  state = step.init_state(cfg.train.seed)
  init = {n: jax.device_get(s.params) for n, s in state.items()}
  if batches is None:
    path = loader.build_paths(cfg)["train"]
    ds = loader.train_dataset(cfg, path, step.ctx.groups)
    batches = [ds[s] for s in range(steps)]
  elif callable(batches):
    batches = batches(step.ctx.groups)
  out = []
  for batch in batches[:steps]:
    state, metrics = step.train_step(state, batch)
    out.append(jax.device_get(metrics))
  # Programs compiled ahead (precompile.py) are compiled for the plan's parameter layout before
  # the state exists: the state must hold exactly that, or every step would compile again.
  planned = precompile.abstract({n: step.plan[n].abstract_params for n in state})
  assert precompile.abstract({n: s.params for n, s in state.items()}) == planned
  return out, step, state, init


def language_step_hlo(step: Step, state: dict, batch) -> list[str]:
  """Trains `batch` as one step of `step`; returns the compiled HLO of each of its language-step
  calls (one a microbatch, or one for a pipelined model)."""
  hlo = []
  program = step.programs.language_step

  def capture(*args):
    hlo.append(program.lower(*args).compile().as_text())
    return program(*args)
  step.programs = dataclasses.replace(step.programs, language_step=capture)
  step.train_step(state, batch)
  return hlo


def assert_close_trajectory(ref: list[dict], got: list[dict], rtol: float) -> None:
  for key in ("loss", "grad_norm"):
    a = np.array([float(m[key]) for m in ref])
    b = np.array([float(m[key]) for m in got])
    np.testing.assert_allclose(b, a, rtol=rtol, atol=0, err_msg=key)
  assert all(int(m["mismatches"]) == 0 for m in got)


def image_layout(seq_len: int, tokens_per_image: int, groups: int, slots: int,
                 image_shape: tuple = (8, 8, 1), pack_rows: int = 0, slot_patches: int = 0,
                 patch_size: int = 4, downsample: int = 1, slot_images: int = 0) -> Layout:
  """A layout with the vision encoder's image slots only (as the digits and synthetic tasks)."""
  tokens = slot_patches // downsample**2 if slot_patches else tokens_per_image
  return Layout(seq_len, groups, (ImageSlots("vision", IMG, groups, slots, tokens, slot_images,
                                             image_shape=image_shape, slot_patches=slot_patches,
                                             patch_size=patch_size, downsample=downsample),),
                pack_rows=pack_rows)


def assert_hf_error(capsys, fn, *words) -> None:
  """`fn` exits with status 2 and one line `tools.hf: error: ...` containing `words`."""
  import pytest  # pylint: disable=import-outside-toplevel
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    fn()
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tools.hf: error: "), lines
  for w in words:
    assert w in lines[0], (w, lines[0])


def run_main(main, *args) -> types.SimpleNamespace:
  """A tool's `main(argv)` in this process (no JAX start-up): its exit status and what it
  printed, as `subprocess.run(..., capture_output=True)` gives them."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    status = main([str(a) for a in args])
  return types.SimpleNamespace(returncode=status, stdout=out.getvalue(), stderr=err.getvalue())


@contextlib.contextmanager
def file_size_limit(nbytes: int):
  """While the block runs, a write past `nbytes` into any file fails in this process (EFBIG:
  Python ignores SIGXFSZ), as a full disk fails it: a real failed write, whichever library
  writes (RLIMIT_FSIZE; the limit before is put back)."""
  import resource  # pylint: disable=import-outside-toplevel
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def deep_images(image, folder) -> dict:
  """Image file `image` as 8-bit grayscale ("8"), as a 16-bit PNG ("16") and as a float TIFF
  ("float") of the same values, and as a float TIFF of values past [0, 1] ("past"), in `folder`:
  their paths."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  gray = np.asarray(Image.open(image).convert("L"))
  files = {k: folder / f for k, f in (("8", "gray8.png"), ("16", "gray16.png"),
                                      ("float", "gray.tif"), ("past", "past.tif"))}
  Image.fromarray(gray).save(files["8"])
  Image.fromarray(gray.astype(np.uint16) * 257).save(files["16"])  # 255 -> 65535
  Image.fromarray(gray.astype(np.float32) / 255, "F").save(files["float"])
  Image.fromarray(gray.astype(np.float32), "F").save(files["past"])  # 0..255 as floats
  return files
