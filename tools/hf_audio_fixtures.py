"""Tiny random Hugging Face audio checkpoints and their reference outputs, for the interop tests.

  python -m tools.hf_audio_fixtures [--out tests/fixtures/hf_audio]

Needs torch and transformers; the tests that read the fixtures do not. Writes, each as
`save_pretrained` writes it plus `reference.npz` (inputs and transformers' float32 outputs):
two Whisper encoders of different shapes (`whisper_a`: a WhisperModel, `whisper_b`: a
WhisperForConditionalGeneration; `last_hidden_state` of the encoder on log-mel windows `mel`
[n, mel_bins, frames]) and two Qwen2AudioForConditionalGeneration (`qwen2_audio_a`, `_b`: logits
of `input_ids` whose audio placeholders are expanded to each clip's tokens, for `mel` with
`mel_frames` valid frames a clip, and the tower's `audio_hidden` [n, positions / 2, dim]; beside
it `generate.npz`: transformers' greedy `generate` of 8 new tokens after each row's prompt, one
prompt a call, `--only generate` writes just these from the saved models).

`qwen2_audio_chat` is a Qwen2-Audio of real window length (128 mel bins, 30 s windows, at toy
width) saved with a complete Qwen2AudioProcessor (WhisperFeatureExtractor, a word-level
tokenizer with Qwen2-Audio's audio tokens, a chat template), for generation from audio files:
`chat_generate.npz` holds transformers' greedy `generate` (GENERATE new tokens, stopping at
<|im_end|>) for each of PROMPTS (its text and the CLIPS it is given, tests/fixtures/audio/),
rendered with the chat template, each `<audio>` as the template's markers, and run through the
processor (features and the expansion of <|AUDIO|> are transformers'); files are decoded with
soundfile and resampled to 16 kHz with soxr (HQ), as librosa does by default.
Rerun after changing a fixture (`--only chat` writes just that one); the whole set stays well
under a megabyte. `--check_export DIR` loads a `tools.hf export` of the chat fixture's import
with transformers (AutoConfig, AutoProcessor, Qwen2AudioForConditionalGeneration), offline,
and checks that its answers to PROMPTS are chat_generate.npz's token for token, and that its
processor's chat template renders each prompt given as transformers' list of parts as it renders
the prompt's text.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (mel_bins, positions, dim, layers, heads, mlp_dim) of each fixture's encoder.
SHAPES = {"a": (8, 8, 16, 2, 2, 32), "b": (12, 6, 24, 3, 4, 40)}
VOCAB, AUDIO_TOKEN, TEXT_DIM = 64, 5, 32
AUDIO_DIR = ROOT / "tests" / "fixtures" / "audio"
CHAT_SPECIALS = ("[UNK]", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|audio_eos|>",
                 "<|AUDIO|>")  # <|AUDIO|> is AUDIO_TOKEN
CHAT_WORDS = ("system", "user", "assistant", "what", "is", "in", "the", "audio", "hello",
              "there", "say", "it", "again", "and", "you", "are", "a", "helpful")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
MARKERS = "<|audio_bos|><|AUDIO|><|audio_eos|>"
# (prompt text, clips): `<audio>` marks a clip's place; a prompt without clips is text only.
PROMPTS = (("<audio>\nwhat is in the audio", ("speech.flac",)),
           ("<audio>\nwhat is in the audio", ("one_second.flac",)),
           ("hello there say it again", ()),
           ("<audio>\n<audio>\nwhat is in the audio and the audio",
            ("source_8k.flac", "stereo_44k.flac")))
GENERATE = 8


def _encoder(shape: str, **kw) -> dict:
  mels, positions, dim, layers, heads, mlp = SHAPES[shape]
  return dict(num_mel_bins=mels, max_source_positions=positions, d_model=dim,
              encoder_layers=layers, encoder_attention_heads=heads, encoder_ffn_dim=mlp, **kw)


def _mel(rng, n: int, mels: int, frames: int) -> np.ndarray:
  return rng.standard_normal((n, mels, frames)).astype(np.float32)


def whisper(out: pathlib.Path, shape: str, rng) -> None:
  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import WhisperConfig, WhisperForConditionalGeneration, WhisperModel
  config = WhisperConfig(vocab_size=VOCAB, decoder_layers=1, decoder_attention_heads=2,
                         decoder_ffn_dim=32, max_target_positions=16, pad_token_id=1,
                         bos_token_id=2, eos_token_id=3, decoder_start_token_id=2,
                         **_encoder(shape))
  cls = WhisperModel if shape == "a" else WhisperForConditionalGeneration
  torch.manual_seed(len(shape) + ord(shape))
  model = cls(config).eval()
  mels, positions = SHAPES[shape][:2]
  mel = _mel(rng, 3, mels, 2 * positions)
  with torch.no_grad():
    hidden = model.get_encoder()(torch.from_numpy(mel)).last_hidden_state.numpy()
  path = out / f"whisper_{shape}"
  model.save_pretrained(path, safe_serialization=True)
  np.savez(path / "reference.npz", mel=mel, last_hidden_state=hidden)


def qwen2_audio(out: pathlib.Path, shape: str, rng) -> None:
  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import (Qwen2AudioConfig, Qwen2AudioEncoderConfig,
                            Qwen2AudioForConditionalGeneration, Qwen2Config)
  mels, positions = SHAPES[shape][:2]
  audio = Qwen2AudioEncoderConfig(**_encoder(shape))
  text = Qwen2Config(vocab_size=VOCAB, hidden_size=TEXT_DIM, intermediate_size=48,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     tie_word_embeddings=False)
  config = Qwen2AudioConfig(audio_config=audio.to_dict(), text_config=text.to_dict(),
                            audio_token_index=AUDIO_TOKEN)
  torch.manual_seed(7 + ord(shape))
  model = Qwen2AudioForConditionalGeneration(config).eval()
  frames = 2 * positions
  mel = _mel(rng, 2, mels, frames)
  valid = np.asarray([frames, frames // 2 + 1], np.int64)  # a full window and a part one
  mel_mask = (np.arange(frames)[None] < valid[:, None]).astype(np.int64)
  conv = (valid - 1) // 2 + 1
  tokens = (conv - 2) // 2 + 1
  rows = []
  for k in tokens:  # one clip a row: text, the clip's tokens, text
    rows.append([7, 9] + [AUDIO_TOKEN] * int(k) + list(rng.integers(10, VOCAB, size=3)))
  width = max(len(r) for r in rows)
  ids = np.asarray([r + [0] * (width - len(r)) for r in rows], np.int64)
  mask = np.asarray([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int64)
  with torch.no_grad():
    out_ = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                 input_features=torch.from_numpy(mel),
                 feature_attention_mask=torch.from_numpy(mel_mask))
    tower = model.audio_tower if hasattr(model, "audio_tower") else model.model.audio_tower
    # The tower as the model runs it: padded positions masked as keys (a 4-D additive mask).
    pos_mask = np.arange(positions)[None] < conv[:, None]
    add = np.where(pos_mask[:, None, None, :], 0.0, np.finfo(np.float32).min).astype(np.float32)
    add = np.broadcast_to(add, (2, 1, positions, positions)).copy()
    hidden = tower(torch.from_numpy(mel), attention_mask=torch.from_numpy(add)).last_hidden_state
  path = out / f"qwen2_audio_{shape}"
  model.save_pretrained(path, safe_serialization=True)
  np.savez(path / "reference.npz", mel=mel, mel_frames=valid.astype(np.int32),
           input_ids=ids.astype(np.int32), attention_mask=mask.astype(np.int32),
           logits=out_.logits.numpy(), audio_hidden=hidden.numpy())
  generate(path)


def generate(path: pathlib.Path, new: int = 8) -> None:
  """Greedy generation after each reference row's prompt (its real tokens, one row a call, so
  no padding), with its clip."""
  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import Qwen2AudioForConditionalGeneration
  model = Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()
  ref = np.load(path / "reference.npz")
  frames = ref["mel"].shape[2]
  rows = []
  for i in range(ref["input_ids"].shape[0]):
    ids = ref["input_ids"][i][ref["attention_mask"][i].astype(bool)][None].astype(np.int64)
    mask = (np.arange(frames)[None] < ref["mel_frames"][i]).astype(np.int64)
    with torch.no_grad():
      got = model.generate(input_ids=torch.from_numpy(ids),
                           attention_mask=torch.ones_like(torch.from_numpy(ids)),
                           input_features=torch.from_numpy(ref["mel"][i:i + 1]),
                           feature_attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    rows.append(got[0, ids.shape[1]:].numpy().astype(np.int32))
  np.savez(path / "generate.npz", tokens=np.stack(rows))


def chat_tokenizer(path: pathlib.Path):
  """A word-level tokenizer of VOCAB ids with Qwen2-Audio's special tokens and CHAT_TEMPLATE."""
  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  # Id 3, the built-in image placeholder a synthetic-task run's vision encoder keeps, is a word
  # no prompt uses.
  vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2, "w3": 3, "<|audio_bos|>": 4,
           "<|AUDIO|>": AUDIO_TOKEN, "<|audio_eos|>": 6}
  for w in CHAT_WORDS:
    vocab[w] = len(vocab)
  for i in range(len(vocab), VOCAB):
    vocab[f"w{i}"] = i
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(list(CHAT_SPECIALS[1:]))
  assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<|AUDIO|>") == AUDIO_TOKEN
  return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                 pad_token="[UNK]", chat_template=CHAT_TEMPLATE)


