"""tools.convert against a probe's findings: images of several channel counts refused (and the
loader's check of an image's channels), `--audio` read relative to --json's folder by default, the
`skipped:` lines of one reason bounded, and the eval warning's wording."""

import json
import shutil

import numpy as np
import pytest
import soundfile
from PIL import Image

from mimo_jax.config import ConfigError
from mimo_jax.data import audio, conversations
from tests.helpers import image_layout
from tests.test_convert_audio import media_source
from tests.test_convert_faults import FIXTURES, PROCESSOR, TOKENIZER, _main, _one_line_error
from tools import convert

TURNS = [{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "A digit."}]


def _keeps_bands(root):
  """A copy of the fixtures' processor that keeps an image's bands (do_convert_rgb false, as the
  av_digits task's)."""
  keeps = root / "keeps"
  shutil.copytree(PROCESSOR, keeps)
  config = json.loads((keeps / "preprocessor_config.json").read_text())
  (keeps / "preprocessor_config.json").write_text(json.dumps(dict(config, do_convert_rgb=False)))
  return keeps


def test_images_of_several_channel_counts_fail_the_conversion_naming_one_of_each(tmp_path,
                                                                                 capsys):
  """Grayscale images and one RGB photo under a processor that keeps bands: one error line naming
  the first image of each count and the Pillow fix, nothing written (the manifest's most common
  count would make training fail reshaping the photo)."""
  (tmp_path / "images").mkdir()
  rng = np.random.default_rng(0)
  for k in range(11):
    Image.fromarray(rng.integers(0, 256, (24, 24), np.uint8), "L").save(
        tmp_path / "images" / f"g{k}.png")
  Image.fromarray(rng.integers(0, 256, (24, 24, 3), np.uint8), "RGB").save(
      tmp_path / "images" / "photo.png")
  records = [{"id": f"g{k}", "image": f"images/g{k}.png", "conversations": TURNS}
             for k in range(11)]
  records.insert(5, {"id": "photo", "image": "images/photo.png", "conversations": TURNS})
  (tmp_path / "mixed.json").write_text(json.dumps(records))
  out = tmp_path / "out"
  rc, err, _ = _main(["--json", str(tmp_path / "mixed.json"), "--tokenizer", str(TOKENIZER),
                      "--processor", str(_keeps_bands(tmp_path)), "--out", str(out),
                      "--workers", "2", "--eval", "1"], capsys)
  images = tmp_path / "images"
  _one_line_error(rc, err, f"--json {tmp_path / 'mixed.json'}: its images differ in channels, "
                  f"11 images of 1 channel ({images / 'g0.png'} of record 0 (id 'g0'), ...) and "
                  f"1 image of 3 channels ({images / 'photo.png'} of record 5 (id 'photo'))",
                  "keeps an image's bands (\"do_convert_rgb\": false)",
                  "convert the 3-channel images to grayscale (with Pillow: Image.open(path)"
                  ".convert(\"L\").save(new_path)), or give a processor that converts every "
                  "image to RGB")
  assert not out.exists() and "Traceback" not in err


@pytest.mark.parametrize("slot_patches", [0, 4])
def test_an_image_whose_channels_differ_from_the_tower_is_one_error_naming_the_fix(slot_patches):
  """The loader's defence: an RGB image where model.vision.channels is 1 is a ConfigError (one
  line from launch, exit status 2) naming the field and the fix, not numpy's reshape error."""
  slots = image_layout(16, 4, 1, 1, (8, 8, 1), slot_patches=slot_patches).encoders[0]
  inputs = slots.empty()
  with pytest.raises(ConfigError, match=r"^model\.vision\.channels: 1, but the data holds a 8x8 "
                     r"image of 3 channels .*convert the data again with images of one channel "
                     r"count \(Pillow's \.convert\(\"L\"\)"):
    slots.write(inputs, 0, 0, slots.slot_tokens, np.zeros((8, 8, 3), np.uint8), (8, 8), 1)
  slots.write(inputs, 0, 0, slots.slot_tokens, np.full((8, 8, 1), 7, np.uint8), (8, 8), 1)
  assert (next(iter(inputs.values())) == 7).any()  # an image of the tower's channels is written


