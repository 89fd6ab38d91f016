"""tools.hf import under faults and bad input: non-finite weights, safetensors headers that lie,
null or mistyped config.json fields, an --out that cannot be written, a save that fails midway, a
kill midway or after the save (nothing is left), and what a finished import leaves: absolute
source paths, a complete launch line, a checkpoint that restores from the directory it was
renamed to, on a path that is not ASCII too."""

import collections
import gc
import json
import logging
import os
import pathlib
import shutil
import signal

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mimo_jax import checkpoint, hf, output
from tests.helpers import file_size_limit
from tools import hf as hf_tool
from tools import hf_import

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
RUN = ["--config=tests/configs/tiny.py", "--config.data.task=synthetic",
       "--config.model.vision.max_images=1", "--config.data.image_probs=0.25,0.75",
       "--config.data.seq_len=40", "--config.data.text_len=12", "--config.eval.samples=16"]


def _import(hf_dir, out, *extra, run=RUN):
  hf_tool.main(["import", "--hf", str(hf_dir), "--out", str(out), *run, *extra])


def _exits(capsys, code, fn) -> str:
  """`fn` exits with `code` after one line on stderr (`tools.hf: ...`); returns the line."""
  with pytest.raises(SystemExit) as e:
    fn()
  assert e.value.code == code
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tools.hf: "), lines
  return lines[0]


def _error(capsys, fn, *words):
  line = _exits(capsys, 2, fn)
  assert line.startswith("tools.hf: error: "), line
  for w in words:
    assert w in line, (w, line)


def _copy(name, to):
  shutil.copytree(FIXTURES / name, to)
  return to


def _edit_config(directory, edit):
  f = pathlib.Path(directory) / "config.json"
  config = json.loads(f.read_text())
  edit(config)
  f.write_text(json.dumps(config))


def _reads(monkeypatch) -> list[str]:
  """The names Source.read is asked for, in order."""
  names, read = [], hf.Source.read
  def counted(self, name, shape):
    names.append(name)
    return read(self, name, shape)
  monkeypatch.setattr(hf.Source, "read", counted)
  return names


def _left(parent) -> list[str]:
  """What an import left in `parent`: the output, staging directories, lock files."""
  return sorted(p.name for p in pathlib.Path(parent).iterdir() if "out" in p.name)


def test_non_finite_weights_are_refused_as_each_tensor_is_read(tmp_path, capsys, monkeypatch):
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  src = _copy("qwen2", tmp_path / "qwen2")
  f = src / "model.safetensors"
  tensors = load_file(str(f))
  bad = "model.layers.1.mlp.down_proj.weight"
  tensors[bad][3, 5] = np.nan
  save_file(tensors, str(f), metadata={"format": "pt"})
  names = _reads(monkeypatch)
  _error(capsys, lambda: _import(src, tmp_path / "out"), str(f), bad, "NaN or infinite",
         "nan at index (3, 5)")  # the index in the file's layout
  assert names[-1] == bad and len(set(names)) == len(names)  # stopped there; nothing read twice
  assert _left(tmp_path) == []
  # Infinity in a bfloat16 tensor (read from its raw bits), named with its index.
  fixture = load_file(str(FIXTURES / "qwen2" / "model.safetensors"))
  tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in fixture.items()}
  tensors["model.norm.weight"][7] = np.inf
  save_file(tensors, str(f), metadata={"format": "pt"})
  with pytest.raises(hf.HFError, match=r"model\.norm\.weight holds NaN or infinite values "
                     r"\(inf at index \(7,\)\)"):
    hf.Source.open(src).read("model.norm.weight", (32,))


def _lie(src: pathlib.Path, edit) -> pathlib.Path:
  """src/model.safetensors rewritten with `edit(header, body) -> (header, body)`: the bytes of
  the tensors kept, the header's claims about them changed."""
  f = src / "model.safetensors"
  data = f.read_bytes()
  n = int.from_bytes(data[:8], "little")
  header, body = edit(json.loads(data[8:8 + n]), data[8 + n:])
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  f.write_bytes(len(text).to_bytes(8, "little") + text + body)
  return f


LIAR = "model.layers.1.mlp.down_proj.weight"


