"""tools.convert's messages to a new user: a JSON object instead of a list of records, a
conversation that opens with the assistant, a flag out of range named alone, an error that is one
line (notes follow a finished conversion) and a launch line that keeps the model config's
global batch unless `--global_batch` is given."""

import json
import os
import shlex
import shutil
import signal

import pytest

from mimo_jax import output
from mimo_jax.config import ConfigError
from mimo_jax.data import conversion
from mimo_jax.data.chat import AssistantFirst, ChatTokenizer
from tests.test_convert_faults import PROCESSOR, TOKENIZER, FIXTURES, _main, _one_line_error
from tools import convert


def _record(i, first="human"):
  turns = [{"from": "human", "value": "<image>\nWhat is it?"},
           {"from": "gpt", "value": f"Answer {i}."}]
  if first == "gpt":  # the assistant opens: no user turn before it
    turns = [{"from": "gpt", "value": "<image>\nHello."}, *turns[1:]]
    turns[1]["value"] = "Hi."
    turns.append({"from": "human", "value": "What is it?"})
    turns.append({"from": "gpt", "value": f"Answer {i}."})
  return {"id": f"r{i}", "image": "portrait.png", "conversations": turns}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  """portrait.png, ok.json (12 records), wrapped.json / wrapped.jsonl / pretty.json (the records
  inside an object), other.json (an object of no list) and gpt_first.json (record 0 opens with the
  assistant)."""
  root = tmp_path_factory.mktemp("messages")
  shutil.copy(FIXTURES / "images" / "portrait.png", root)
  records = [_record(i) for i in range(12)]
  (root / "ok.json").write_text(json.dumps(records))
  (root / "wrapped.json").write_text(json.dumps({"data": records}))
  (root / "wrapped.jsonl").write_text(json.dumps({"data": records}) + "\n")
  (root / "pretty.json").write_text(json.dumps({"info": "v1", "data": records}, indent=2))
  (root / "other.json").write_text(json.dumps({"a": 1, "b": {}}))
  (root / "gpt_first.json").write_text(json.dumps([_record(0, "gpt")] + records[1:]))
  return root


def _args(src, out, data="ok.json", *extra):
  return ["--json", str(src / data), "--images", str(src), "--tokenizer", str(TOKENIZER),
          "--processor", str(PROCESSOR), "--out", str(out), "--workers", "1", *extra]


