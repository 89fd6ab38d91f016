"""The read-only tools beside a live run and under bad input, in-process: `tools.ckpt`
check/inspect/export, `tools.generate` and `tools.eval` read committed steps only, take a step
rotated away under them for gone (not damaged) and say that a run holds the workdir; `export`
writes its file staged; no warning prints above an error line (garbage values that reach the
fingerprint's bfloat16 cast included); `generate` refuses bad flags, another model's tokenizer,
unencodable words, oversized images and prompts past the context in one line, prepares images as
the run's data was and finds a run's older relative paths from any directory."""

import json
import os
import pathlib
import shutil
import signal
import socket
import struct
import sys
import warnings
import zlib

import jax
import numpy as np
import pytest
from PIL import Image

from mimo_jax import checkpoint, checkpoint_reader, hf, run_paths
from mimo_jax import modules
from mimo_jax.checkpoint import Checkpointer, complete_steps
from mimo_jax.config import Config
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.data import conversations, conversion
from mimo_jax.state import ModuleState
from mimo_jax.validation import validate
from tests.helpers import deep_images, file_size_limit
from tests.test_generate import _tokenizer
from tools import ckpt
from tools import eval as eval_tool
from tools import generate as generate_tool

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
IMAGE = FIXTURES / "images" / "landscape.png"  # 64x27: padding to a square changes it
STEPS = (10, 20, 30)
SEQ_LEN = 48  # the run's rows: the context of a model trained from scratch


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> pathlib.Path:
  """A run's launch directory, as an older version left it: tok/ (tokenizer and processor),
  data/ (a record converted with pad_to_square, train and eval, its manifest naming tok/ relative to this
  directory), run/ (steps 10, 20, 30 of the LLaVA fixture's weights, saved by a run whose
  run.workdir and data.dir were relative)."""
  root = tmp_path_factory.mktemp("launch")
  _tokenizer(root / "tok")
  (root / "records.json").write_text(json.dumps([{
      "id": i, "image": IMAGE.name, "conversations": [
          {"from": "human", "value": "<image>\nwhat is in the picture"},
          {"from": "gpt", "value": "hello there"}]} for i in ("a", "b")]))
  conversion.convert(root / "records.json", root / "data", conversion.Options(
      tokenizer=str(root / "tok"), images=str(IMAGE.parent), pad_to_square=True),
                     eval_ids=[1], progress=False)
  manifest = json.loads((root / "data" / conversations.MANIFEST).read_text())
  manifest.update(tokenizer="tok", processor="tok")  # relative to the converter's directory
  (root / "data" / conversations.MANIFEST).write_text(json.dumps(manifest))
  src = hf.Source.open(FIXTURES / "hf" / "llava15")
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.data.task, cfg.model.vision.max_images, cfg.data.image_probs = "synthetic", 1, "0.5,0.5"
  cfg.model.language.vocab_size = 64
  hf.configure(cfg, src)
  validate(cfg)
  built = modules.build_modules(cfg)
  params = {m: jax.device_put(hf.load(src, m, cfg, built[m].init(0)))
            for m in ("vision", "language")}
  cfg.data.task, cfg.data.dir, cfg.run.workdir, cfg.data.seq_len = (
      "conversations", "data", "run", SEQ_LEN)
  saver = Checkpointer(str(root / "run" / "checkpoints"), list(params), async_save=False)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(run_paths, "absolute", lambda c: c)  # the paths as they were given
    for step in STEPS:
      saver.save(step, {m: ModuleState(p, None) for m, p in params.items()}, cfg, force=True,
                 params_only=True)
  saver.close()
  (root / "elsewhere").mkdir()
  return root


@pytest.fixture
def run(launch, tmp_path, monkeypatch) -> pathlib.Path:
  """A copy of the launch directory for one test: its run's workdir, with the current directory
  elsewhere."""
  shutil.copytree(launch, tmp_path / "launch")
  monkeypatch.chdir(tmp_path / "launch" / "elsewhere")
  monkeypatch.setattr(checkpoint_reader, "SETTLE_S", 0.0)
  return tmp_path / "launch" / "run"


def _live(work: pathlib.Path) -> None:
  """A run.lock of a process that is running (this one)."""
  (work / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                             "started": "2026-11-24 10:00:00"}))