def _set(key, value):
  return lambda h, b: (dict(h, **{LIAR: dict(h[LIAR], **{key: value(h[LIAR])})}), b)


@pytest.mark.parametrize("edit", [
    lambda h, b: (h, b[:-100]),  # more bytes than the file holds
    _set("dtype", lambda t: "BF16"),  # another dtype: half the bytes
    _set("shape", lambda t: [t["shape"][0] * 2, t["shape"][1]]),  # a larger shape
    _set("data_offsets", lambda t: [t["data_offsets"][0], t["data_offsets"][1] + 10**9]),
], ids=["bytes", "dtype", "shape", "offsets"])
def test_a_safetensors_header_that_lies_is_one_line_before_anything_is_written(tmp_path, capsys,
                                                                              edit):
  src = _copy("qwen2", tmp_path / "qwen2")
  f = _lie(src, edit)
  _error(capsys, lambda: _import(src, tmp_path / "out"), str(f), "cannot be read as safetensors")
  assert _left(tmp_path) == []


def test_a_header_whose_lie_fits_the_bytes_is_refused_as_the_tensor_is_read(tmp_path):
  """A dtype or shape that the file's bytes allow, but not the model's: an HFError naming the
  tensor as it is read (which the import prints as its one line, as for every HFError)."""
  for edit, match in ((_set("dtype", lambda t: "I32"), "has dtype int32, expected a floating"),
                      (_set("shape", lambda t: t["shape"][::-1]), r"has shape \(48, 32\), but "
                       r"config.json implies \(32, 48\)")):
    src = _copy("qwen2", tmp_path / "qwen2")
    _lie(src, edit)
    with pytest.raises(hf.HFError, match=f"{LIAR} {match}"):
      hf.Source.open(src).read(LIAR, (32, 48))
    shutil.rmtree(src)


@pytest.mark.parametrize("fixture,edit,words", [
    ("llama31", lambda c: c["rope_parameters"].pop("factor"), ("rope_parameters.factor",
                                                                "missing")),
    ("llama31", lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": None}),
     ("rope_scaling.factor is null",)),  # transformers 4.x's name
    ("llama31", lambda c: c.update(rope_scaling="llama3"), ("rope_scaling", '"llama3"')),
    ("llama3", lambda c: c.update(rms_norm_eps=None), ("field rms_norm_eps is null",
                                                        "a finite number")),
    ("llama3", lambda c: c.update(hidden_size="32"), ("field hidden_size is \"32\"",
                                                       "a positive integer")),
    ("llama3", lambda c: c.update(tie_word_embeddings="false"), ("tie_word_embeddings",
                                                                 "true or false")),
    ("qwen2", lambda c: c.update(rope_theta=None), ("rope_theta is null",)),
    ("qwen2", lambda c: c.update(model_type=["qwen2"]), ("model_type", "a string")),
    ("llava15", lambda c: c["text_config"].update(rms_norm_eps=None),
     ("field text_config.rms_norm_eps is null",)),
    ("llava15", lambda c: c.update(vision_config=None), ("field vision_config is null",)),
    ("llava15", lambda c: c.update(vision_feature_layer=None), ("vision_feature_layer is null",)),
    ("llava15", lambda c: c["vision_config"].update(layer_norm_eps="1e-5"),
     ("vision_config.layer_norm_eps",)),
    ("llava15", lambda c: c.update(image_token_index="<image>"), ("image_token_index",)),
    ("llava15", lambda c: c.update(image_token_index=64), ("field image_token_index is 64",
                                                           "text_config.vocab_size 64")),
    # Fewer layers than the tensors hold: imported as a smaller model, silently.
    ("llama31", lambda c: c.update(num_hidden_layers=1), ("gives language 1 layer, but the "
                                                          "directory holds model.layers.1.",)),
    ("llava15", lambda c: c["text_config"].update(num_hidden_layers=1),
     ("gives language 1 layer", "layers.1.", "a layer past them; set the layer count")),
])
def test_null_missing_or_mistyped_config_fields_are_one_line(tmp_path, capsys, fixture, edit,
                                                             words):
  src = _copy(fixture, tmp_path / fixture)
  _edit_config(src, edit)
  _error(capsys, lambda: _import(src, tmp_path / "out"), str(src / "config.json"), *words)
  assert _left(tmp_path) == []


