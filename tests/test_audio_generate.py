"""Generation from audio files: prompts with 0, 1 and 2 clips (decoded, resampled, featurised and
expanded as tools.generate does) answered greedily by an imported Qwen2-Audio give transformers'
`generate` token for token, in one left-padded batch and through `tools.generate --audio`; a bad
audio file is one error naming it. The fixture is a tiny random Qwen2-Audio of 30 s windows with
its processor (tools/hf_audio_fixtures.py: chat_generate.npz; no torch needed)."""

import json
import pathlib

import jax
import numpy as np
import pytest

from mimo_jax import generate, whole
from mimo_jax.data.chat import ChatTokenizer
from mimo_jax.encoders import audio as audio_encoder
from mimo_jax.hf import chat_parts
from tools import generate as generate_tool
from tools import hf as hf_tool
from tools import hf_export
from tools.hf_audio_fixtures import PROMPTS

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CHAT = FIXTURES / "hf_audio" / "qwen2_audio_chat"
AUDIO = FIXTURES / "audio"
# A conversations run without its data yet (an AVLM import: vision from the seed).
RUN = ["--config=tests/configs/tiny_audio.py", "--config.data.task=conversations",
       "--config.data.seq_len=1024"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> pathlib.Path:
  """The chat fixture imported as a run's step 0 (its tokenizer found through the import)."""
  out = tmp_path_factory.mktemp("audio_generate") / "run"
  assert hf_tool.main(["import", "--hf", str(CHAT), "--out", str(out), *RUN]) in (0, None)
  return out


def _want() -> np.ndarray:
  return np.load(CHAT / "chat_generate.npz")["tokens"]


def test_a_batch_with_and_without_clips_equals_transformers(imported):
  """All PROMPTS in one left-padded batch (a text-only row between rows of one and two clips,
  8 kHz and 44.1 kHz stereo sources among them) answer as transformers' one prompt a call, with
  the parameters the import wrote."""
  cfg, params, _, _ = hf_export._read_checkpoint(str(imported), 0)  # pylint: disable=protected-access
  audio, language = params["audio"], params["language"]
  tok = ChatTokenizer.open(CHAT)
  rows, tokens = [], []
  for text, files in PROMPTS:
    clips = generate_tool.load_audios([str(AUDIO / f) for f in files], cfg) if files else []
    per_clip = tuple(sum(map(cfg.model.audio.window_tokens, f)) for _, f in clips)
    rows.append(generate_tool.prompt_ids(tok, text, 0, "<image>", 0, per_clip))
    tokens += [np.asarray(audio_encoder.audio_tokens(cfg, audio, m, np.asarray(f)))
               for m, f in clips]
    assert [len(t) for t in tokens[len(tokens) - len(clips):]] == list(per_clip)
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int32)
  mask = np.zeros_like(ids)
  for r, row in enumerate(rows):
    ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
  assert len({len(r) for r in rows}) == len(rows)  # every row padded differently
  with jax.default_matmul_precision("highest"):
    embeds = whole.merged_embeddings(cfg, language, ids, np.concatenate(tokens)[None],
                                     json.loads((CHAT / "config.json").read_text())[
                                         "audio_token_index"])
    want = _want()
    got = generate.generate(cfg, language, ids, mask, want.shape[1], embeds_bld=embeds,
                            eos=tok.token_id("<|im_end|>"))
  np.testing.assert_array_equal(got, want)
  assert len({tuple(r) for r in want}) == len(want)  # each clip's answer its own


