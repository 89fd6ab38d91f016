"""tools.eval on an imported LLaVA (one module fixture): a LLaVA JSON answered on the run's meshes
(the same answers on two language dp ranks as on one, as tools.generate gives each prompt alone),
rows kept across a SIGTERM or a failed write and resumed without duplicates, progress on a
terminal and in a log, the default --out's files, bad input refused with one clear error. Its
parts that need no such run (and its program's answers against transformers' generate, on
imports of their own) are in tests/test_eval_tool_parts.py."""

import io
import json
import os
import pathlib
import shutil
import signal
import sys

import jax
import pytest

from mimo_jax import checkpoint_steps
from mimo_jax.config import ConfigError
from mimo_jax.evaluate import Evaluator

from tests.helpers import file_size_limit
from tests.test_generate import FIXTURES, _tokenizer
from tools import eval as eval_tool
from tools import generate as generate_tool
from tools import hf as hf_tool

IMAGES = pathlib.Path(__file__).parent / "fixtures" / "images"
FILES = ["landscape.png", "portrait.png", "tiny.png"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """An imported LLaVA (float32), a word-level tokenizer and five records with 0-2 images."""
  root = tmp_path_factory.mktemp("eval")
  hf_tool.main(["import", "--hf", str(FIXTURES / "llava15"), "--out", str(root / "run"),
                "--config=configs/llava_cpu.py"])
  _tokenizer(root / "tok")
  records = []
  for i in range(5):
    n = i % 3
    records.append({"id": f"q{i}", "image": FILES[:n], "conversations": [
        {"from": "human", "value": "<image>\n" * n + "what is in the picture" + " hello" * i},
        {"from": "gpt", "value": "hello there"}]})
  records[1]["answers"] = ["hello there"] * 3 + ["w4"] * 7
  (root / "data.json").write_text(json.dumps(records))
  return root


def _eval(root, out, *extra, data="data.json"):
  return eval_tool.main([str(root / "run"), "--data", str(root / data), "--images",
                         str(IMAGES), "--tokenizer", str(root / "tok"), "--processor",
                         str(root / "tok"), "--max_new_tokens", "4", "--batch", "4",
                         "--seq_len", "96", "--metric", "vqa", "--metric", "exact_match",
                         "--out", str(out), *extra])


def _raise(e: Exception):
  raise e


def _rows(path):
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def one_device(setup):
  assert _eval(setup, setup / "one.jsonl") == 0
  return _rows(setup / "one.jsonl")


def test_rows_answer_each_prompt_as_tools_generate_does(setup, one_device, capsys):
  assert [r["id"] for r in one_device] == [f"q{i}" for i in range(5)]
  assert one_device[1]["reference"] == ["hello there"] * 3 + ["w4"] * 7
  for i in (0, 4):  # no image; one image
    capsys.readouterr()
    assert generate_tool.main([str(setup / "run"), "--tokenizer", str(setup / "tok"),
                               "--processor", str(setup / "tok"), "--max_new_tokens", "4",
                               *(["--image", str(IMAGES / FILES[0])] if i == 4 else []),
                               "--prompt", "what is in the picture" + " hello" * i]) == 0
    got = capsys.readouterr()
    assert got.out.splitlines()[1] == one_device[i]["prediction"]
    # An answer without an end token in its 4 new tokens is cut: both tools say so alike.
    assert ("note: the answer stopped at 4 new tokens" in got.err) == one_device[i]["at_limit"]
  summary = json.loads((setup / "one.summary.json").read_text())
  assert summary["at_limit"] == sum(r["at_limit"] for r in one_device) > 0
  assert summary["samples"] == 5
  assert summary["vqa"] == pytest.approx(sum(r["score"]["vqa"] for r in one_device) / 5)


def test_a_relative_out_is_named_absolute_as_the_other_paths(setup, one_device, monkeypatch,
                                                            capsys):
  for name in ("one.jsonl", "one.jsonl.settings.json"):  # its rows: nothing is answered again
    shutil.copy(setup / name, setup / name.replace("one", "rel"))
  monkeypatch.chdir(setup)
  capsys.readouterr()
  assert _eval(setup, "rel.jsonl") == 0
  summary = json.loads((setup / "rel.summary.json").read_text())
  assert summary["answered_now"] == 0
  assert summary["out"] == str(setup / "rel.jsonl") and summary["data"] == str(setup / "data.json")
  got = capsys.readouterr()
  assert got.out.rstrip().endswith(f"rows in {setup / 'rel.jsonl'}")
  assert (f"note: {summary['at_limit']} of 5 answers stopped at --max_new_tokens 4 before an end "
          "token" in got.err), got.err


def test_two_language_dp_ranks_answer_as_one_device(setup, one_device):
  assert _eval(setup, setup / "dp2.jsonl", "--layout", "language=0/2/1,vision=2/2/1") == 0
  assert _rows(setup / "dp2.jsonl") == one_device
  topology = json.loads((setup / "dp2.summary.json").read_text())["topology"]
  assert "language: dp=2" in topology and "vision: dp=2" in topology


def test_an_interrupted_eval_keeps_its_rows_and_resumes_without_duplicates(setup, one_device,
                                                                           monkeypatch, capsys):
  out = setup / "cut.jsonl"
  append = eval_tool.Rows.append

  def sigterm_first(self, rows):  # before the first batch's rows: nothing is written
    os.kill(os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(eval_tool.Rows, "append", sigterm_first)
  assert _eval(setup, out, "--batch", "2") == 128 + signal.SIGTERM
  assert capsys.readouterr().err.splitlines()[-1] == (
      "tools.eval: interrupted (SIGTERM); nothing was written: run the same command to go on.")
  assert not out.exists() and not (setup / "cut.summary.json").exists()

  def append_then_sigterm(self, rows):
    append(self, rows)
    os.kill(os.getpid(), signal.SIGTERM)  # after the first batch's rows
  monkeypatch.setattr(eval_tool.Rows, "append", append_then_sigterm)
  assert _eval(setup, out, "--batch", "2") == 128 + signal.SIGTERM
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"tools.eval: interrupted (SIGTERM); 2 rows in {out}, 2 written now: run the same command "
      "to go on.")
  kept = _rows(out)
  assert kept == one_device[:2]
  assert not (setup / "cut.summary.json").exists()
  monkeypatch.setattr(eval_tool.Rows, "append", append)
  # A device out of memory (XLA's error, as the GPU's allocator raises it): one line, the rows kept.
  monkeypatch.setattr(Evaluator, "answers", lambda *_, **__: _raise(jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 bytes.\nBuffer...")))
  assert _eval(setup, out, "--batch", "2") == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      "tools.eval: error: a device ran out of memory (XLA: Out of memory while trying to allocate "
      "2147483648 bytes); to use less, a smaller --batch (now 2); 2 rows in "
      f"{out}, 0 written now: run the same command to go on.")
  assert _rows(out) == kept
  monkeypatch.undo()
  with open(out, "a", encoding="utf-8") as f:
    f.write('{"id": "q2", "predic')  # a row cut by a crash
  assert _eval(setup, out, "--batch", "2") == 0
  assert _rows(out) == one_device
  resumed = json.loads((setup / "cut.summary.json").read_text())
  assert resumed["answered_now"] == 3 and resumed["new_tokens_per_s"] > 0
  # Run again: everything is answered, nothing is appended; the summary keeps the speed.
  assert _eval(setup, out) == 0
  assert _rows(out) == one_device
  again = json.loads((setup / "cut.summary.json").read_text())
  assert again == dict(resumed, answered_now=0)


def test_a_failed_write_of_the_rows_is_one_line_and_keeps_the_rows_before_it(setup, one_device,
                                                                             capsys):
  """A write refused midway (a file size limit, as a full disk) ends the eval with one line
  naming --out; the rows written before it stay, and the same command goes on from them."""
  out = setup / "full.jsonl"
  first = "".join(json.dumps(row) + "\n" for row in one_device[:2]).encode()
  with file_size_limit(len(first) + 8):  # the first batch's rows fit, the second's do not
    assert _eval(setup, out, "--batch", "2") == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert [ln for ln in err if "error" in ln] == err[-1:], err  # after the start-up's lines
  assert err[-1].startswith("tools.eval: error: ")
  assert f"--out={str(out)!r}" in err[-1] and "File too large" in err[-1]
  assert out.read_bytes().startswith(first) and len(out.read_bytes()) <= len(first) + 8
  assert not (setup / "full.summary.json").exists()
  assert not list(setup.glob(".full.jsonl.lock*"))  # the lock is released
  assert _eval(setup, out, "--batch", "2") == 0
  assert _rows(out) == one_device
  assert json.loads((setup / "full.summary.json").read_text())["answered_now"] == 3


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_a_bar_counts_the_samples_on_a_terminal_only(setup, one_device, monkeypatch, capsys):
  """On a terminal the bar counts every sample, from those a resumed eval's rows hold; a log gets
  no bar but a line as each slow part starts (reading, loading, answering) and, while reading,
  laying out and answering, one every PROGRESS_SECONDS; the cut answers' note ends it."""
  rows = (setup / "one.jsonl").read_text().splitlines(keepends=True)
  for name, kept in (("log", 1), ("tty", 2)):
    (setup / f"{name}.jsonl").write_text("".join(rows[:kept]))
    (setup / f"{name}.jsonl.settings.json").write_text(
        (setup / "one.jsonl.settings.json").read_text())
  monkeypatch.setattr(eval_tool, "PROGRESS_SECONDS", 0)
  assert _eval(setup, setup / "log.jsonl", "--batch", "2") == 0
  err = capsys.readouterr().err.splitlines()
  reading = [line for line in err if line.startswith("tools.eval: reading: ")]
  assert [line.split(" (")[0] for line in reading] == [
      f"tools.eval: reading: {k} of 5 records" for k in range(1, 5)], err
  assert err[-1].startswith("tools.eval: note: ") and "stopped at --max_new_tokens" in err[-1]
  laying = [line for line in err if line.startswith("tools.eval: laying out: ")]
  assert [line.split(" (")[0] for line in laying] == ["tools.eval: laying out: 2 of 4 samples"]
  err = [line for line in err[:-1] if line not in reading + laying]
  assert err[:2] == [f"tools.eval: reading the samples of {setup / 'data.json'} ...",
                     f"tools.eval: read 5 samples in {err[1].split(' in ')[1].split()[0]} s; "
                     f"loading step 0 of {setup / 'run'} ..."], err
  assert err[2].startswith("tools.eval: loaded step 0 in ") and err[2].endswith(
      f"answering 4 of 5 samples (1 answered already in {setup / 'log.jsonl'})"), err
  assert err[3].startswith("tools.eval: answering: 3 of 5 samples (60%), "), err
  assert len(err) == 4 and "data.json step" not in "".join(err), err  # no bar; no line at 5/5
  assert _rows(setup / "log.jsonl") == one_device
  terminal = _Terminal()
  monkeypatch.setattr(sys, "stderr", terminal)
  assert _eval(setup, setup / "tty.jsonl") == 0
  bar = terminal.getvalue()
  assert "data.json step" in bar and " 2/5 " in bar and " 5/5 " in bar, bar
  assert _rows(setup / "tty.jsonl") == one_device


@pytest.mark.parametrize("change,message", [
    (["--metric", "bleu"], "--metric bleu: no such metric; registered: contains"),
    (["--data", "/nonexistent.json"], "--data /nonexistent.json: not found"),
    (["--data", str(IMAGES)], f"tools.eval: error: --data: {IMAGES / 'conversations.json'} not "
     "found; --data takes a LLaVA-format JSON file or a directory written by"),
    (["--max_new_tokens", "0"], "--max_new_tokens 0: give a positive number"),
    (["--seq_len", "1"], "tools.eval: error: --seq_len 1: cannot hold 1 image of 16 tokens plus "
     "their answer; use >= 19."),  # was named config.data.seq_len
    (["--cpu_devices", "100000"], "--cpu_devices 100000: at most 1024"),  # took the host's memory
    (["--out", "/tmp"], "--out /tmp is a directory; give the predictions' file"),
    (["--seq_len", "40"], "data.json: record 2 (id 'q2', line 1) needs 46 positions (14 for its "
     "text, 32 for its 2 images), more than the eval's rows hold (40, --seq_len); give --seq_len "
     "46 or more, or shorten the record."),
    # --layout's errors name the flag and its value, not the config fields it sets.
    (["--layout", "foo"], "tools.eval: error: --layout 'foo': not module=offset/dp/tp[/pp[/virtual"
     "]][@schedule] (e.g. vision=0/1/1); modules: vision, language."),
    (["--layout", "foo=0/1/1"], "tools.eval: error: --layout 'foo=0/1/1': unknown module 'foo'; "
     "modules: vision, language."),
    (["--layout", "language=x"], "tools.eval: error: --layout 'language=x': language: not "
     "offset/dp/tp"),
    (["--layout", "language=0/2/1"], "tools.eval: error: --layout 'language=0/2/1': language: "
     "devices [0, 2) partially overlap vision's [0, 1)"),
])
def test_bad_flags_are_refused(setup, capsys, change, message):
  assert _eval(setup, setup / "bad.jsonl", *change) == 2
  err = capsys.readouterr().err
  assert message in err
  if change[0] == "--layout":  # refused before any sample is read
    assert "reading the samples" not in err, err
  assert not (setup / "bad.jsonl").exists()


@pytest.mark.parametrize("record,message", [
    ({"id": 1, "conversations": [{"from": "human", "value": "hello"}]},
     "no assistant turn and no \"answers\""),
    ({"id": 1, "image": "missing.png", "conversations": [
        {"from": "human", "value": "<image>\nhello"}, {"from": "gpt", "value": "there"}]},
     "missing.png not found"),
    ({"id": 1, "answers": "yes", "conversations": [{"from": "human", "value": "hello"}]},
     "\"answers\" is \"yes\", not a list of strings"),
    ({"id": 1, "answers": None, "conversations": [{"from": "human", "value": "hello"},
                                                 {"from": "gpt", "value": "there"}]},
     "\"answers\" is null, not a list of strings"),
    ({"id": 1, "answers": [], "conversations": [{"from": "human", "value": "hello"}]},
     "\"answers\" is []: no answer; give each reference a text"),
    ({"id": 1, "answers": ["yes", " "], "conversations": [{"from": "human", "value": "hello"}]},
     "\"answers\" is [\"yes\", \" \"]: an empty answer;"),
    ({"id": 1, "image": 7, "conversations": [
        {"from": "human", "value": "<image>\nhello"}, {"from": "gpt", "value": "there"}]},
     "\"image\" is 7, not a path or a list of paths"),
    ({"id": 1, "image": str(IMAGES / "landscape.png"), "conversations": [
        {"from": "human", "value": "hello"}, {"from": "gpt", "value": "there"}]},
     "its prompt has 0 <image> for 1 image."),
    ({"id": float("nan"), "conversations": [{"from": "human", "value": "hello"},
                                            {"from": "gpt", "value": "there"}]},
     "\"id\" is NaN, not a string or an integer"),
    ({"id": 1, "conversations": [{"from": "human", "value": "hello zebra"},  # was read as [UNK]
                                 {"from": "gpt", "value": "there"}]},
     "the word 'zebra' is not in the vocabulary of"),
    ({"id": 1, "conversations": "hello"},  # its characters were taken for turns
     "\"conversations\" is a string, not a list of turns."),
])
def test_bad_records_are_refused_naming_them(setup, capsys, record, message):
  data = setup / "bad.json"
  data.write_text(json.dumps([record]))
  assert eval_tool.main([str(setup / "run"), "--data", str(data), "--tokenizer",
                         str(setup / "tok"), "--processor", str(setup / "tok"),
                         "--out", str(setup / "bad.jsonl")]) == 2
  err = capsys.readouterr().err
  assert ("record 0 (id 1, line 1): " if record["id"] == 1 else "record 0 (line 1): ") in err
  assert message in err
  assert not (setup / "bad.jsonl").exists()


def test_an_image_of_other_channels_is_one_error_naming_it_before_anything_is_written(
    setup, capsys):
  # A processor that keeps bands (do_convert_rgb false) makes a grayscale image one channel where
  # the model reads three: said when the samples are read, not as a reshape of a batch that
  # blamed --seq_len after the rows' files were opened.
  keeps = setup / "tok_keeps_bands"
  if not keeps.exists():
    shutil.copytree(setup / "tok", keeps)
    config = json.loads((keeps / "preprocessor_config.json").read_text())
    (keeps / "preprocessor_config.json").write_text(json.dumps(dict(config,
                                                                    do_convert_rgb=False)))
  data = setup / "gray.json"
  data.write_text(json.dumps([{"id": "rgb", "image": "landscape.png", "conversations": [
      {"from": "human", "value": "<image>\nhello"}, {"from": "gpt", "value": "there"}]},
                              {"id": "cam", "image": "grayscale.png", "conversations": [
      {"from": "human", "value": "<image>\nhello"}, {"from": "gpt", "value": "there"}]}]))
  out = setup / "gray_out" / "gray.jsonl"
  assert eval_tool.main([str(setup / "run"), "--data", str(data), "--images", str(IMAGES),
                         "--tokenizer", str(setup / "tok"), "--processor", str(keeps),
                         "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.splitlines()[-1] == (
      f"tools.eval: error: --data {data}: record 1 (id 'cam', line 1): image "
      f"{IMAGES / 'grayscale.png'}: "
      "the processor makes it 16x16x1 (height x width x channels) where the model reads 16x16x3; "
      "convert the image to three channels, an RGB image (e.g. with Pillow: "
      "Image.open(path).convert(\"RGB\").save(new_path)), or give a processor that converts it "
      "(\"do_convert_rgb\": true in its preprocessor_config.json)."), err
  assert "--seq_len" not in err and "answering" not in err
  assert not out.parent.exists() or not list(out.parent.iterdir())  # no rows, settings, lock


def test_a_record_longer_than_the_rows_is_named_by_its_line_in_the_file_with_the_fix(
    setup, capsys, monkeypatch):
  """Found before anything is written, or (the check skipped) when its batch is laid out: the
  record by its number, id and line in the file (not its place in the batch), and the fix."""
  records = json.loads((setup / "data.json").read_text())
  (setup / "lines.jsonl").write_text("\n".join(map(json.dumps, records)).replace("\n", "\n\n", 1))
  for check in (True, False):
    if not check:
      monkeypatch.setattr(eval_tool.eval_samples, "check_lengths", lambda *a: None)
    assert _eval(setup, setup / "long.jsonl", "--batch", "2", "--seq_len", "40",
                 data="lines.jsonl") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"tools.eval: error: --data {setup / 'lines.jsonl'}: record 2 (id 'q2', line 4) needs 46 "
        "positions (14 for its text, 32 for its 2 images), more than the eval's rows hold (40, "
        "--seq_len); give --seq_len 46 or more, or shorten the record.")
    assert not (setup / "long.jsonl").exists()


def test_a_record_the_layout_refuses_stops_the_eval_with_nothing_written(setup, capsys):
  """An error raised only when a batch is laid out (here an answer that starts with <image>: a
  placeholder without its image) stops the eval before a row is written, whichever batch holds
  it: a new --out gets no rows, settings or folder; an earlier eval's --out stays as it was (its
  torn last line too)."""
  turns = lambda answer: [{"from": "human", "value": "<image>\nhello"},
                          {"from": "gpt", "value": answer}]
  (setup / "layout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
      {"id": "fine", "image": FILES[0], "conversations": turns("there")},
      {"id": "bad", "image": FILES[0], "conversations": turns("<image> there")}]))
  out = setup / "layout_out" / "layout.jsonl"
  run = lambda *extra: _eval(setup, out, "--batch", "1", *extra, data="layout.jsonl")
  capsys.readouterr()
  assert run() == 2
  assert not out.parent.exists()
  err = capsys.readouterr().err.splitlines()
  assert "answering" not in "".join(err) and err[-1] == (
      f"tools.eval: error: --data {setup / 'layout.jsonl'}: record 1 (id 'bad', line 2): its "
      "text has 2 image placeholders (token 63) but it has 1 images."), err
  assert run("--samples", "1") == 0  # the fine record's row; then a row cut by a crash
  with open(out, "a", encoding="utf-8") as f:
    f.write('{"id": "bad", "predic')
  before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
  assert run() == 2
  assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before


