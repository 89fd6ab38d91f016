"""tools.eval's parts checked without tests/test_eval_tool.py's module fixture: its progress
lines, converted samples named by their records' ids and kept by position, the CPU devices its
default spans, audio slots sized to the longest clip, its program's answers against
transformers' generate (on imports of its own); and tools.eval_bench's prompts and a tiny run
of it."""

import argparse
import json

import jax
import numpy as np
import pytest

from mimo_jax import eval_set
from mimo_jax.data import conversations, loader
from mimo_jax.data.chat import ChatTokenizer
from mimo_jax.evaluate import Evaluator

from tests.test_generate import FIXTURES, _tokenizer
from tools import eval as eval_tool
from tools import eval_samples
from tools import hf as hf_tool

IMAGES = FIXTURES.parent / "images"


def test_reading_a_json_says_how_far_it_is_every_few_seconds(monkeypatch, capsys):
  """Reading records (a terminal or not: no bar shows it) and answering (lines where stderr is no
  terminal): a line every PROGRESS_SECONDS, none after the last."""
  now = [100.0]
  monkeypatch.setattr(eval_tool.time, "monotonic", lambda: now[0])
  lines = eval_tool._Lines("reading", "record", 1000, bar=False)  # pylint: disable=protected-access
  for _ in range(3):
    now[0] += 4.0
    lines.update(100)
  assert capsys.readouterr().err == (
      "tools.eval: reading: 300 of 1000 records (30%), 25.0 records/s, about 28 s left\n")
  now[0] += 20.0
  lines.update(700)
  assert capsys.readouterr().err == ""


def test_converted_samples_are_named_by_their_records_ids_and_kept_by_position(tmp_path, capsys):
  # Records converted before ids were kept have none (null, with a note); the position in the
  # split keeps the rows either way, and rows written when the id was the position resume.
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  _tokenizer(tmp_path / "tok")
  tok = ChatTokenizer.open(str(tmp_path / "tok"))
  sample = {"tokens": [1, 5, 8, 2], "loss_mask": [0, 0, 1, 1], "images": []}
  path = tmp_path / "eval.array_record"
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for record in (sample, dict(sample, id="q7"), dict(sample, id="q7")):  # ids may be shared
    writer.write(conversations.encode(record))
  writer.close()
  got = eval_set.converted(str(path), tok)
  assert [(s["id"], s["position"]) for s in got] == [(None, 0), ("q7", 1), ("q7", 2)]
  assert len({eval_tool.key(s) for s in got}) == 3
  assert eval_tool.key({"id": 2, "prediction": "x"}) == eval_tool.key(got[2])
  (tmp_path / conversations.MANIFEST).write_text(json.dumps({"format": 1}))
  args = argparse.Namespace(data=str(tmp_path), split="eval", samples=0)
  assert eval_samples.converted_samples(args, tok) == got
  assert "converted before the records' ids were kept" in capsys.readouterr().err


def test_the_benchmark_s_prompts_are_left_padded_with_one_image_each():
  from tools import eval_bench  # pylint: disable=import-outside-toplevel
  p = eval_bench.prompts(argparse.Namespace(tiny=True, batch=5, prompt=12))
  lengths = p["mask"].sum(axis=1)
  assert lengths.tolist() == [12 + 16, 11 + 16, 10 + 16, 9 + 16, 12 + 16]
  assert ((p["ids"] == 63).sum(axis=1) == 16).all() and p["images"].shape == (5, 16, 16, 3)
  assert (p["ids"][p["mask"] == 0] == 0).all() and p["mask"][:, -1].all()


def test_the_benchmark_runs_both_sides_at_tiny_size(capsys):
  """Where torch and transformers are installed: both generate, and agree in float32."""
  pytest.importorskip("transformers")
  from tools import eval_bench  # pylint: disable=import-outside-toplevel
  assert eval_bench.main(["--tiny", "--batch", "2", "--prompt", "8", "--new", "4",
                          "--reps", "1"]) == 0
  out = capsys.readouterr().out
  assert "new tokens equal in HF's and the eval's: 100.0%" in out
  assert "| mimo_jax `tools.generate`'s programs, the ids as text | float32 |" in out, out