def test_the_tool_answers_from_audio_files_as_transformers(imported, capsys):
  """tools.generate --audio twice, the prompt without marks: the clips' markers go before its
  text, as PROMPTS' last prompt has them; the answer is transformers' tokens."""
  text, files = PROMPTS[-1]
  prompt = text.replace("<audio>\n", "")
  capsys.readouterr()
  assert generate_tool.main([str(imported), *[a for f in files for a in ("--audio", str(AUDIO / f))],
                             "--prompt", prompt, "--max_new_tokens", "8"]) == 0
  out = capsys.readouterr().out.splitlines()
  tok = ChatTokenizer.open(CHAT)
  answer = tok.tokenizer.decode(_want()[-1].tolist(), skip_special_tokens=True).strip()
  assert out == [f"> {' '.join(f'[{f}]' for f in files)} {prompt}", answer]


def test_paired_clips_go_one_to_each_prompt(imported, capsys):
  """--pair: PROMPTS' two one-clip prompts, their text alike, each get their own clip and answer
  as transformers does (every clip to every prompt would give both the same answer)."""
  (text, [first]), (same, [second]) = PROMPTS[:2]
  assert text == same
  capsys.readouterr()
  assert generate_tool.main([str(imported), "--pair", "--audio", str(AUDIO / first), "--audio",
                             str(AUDIO / second), "--prompt", text.replace("<audio>\n", ""),
                             "--prompt", text, "--max_new_tokens", "8"]) == 0
  out = capsys.readouterr().out
  tok = ChatTokenizer.open(CHAT)
  answers = [tok.tokenizer.decode(w.tolist(), skip_special_tokens=True).strip()
             for w in _want()[:2]]
  assert answers[0] != answers[1]
  prompt = text.replace("<audio>\n", "")  # the second prompt places its clip itself
  assert out == f"> [{first}] {prompt}\n{answers[0]}\n> [{second}] {text}\n{answers[1]}\n"


def test_the_tool_refuses_a_bad_audio_file_naming_it(imported, tmp_path, capsys):
  """A corrupt, missing, unsupported or too short clip, or marks for more clips than given: one
  error, exit 2, nothing printed."""
  import soundfile  # pylint: disable=import-outside-toplevel
  corrupt, short, text = tmp_path / "corrupt.wav", tmp_path / "short.wav", tmp_path / "notes.txt"
  corrupt.write_bytes(b"RIFF\x00\x01garbage" * 10)
  soundfile.write(short, np.zeros(320, np.float32) + 0.1, 16000)  # 20 ms: 2 frames, 0 tokens
  text.write_text("not audio")
  speech = str(AUDIO / "speech.flac")
  cases = [([str(corrupt)], "hello", f"{corrupt}: cannot be decoded"),
           ([str(tmp_path / "none.flac")], "hello", f"{tmp_path / 'none.flac'}: no such file"),
           ([str(text)], "hello", f"{text}: unsupported format .txt"),
           ([str(short)], "hello", f"{short}: its 2 mel frames (up to 20 ms of audio) yield no audio token"),
           ([speech], "<audio> hello <audio>", "has 2 <audio> for 1 --audio file.")]
  for files, prompt, error in cases:
    capsys.readouterr()
    args = [str(imported), *[a for f in files for a in ("--audio", f)], "--prompt", prompt]
    assert generate_tool.main(args) == 2, error
    out, err = capsys.readouterr()
    assert error in err and err.startswith("tools.generate: error:"), (error, err)
    assert "\n>" not in out


def _records(tmp_path: pathlib.Path) -> list[dict]:
  """PROMPTS as LLaVA-format records whose answers are transformers' (clips under AUDIO)."""
  tok = ChatTokenizer.open(CHAT)
  out = []
  for k, ((text, files), want) in enumerate(zip(PROMPTS, _want())):
    answer = tok.tokenizer.decode(want.tolist(), skip_special_tokens=True).strip()
    r = {"id": k, "conversations": [{"from": "human", "value": text},
                                    {"from": "gpt", "value": answer}]}
    if files:  # one clip as "audio": a path; two as "audios": a list
      r.update({"audio": files[0]} if len(files) == 1 else {"audios": list(files)})
    out.append(r)
  return out