def read_clip(name: str) -> np.ndarray:
  """A fixture clip at 16 kHz, mono (channels averaged): soundfile, then soxr HQ."""
  import soundfile  # pylint: disable=import-outside-toplevel
  import soxr  # pylint: disable=import-outside-toplevel
  wave, rate = soundfile.read(AUDIO_DIR / name, dtype="float32", always_2d=True)
  wave = wave.mean(axis=1, dtype=np.float32)
  return wave if rate == 16000 else soxr.resample(wave, rate, 16000, quality="HQ")


def answers(model, processor, tok) -> np.ndarray:
  """transformers' greedy answers [len(PROMPTS), GENERATE] to PROMPTS (eos-padded)."""
  import torch  # pylint: disable=import-outside-toplevel
  eos = tok.convert_tokens_to_ids("<|im_end|>")
  rows = []
  for text_, clips in PROMPTS:
    content = text_.replace("<audio>", MARKERS)
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
    waves = [read_clip(c) for c in clips]
    inputs = processor(text=rendered, audio=waves or None, sampling_rate=16000,
                       return_tensors="pt")
    with torch.no_grad():
      got = model.generate(**inputs, max_new_tokens=GENERATE, do_sample=False)
    new = got[0, inputs["input_ids"].shape[1]:].numpy().astype(np.int32)
    rows.append(np.pad(new, (0, GENERATE - len(new)), constant_values=eos))
    print(text_.replace("\n", " "), clips, "->", tok.decode(new), new.tolist(),
          tuple(inputs["input_ids"].shape))
  return np.stack(rows)