def test_a_json_object_is_named_as_not_a_list_of_records(setup, capsys):
  # A list of records wrapped in an object reads as one record (or as JSONL by its lines): named
  # as tools.convert names it, however the file is laid out.
  record = {"id": 1, "conversations": [{"from": "human", "value": "hello"},
                                       {"from": "gpt", "value": "there"}]}
  for indent in (None, 1):
    data = setup / "wrapped.json"
    data.write_text(json.dumps({"data": [record]}, indent=indent))
    assert eval_tool.main([str(setup / "run"), "--data", str(data), "--tokenizer",
                           str(setup / "tok"), "--processor", str(setup / "tok")]) == 2
    err = capsys.readouterr().err
    assert "a JSON object with key data, not a list of records" in err and "--data" in err, err


def test_a_missing_image_under_the_images_given_names_that_folder(setup, capsys):
  data = setup / "missing.json"
  data.write_text(json.dumps([{"id": 1, "image": "missing.png", "conversations": [
      {"from": "human", "value": "<image>\nhello"}, {"from": "gpt", "value": "there"}]}]))
  assert eval_tool.main([str(setup / "run"), "--data", str(data), "--tokenizer",
                         str(setup / "tok"), "--processor", str(setup / "tok"),
                         "--images", str(setup), "--out", str(setup / "missing.jsonl")]) == 2
  err = capsys.readouterr().err
  assert f"not found; it is not in --images {setup}: give the folder that holds it." in err, err