def test_a_null_pixel_mean_names_preprocessor_config(tmp_path, capsys):
  src = _copy("clip", tmp_path / "clip")
  pre = src / "preprocessor_config.json"
  pre.write_text(json.dumps(dict(json.loads(pre.read_text()), image_mean=None)))
  _error(capsys, lambda: _import(src, tmp_path / "out"), str(pre), "field image_mean is null")


def test_a_tower_without_pixel_statistics_is_imported_with_a_note_saying_so(tmp_path, capsys):
  """Without preprocessor_config.json a tower would take images unnormalised: the import says so
  and how to give them; with them set, nothing is said."""
  src = _copy("llava15", tmp_path / "llava")
  (src / "preprocessor_config.json").unlink()
  _import(src, tmp_path / "out")
  assert "images go into the tower unnormalised" in capsys.readouterr().out
  _import(src, tmp_path / "out2", "--config.model.vision.pixel_mean=0.5,0.5,0.5",
          "--config.model.vision.pixel_std=0.25,0.25,0.25")
  assert "unnormalised" not in capsys.readouterr().out


def test_a_bad_base_config_or_override_is_one_line(tmp_path, capsys):
  run = [a for a in RUN if not a.startswith("--config=")]
  _error(capsys, lambda: _import(FIXTURES / "qwen2", tmp_path / "out",
                                 "--config=configs/llava_cpu.py:big", run=run),
         "configs/llava_cpu.py: no variant 'big'")
  _error(capsys, lambda: _import(FIXTURES / "qwen2", tmp_path / "out",
                                 "--config.model.vision.final_norm=ture"),
         "--config.model.vision.final_norm=ture: not a bool")
  assert _left(tmp_path) == []


def test_an_out_that_cannot_be_written_is_refused_before_any_tensor_is_read(tmp_path, capsys,
                                                                            monkeypatch):
  names = _reads(monkeypatch)
  a_file = tmp_path / "out_file"
  a_file.write_text("notes")
  _error(capsys, lambda: _import(FIXTURES / "qwen2", a_file), "--out=", "is a file")
  assert a_file.read_text() == "notes"
  busy = tmp_path / "out_busy"
  busy.mkdir()
  (busy / "notes.txt").write_text("mine")
  _error(capsys, lambda: _import(FIXTURES / "qwen2", busy), "is not empty (notes.txt)")
  # Too little free space for the tensors' bytes (those of the files: 2 or 4 an element).
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(output.shutil, "disk_usage", lambda p: usage(1, 1, 1000))
  _error(capsys, lambda: _import(FIXTURES / "qwen2", tmp_path / "out"), "needs about",
         "1.0 kB are free")
  assert names == [] and _left(tmp_path) == ["out_busy", "out_file"]