def test_eval_answers_audio_records_as_transformers(imported, tmp_path, capsys):
  """tools.eval on the run's meshes answers PROMPTS, as a LLaVA-format JSON with clips and as
  the eval split tools.convert writes of them, with transformers' tokens (every exact_match 1);
  a JSON naming a missing clip is one error naming the record and file."""
  from tools import convert as convert_tool  # pylint: disable=import-outside-toplevel
  from tools import eval as eval_tool  # pylint: disable=import-outside-toplevel
  records = _records(tmp_path)
  data = tmp_path / "set.json"
  # The tokenizer has no image token: the vision encoder's placeholder is no word of a prompt
  # (not w3, id 3, the built-in placeholder).
  words = {"id": 9, "conversations": [{"from": "human", "value": "w3 hello"},
                                      {"from": "gpt", "value": "there"}]}
  data.write_text(json.dumps(records + [words]))
  common = ["--max_new_tokens", "8", "--metric", "exact_match"]
  assert eval_tool.main([str(imported), "--data", str(data), "--audio", str(AUDIO),
                         "--out", str(tmp_path / "json.jsonl"), *common]) == 0
  rows = [json.loads(x) for x in (tmp_path / "json.jsonl").read_text().splitlines()]
  assert sorted(r["id"] for r in rows) == list(range(len(PROMPTS))) + [9]
  assert all(r["prediction"] == r["reference"] and r["score"]["exact_match"] == 1
             for r in rows if r["id"] != 9)
  # Converted: twice the records (an eval split of 4), a vision processor for the converter.
  (tmp_path / "proc").mkdir()
  (tmp_path / "proc" / "preprocessor_config.json").write_text(json.dumps(
      {"image_processor_type": "SiglipImageProcessor", "size": {"height": 16, "width": 16},
       "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
  data.write_text(json.dumps(records + [dict(r, id=r["id"] + 10) for r in records]))
  assert convert_tool.main(["--json", str(data), "--images", str(tmp_path), "--audio", str(AUDIO),
                            "--tokenizer", str(CHAT), "--processor", str(tmp_path / "proc"),
                            "--out", str(tmp_path / "conv"), "--eval", "4", "--workers", "1",
                            "--on_error", "fail", "--image_token", "helpful",
                            "--image_tokens", "4"]) in (0, None)
  assert eval_tool.main([str(imported), "--data", str(tmp_path / "conv"),
                         "--out", str(tmp_path / "conv.jsonl"), *common]) == 0
  rows = [json.loads(x) for x in (tmp_path / "conv.jsonl").read_text().splitlines()]
  assert len(rows) == 4 and any("<|AUDIO|>" in r["prompt"] for r in rows)
  assert all(r["prediction"] == r["reference"] for r in rows)
  data.write_text(json.dumps([dict(records[0], audio="gone.flac")]))
  capsys.readouterr()
  assert eval_tool.main([str(imported), "--data", str(data), "--audio", str(AUDIO),
                         "--out", str(tmp_path / "bad.jsonl"), *common]) == 2
  err = capsys.readouterr().err
  assert "record 0" in err and str(AUDIO / "gone.flac") in err and "no such file" in err, err
  assert not (tmp_path / "bad.jsonl").exists()


def test_export_writes_a_complete_qwen2_audio_directory(imported, tmp_path, capsys):
  """tools.hf export of the import (a run with vision beside audio: Qwen2-Audio as its language
  model's source was) writes the fixture's tensors bit for bit, a config.json with its fields,
  its feature extractor, Qwen2AudioProcessor's config, the tokenizer with its chat template and
  generation_config.json. transformers loads the directory and answers PROMPTS with the fixture's
  tokens: `python -m tools.hf_audio_fixtures --check_export DIR` (needs torch)."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  out = tmp_path / "hf"
  hf_tool.main(["export", str(imported), "--out", str(out)])
  ours, theirs = load_file(out / "model.safetensors"), load_file(CHAT / "model.safetensors")
  assert sorted(ours) == sorted(theirs)
  for k, x in ours.items():
    np.testing.assert_array_equal(x.view(np.uint32), theirs[k].view(np.uint32), err_msg=k)
  read = lambda d, f: json.loads((d / f).read_text())
  config, source = read(out, "config.json"), read(CHAT, "config.json")
  assert config["architectures"] == ["Qwen2AudioForConditionalGeneration"]
  assert config["audio_token_index"] == source["audio_token_index"]
  for section, keys in (("audio_config", ("model_type", "num_mel_bins", "max_source_positions",
                                          "d_model", "encoder_layers", "encoder_attention_heads",
                                          "encoder_ffn_dim", "activation_function")),
                        ("text_config", ("model_type", "hidden_size", "intermediate_size",
                                         "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "vocab_size", "rms_norm_eps",
                                         "max_position_embeddings", "tie_word_embeddings"))):
    for k in keys:
      assert config[section][k] == source[section][k], (section, k)
  assert config["text_config"]["rope_theta"] == source["text_config"]["rope_parameters"][
      "rope_theta"]
  extractor = read(CHAT, "processor_config.json").pop("feature_extractor")
  assert read(out, "preprocessor_config.json") == {k: v for k, v in extractor.items()
                                                   if k != "dither"}
  assert read(out, "processor_config.json") == {k: v for k, v in read(
      CHAT, "processor_config.json").items() if k != "feature_extractor"}
  assert (out / "tokenizer.json").read_bytes() == (CHAT / "tokenizer.json").read_bytes()
  # The template takes transformers' list of parts, a clip as tools.convert's markers.
  template = (out / "chat_template.jinja").read_text()
  assert template == chat_parts.wrap((CHAT / "chat_template.jinja").read_text(),
                                     {"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>\n"})
  render = lambda content: ChatTokenizer.open(out).render([{"role": "user", "content": content}])
  assert render([{"type": "audio", "path": "a.wav"}, {"type": "text", "text": "Say it."}]) == \
      render("<|audio_bos|><|AUDIO|><|audio_eos|>\nSay it.")
  assert read(out, "tokenizer_config.json")["processor_class"] == "Qwen2AudioProcessor"
  assert read(out, "generation_config.json")["eos_token_id"] == [2]
  with pytest.raises(SystemExit):  # a whole model and one module at once: one error
    hf_tool.main(["export", str(imported), "--out", str(tmp_path / "both"), "--model",
                  "qwen2_audio", "--module", "audio"])
  assert "--model qwen2_audio is the whole model" in capsys.readouterr().err
  assert not (tmp_path / "both").exists()


def test_a_prompt_with_images_and_clips_places_and_expands_both():
  """Images' marks first, then the clips' as the template's markers, each placeholder written
  out as its item's tokens (clips in order); marks the prompt places itself stay there."""
  tok = ChatTokenizer.open(CHAT)
  audio, image = tok.token_id("<|AUDIO|>"), tok.token_id("w3")

  def want(text: str, per_image: int, clips: list[int]) -> list[int]:
    row = tok.tokenizer.encode(tok.render([{"role": "user", "content": text}], True),
                               add_special_tokens=False).ids
    clip = iter(clips)
    return [t for i in row
            for t in [i] * (per_image if i == image else next(clip) if i == audio else 1)]

  markers = "<|audio_bos|><|AUDIO|><|audio_eos|>"
  got = generate_tool.prompt_ids(tok, "hello", 1, "w3", 2, (3, 1))
  assert got == want(f"w3\n{markers}\n{markers}\nhello", 2, [3, 1])
  runs = [len(r) for r in "".join("a" if i == audio else " " for i in got).split()]
  assert runs == [3, 1] and got.count(image) == 2 and got.index(image) < got.index(audio)
  placed = generate_tool.prompt_ids(tok, "hello <audio> there", 0, "w3", 0, (2,))
  assert placed == want(f"hello {markers} there", 0, [2])
