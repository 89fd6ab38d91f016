"""tools.convert and an image's or clip's placeholder in an assistant turn: such a record is bad
(the assistant's turns are what the model learns to say, and it cannot say an image), skipped and
counted by reason or, with --on_error fail, the end of a conversion that writes nothing; its
message names the record, the turn and the fix. A placeholder in a user turn converts as before,
outside the loss."""

import json

import pytest

from mimo_jax.data import conversations, conversion_files
from tests.test_convert_audio import _samples, media_source
from tests.test_convert_faults import FIXTURES, _leftovers, _main, _one_line_error

FIX = "images and clips go in a user turn"


def _rec(rid, *turns, **media):
  """A record of alternating human and gpt turns."""
  return {"id": rid, "conversations": [{"from": ("human", "gpt")[k % 2], "value": t}
                                       for k, t in enumerate(turns)], **media}


GOOD = [_rec(f"g{k}", "<image>\nWhat is it?", "A portrait.", image="portrait.png")
        for k in range(3)] + [_rec("heard", "<audio>\nWhat is said?", "Hello.",
                                   audio="one_second.flac")]
BAD = {  # each lists as many images or clips as its text marks: the counts agree
    "image": _rec("bad-image", "<image>\nWhat is it?", "A portrait.", "And this one?",
                  "<image>\nThe same.", image=["portrait.png", "portrait.png"]),
    "audio": _rec("bad-audio", "What is said?", "It says <audio>.", audio="one_second.flac"),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  """A tokenizer with Qwen2-Audio's audio tokens, images/, audio/ and image.json, audio.json
  (the good records, then one bad) and both.json (the good records, then both bad ones)."""
  root = media_source(tmp_path_factory.mktemp("placeholders"), ("one_second.flac",))
  for name, record in BAD.items():
    (root / f"{name}.json").write_text(json.dumps(GOOD + [record]))
  (root / "both.json").write_text(json.dumps(GOOD + list(BAD.values())))
  return root


def _args(root, out, data, *extra):
  return ["--json", str(root / data), "--images", str(root / "images"), "--audio",
          str(root / "audio"), "--tokenizer", str(root / "tokenizer"), "--processor",
          str(FIXTURES / "images" / "siglip"), "--out", str(out), "--eval", "1", "--workers",
          "1", "--mel_bins", "80", *extra]


@pytest.mark.parametrize("medium,turn,mark", [("image", 3, "<image>"), ("audio", 1, "<audio>")])
def test_a_placeholder_in_an_assistant_turn_under_fail_stops_writing_nothing(src, tmp_path, capsys,
                                                                             medium, turn, mark):
  out = tmp_path / "made" / "out"
  rc, err, _ = _main(_args(src, out, f"{medium}.json", "--on_error", "fail"), capsys)
  _one_line_error(rc, err, f"{medium}.json: record 4 (id 'bad-{medium}'): assistant turn {turn} "
                  f"holds {mark}", FIX, "--on_error skip converts the rest")
  assert _leftovers(tmp_path) == []


def test_a_placeholder_in_an_assistant_turn_is_skipped_and_counted(src, tmp_path, capsys):
  """Skipped by reason, named on a `skipped:` line and in skipped.jsonl; no converted sample has
  a placeholder inside its loss, and those in user turns are kept outside it."""
  out = tmp_path / "out"
  rc, err, _ = _main(_args(src, out, "both.json", "--max_skipped_fraction", "1"), capsys)
  assert rc == 0, err
  m = conversations.manifest(str(out))
  assert m["skipped"] == {"image in assistant turn": 1, "audio in assistant turn": 1}, m
  assert sum(m["samples"].values()) == len(GOOD)
  rows = [json.loads(line) for line in (out / conversion_files.SKIPPED).read_text().splitlines()]
  assert [(r["record"], r["id"], r["reason"]) for r in rows] == [
      (4, "bad-image", "image in assistant turn"), (5, "bad-audio", "audio in assistant turn")]
  for r, (turn, mark) in zip(rows, [(3, "<image>"), (1, "<audio>")]):
    assert f"record {r['record']} (id '{r['id']}'): assistant turn {turn} holds {mark}" \
        in r["error"] and FIX in r["error"], r
    assert f"skipped: {r['error']}" in err, err
  samples = _samples(out)
  assert len(samples) == len(GOOD)
  for s in samples:
    marks = (s["tokens"] == m["image_token"]) | (s["tokens"] == m["audio_token"])
    assert marks.sum() == 1 and not s["loss_mask"][marks].any(), s