def test_a_run_from_an_import_whose_data_moved_finds_the_tokenizer_as_tools_generate(
    setup, tmp_path, monkeypatch, capsys):
  """A run started from an import (its step's config: model.init_from names it, data.dir its
  converted data, since moved): eval's tokenizer is the import's HF directory's, found as
  tools.generate finds it, with the same note. Reading its vocabulary stops both tools."""
  imported, run = tmp_path / "import", tmp_path / "lora"
  for folder in (imported, run):
    shutil.copytree(setup / "run", folder, symlinks=True)
  record = json.loads((imported / "hf_import.json").read_text())
  record["sources"] = {"vision": str(setup / "tok"), "language": str(setup / "tok")}
  (imported / "hf_import.json").write_text(json.dumps(record))
  (run / "hf_import.json").unlink()
  meta_file = run / "checkpoints" / "0" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["config"]["data"].update(task="conversations", dir=str(tmp_path / "gone"), image_token=5)
  model = meta["config"]["model"]
  model["init_from"] = str(imported)
  for section in (model["encoders"]["vision"], model["language"]):
    section["init_from"] = ""
  meta["digest"] = checkpoint_steps.digest(meta)
  meta_file.write_text(json.dumps(meta))
  opened = []

  def stop(tok, *_):
    opened.append(str(tok.path))
    raise ConfigError("stopped at the vocabulary")
  monkeypatch.setattr(generate_tool, "check_vocab", stop)
  capsys.readouterr()
  assert generate_tool.main([str(run), "--prompt", "hi"]) == 2
  assert eval_tool.main([str(run), "--data", str(setup / "data.json"), "--samples", "2"]) == 2
  err = capsys.readouterr().err
  assert len(opened) == 2 and opened[0] == opened[1], err
  assert opened[0] == str(setup / "tok")
  assert err.count(f"its run's data directory {tmp_path / 'gone'} is missing: the tokenizer and "
                   "processor are the HF directories' it came from") == 2, err
  assert err.count("stopped at the vocabulary") == 2, err