def _removed_when_read(monkeypatch, work: pathlib.Path, step: int, reader: str) -> None:
  """The step folder disappears as `reader` (a checkpoint_reader read) starts on it: the run's
  rotation (checkpoint.keep) deleting it between the listing and the read."""
  real = getattr(checkpoint_reader, reader)

  def read(mngr, s, *rest):
    if s == step and (work / "checkpoints" / str(step)).exists():
      shutil.rmtree(work / "checkpoints" / str(step))
    return real(mngr, s, *rest)
  monkeypatch.setattr(checkpoint_reader, reader, read)


def _damage(work: pathlib.Path, step: int) -> None:
  """Flipped bytes in the largest array file of each module of `step`."""
  for module in ("vision", "language"):
    files = sorted((work / "checkpoints" / str(step) / module).rglob("d/*"),
                   key=lambda p: p.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    for i in range(64):
      data[len(data) // 3 + 5 * i] ^= 0xA5
    files[-1].write_bytes(bytes(data))


@pytest.fixture(autouse=True)
def _warnings_on_stderr():
  """Every warning printed to stderr, as a user running the tool sees it: pytest records warnings
  aside, which would hide one in front of a tool's error line from `_error`."""
  def show(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    warnings.showwarning = show
    yield


def _garbage_when_read(monkeypatch, step: int, key: str) -> None:
  """Parameter `key` (`module/path`) of `step` reads back as garbage float32 (NaNs, values past
  bfloat16's range): damaged bytes that still decompress. `_damage` flips bytes where the file
  layout puts them, which may leave a step unreadable before any value is looked at."""
  module, path = key.split("/", 1)

  def garbled(x):
    bits = np.random.default_rng(0).integers(0, 2**32, x.size, dtype=np.uint64)
    return bits.astype(np.uint32).view(np.float32).reshape(x.shape)
  real_params = checkpoint_reader._read_params  # pylint: disable=protected-access
  real_module = checkpoint_reader._read_module  # pylint: disable=protected-access

  def read_params(mngr, s, modules):
    flat = real_params(mngr, s, modules)
    if s == step and key in flat:
      flat[key] = garbled(flat[key])
    return flat

  def read_module(mngr, s, m):
    tree = real_module(mngr, s, m)
    if s == step and m == module:
      *parents, leaf = path.split("/")
      node = tree["params"]
      for k in parents:
        node = node[k]
      node[leaf] = garbled(node[leaf])
    return tree
  monkeypatch.setattr(checkpoint_reader, "_read_params", read_params)
  monkeypatch.setattr(checkpoint_reader, "_read_module", read_module)


def _error(capsys, tool: str, *words: str) -> str:
  """The last line of stderr: one error sentence of `tool` with `words`; no traceback, no
  warning."""
  err = capsys.readouterr().err
  assert "Traceback" not in err and "Warning:" not in err, err
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"{tool}: error: "), err
  for w in words:
    assert w in last, (w, last)
  return last


# tools.ckpt beside a live run.

def test_check_beside_a_live_run_takes_a_rotated_step_for_gone(run, monkeypatch, capsys):
  _live(run)
  _removed_when_read(monkeypatch, run, 10, "_read_module")
  assert ckpt.main(["check", str(run)]) == 0
  out, err = capsys.readouterr()
  assert ("step 10 was removed while being read (the run rotates old steps: checkpoint.keep)"
          in out), out
  assert "FAILED" not in out and "step 20: " in out and "step 30: " in out
  assert f"pid {os.getpid()}" in err and "newer steps may appear" in err


def test_check_fails_only_damaged_steps_and_never_advises_moving_good_ones(run, capsys):
  _damage(run, 20)  # a middle step: the newest passes, a resume reads it
  assert ckpt.main(["check", str(run)]) == 2
  last = _error(capsys, "tools.ckpt", "step 20", "newest step 30 passed")
  assert "restore_step" not in last
  _damage(run, 30)  # now the newest: resume from the newest that passed
  assert ckpt.main(["check", str(run)]) == 2
  _error(capsys, "tools.ckpt", "steps 20, 30", "--config.checkpoint.restore_step=10")
  _live(run)  # a live run writes its next step itself: no resume advice while it runs
  assert ckpt.main(["check", str(run)]) == 2
  out, err = capsys.readouterr()
  assert "step 30: FAILED" in out and "step 10: " in out
  last = err.strip().splitlines()[-1]
  assert last.startswith("tools.ckpt: error: ") and "Traceback" not in err
  assert "restore_step" not in last and f"pid {os.getpid()}" in last


def test_check_never_advises_deleting_the_frozen_base_a_passing_step_reads(run, monkeypatch,
                                                                           capsys):
  """A LoRA run's later steps read its frozen weights from its step 0 (here steps 20 and 30 name
  step 10): that step failing makes them unusable, so it is not one of "the failed steps never
  read", and a step checked alone brings its base into the check."""
  real = checkpoint_reader.Reader.meta

  def meta(self, step):
    m = dict(real(self, step))
    if step != 10:
      m["base"] = {"path": ".", "step": 10, "fingerprints": {}}
      m["digest"] = checkpoint.digest(m)
    return m
  monkeypatch.setattr(checkpoint_reader.Reader, "meta", meta)
  _damage(run, 10)
  assert ckpt.main(["check", str(run)]) == 2
  last = _error(capsys, "tools.ckpt", "steps 20, 30 passed but read the frozen weights of step "
                "10, which failed: do not delete it", "--config.checkpoint.base=DIR")
  assert "nothing to do" not in last
  assert ckpt.main(["check", str(run), "--step", "30"]) == 2
  out = capsys.readouterr().out
  assert "step 30: " in out and "step 10: FAILED" in out and "step 20" not in out


def test_a_steps_own_folder_is_named_with_the_workdir_and_step_to_give(run, capsys):
  assert ckpt.main(["check", str(run / "checkpoints" / "30")]) == 2
  _error(capsys, "tools.ckpt", "checkpoints/30 is one step's folder; give the run's workdir "
         f"{run} (or its checkpoints/ folder) with --step 30.")


def test_a_step_missing_a_modules_folder_fails_alone(run, capsys):
  """The newest step without its language folder is damaged; the steps before it still pass
  (their items are read with handlers for every item any step holds)."""
  shutil.rmtree(run / "checkpoints" / "30" / "language")
  assert ckpt.main(["check", str(run)]) == 2
  out = capsys.readouterr().out
  assert "step 30: FAILED" in out and "step 20: FAILED" not in out and "step 10: FAILED" not in out
  assert ckpt.main(["check", str(run), "--step", "20"]) == 0


def test_check_of_a_truncated_step_prints_no_closed_loop_reports(run, monkeypatch, capsys):
  """A step's file cut to 0 bytes: orbax's reads left behind report "Event loop is closed" from
  its threads, some before the failure reaches the reader and some after the tool's `main` (its
  interrupt handling put back the hooks it found): none may print around the error line."""
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  closed = lambda: sys.unraisablehook(  # pylint: disable=unnecessary-lambda-assignment
      type("Report", (), {"exc_type": RuntimeError, "object": None, "err_msg": None,
                          "exc_value": RuntimeError("Event loop is closed"),
                          "exc_traceback": None})())
  real = checkpoint_reader._read_module  # pylint: disable=protected-access

  def read_module(mngr, step, module):
    if step == 30:
      closed()  # a leftover of the failed read, before the failure reaches the reader
    return real(mngr, step, module)
  monkeypatch.setattr(checkpoint_reader, "_read_module", read_module)
  largest = max((run / "checkpoints" / "30").rglob("d/*"), key=lambda p: p.stat().st_size)
  largest.write_bytes(b"")
  assert ckpt.main(["check", str(run)]) == 2
  closed()  # one after main
  _error(capsys, "tools.ckpt", "step 30", "--config.checkpoint.restore_step=20")
  assert seen == []


def test_check_names_only_the_module_whose_metadata_is_damaged(run, capsys):
  (run / "checkpoints" / "30" / "vision" / "_METADATA").write_text("garbage{")
  assert ckpt.main(["check", str(run)]) == 2
  out = capsys.readouterr().out
  line = [ln for ln in out.splitlines() if ln.startswith("step 30: ")][0]
  assert "vision: unreadable" in line and "language" not in line, line


def test_inspect_and_export_beside_a_live_run_follow_the_newest_step(run, monkeypatch, capsys):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  _live(run)
  _removed_when_read(monkeypatch, run, 30, "_meta")
  out = run.parent / "out" / "model.safetensors"
  out.parent.mkdir()
  assert ckpt.main(["export", str(run), "--out", str(out)]) == 0
  stdout, err = capsys.readouterr()
  assert "step 30 was removed while being read" in err and "of step 20" in stdout
  assert set(load_file(str(out))) and os.listdir(out.parent) == ["model.safetensors"]
  mask = os.umask(0)
  os.umask(mask)
  assert os.stat(out).st_mode & 0o777 == 0o666 & ~mask  # as any new file, not owner-only
  # A given step that is removed names the steps there are now.
  _removed_when_read(monkeypatch, run, 20, "_meta")
  assert ckpt.main(["inspect", str(run), "--step", "20"]) == 2
  _error(capsys, "tools.ckpt", "step 20 was removed while being read", "steps 10 now")


def test_inspect_names_the_step_it_shows_where_there_are_several(run, capsys):
  assert ckpt.main(["inspect", str(run)]) == 0
  assert "steps: 10, 20, 30 (showing 30)\n" in capsys.readouterr().out
  for step in (10, 20):
    shutil.rmtree(run / "checkpoints" / str(step))
  assert ckpt.main(["inspect", str(run)]) == 0
  assert "steps: 30\n" in capsys.readouterr().out


def test_export_is_staged_checked_for_space_and_refuses_an_existing_file_or_directory(
    run, monkeypatch, capsys):
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  from mimo_jax import output  # pylint: disable=import-outside-toplevel
  out = run.parent / "out" / "model.safetensors"
  out.parent.mkdir()
  out.write_bytes(b"an earlier export")
  assert ckpt.main(["export", str(run), "--out", str(out)]) == 2
  _error(capsys, "tools.ckpt", f"--out={str(out)!r} exists")
  assert out.read_bytes() == b"an earlier export"
  out.unlink()
  real = output.shutil.disk_usage
  monkeypatch.setattr(output.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
  assert ckpt.main(["export", str(run), "--out", str(out)]) == 2
  _error(capsys, "tools.ckpt", "needs about", "B at", "where 1.0 kB are free", "free space")
  monkeypatch.setattr(output.shutil, "disk_usage", real)
  # A write that fails midway (a file size limit, as a full disk): safetensors raises its
  # SafetensorError, which is no OSError.
  with file_size_limit(4096):
    assert ckpt.main(["export", str(run), "--out", str(out)]) == 2
  _error(capsys, "tools.ckpt", f"--out={str(out)!r}", "refused the write (File too large)")
  assert os.listdir(out.parent) == []  # no partial file, no lock
  # An existing directory is refused as --out.
  out.mkdir()
  assert ckpt.main(["export", str(run), "--out", str(out)]) == 2
  _error(capsys, "tools.ckpt", f"--out={str(out)!r} is a directory", "model.safetensors")
  assert os.listdir(out) == []
  out.rmdir()
  assert ckpt.main(["export", str(run), "--out", ""]) == 2  # was named a directory (the cwd)
  _error(capsys, "tools.ckpt", "--out is empty", "model.safetensors")

  def killed(tensors, path, metadata=None):  # pylint: disable=unused-argument
    pathlib.Path(path).write_bytes(b"half a file")
    raise output.Interrupted(signal.SIGTERM)
  monkeypatch.setattr(safetensors.numpy, "save_file", killed)
  assert ckpt.main(["export", str(run), "--out", str(out)]) == 143
  assert "interrupted (SIGTERM)" in capsys.readouterr().err
  assert os.listdir(out.parent) == []

  def ctrl_c(tensors, path, metadata=None):  # pylint: disable=unused-argument
    raise KeyboardInterrupt
  monkeypatch.setattr(safetensors.numpy, "save_file", ctrl_c)
  assert ckpt.main(["export", str(run), "--out", str(out)]) == 130
  assert "interrupted (Ctrl-C); nothing was written" in capsys.readouterr().err
  assert os.listdir(out.parent) == []


def test_export_and_generate_refuse_a_damaged_step(run, capsys):
  _damage(run, 30)
  out = run.parent / "model.safetensors"
  assert ckpt.main(["export", str(run), "--out", str(out)]) == 2
  _error(capsys, "tools.ckpt", "step 30", "damaged", "--step")  # unreadable or not its values
  assert not out.exists()
  assert generate_tool.main([str(run), "--prompt", "hello"]) == 2
  _error(capsys, "tools.generate", "step 30", "damaged", "--step")


def test_garbage_values_fail_check_export_and_generate_in_one_line_without_a_warning(
    run, monkeypatch, capsys):
  # The fingerprint check casts float32 values to bfloat16 (a frozen weight of a bfloat16 run is
  # fingerprinted so): garbage there must not print numpy's cast warning above the error line.
  _garbage_when_read(monkeypatch, 30, "language/blocks/mlp/up/kernel")
  assert ckpt.main(["check", str(run), "--step", "30"]) == 2
  out, _ = capsys.readouterr()
  assert "language params/blocks/mlp/up/kernel: does not match its fingerprint" in out, out
  assert ckpt.main(["check", str(run)]) == 2
  _error(capsys, "tools.ckpt", "step 30", "--config.checkpoint.restore_step=20")
  out = run.parent / "model.safetensors"
  assert ckpt.main(["export", str(run), "--out", str(out)]) == 2
  _error(capsys, "tools.ckpt", "step 30", "language/blocks/mlp/up/kernel", "damaged")
  assert not out.exists()
  assert generate_tool.main([str(run), "--prompt", "hello"]) == 2
  _error(capsys, "tools.generate", "step 30", "language/blocks/mlp/up/kernel", "damaged")


# tools.generate.

def test_generate_beside_a_live_run_answers_from_the_newest_step(run, monkeypatch, capsys):
  _live(run)
  _removed_when_read(monkeypatch, run, 30, "_meta")
  assert generate_tool.main([str(run), "--prompt", "hello there", "--max_new_tokens", "2"]) == 0
  out, err = capsys.readouterr()
  assert out.splitlines()[0] == "> hello there" and len(out.splitlines()) == 2
  assert f"pid {os.getpid()}" in err and "step 30 was removed while being read" in err
  assert complete_steps(run / "checkpoints") == [10, 20]


def test_eval_beside_a_live_run_takes_steps_rotated_away_before_or_during_the_load_for_gone(
    run, monkeypatch, capsys):
  """Step 30 is removed after the eval read its metadata, before its weights load; step 20 as
  its weights are read: neither is damaged, the eval answers from the newest step left."""
  from mimo_jax import checkpoint  # pylint: disable=import-outside-toplevel
  _live(run)
  meta = checkpoint_reader._meta  # pylint: disable=protected-access
  read = checkpoint.Checkpointer.read

  def meta_then_rotated(mngr, s):
    got = meta(mngr, s)
    shutil.rmtree(run / "checkpoints" / "30", ignore_errors=True)
    return got

  def rotated_when_read(self, s, *rest):
    if s == 20:
      shutil.rmtree(run / "checkpoints" / "20")
    return read(self, s, *rest)
  monkeypatch.setattr(checkpoint_reader, "_meta", meta_then_rotated)
  monkeypatch.setattr(checkpoint.Checkpointer, "read", rotated_when_read)
  out = run.parent / "preds.jsonl"
  assert eval_tool.main([str(run), "--data", str(run.parent / "data"), "--max_new_tokens", "2",
                         "--out", str(out)]) == 0
  stdout, err = capsys.readouterr()
  assert "step 20 was removed while being read" in err and f"pid {os.getpid()}" in err, err
  assert "error" not in err and "at step 10:" in stdout, (stdout, err)
  assert json.loads(out.with_suffix(".summary.json").read_text())["step"] == 10


@pytest.mark.parametrize("sig,at,said", [
    (signal.SIGTERM, 1, "interrupted (SIGTERM) while decoding, after 2 of 6 new tokens"),
    (signal.SIGINT, 3, "interrupted (Ctrl-C) as decoding ended"),
], ids=["SIGTERM", "Ctrl-C"])
def test_generate_stops_at_a_signal_after_the_chunk_under_way(run, monkeypatch, capsys, sig, at,
                                                              said):
  """Chunks of 2 of the 6 new tokens: a signal sent during chunk `at` stops the tool after it, in
  one line, with no answer printed and the signal's handler as it was."""
  from mimo_jax import generate  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(generate, "CHUNK", 2)
  real, chunks = generate._chunk, []  # pylint: disable=protected-access

  def chunk(*args, **kwargs):
    chunks.append(real(*args, **kwargs))
    if len(chunks) == at:
      os.kill(os.getpid(), sig)
    return chunks[-1]
  monkeypatch.setattr(generate, "_chunk", chunk)
  handler = signal.getsignal(sig)
  assert generate_tool.main([str(run), "--prompt", "hello there", "--max_new_tokens", "6"]) \
      == 128 + sig
  out, err = capsys.readouterr()
  assert out == "" and len(chunks) == at, (out, err)
  assert err.splitlines()[1:] == [f"tools.generate: {said}; no answer printed."], err
  assert err.startswith(f"{run}: 1 prompt of up to "), err
  assert signal.getsignal(sig) is handler


@pytest.mark.parametrize("flags,words", [
    (["--top_p", "0"], ["--top_p 0.0"]),
    (["--top_p", "-0.5"], ["--top_p -0.5"]),
    (["--temperature", "nan"], ["--temperature nan"]),
    (["--temperature", "-1"], ["--temperature -1.0"]),
    (["--seed", str(10**23), "--temperature", "1"], [f"--seed {10**23}: give 0 to 2**32 - 1."]),
    (["--max_new_tokens", "-3"], ["--max_new_tokens -3", "at least 1"]),
    (["--max_new_tokens", "1e8"], ["--max_new_tokens 100000000", f"{SEQ_LEN} positions",
                                   "data.seq_len"]),
    (["--prompt", " ".join(["hello"] * SEQ_LEN)], ["'hello hello", f"is {SEQ_LEN + 7} tokens",
                                                   f"{SEQ_LEN} positions"]),
    (["--pair", "--prompt", "there", "--image", str(IMAGE)],
     ["--pair: 2 prompts and 1 --image file: give one --image a prompt"]),
    (["--pair", "--audio", "a.wav", "--audio", "b.wav"],
     ["--pair: 1 prompt and 2 --audio files: give one --audio a prompt"]),
])
def test_generate_refuses_bad_flags_in_one_line(run, capsys, flags, words):
  assert generate_tool.main([str(run), "--prompt", "hello", *flags]) == 2
  _error(capsys, "tools.generate", *words)


def _variant(launch: pathlib.Path, name: str, edit) -> pathlib.Path:
  """A copy of tok/ whose tokenizer.json `edit` changed."""
  out = launch / name
  shutil.copytree(launch / "tok", out)
  tok = json.loads((out / "tokenizer.json").read_text())
  edit(tok["model"])
  (out / "tokenizer.json").write_text(json.dumps(tok))
  return out


def _swap_two(model: dict) -> None:
  a, b = list(model["vocab"])[:2]
  model["vocab"][a], model["vocab"][b] = model["vocab"][b], model["vocab"][a]


def test_generate_refuses_another_tokenizer_an_unencodable_word_and_a_bomb(run, capsys):
  launch = run.parent
  bigger = _variant(launch, "tok_bigger", lambda m: m["vocab"].update(
      {f"x{i}": 64 + i for i in range(36)}))
  assert generate_tool.main([str(run), "--prompt", "hello", "--tokenizer", str(bigger)]) == 2
  _error(capsys, "tools.generate", "--tokenizer", "100 tokens", "64")
  # A manifest of an older conversion names no vocabulary size: the model's rows are the check,
  # a tokenizer larger than them or smaller by more than padding is another model's.
  manifest_file = launch / "data" / conversations.MANIFEST
  older = json.loads(manifest_file.read_text())
  del older["vocab_size"]
  manifest_file.write_text(json.dumps(older))
  assert generate_tool.main([str(run), "--prompt", "hello", "--tokenizer", str(bigger)]) == 2
  _error(capsys, "tools.generate", "--tokenizer", "has 100 tokens, more than the model's 64")
  smaller = _variant(launch, "tok_smaller", lambda m: m.update(
      vocab={k: i for k, i in m["vocab"].items() if i < 40}))
  assert generate_tool.main([str(run), "--prompt", "hello", "--tokenizer", str(smaller)]) == 2
  _error(capsys, "tools.generate", "--tokenizer", "tokens where the model has 64")
  manifest_file.write_text(json.dumps(dict(older, vocab_size=64)))
  # A tokenizer of the same size whose ids are not the run's (two swapped) is another model's.
  swapped = _variant(launch, "tok_swapped", _swap_two)
  assert generate_tool.main([str(run), "--prompt", "hello", "--tokenizer", str(swapped)]) == 2
  _error(capsys, "tools.generate", "--tokenizer", "is not the run's tokenizer",
         "2 tokens have other ids")
  strict = _variant(launch, "tok_strict", lambda m: m.update(unk_token="<none>"))
  manifest = json.loads(manifest_file.read_text())
  assert generate_tool.main([str(run), "--prompt", "hello zebra", "--tokenizer", str(strict)]) \
      == 2 and manifest["vocab_size"] == 64
  _error(capsys, "tools.generate", "'hello zebra'",
         "cannot encode the word 'zebra': it is not in its vocabulary")
  # With an unknown token, a word outside the vocabulary would be read as it: refused too.
  assert generate_tool.main([str(run), "--prompt", "hello zebra"]) == 2
  _error(capsys, "tools.generate", "'hello zebra'", "'zebra' is not in the vocabulary")
  # A PNG whose header claims 20000x20000 pixels: Pillow's decompression bomb limit.
  small = launch / "small.png"
  Image.new("RGB", (1, 1)).save(small)
  data = bytearray(small.read_bytes())
  data[16:24] = struct.pack(">II", 20000, 20000)
  data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
  (launch / "bomb.png").write_bytes(bytes(data))
  assert generate_tool.main([str(run), "--image", str(launch / "bomb.png")]) == 2
  _error(capsys, "tools.generate", "bomb.png", "decompression bomb", "give a smaller image")
  # tools.eval of a record of it says the same (not "cannot be read"), naming the record.
  (launch / "bomb.json").write_text(json.dumps([{"id": "b", "image": "bomb.png", "conversations": [
      {"from": "human", "value": "<image>"}, {"from": "gpt", "value": "1"}]}]))
  assert eval_tool.main([str(run), "--data", str(launch / "bomb.json"),
                         "--out", str(launch / "bomb.jsonl")]) == 2
  _error(capsys, "tools.eval", "record 0 (id 'b', line 1): image", "bomb.png is refused as a "
         "possible decompression bomb (", "give a smaller image")
  assert not (launch / "bomb.jsonl").exists()


def test_generate_pairs_files_without_prompts_one_prompt_a_file(run, capsys):
  # The second prompt answers as the second image alone does (unpaired, it would get both).
  other = str(FIXTURES / "images" / "portrait.png")
  assert generate_tool.main([str(run), "--image", other, "--max_new_tokens", "3"]) == 0
  alone = capsys.readouterr().out.splitlines()
  assert generate_tool.main([str(run), "--pair", "--image", str(IMAGE), "--image", other,
                             "--max_new_tokens", "3"]) == 0
  paired = capsys.readouterr().out.splitlines()
  assert len(paired) == 4 and paired[0] == "> [landscape.png]" and paired[2:] == alone, paired
  assert alone[0] == "> [portrait.png]" and alone[1]


class _Prepared(Exception):
  """Raised with the images generate hands to the model, to stop before the generation."""


def test_generate_prepares_images_as_the_runs_data_from_another_directory(run, monkeypatch):
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.images import ImageProcessor  # pylint: disable=import-outside-toplevel
  from mimo_jax.encoders import vision as vision_encoder  # pylint: disable=import-outside-toplevel

  def tokens(cfg, params, images):  # pylint: disable=unused-argument
    raise _Prepared(images)
  monkeypatch.setattr(vision_encoder, "image_tokens", tokens)
  launch = run.parent
  assert pathlib.Path.cwd() == launch / "elsewhere"  # the manifest's paths: relative to launch/
  with pytest.raises(_Prepared) as got:
    generate_tool.main([str(run), "--image", str(IMAGE), "--prompt", "what is in the picture"])
  prepared = got.value.args[0][0]
  path = launch / "data" / "train.array_record"
  record = array_record_module.ArrayRecordReader(str(path)).read([0])[0]
  converted = conversations.decode(record, str(path), 0)["images"][0]
  np.testing.assert_array_equal(np.rint(prepared * 255).astype(np.uint8), converted)
  unpadded = ImageProcessor.open(launch / "tok")(Image.open(IMAGE))
  assert not np.array_equal(unpadded, converted)  # the padding shows
  with pytest.raises(_Prepared) as got:
    generate_tool.main([str(run), "--image", str(IMAGE), "--no-pad_to_square"])
  np.testing.assert_array_equal(np.rint(got.value.args[0][0] * 255).astype(np.uint8), unpadded)


def test_generate_reads_16_bit_and_float_images_as_the_converter_does(run, monkeypatch, capsys):
  from mimo_jax.encoders import vision as vision_encoder  # pylint: disable=import-outside-toplevel

  def tokens(cfg, params, images):  # pylint: disable=unused-argument
    raise _Prepared(images)
  monkeypatch.setattr(vision_encoder, "image_tokens", tokens)
  files = deep_images(IMAGE, run.parent)
  prepared = {}
  for k in ("8", "16", "float"):
    with pytest.raises(_Prepared) as got:
      generate_tool.main([str(run), "--image", str(files[k])])
    prepared[k] = got.value.args[0][0]
  np.testing.assert_array_equal(prepared["16"], prepared["8"])
  np.testing.assert_array_equal(prepared["float"], prepared["8"])
  assert generate_tool.main([str(run), "--image", str(files["past"])]) == 2
  _error(capsys, "tools.generate", "past.tif", "float image with values from 9 to 247",
         "[0, 1]")


def test_check_with_every_step_rotated_away_says_try_again_not_damaged(run, monkeypatch, capsys):
  """Nothing could be checked (the run rotated each step away under its read): status 75, the
  temporary failure, never 2, which means a damaged step."""
  _live(run)
  real = checkpoint_reader._read_module  # pylint: disable=protected-access

  def read(mngr, s, *rest):
    shutil.rmtree(run / "checkpoints" / str(s), ignore_errors=True)
    return real(mngr, s, *rest)
  monkeypatch.setattr(checkpoint_reader, "_read_module", read)
  assert ckpt.main(["check", str(run)]) == 75
  _error(capsys, "tools.ckpt", "was removed while being read", "check again")


def test_damaged_float32_bytes_fail_the_fingerprint_quietly():
  # Garbage read as float32 (NaNs, values past bfloat16's range) is "not the saved values", with
  # no RuntimeWarning from the bfloat16 cast that checks a frozen weight's fingerprint.
  garbage = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert not checkpoint_reader.matches(garbage.view(np.float32), [0, 0])


def test_digit_images_refuses_bad_flags_writing_nothing_and_writes_whole_files(tmp_path, capsys):
  """tools.digit_images: a count past the eval set, a scale below 1 or a file as --out is one
  line with exit 2 and no folder made; good flags write the PNGs (no temporary file left)."""
  from tools import digit_images  # pylint: disable=import-outside-toplevel
  (tmp_path / "file").write_text("")
  for flags, words in ((["--count", "0"], "--count 0: the eval set has"),
                       (["--scale", "-2"], "--scale -2: give a whole number"),
                       (["--scale", "100000"], "--scale 100000: give a whole number"),  # memory
                       (["--out", str(tmp_path / "file")], "is a file; give a folder")):
    out = ["--out", str(tmp_path / "new")] if "--out" not in flags else []
    with pytest.raises(SystemExit) as exit_:
      digit_images.main(out + flags)
    assert exit_.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
  digit_images.main(["--out", str(tmp_path / "new"), "--count", "3", "--scale", "2"])
  written = sorted(p.name for p in (tmp_path / "new").iterdir())
  assert [n.split("-")[1] for n in written] == ["0000", "0001", "0002"] and len(written) == 3
  assert Image.open(tmp_path / "new" / written[0]).size == (16, 16)