def test_audio_paths_are_read_from_the_json_folder_by_default(tmp_path, capsys, monkeypatch):
  """Without --audio, clip paths are relative to --json's folder (as --images' and tools.eval's
  --audio), from any working directory; a missing clip's skip line names the folder it was looked
  for in and the flag, and the warning says which folder was read; --help says the default."""
  root = media_source(tmp_path / "src", ())
  (root / "clips").mkdir()
  tone = np.sin(np.arange(audio.SAMPLE_RATE) * 0.05).astype(np.float32) * 0.3
  for k in range(12):
    soundfile.write(root / "clips" / f"a{k}.wav", tone, audio.SAMPLE_RATE)
  records = [{"id": f"a{k}", "audio": f"clips/a{k}.wav", "conversations": [
      {"from": "human", "value": "<audio> what?"}, {"from": "gpt", "value": "A tone."}]}
             for k in range(12)]
  records.append(dict(records[0], id="gone", audio="clips/gone.wav"))
  (root / "data.json").write_text(json.dumps(records))
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path / "elsewhere")
  out = tmp_path / "out"
  rc, err, _ = _main(["--json", str(root / "data.json"), "--tokenizer", str(root / "tokenizer"),
                      "--out", str(out), "--workers", "1", "--eval", "1", "--mel_bins", "80",
                      "--audio_window", "1", "--max_skipped_fraction", "1"], capsys)
  assert rc == 0, err
  assert conversations.manifest(str(out))["audios"] == 12, err
  assert (f"skipped: {root / 'data.json'}: record 12 (id 'gone'): audio file "
          f"{root / 'clips' / 'gone.wav'}: no such file under --audio {root}.\n") in err, err
  assert (f"; no --audio was given: audio paths were read relative to --json's folder {root}; "
          "give --audio DIR where they are elsewhere.") in err, err
  with pytest.raises(SystemExit):
    convert.main(["--help"])
  said = " ".join(capsys.readouterr().out.split())
  assert ("--audio AUDIO the folder audio paths are relative to (default: --json's folder, as "
          "tools.eval's; records without clips need none)") in said, said


def test_skipped_lines_of_one_reason_stop_after_the_first_five(tmp_path, capsys):
  """One systematic mistake (20 records of a missing image) prints its first 5 `skipped:` lines
  and one line saying the rest are not printed; another reason's lines still print, skipped.jsonl
  lists every skipped record, and a failed conversion's summary says only the first are named."""
  shutil.copy(FIXTURES / "images" / "portrait.png", tmp_path)
  records = [{"id": f"r{k}", "image": "portrait.png" if k % 3 == 2 else f"gone{k}.png",
              "conversations": TURNS} for k in range(30)]
  records += [{"id": f"role{k}", "conversations": [{"from": "robot", "value": "hi"}]}
              for k in range(2)]
  (tmp_path / "d.json").write_text(json.dumps(records))
  args = ["--json", str(tmp_path / "d.json"), "--tokenizer", str(TOKENIZER), "--processor",
          str(PROCESSOR), "--workers", "2", "--eval", "1"]
  rc, err, _ = _main(args + ["--out", str(tmp_path / "out"), "--max_skipped_fraction", "1"],
                     capsys)
  assert rc == 0, err
  lines = [ln for ln in err.splitlines() if ln.startswith("skipped: ")]
  missing = [ln for ln in lines if " not found." in ln]
  assert [ln.split("(id ")[1].split(")")[0] for ln in missing] == [
      "'r0'", "'r1'", "'r3'", "'r4'", "'r6'"], err
  assert lines.count("skipped: further records skipped as 'missing image' are not printed; a "
                     "finished conversion lists every one in skipped.jsonl in --out.") == 1, err
  assert sum("unknown role 'robot'" in ln for ln in lines) == 2 and len(lines) == 8, err
  rows = [json.loads(r) for r in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
  assert [r["reason"] for r in rows] == ["missing image"] * 20 + ["unknown role"] * 2, rows
  rc, err, _ = _main(args + ["--out", str(tmp_path / "out2")], capsys)
  _one_line_error(rc, err, "missing image 20 ('r0', 'r1', 'r3', ...), unknown role 2 ('role0', "
                  "'role1'), more than --max_skipped_fraction 0.05 allows; the first 5 of each "
                  "reason are named above on `skipped:` lines.")


def test_the_default_eval_draw_that_lost_records_is_said_in_a_sentence(tmp_path, capsys):
  """Without --eval (10 of 100 records drawn) and some drawn records skipped, the warning reads
  "eval holds N of the 10 records drawn for it: ..." (no "records were drawn")."""
  shutil.copy(FIXTURES / "images" / "portrait.png", tmp_path)
  records = [{"id": f"r{k}", "image": f"gone{k}.png" if k % 3 == 0 else "portrait.png",
              "conversations": TURNS} for k in range(100)]
  (tmp_path / "d.json").write_text(json.dumps(records))
  rc, err, _ = _main(["--json", str(tmp_path / "d.json"), "--tokenizer", str(TOKENIZER),
                      "--processor", str(PROCESSOR), "--workers", "2", "--out",
                      str(tmp_path / "out"), "--max_skipped_fraction", "1"], capsys)
  assert rc == 0, err
  held = conversations.manifest(str(tmp_path / "out"))["samples"]["eval"]
  assert 0 < held < 10, err  # seed 0 draws records of a missing image too
  lost = 10 - held
  assert (f"tools.convert: warning: eval holds {held} of the 10 records drawn for it: {lost} of them "
          f"{'was' if lost == 1 else 'were'} skipped (a skipped record is not replaced; a larger "
          "--eval holds more).") in err.splitlines(), err