def test_a_json_has_no_split_and_rows_recorded_with_one_go_on(setup, one_device):
  """A JSON's settings and summary record its split as null (a converted directory's is its
  --split); rows whose settings recorded "eval" for it, as older versions did, are gone on from."""
  assert json.loads((setup / "one.summary.json").read_text())["split"] is None
  settings = json.loads((setup / "one.jsonl.settings.json").read_text())
  assert settings["split"] is None
  (setup / "old.jsonl").write_text((setup / "one.jsonl").read_text())
  (setup / "old.jsonl.settings.json").write_text(json.dumps(dict(settings, split="eval")))
  assert _eval(setup, setup / "old.jsonl") == 0
  summary = json.loads((setup / "old.summary.json").read_text())
  assert summary["answered_now"] == 0 and summary["split"] is None
  assert _rows(setup / "old.jsonl") == one_device


def test_a_batch_holds_no_more_rows_than_there_are_samples(setup, one_device, monkeypatch):
  """--batch 64 for the 5 samples: one batch of 5 rows (padding rows cost as real ones), the same
  answers as batches of 4."""
  sizes, batch = [], eval_tool.eval_samples.batch
  monkeypatch.setattr(eval_tool.eval_samples, "batch",
                      lambda chunk, args, layout, bsz: sizes.append(bsz) or batch(chunk, args,
                                                                                  layout, bsz))
  assert _eval(setup, setup / "wide.jsonl", "--batch", "64") == 0
  assert set(sizes) == {5} and _rows(setup / "wide.jsonl") == one_device