def test_an_import_interrupted_midway_or_killed_after_its_save_leaves_nothing(
    tmp_path, capsys, monkeypatch):
  # Ctrl-C while the tensors are read.
  read = hf.Source.read
  def interrupted(self, name, shape):
    if "layers.1." in name:
      raise KeyboardInterrupt
    return read(self, name, shape)
  monkeypatch.setattr(hf.Source, "read", interrupted)
  line = _exits(capsys, 130, lambda: _import(FIXTURES / "qwen2", tmp_path / "out"))
  assert line == f"tools.hf: import interrupted; nothing was written to {tmp_path / 'out'}"
  assert _left(tmp_path) == []
  monkeypatch.setattr(hf.Source, "read", read)
  # SIGTERM once the checkpoint is saved, before config.py: no workdir without its config.
  save = checkpoint.Checkpointer.save
  def killed(self, *args, **kwargs):
    save(self, *args, **kwargs)
    assert os.listdir(self.path) == ["0"]  # the step is complete in the staging directory
    os.kill(os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(checkpoint.Checkpointer, "save", killed)
  line = _exits(capsys, 128 + signal.SIGTERM, lambda: _import(FIXTURES / "qwen2",
                                                              tmp_path / "out"))
  assert "import interrupted; nothing was written" in line
  assert _left(tmp_path) == []


def test_an_interrupt_after_the_workdir_is_in_place_says_it_is_whole(tmp_path, capsys,
                                                                      monkeypatch):
  """Ctrl-C as the report is printed, the workdir already in place: exit 130 with one line that
  says the workdir is whole (not that nothing was written); the workdir stays, complete."""
  printed = print
  def interrupted(*args, **kwargs):
    if args and str(args[0]).startswith("wrote step 0"):
      raise KeyboardInterrupt
    printed(*args, **kwargs)
  monkeypatch.setattr("builtins.print", interrupted)
  line = _exits(capsys, 130, lambda: _import(FIXTURES / "qwen2", tmp_path / "out"))
  assert line == (f"tools.hf: import interrupted; {tmp_path / 'out'} was complete before it "
                  "came: the workdir is whole, its report cut short"), line
  assert _left(tmp_path) == ["out"] and (tmp_path / "out" / "config.py").is_file()


def test_a_save_that_fails_midway_is_one_line_and_leaves_nothing(tmp_path, capsys, caplog,
                                                                  monkeypatch):
  """A file size limit (as a full disk) fails the step-0 save: tensorstore's error (a ValueError)
  is one line naming --out and the reason; orbax's writer threads' tracebacks of it are not
  printed."""
  save = checkpoint.Checkpointer.save
  def limited(self, *args, **kwargs):  # the limit on the save alone: not on compilation caches
    with file_size_limit(20000):
      return save(self, *args, **kwargs)
  monkeypatch.setattr(checkpoint.Checkpointer, "save", limited)
  out = tmp_path / "out"
  _error(capsys, lambda: _import(FIXTURES / "qwen2", out), f"--out={str(out)!r}",
         "refused the write (File too large)")
  assert _left(tmp_path) == []
  gc.collect()  # the other writes' tasks, failed too: asyncio logs each as it is collected
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_workdir_path_with_non_ascii_characters_imports_and_reads_back(tmp_path, capsys):
  """Lock, staging directory, orbax's save and read, tools.ckpt's check: on a path that is not
  ASCII (with a space)."""
  from tools import ckpt  # pylint: disable=import-outside-toplevel
  out = tmp_path / "dönüş 数据" / "wörk dir"
  _import(FIXTURES / "qwen2", out)
  assert (out / "config.py").is_file()
  capsys.readouterr()
  assert ckpt.main(["check", str(out)]) == 0
  assert "step 0: " in capsys.readouterr().out
  assert sorted(p.name for p in out.parent.iterdir()) == ["wörk dir"]  # no lock, no staging


def test_a_finished_import_names_absolute_paths_and_a_complete_launch_line(
    tmp_path, capsys, monkeypatch):
  """Run from another directory with relative paths; the base config is the default (a cheap
  one here), the task conversations: the import leaves the data to the launch line, notes the
  GPU-sized default on a CPU, and its checkpoint restores from where the staging directory was
  renamed to."""
  from tools import ckpt  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(hf_import, "DEFAULT_BASE", "tests/configs/tiny.py")
  monkeypatch.chdir(tmp_path)
  shutil.copytree(FIXTURES / "llava15", tmp_path / "models" / "llava")
  run = [a for a in RUN if not a.startswith("--config=")]
  _import("models/llava", "out", "--config.data.task=conversations", run=run)
  out = tmp_path / "out"
  printed = capsys.readouterr().out
  record = json.loads((out / "hf_import.json").read_text())
  assert record["sources"] == {m: str(tmp_path / "models" / "llava")
                               for m in ("vision", "language")}
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["run"]["workdir"] == str(out) and cfg["data"]["dir"] == ""
  assert (f"train with: python -m mimo_jax.launch --config={out / 'config.py'} "
          "--config.data.dir=DATA --config.data.image_token=63\n") in printed, printed
  assert "note: the fields config.json does not set came from tests/configs/tiny.py, sized for" \
         " GPUs" in printed
  assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "out"]  # no lock, no staging
  ckpt.main(["check", "out"])  # orbax reads the step where it now is
  assert "step 0: " in capsys.readouterr().out
  # A workdir holding checkpoints is refused, as before, before anything is read.
  _error(capsys, lambda: _import("models/llava", "out", run=RUN), "already holds checkpoints")