@pytest.mark.parametrize("data,keys,inside", [
    ("wrapped.json", "key data", "or the list inside it (under data)"),
    ("wrapped.jsonl", "key data", "or the list inside it (under data)"),
    ("pretty.json", "keys info, data", "or the list inside it (under data)"),
    ("other.json", "keys a, b", "a list of records (LLaVA's format)."),
])
def test_a_json_object_is_named_as_one_with_its_keys(src, tmp_path, capsys, data, keys, inside):
  rc, err, _ = _main(_args(src, tmp_path / "out", data), capsys)
  _one_line_error(rc, err, f"a JSON object with {keys}, not a list of records", inside)
  assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_conversation_that_opens_with_the_assistant_says_so(src, tmp_path, capsys):
  rc, err, _ = _main(_args(src, tmp_path / "out", "gpt_first.json", "--on_error", "fail"),
                     capsys)
  _one_line_error(rc, err, "record 0 (id 'r0'): assistant turn 0 comes first: a conversation "
                  "starts with a user (or system) turn")
  assert "no prefix" not in err
  tok = ChatTokenizer.open(TOKENIZER)
  with pytest.raises(AssistantFirst):
    tok.encode([{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi."}])
  _, mask = tok.encode([{"role": "system", "content": "Be brief."},  # a system turn first is fine
                        {"role": "assistant", "content": "Hello."}])
  assert mask.any()


@pytest.mark.parametrize("flags,named,unnamed", [
    (["--workers", "0"], "error: give --workers at least 1 (not 0).", "--image_tokens"),
    (["--global_batch", "0", "--seed", "-1"],
     "give --global_batch at least 1 (not 0) and --seed at least 0 (not -1).", "--workers"),
    (["--seq_len", "-1", "--audio_pool", "0", "--image_tokens", "-2"],
     "give --image_tokens at least 1 (not -2), --audio_pool at least 1 (not 0) and --seq_len at "
     "least 0 (not -1).", "--seed"),
])
def test_a_flag_out_of_range_is_named_alone(src, tmp_path, capsys, flags, named, unnamed):
  rc, err, _ = _main(_args(src, tmp_path / "out", "ok.json", *flags), capsys)
  _one_line_error(rc, err, named)
  assert unnamed not in err


def test_an_error_is_one_line_and_notes_follow_a_finished_conversion(src, tmp_path, capsys):
  """Without --image_tokens the image's tokens are a note: after the conversion, never before an
  error (--eval too large is found once the records are read); the launch line leaves
  data.global_batch to the model config unless --global_batch is given."""
  rc, err, _ = _main(_args(src, tmp_path / "bad", "ok.json", "--eval", "12"), capsys)
  _one_line_error(rc, err, "--eval 12")
  assert len(err.strip().splitlines()) == 1, err
  rc, err, printed = _main(_args(src, tmp_path / "out", "ok.json", "--eval", "2"), capsys)
  assert rc == 0, err
  assert "an image counts as 1 token" in err
  line = shlex.split(printed.strip().splitlines()[-1])
  assert line[:4] == ["python", "-m", "mimo_jax.launch", "--config=MODEL_CONFIG"]
  assert not any("global_batch" in f for f in line), line
  m = json.loads((tmp_path / "out" / "conversations.json").read_text())
  assert "--config.data.global_batch=8" in convert.launch_flags(tmp_path / "out", m, 0, 8)


def test_a_signal_whose_exception_another_wraps_is_an_interrupt(tmp_path, monkeypatch):
  """A signal taken inside a class's creation during an import (the built-in encoders load once
  the conversion has begun) reaches the converter wrapped in a RuntimeError: it is still the
  interrupt, which tools.convert reports in one line."""
  def builtin():
    try:
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(10_000):  # the handler runs between bytecodes
        pass
    except output.Interrupted as e:
      raise RuntimeError("Error calling __set_name__") from e
  monkeypatch.setattr(conversion.encoders, "builtin", builtin)
  with pytest.raises(output.Interrupted, match="SIGINT"):
    conversion.convert(tmp_path / "records.json", tmp_path / "out", None)
  assert not (tmp_path / "out").exists()


def test_progress_is_lines_where_stderr_is_no_terminal(src, tmp_path, capsys, monkeypatch):
  """Under `2> file` (stderr no terminal) a conversion says its progress in whole lines (records
  done, skipped, rate), never a bar's carriage returns."""
  monkeypatch.setattr(conversion, "PROGRESS_SECONDS", 0.0)  # a line a record
  rc, err, _ = _main(_args(src, tmp_path / "out", "ok.json", "--eval", "2"), capsys)
  assert rc == 0, err
  lines = [ln for ln in err.splitlines() if ln.startswith("converting: ")]
  assert "\r" not in err and len(lines) == 11, err
  assert lines[0].startswith("converting: 1 of 12 records (8%), 0 skipped, ") and \
      lines[0].endswith(" s left") and "records/s, about " in lines[0], lines[0]


def test_no_record_converted_is_a_sentence_with_the_fix(src, tmp_path, capsys):
  """Every record skipped (too long for --seq_len 20, one missing its image): the error counts the
  reasons with their first records and gives the fix, --seq_len the longest sample's tokens (no
  dict repr); with that --seq_len every sample fits."""
  records = json.loads((src / "ok.json").read_text())
  (src / "d.json").write_text(json.dumps(records + [dict(records[0], id="gone",
                                                         image="nowhere.png")]))
  rc, err, _ = _main(_args(src, tmp_path / "out", "d.json", "--seq_len", "20", "--eval", "1"),
                     capsys)
  _one_line_error(rc, err, "d.json: no record could be converted for train: 13 of 13 records "
                  "(100.0%) were skipped: too long 12 ('r0', 'r1', 'r2', ...), missing image 1 "
                  "('gone'); the first 5 of each reason are named above on `skipped:` lines. Give "
                  "--seq_len ")
  line = err.strip().splitlines()[-1]
  assert "{" not in line and line.endswith(
      " or more (the tokens of the longest sample; 0: no limit) and fix the other records or the "
      "flags that reject them."), line
  longest = line.split("Give --seq_len ")[1].split()[0]
  rc, err, _ = _main(_args(src, tmp_path / "out", "d.json", "--seq_len", longest, "--eval", "1",
                           "--max_skipped_fraction", "1"), capsys)
  assert rc == 0, err
  m = json.loads((tmp_path / "out" / "conversations.json").read_text())
  assert m["skipped"] == {"missing image": 1} and m["longest"] == int(longest)


@pytest.mark.parametrize("bad,kind", [(5, "an integer"), (None, "null"), ([1], "a list"),
                                      ("x", "a string")])
def test_a_record_that_is_no_object_is_named_in_json_words(tmp_path, bad, kind):
  path = tmp_path / "data.json"
  path.write_text(json.dumps([{"id": 0, "conversations": []}, bad]))
  with pytest.raises(ConfigError) as e:
    conversion.records_of(path)
  assert str(e.value) == (f"--json {path}: record 1 is {kind}, not an object with an id and "
                          "conversations.")


def test_an_image_without_read_access_is_named_unreadable_not_corrupt(tmp_path, monkeypatch):
  """Permission denied is no damage: the record is skipped as an unreadable image, with the fix
  (read access), not counted among corrupt ones."""
  import types  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import conversion_record, images  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.record_error import RecordError  # pylint: disable=import-outside-toplevel
  (tmp_path / "a.png").write_bytes(b"")

  def denied(path, proc):
    raise PermissionError(13, "Permission denied", str(path))
  monkeypatch.setattr(images, "load", denied)
  monkeypatch.setattr(conversion_record, "WORKER", {
      "images": tmp_path, "root": str(tmp_path), "proc": None,
      "opts": types.SimpleNamespace(allow_outside_images=False)})
  with pytest.raises(RecordError) as e:
    conversion_record._read_image("a.png", "record 0")  # pylint: disable=protected-access
  assert e.value.reason == "unreadable image"
  assert str(e.value) == (f"record 0: image {tmp_path / 'a.png'} cannot be opened (permission "
                          "denied); give the converter read access to it.")


def test_a_sample_far_longer_than_the_others_is_named_beside_the_launch_line(src, tmp_path,
                                                                              capsys):
  """One long record sizes the launch line's data.seq_len for every row: a note names it, with
  the --seq_len that 99% of the samples fit in (none where --seq_len is given)."""
  records = [_record(i) for i in range(12)]
  records[5]["conversations"][1]["value"] = " ".join(["Answer 5."] * 60)
  (tmp_path / "long.json").write_text(json.dumps(records))
  rc, err, printed = _main(_args(src, tmp_path / "out", str(tmp_path / "long.json"),
                                 "--eval", "2"), capsys)
  assert rc == 0, err
  m = json.loads((tmp_path / "out" / "conversations.json").read_text())
  assert m["longest_record"] == {"record": 5, "id": "r5"} and m["longest"] > 2 * m["positions_p99"]
  assert (f"note: record 5 (id 'r5') is the longest sample, {m['longest']} positions, where 99% "
          f"of the samples take {m['positions_p99']} or fewer: the launch line's data.seq_len="
          f"{m['longest']} gives every row its length; --seq_len {m['positions_p99']} with "
          "--max_skipped_fraction 0.09 skips the 1 sample longer than that.") in err, err
  assert f"--config.data.seq_len={m['longest']}" in printed
  rc, err, _ = _main(_args(src, tmp_path / "cut", str(tmp_path / "long.json"), "--eval", "2",
                           "--seq_len", str(m["positions_p99"]), "--max_skipped_fraction", "0.09"),
                     capsys)
  assert rc == 0 and "is the longest sample" not in err, err
  cut = json.loads((tmp_path / "cut" / "conversations.json").read_text())
  assert cut["skipped"] == {"too long": 1} and cut["longest"] == m["positions_p99"]