def test_rows_of_another_eval_are_not_mixed_in(setup, one_device, capsys):
  assert _eval(setup, setup / "one.jsonl", "--max_new_tokens", "3") == 2
  err = capsys.readouterr().err
  assert "holds rows of another eval (max_new_tokens " in err and "3 here)" in err, err
  assert _rows(setup / "one.jsonl") == one_device
  data = (setup / "data.json").read_bytes()  # --out naming the data itself: no rows file
  assert _eval(setup, setup / "data.json") == 2
  assert (f"--out {setup / 'data.json'} exists and is no eval's rows file (it has no readable "
          "data.json.settings.json beside it); give another --out.") in capsys.readouterr().err
  assert (setup / "data.json").read_bytes() == data


def test_without_out_evals_of_other_settings_keep_files_of_their_own(setup, tmp_path, capsys):
  """The default `--out` of an eval whose file holds another eval's rows is the next numbered
  one, and the same command finds its own again (nothing answered twice)."""
  run = tmp_path / "run"
  shutil.copytree(setup / "run", run, symlinks=True)
  args = lambda *extra: [str(run), "--data", str(setup / "data.json"), "--images", str(IMAGES),
                         "--tokenizer", str(setup / "tok"), "--processor", str(setup / "tok"),
                         "--batch", "4", "--seq_len", "96", "--samples", "2", *extra]
  folder = run / "eval"
  assert eval_tool.main(args("--max_new_tokens", "2")) == 0
  first = sorted(p.name for p in folder.glob("*.jsonl"))
  assert eval_tool.main(args("--max_new_tokens", "3")) == 0
  assert eval_tool.main(args("--max_new_tokens", "2")) == 0  # again: its rows are there
  capsys.readouterr()
  files = sorted(p.name for p in folder.glob("*.jsonl"))
  assert len(first) == 1 and len(files) == 2, files
  one, two = folder / first[0], folder / files[0 if files[1] == first[0] else 1]
  assert two.name == one.name.replace(".jsonl", ".2.jsonl")
  summaries = [json.loads(eval_tool.summary_path(p).read_text()) for p in (one, two)]
  assert [s["max_new_tokens"] for s in summaries] == [2, 3]
  assert summaries[0]["answered_now"] == 0 and summaries[1]["answered_now"] == 2
  assert len(_rows(one)) == len(_rows(two)) == 2
  # --samples takes the first N: a larger N goes on from the rows of a smaller one, in its file.
  before = _rows(one)
  assert eval_tool.main(args("--max_new_tokens", "2", "--samples", "3")) == 0
  assert sorted(p.name for p in folder.glob("*.jsonl")) == files
  summary = json.loads(eval_tool.summary_path(one).read_text())
  assert summary["answered_now"] == 1 and summary["samples"] == 3
  assert _rows(one)[:2] == before and len(_rows(one)) == 3