def check_export(path: pathlib.Path) -> None:
  """A Qwen2-Audio export loaded by transformers answers PROMPTS as the fixture does."""
  # pylint: disable=import-outside-toplevel
  from transformers import AutoConfig, AutoProcessor, Qwen2AudioForConditionalGeneration
  config = AutoConfig.from_pretrained(path, local_files_only=True)
  assert type(config).__name__ == "Qwen2AudioConfig", type(config)
  processor = AutoProcessor.from_pretrained(path, local_files_only=True)
  assert type(processor).__name__ == "Qwen2AudioProcessor", type(processor)
  assert processor.feature_extractor.feature_size == config.audio_config.num_mel_bins
  for text_, clips in PROMPTS:  # the template also takes the prompt as transformers' parts
    *marks, words = text_.split("<audio>\n")
    parts = [{"type": "audio", "path": str(AUDIO_DIR / c)} for c in clips[:len(marks)]]
    as_parts, as_text = ([{"role": "user", "content": c}] for c in (
        parts + [{"type": "text", "text": words}], text_.replace("<audio>", MARKERS)))
    rendered = processor.apply_chat_template(as_parts, tokenize=False, add_generation_prompt=True)
    assert rendered == processor.tokenizer.apply_chat_template(
        as_text, tokenize=False, add_generation_prompt=True), rendered
  model = Qwen2AudioForConditionalGeneration.from_pretrained(path, local_files_only=True).eval()
  got = answers(model, processor, processor.tokenizer)
  want = np.load(ROOT / "tests" / "fixtures" / "hf_audio" / "qwen2_audio_chat" /
                 "chat_generate.npz")["tokens"]
  np.testing.assert_array_equal(got, want)
  print(f"{path}: transformers loads it and answers the {len(PROMPTS)} prompts as the fixture")