def test_the_cpu_devices_default_spans_the_runs_topology(tmp_path):
  """A run of two processes of 4 CPU devices each records run.cpu_devices=4 and a topology over
  8: the eval creates the 8 its meshes need (or --layout's, or --cpu_devices)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from mimo_jax.config import set_layout  # pylint: disable=import-outside-toplevel
  from configs import digits  # pylint: disable=import-outside-toplevel
  cfg = digits.get_config()
  cfg.run.cpu_devices = 4
  set_layout(cfg, "vision=0/4/1,language=4/4/1")
  meta = tmp_path / "checkpoints" / "30" / "meta"
  meta.mkdir(parents=True)
  (meta / "metadata").write_text(json.dumps({"config": dataclasses.asdict(cfg)}))
  args = lambda **kw: argparse.Namespace(**{"workdir": str(tmp_path), "step": None,
                                            "layout": "", "cpu_devices": None, **kw})
  assert eval_tool.cpu_devices(args()) == 8
  assert eval_tool.cpu_devices(args(layout="vision=0/1/1,language=0/1/1")) == 4
  assert eval_tool.cpu_devices(args(cpu_devices=2)) == 2


def test_a_clip_longer_than_the_runs_windows_gets_them_in_the_evals_slots(capsys):
  """model.audio.max_windows is a data setting: an eval of longer clips sizes its slots to the
  longest (tools.generate encodes a clip whole), said on stderr; packed slots keep theirs."""
  from tests.configs import tiny_audio  # pylint: disable=import-outside-toplevel
  cfg = tiny_audio.get_config()
  a = cfg.model.encoders["audio"]
  a.max_windows, a.slot_frames = 1, 0
  samples = [{"sample": {"audio_frames": [a.frames]}},
             {"sample": {"audio_frames": [a.frames, 2 * a.frames + 1]}}, {"sample": {}}]
  eval_samples.fit_windows(cfg, samples, eval_tool._say)  # pylint: disable=W0212
  assert a.max_windows == 3
  assert capsys.readouterr().err == (
      f"tools.eval: the longest clip spans 3 windows of {a.frames} frames: this eval's slots "
      "hold 3 (the run's model.audio.max_windows is 1)\n")
  eval_samples.fit_windows(cfg, samples, eval_tool._say)  # pylint: disable=W0212
  assert capsys.readouterr().err == ""  # fits already: nothing to say
  a.max_windows, a.slot_frames = 1, 4 * a.frames
  eval_samples.fit_windows(cfg, samples, eval_tool._say)  # pylint: disable=W0212
  assert a.max_windows == 1


def _hf_prompts(ref, image_id: int, tokens: int) -> list[tuple[list[int], list[np.ndarray]]]:
  """The fixture's rows as converted samples hold them: each image one placeholder (its run of
  `tokens` image ids collapsed), with its images."""
  rows = np.split(ref["rows"], np.cumsum(ref["lengths"])[:-1])
  images = np.split(ref["images"], np.cumsum(ref["image_counts"])[:-1])
  out = []
  for row, pixels in zip(rows, images):
    ids, run = [], 0
    for t in [*row.tolist(), -1]:
      if t == image_id:
        run += 1
        continue
      ids += [image_id] * (run // tokens)
      run = 0
      if t >= 0:
        ids.append(t)
    out.append((ids, list(pixels)))
  return out


@pytest.mark.parametrize("name,base", [("llava15", "configs/llava_cpu.py"),
                                       ("llava_siglip", "configs/vlm.py")])
def test_answers_equal_transformers_generate_for_prompts_with_0_to_3_images(tmp_path, name, base):
  """The eval's program (layout, encoder on its mesh, merge, left-padded prompts, KV-cache decode)
  against transformers' greedy `generate` on a batch of prompts of different lengths; on an
  import of the default base too, whose built-in task marks images with an id of its own (the
  eval takes the data's)."""
  workdir = tmp_path / name
  hf_tool.main(["import", "--hf", str(FIXTURES / name), "--out", str(workdir), f"--config={base}"])
  ref = np.load(FIXTURES / name / "eval_generate.npz")
  image_id = json.loads((FIXTURES / name / "config.json").read_text())["image_token_index"]
  args = argparse.Namespace(workdir=str(workdir), step=None, layout="", seq_len=96,
                            data=str(workdir))
  with jax.default_matmul_precision("highest"):
    step, cfg = eval_tool.run_config(args)
    assert cfg.data.task == ("synthetic" if base == "configs/vlm.py" else "conversations")
    cfg.model.dtype = "float32"  # the reference's (the default base computes in bfloat16)
    eval_tool.from_step(args, cfg, step)
    trainer = eval_tool.build_step(args, cfg, image_id)
    tokens = cfg.model.vision.tokens_per_image
    samples = [{"sample": eval_set.eval_sample(ids, [4], {"images": pixels})}
               for ids, pixels in _hf_prompts(ref, image_id, tokens)]
    batch = loader.layout_microbatch([s["sample"] for s in samples], list(range(len(samples))),
                                     eval_set.layout_for(cfg, 1, len(samples), samples),
                                     conversations.VOCABULARY)
    evaluator = Evaluator(trainer)
    got = evaluator.answers(trainer.init_state(0, optimizer=False), [batch],
                            ref["generated"].shape[1])
  assert [len(p) for _, p in _hf_prompts(ref, image_id, tokens)] == [0, 2, 1, 3]
  np.testing.assert_array_equal(np.stack([got[i] for i in range(len(samples))]),
                                ref["generated"])


def test_an_error_names_a_record_by_the_line_it_starts_on(tmp_path):
  """A JSON's record by its number, id and first line (a list laid out on lines, a BOM, brackets
  and newlines inside strings; JSONL's blank lines counted); a converted split's by position."""
  records = [{"id": f"r{i}", "text": "] ,\n{" * i} for i in range(3)]
  files = {"list.json": ("\ufeff" + json.dumps(records, indent=2), [2, 6, 10]),
           "one_line.json": (json.dumps(records), [1, 1, 1]),
           "lines.jsonl": ("\n" + "\n\n".join(map(json.dumps, records)), [2, 4, 6])}
  for name, (text, lines) in files.items():
    (tmp_path / name).write_text(text, encoding="utf-8")
    assert [eval_samples.record_line(tmp_path / name, i) for i in range(4)] == lines + [None]
  args = argparse.Namespace(data=str(tmp_path / "list.json"), split="eval")
  assert eval_samples.named(args, {"id": "r2", "record": 2}) == (
      f"--data {tmp_path / 'list.json'}: record 2 (id 'r2', line 10)")
  args.data = str(tmp_path)
  assert eval_samples.named(args, {"id": "q7", "position": 4}) == (
      f"--data {tmp_path} (--split eval): sample 'q7' (position 4 of the split)")


def test_a_record_error_names_the_line_the_record_starts_on(tmp_path):
  """Not only the layout's errors: a record without a reference, or whose id is bad (so named by
  its number alone), is named by the line it begins on too (found only when the error is
  raised)."""
  from configs import llava_cpu  # pylint: disable=import-outside-toplevel
  from mimo_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  _tokenizer(tmp_path / "tok")
  tok = ChatTokenizer.open(str(tmp_path / "tok"))
  asks = [{"from": "human", "value": "hello"}]
  fine = {"id": "a", "conversations": asks + [{"from": "gpt", "value": "there"}]}
  data = tmp_path / "data.json"
  args = argparse.Namespace(data=str(data), images=None, samples=0)
  for bad, said in (({"id": "b", "conversations": asks},
                     "record 1 (id 'b', line 15): no assistant turn and no \"answers\""),
                    ({"id": 1.5, "conversations": asks},
                     "record 1 (line 15): \"id\" is 1.5, not a string or an integer")):
    data.write_text(json.dumps([fine, bad], indent=2))  # record 1's "{" on line 15
    with pytest.raises(ConfigError) as e:
      eval_samples.json_samples(args, llava_cpu.get_config(), tok, lambda: None, "<image>")
    assert str(e.value).startswith(f"--data {data}: {said}"), e.value


def test_rgba_and_palette_images_are_made_rgb_as_training_makes_them_or_refused_with_the_fix(
    tmp_path):
  """A processor that converts (do_convert_rgb, the default) makes an RGBA or palette image RGB
  as tools.convert does (both read through images.load), its transparency onto white; one that
  keeps an image's bands refuses them as tools.convert does, naming the Pillow conversion that
  makes those same pixels (tools.eval: the record and file; tools.generate: the file)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from configs import llava_cpu  # pylint: disable=import-outside-toplevel
  from mimo_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.images import ImageProcessor  # pylint: disable=import-outside-toplevel
  from tools import prompts  # pylint: disable=import-outside-toplevel
  _tokenizer(tmp_path / "tok")
  tok, proc = ChatTokenizer.open(str(tmp_path / "tok")), ImageProcessor.open(tmp_path / "tok")
  cfg = llava_cpu.get_config()
  cfg.model.vision.image_size, cfg.model.vision.channels = 16, 3
  names, data = ("rgba", "palette"), tmp_path / "data.jsonl"
  data.write_text("".join(json.dumps({"id": n, "image": f"{n}.png", "conversations": [
      {"from": "human", "value": "<image>\nhello"}, {"from": "gpt", "value": "there"}]}) + "\n"
                          for n in names))
  args = argparse.Namespace(data=str(data), images=str(IMAGES), samples=0)
  samples = eval_samples.json_samples(args, cfg, tok, lambda: proc, "<image>")
  for s, name in zip(samples, names):
    with Image.open(IMAGES / f"{name}.png") as image:  # the fix's command, as the errors name it
      im = image.convert("RGBA")
      white = Image.alpha_composite(Image.new("RGBA", im.size, "white"), im).convert("RGB")
    np.testing.assert_array_equal(s["sample"]["images"][0], proc(white))
    assert not np.array_equal(proc(im.convert("RGB")), proc(white))  # transparency dropped
  keeps = dataclasses.replace(proc, convert_rgb=False)
  fix = ("where the processor keeps an image's bands (\"do_convert_rgb\": false) and reads only "
         "grayscale (L) and RGB images (tools.convert refuses it too); convert it to RGB, any "
         "transparency onto white as a converting processor does (e.g. with Pillow: im = "
         "Image.open(path).convert(\"RGBA\"); Image.alpha_composite(Image.new(\"RGBA\", im.size, "
         "\"white\"), im).convert(\"RGB\").save(new_path)), or give a processor that converts it "
         "(\"do_convert_rgb\": true in its preprocessor_config.json).")
  with pytest.raises(ConfigError) as e:
    eval_samples.json_samples(args, cfg, tok, lambda: keeps, "<image>")
  assert str(e.value) == (f"--data {data}: record 0 (id 'rgba', line 1): image "
                          f"{IMAGES / 'rgba.png'} is "
                          f"an RGBA image (with transparency), {fix}")
  with pytest.raises(ConfigError) as e:
    prompts.load_images([str(IMAGES / "palette.png")], keeps, cfg)
  assert str(e.value) == f"{IMAGES / 'palette.png'} is a palette (P) image, {fix}"
  cfg.model.vision.channels = 1  # a grayscale tower (the digits'): to L, no converting processor
  with pytest.raises(ConfigError) as e:
    prompts.load_images([str(IMAGES / "palette.png")], keeps, cfg)
  assert str(e.value).endswith("; convert it to grayscale (L), any transparency onto white as a "
                               "converting processor does (e.g. with Pillow: im = Image.open(path)"
                               ".convert(\"RGBA\"); Image.alpha_composite(Image.new(\"RGBA\", "
                               "im.size, \"white\"), im).convert(\"L\").save(new_path)).")


@pytest.mark.parametrize("line", [b"[1]\n", b'"x"\n', b"{}\n", b'{"id": "cut\n', b"\xff\xfe\n",
                                  b'{"id": "q1"}\n', b'{"id": "q1", "score": {}}\n'])
def test_a_damaged_row_in_out_is_one_line_naming_it(tmp_path, line):
  from mimo_jax import output  # pylint: disable=import-outside-toplevel
  from tools.eval_rows import Rows  # pylint: disable=import-outside-toplevel
  out, settings = tmp_path / "rows.jsonl", {"metrics": ["exact_match"]}
  rows = Rows(out, settings)
  rows.append([{"id": "a", "prediction": "x", "score": {"exact_match": 1.0}}])
  rows.close()
  with open(out, "ab") as f:
    f.write(line)
  with pytest.raises(output.OutputError, match=rf"^--out {out}: line 2 is not an eval's row "
                     r"\(.*\); remove it \(the eval answers its sample again\) or give another "
                     r"--out\.$"):
    Rows(out, settings)
  assert not (tmp_path / ".rows.jsonl.lock").exists()  # released


def test_the_default_out_is_named_as_such_where_it_is_refused(tmp_path):
  from mimo_jax import output  # pylint: disable=import-outside-toplevel
  from tools.eval_rows import Rows  # pylint: disable=import-outside-toplevel
  out = tmp_path / ("d" * 240 + ".step3.jsonl")  # a long --data name
  with pytest.raises(output.OutputError, match=r"^the default --out \(from --data's name\)="
                     r".*: its name is 252 bytes"):
    Rows(out, {"metrics": []}, "the default --out (from --data's name)")
  assert list(tmp_path.iterdir()) == []
  out = tmp_path / "data.step3.jsonl"
  out.write_text("{}\n")  # no settings beside it: not an eval's rows
  with pytest.raises(output.OutputError, match=rf"^the default --out \(from --data's name\) {out} "
                     r"exists and is no eval's rows file"):
    Rows(out, {"metrics": []}, "the default --out (from --data's name)")