def test_seq_len_is_held_to_the_eval_data_not_the_run_s_own(setup, one_device, tmp_path):
  """A run whose own converted data holds a sample longer than --seq_len evaluates a JSON whose
  samples fit: the rows are checked against --data's samples, not the run's data.dir."""
  from tools import convert  # pylint: disable=import-outside-toplevel
  long = [{"id": f"l{k}", "image": FILES[:1], "conversations": [
      {"from": "human", "value": "<image>\nwhat is in the picture" + " hello" * 120},
      {"from": "gpt", "value": "hello there"}]} for k in range(4)]
  (tmp_path / "long.json").write_text(json.dumps(long))
  assert convert.main(["--json", str(tmp_path / "long.json"), "--images", str(IMAGES),
                       "--tokenizer", str(setup / "tok"), "--processor", str(setup / "tok"),
                       "--image_token", "<image>", "--out", str(tmp_path / "data"), "--eval", "1",
                       "--workers", "1"]) == 0
  manifest = json.loads((tmp_path / "data" / "conversations.json").read_text())
  assert manifest["longest"] > 96
  run = tmp_path / "run"
  shutil.copytree(setup / "run", run, symlinks=True)
  meta_file = run / "checkpoints" / "0" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["config"]["data"].update(task="conversations", dir=str(tmp_path / "data"),
                                image_token=manifest["image_token"])
  meta["digest"] = checkpoint_steps.digest(meta)
  meta_file.write_text(json.dumps(meta))
  assert eval_tool.main([str(run), "--data", str(setup / "data.json"), "--images", str(IMAGES),
                         "--tokenizer", str(setup / "tok"), "--processor", str(setup / "tok"),
                         "--max_new_tokens", "4", "--batch", "4", "--seq_len", "96", "--metric",
                         "vqa", "--metric", "exact_match", "--out", str(tmp_path / "e.jsonl")]) == 0
  assert _rows(tmp_path / "e.jsonl") == one_device