def qwen2_audio_chat(out: pathlib.Path) -> None:
  """A Qwen2-Audio of 30 s windows and 128 mel bins with its processor, and transformers'
  greedy answers to PROMPTS (chat_generate.npz)."""
  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import (Qwen2AudioConfig, Qwen2AudioEncoderConfig,
                            Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor, Qwen2Config,
                            WhisperFeatureExtractor)
  path = out / "qwen2_audio_chat"
  tok = chat_tokenizer(path)
  eos = tok.convert_tokens_to_ids("<|im_end|>")
  audio = Qwen2AudioEncoderConfig(num_mel_bins=128, max_source_positions=1500, d_model=16,
                                  encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32,
                                  init_std=0.2)
  text = Qwen2Config(vocab_size=VOCAB, hidden_size=TEXT_DIM, intermediate_size=48,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     tie_word_embeddings=False, eos_token_id=eos, initializer_range=0.2)
  config = Qwen2AudioConfig(audio_config=audio.to_dict(), text_config=text.to_dict(),
                            audio_token_index=AUDIO_TOKEN)
  torch.manual_seed(11)
  model = Qwen2AudioForConditionalGeneration(config).eval()
  model.generation_config.eos_token_id = eos
  model.generation_config.pad_token_id = tok.pad_token_id
  processor = Qwen2AudioProcessor(WhisperFeatureExtractor(feature_size=128), tok,
                                  chat_template=CHAT_TEMPLATE)
  model.save_pretrained(path, safe_serialization=True)
  processor.save_pretrained(path)
  np.savez(path / "chat_generate.npz", tokens=answers(model, processor, tok))


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.hf_audio_fixtures",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "hf_audio"))
  parser.add_argument("--only", choices=("generate", "chat"), default=None,
                      help="write only generate.npz beside the saved Qwen2-Audio models, or only "
                      "qwen2_audio_chat")
  parser.add_argument("--check_export", default="",
                      help="a tools.hf export of the chat fixture's import to load and check")
  args = parser.parse_args()
  if args.check_export:
    check_export(pathlib.Path(args.check_export))
    return
  out = pathlib.Path(args.out)
  if args.only == "generate":
    for shape in SHAPES:
      generate(out / f"qwen2_audio_{shape}")
    print("wrote", out)
    return
  if args.only == "chat":
    shutil.rmtree(out / "qwen2_audio_chat", ignore_errors=True)
    qwen2_audio_chat(out)
    print("wrote", out / "qwen2_audio_chat")
    return
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  rng = np.random.default_rng(0)
  for shape in SHAPES:
    whisper(out, shape, rng)
    qwen2_audio(out, shape, rng)
  qwen2_audio_chat(out)
  print("wrote", out)


if __name__ == "__main__":
  main()
