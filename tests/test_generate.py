"""Generation with a key-value cache: greedy equals transformers' `generate` token for token on
the LLaVA fixtures (a batch of left-padded prompts with images), sampling follows its seed and
top-p, and `tools.generate` answers prompts from a workdir."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax import evaluate, generate, hf, modules
from mimo_jax.config import Config, LanguageConfig
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax import whole
from mimo_jax.encoders import vision as vision_encoder
from mimo_jax.models.llm import LanguageModel
from mimo_jax.validation import validate
from tools import generate as generate_tool
from tools import hf as hf_tool

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"


@functools.cache
def _fixture(name: str):
  """The fixture's config, language parameters, references and merged prompt embeddings: loaded
  once (under the callers' highest matmul precision)."""
  src = hf.Source.open(FIXTURES / name)
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.data.task, cfg.model.vision.max_images, cfg.data.image_probs = "synthetic", 1, "0.5,0.5"
  cfg.model.language.vocab_size = 64
  hf.configure(cfg, src)
  validate(cfg)
  ref = dict(np.load(src.path / "generate.npz"))
  built = modules.build_modules(cfg)
  vision, language = (hf.load(src, m, cfg, built[m].init(0)) for m in ("vision", "language"))
  embeds = whole.merged_embeddings(cfg, language, ref["input_ids"],
                                   vision_encoder.image_tokens(cfg, vision, ref["pixels"]),
                                   src.config["image_token_index"])
  return cfg, language, ref, embeds


@pytest.mark.parametrize("name", ["llava15", "llava_siglip"])
def test_greedy_generation_equals_transformers(name):
  with jax.default_matmul_precision("highest"):
    cfg, language, ref, embeds = _fixture(name)
    got = generate.generate(cfg, language, ref["input_ids"], ref["attention_mask"],
                            ref["generated"].shape[1], embeds_bld=embeds)
  np.testing.assert_array_equal(got, ref["generated"])


def test_sampling_follows_its_seed_and_top_p():
  with jax.default_matmul_precision("highest"):
    cfg, language, ref, embeds = _fixture("llava15")
    run = lambda **kw: generate.generate(cfg, language, ref["input_ids"], ref["attention_mask"],
                                         10, generate.Sampling(**kw), embeds)
    hot = run(temperature=2.0, seed=1)
    np.testing.assert_array_equal(hot, run(temperature=2.0, seed=1))
    assert not np.array_equal(hot, run(temperature=2.0, seed=2))
    assert not np.array_equal(hot, ref["generated"])
    # A nucleus smaller than the likeliest token's mass keeps that token alone: greedy.
    np.testing.assert_array_equal(run(temperature=2.0, top_p=1e-6, seed=3), ref["generated"])


@pytest.mark.parametrize("kw", [dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.5),
                                dict(temperature=float("nan")), dict(temperature=-1.0)])
def test_sampling_refuses_settings_that_sample_garbage(kw):
  with pytest.raises(ValueError):
    generate.Sampling(**kw)


def test_a_row_stops_at_its_end_token():
  with jax.default_matmul_precision("highest"):
    cfg, language, ref, embeds = _fixture("llava15")
    eos = int(ref["generated"][0, 2])  # row 0's third greedy token
    got = generate.generate(cfg, language, ref["input_ids"], ref["attention_mask"], 10,
                            embeds_bld=embeds, eos=eos)
  np.testing.assert_array_equal(got[0, :3], ref["generated"][0, :3])
  assert (got[0, 3:] == eos).all()
  row = list(ref["generated"][1])
  stop = row.index(eos) + 1 if eos in row else 10
  np.testing.assert_array_equal(got[1, :stop], ref["generated"][1, :stop])


def test_chunks_decode_the_tokens_of_one_loop_and_a_stop_waits_for_one():
  """Chunks of 3 new tokens (which do not divide 10) give the tokens of a single chunk of 10,
  greedy, with rows stopped at their end token and sampled, from one compiled chunk program;
  asked to stop, `generate` stops before its next chunk."""
  with jax.default_matmul_precision("highest"):
    cfg, language, ref, embeds = _fixture("llava15")
    run = lambda chunk, **kw: generate.generate(cfg, language, ref["input_ids"],
                                                ref["attention_mask"], 10, embeds_bld=embeds,
                                                chunk=chunk, **kw)
    for kw in (dict(), dict(eos=int(ref["generated"][0, 2])),
               dict(sampling=generate.Sampling(temperature=2.0, seed=1))):
      single = run(10, **kw)
      programs = generate._chunk._cache_size()  # pylint: disable=protected-access
      np.testing.assert_array_equal(run(3, **kw), single)
      assert generate._chunk._cache_size() == programs  # pylint: disable=protected-access
    asked, told = [], []
    with pytest.raises(generate.Stopped, match="^after 6 of 10 new tokens$"):
      run(3, stop=lambda: asked.append(0) or len(asked) == 3,  # before the third chunk
          progress=lambda *a: told.append(a))
  assert len(asked) == 3 and told == [(3, 10), (6, 10)]


def _tiny_model() -> LanguageModel:
  """Grouped-query heads (4 over 2), RoPE, float32; parameters drawn on the host (eagerly, each of
  the model's small initialisers would compile alone)."""
  cfg = LanguageConfig(dim=32, layers=2, heads=4, kv_heads=2, mlp_dim=64)
  graphdef, state = nnx.split(nnx.eval_shape(
      lambda: LanguageModel(nnx.Rngs(params=0), cfg, 17, jnp.float32)))
  rng = np.random.default_rng(0)
  return nnx.merge(graphdef, jax.tree.map(
      lambda a: jnp.asarray(rng.normal(0.0, 0.5, a.shape), a.dtype), state))


@nnx.jit
def _logits_without_cache(model: LanguageModel, tokens_bl: jax.Array) -> jax.Array:
  """Training's forward: every block over whole rows, no cache -> logits [b, l, vocab]."""
  graphdef, blocks = nnx.split(model.blocks)
  positions = jnp.broadcast_to(jnp.arange(tokens_bl.shape[1]), tokens_bl.shape)
  run = lambda h, p: (nnx.merge(graphdef, p)(h, positions), None)
  return model.logits(jax.lax.scan(run, model.embed(tokens_bl), blocks)[0])


@nnx.jit
def _logits_with_cache(model: LanguageModel, tokens_bl: jax.Array) -> jax.Array:
  """The same rows as a prompt's prefill (all but the last token), then a one-token step."""
  b, l = tokens_bl.shape
  x, positions = model.embed(tokens_bl), jnp.broadcast_to(jnp.arange(l), (b, l))
  cache = model.init_cache(jnp.ones((b, l), bool), jnp.float32)
  h_prompt, cache = model.decode(x[:, :-1], positions[:, :-1], cache)
  h_last, _ = model.decode(x[:, -1:], positions[:, -1:], cache)
  return model.logits(jnp.concatenate([h_prompt, h_last], axis=1))


def test_a_prefill_and_a_one_token_step_give_the_logits_of_whole_rows():
  with jax.default_matmul_precision("highest"):
    model = _tiny_model()
    tokens = np.random.default_rng(1).integers(0, 17, (4, 12))
    np.testing.assert_allclose(_logits_with_cache(model, tokens),
                               _logits_without_cache(model, tokens), rtol=1e-5, atol=1e-5)


def test_the_blocks_one_layer_at_a_time_decode_as_the_stacked_loop():
  """`decode` given the layers apart (straight-line code, as generation's loop runs them) gives
  the stacked loop's outputs and cache, a prefill and then a one-token step."""
  with jax.default_matmul_precision("highest"):
    model = _tiny_model()
    b, l = 3, 7
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 17, (b, l)))
    x, positions = model.embed(tokens), jnp.broadcast_to(jnp.arange(l), (b, l))
    results = []
    for layers in (None, model.split_layers()):
      cache = model.init_cache(jnp.ones((b, l), bool), jnp.float32)
      h_prompt, cache = model.decode(x[:, :-1], positions[:, :-1], cache, layers)
      h_last, cache = model.decode(x[:, -1:], positions[:, -1:], cache, layers)
      results.append((h_prompt, h_last, cache.k, cache.v, cache.index))
  assert len(model.split_layers()) == 2
  for stacked, apart in zip(*results):
    np.testing.assert_allclose(apart, stacked, rtol=1e-6, atol=1e-6)


def test_evaluation_decodes_its_rows_as_greedy_recomputation_of_whole_rows():
  """The eval's rows (one sample each from index 0, the answer after the ':' at answer_b, later
  tokens not to be seen) through generate.decode name what whole rows recomputed without a cache
  name, one greedy word at a time."""
  steps, answer_b, rows = 3, np.asarray([3, 8, 5, 0]), np.arange(4)
  answers = answer_b[:, None] + 1 + np.arange(steps)
  with jax.default_matmul_precision("highest"):
    model = _tiny_model()
    tokens = np.random.default_rng(2).integers(0, 17, (4, 12))
    ref = tokens.copy()
    for j in range(steps):
      logits = np.asarray(_logits_without_cache(model, ref))
      ref[rows, answer_b + j + 1] = logits[rows, answer_b + j].argmax(axis=-1)
    got = nnx.jit(lambda m, t: generate.decode(m, *evaluate._prompts(m.embed(t), answer_b),
                                               steps))(model, tokens)
  np.testing.assert_array_equal(got, ref[rows[:, None], answers])
  # The answers were hidden: the rows held other words there.
  assert not np.array_equal(ref[rows[:, None], answers], tokens[rows[:, None], answers])

WORDS = ["user", "assistant", ":", "what", "is", "in", "the", "picture", "hello", "there"]


def _tokenizer(path: pathlib.Path) -> None:
  """A word-level tokenizer of the fixture's 64 ids: `<image>` is 63, as in the LLaVA fixture."""
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
  for w in WORDS + [f"w{i}" for i in range(63 - 3 - len(WORDS))]:
    vocab[w] = len(vocab)
  vocab["<image>"] = 63
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<s>", "</s>", "<image>"])
  path.mkdir()
  tok.save(str(path / "tokenizer.json"))
  template = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
              "{% if add_generation_prompt %}<s> assistant : {% endif %}")
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
  (path / "preprocessor_config.json").write_text(json.dumps(
      {"image_processor_type": "SiglipImageProcessor", "size": {"height": 16, "width": 16},
       "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))


def test_the_tool_answers_a_batch_as_each_prompt_alone(tmp_path, capsys):
  hf_tool.main(["import", "--hf", str(FIXTURES / "llava15"), "--out", str(tmp_path / "run")])
  _tokenizer(tmp_path / "tok")
  image = str(pathlib.Path(__file__).parent / "fixtures" / "images" / "landscape.png")
  common = [str(tmp_path / "run"), "--tokenizer", str(tmp_path / "tok"), "--processor",
            str(tmp_path / "tok"), "--image", image, "--max_new_tokens", "6"]
  prompts = ["what is in the picture", "hello there"]
  capsys.readouterr()
  assert generate_tool.main(common + [a for p in prompts for a in ("--prompt", p)]) == 0
  got = capsys.readouterr()
  batch = got.out.splitlines()
  assert batch[0] == "> [landscape.png] " + prompts[0]
  assert batch[2] == "> [landscape.png] " + prompts[1]
  assert len(batch) == 4 and batch[1] and batch[3]  # six words each (a random model's)
  assert " 2 prompts of up to " in got.err, got.err
  # Six new tokens and no end token: cut, and said so (on stderr; the answers are as they are).
  assert ("note: answers 1, 2 stopped at 6 new tokens (--max_new_tokens) before an end token: "
          "they are cut" in got.err), got.err
  for i, p in enumerate(prompts):
    assert generate_tool.main(common + ["--prompt", p]) == 0
    got = capsys.readouterr()
    assert got.out.splitlines()[1] == batch[2 * i + 1]
    assert " 1 prompt of up to " in got.err, got.err
    assert "note: the answer stopped at 6 new tokens" in got.err, got.err
  # --pair: the second prompt gets the second image, as it does alone.
  other, base = image.replace("landscape", "portrait"), common[:5] + ["--max_new_tokens", "6"]
  assert generate_tool.main(base + ["--image", other, "--prompt", prompts[1]]) == 0
  alone = capsys.readouterr().out.splitlines()
  assert alone[0] == "> [portrait.png] " + prompts[1] and alone[1] != batch[3]
  assert generate_tool.main(base + ["--pair", "--image", image, "--image", other]
                            + [a for p in prompts for a in ("--prompt", p)]) == 0
  assert capsys.readouterr().out.splitlines() == batch[:2] + alone
  # An answer that ends at once (its first new token the end token) is said, not a blank line.
  from mimo_jax.data.chat import ChatTokenizer  # pylint: disable=import-outside-toplevel
  eos = ChatTokenizer.open(str(tmp_path / "tok")).token_id("</s>")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(generate, "generate", lambda *a, **k: np.array([[eos, eos], [7, eos]]))
    assert generate_tool.main(common + [a for p in prompts for a in ("--prompt", p)]) == 0
  got = capsys.readouterr()
  assert got.out.splitlines()[1] == "" and got.out.splitlines()[3]
  assert ("tools.generate: note: answer 1 is empty: the model ended at once (its first new token "
          "was an end token) or gave only special tokens.") in got.err, got.err
  assert "stopped at" not in got.err


def test_the_tool_prints_control_characters_of_an_answer_escaped(monkeypatch, capsys):
  # An untrained model's bytes (escape sequences, carriage returns, the bell, a right-to-left
  # override) must not act on the terminal; an answer's own lines and tabs, and any other text,
  # print as they are.
  answers = ["\x1b[2Jcleared\rover\x07 é\ufffd", "two\n\tlines\x85\u202eright\u200b"]
  monkeypatch.setattr(generate_tool, "run", lambda args: answers)
  assert generate_tool.main(["run", "--prompt", "a\x1b]0;title\x07", "--prompt", "b"]) == 0
  assert capsys.readouterr().out == ("> a\\x1b]0;title\\x07\n\\x1b[2Jcleared\\rover\\x07 é\ufffd\n"
                                     "> b\ntwo\n\tlines\\x85\\u202eright\\u200b\n")


def test_a_device_out_of_memory_is_one_line_with_what_uses_less(monkeypatch, capsys):
  def run(args):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Failed to allocate request for 2.99GiB "
                                     "(3206250496B) on device ordinal 0")
  monkeypatch.setattr(generate_tool, "run", run)
  assert generate_tool.main(["run", "--prompt", "a"]) == 1
  assert capsys.readouterr().err == (
      "tools.generate: error: a device ran out of memory (XLA: Failed to allocate request for "
      "2.99GiB (3206250496B) on device ordinal 0); to use less, fewer prompts at once or a "
      "smaller --max_new_tokens; no answer printed.\n")
  monkeypatch.setattr(generate_tool, "run", lambda args: _raise(RuntimeError("a bug")))
  with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
    generate_tool.main(["run", "--prompt", "a"])


def _raise(e: Exception):
  raise e


def test_the_tool_refuses_a_folder_without_checkpoints(tmp_path, capsys):
  assert generate_tool.main([str(tmp_path), "--prompt", "hello"]) == 2
  assert "no checkpoints/" in capsys.readouterr().err
  assert generate_tool.main([str(tmp_path / "nope"), "--prompt", "hello"]) == 2
  assert f"{tmp_path / 'nope'}: no such directory" in capsys.readouterr().err


def test_an_import_for_conversations_without_data_finds_its_tokenizer_and_processor(tmp_path,
                                                                                    capsys):
  """An import made with a conversations config (configs/llava_cpu.py) names no converted data
  yet: tools.generate (and tools.eval, which shares its defaults) take the tokenizer and
  processor from the HF directory the model came from, with no --tokenizer or --processor."""
  recipe = pathlib.Path(__file__).parent / "fixtures" / "recipe" / "llava"
  run = tmp_path / "run"
  assert not hf_tool.main(["import", "--hf", str(recipe), "--out", str(run),
                           "--config=configs/llava_cpu.py"])
  capsys.readouterr()
  assert generate_tool.main([str(run), "--image", str(FIXTURES.parent / "images" / "portrait.png"),
                             "--prompt", "Hello", "--max_new_tokens", "2"]) == 0
  out = capsys.readouterr().out
  assert "> [portrait.png] Hello" in out, out


def test_the_tools_progress_is_a_line_every_few_seconds_of_decoding(monkeypatch, capsys):
  from tools import display, generate as generate_tool  # pylint: disable=import-outside-toplevel
  now = [100.0]
  monkeypatch.setattr(display.time, "monotonic", lambda: now[0])
  progress = generate_tool.Progress()
  for decoded, at in ((32, 105.0), (64, 111.0), (96, 115.0), (2000, 200.0)):
    now[0] = at
    progress(decoded, 2000 if decoded < 2000 else decoded)
  err = capsys.readouterr().err
  assert err == "tools.generate: 64 of up to 2,000 new tokens decoded (6 a second)\n"


def _digits_cfg() -> Config:
  """The digits run's model: 8x8 images of one channel."""
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  assert (cfg.model.vision.image_size, cfg.model.vision.channels) == (8, 1)
  return cfg


def test_a_colour_image_for_a_one_channel_model_says_how_to_convert_it(tmp_path):
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from mimo_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import digits  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.images import ImageProcessor  # pylint: disable=import-outside-toplevel
  from tools import prompts  # pylint: disable=import-outside-toplevel
  digits.write_tokenizer(tmp_path / "tok")
  Image.new("RGB", (20, 20), (200, 30, 30)).save(tmp_path / "photo.png")
  proc = ImageProcessor.open(tmp_path / "tok")
  with pytest.raises(ConfigError) as e:
    prompts.load_images([str(tmp_path / "photo.png")], proc, _digits_cfg())
  assert str(e.value) == (
      f"{tmp_path / 'photo.png'}: the processor makes it 8x8x3 (height x width x channels) where "
      "the model reads 8x8x1; convert the image to one channel, a grayscale PNG (e.g. with "
      "Pillow: Image.open(path).convert(\"L\").save(\"new.png\")).")
  with pytest.raises(ConfigError) as e:  # as tools.convert and tools.eval name it
    prompts.load_images([str(tmp_path / "gone.png")], proc, _digits_cfg())
  assert str(e.value) == f"{tmp_path / 'gone.png'}: not found."


def test_a_prompt_names_the_words_it_cannot_encode_and_the_runs_image_mark(tmp_path):
  from mimo_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import digits  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.chat import ChatTokenizer  # pylint: disable=import-outside-toplevel
  from tools import prompts  # pylint: disable=import-outside-toplevel
  digits.write_tokenizer(tmp_path / "tok")
  tok = ChatTokenizer.open(tmp_path / "tok")
  with pytest.raises(ConfigError) as e:
    prompts.prompt_ids(tok, "<image> What is it?", 0, "<img>", 1)
  message = str(e.value)
  assert message.startswith("the prompt '<image> What is it?': ") and "\n" not in message
  assert "cannot encode the words '<image>', 'What', 'is', 'it?': they are not in" in message
  assert message.endswith("eight nine); '<image>' is no mark of this run: its image mark is "
                          "'<img>' (--image_token sets it)."), message


def test_a_bfloat16_cache_is_read_as_it_is():
  """cached_attention over a bfloat16 cache: its matmuls read the cache in bfloat16 and sum in
  float32 (no float32 copy of the cache at each new token), within bfloat16's rounding of the
  float32 attention over the same values."""
  from mimo_jax.models import layers  # pylint: disable=import-outside-toplevel
  n_layers, b, t, heads, kv_heads, d = 3, 2, 24, 4, 2, 16
  keys = jax.random.split(jax.random.key(0), 5)
  q, k_new, v_new = (jax.random.normal(key, (b, 1, h, d)) for key, h in
                     zip(keys[:3], (heads, kv_heads, kv_heads)))
  k, v = (jax.random.normal(key, (n_layers, b, kv_heads, t, d)) for key in keys[3:])
  valid = jnp.arange(t)[None, :] < jnp.array([[t], [t - 5]])
  cache = lambda dtype: layers.KVCache(k.astype(dtype), v.astype(dtype), jnp.int32(10), valid,
                                       jnp.int32(1))
  args = lambda dtype: (q.astype(dtype), k_new.astype(dtype), v_new.astype(dtype), cache(dtype))
  jaxpr = jax.make_jaxpr(layers.cached_attention)(*args(jnp.bfloat16))
  widened = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
             and e.outvars[0].aval.size >= b * t * kv_heads * d]
  assert not widened, widened
  with jax.default_matmul_precision("highest"):
    want, _ = layers.cached_attention(*args(jnp.float32))
    got, kv = layers.cached_attention(*args(jnp.bfloat16))
  assert got.dtype == jnp.float32 and kv.k.dtype == jnp.bfloat16
  np.testing.assert_allclose(got, want, atol=0.02, rtol=0.02)  # about 4 bfloat16 steps at 1


def test_a_cached_attention_writes_its_layer_and_slots_alone():
  """The new tokens' keys and values land in layer `cache.layer` at slots `cache.index`..,
  heads first; every other slot of every layer is as it was. The output is the attention over
  that layer's keys and values, as a whole-row softmax attention computes it."""
  from mimo_jax.models import layers  # pylint: disable=import-outside-toplevel
  n_layers, b, t, heads, kv_heads, d, n, at = 3, 2, 8, 4, 2, 8, 2, 3
  keys = jax.random.split(jax.random.key(1), 5)
  q = jax.random.normal(keys[0], (b, n, heads, d))
  k_new, v_new = (jax.random.normal(key, (b, n, kv_heads, d)) for key in keys[1:3])
  k, v = (jax.random.normal(key, (n_layers, b, kv_heads, t, d)) for key in keys[3:])
  valid = jnp.ones((b, t), bool)
  with jax.default_matmul_precision("highest"):
    out, kv = layers.cached_attention(q, k_new, v_new,
                                      layers.KVCache(k, v, jnp.int32(at), valid, jnp.int32(1)))
  for old, new, put in ((k, kv.k, k_new), (v, kv.v, v_new)):
    want = np.array(old)
    want[1, :, :, at:at + n] = np.transpose(np.array(put), (0, 2, 1, 3))
    np.testing.assert_array_equal(new, want)
  # The reference: each query head over its key-value head's slots up to its own position.
  kk, vv = (np.repeat(np.array(a[1]), heads // kv_heads, axis=1) for a in (kv.k, kv.v))
  scores = np.einsum("bnhd,bhtd->bhnt", np.array(q), kk) / np.sqrt(d)
  scores = np.where(np.arange(t)[None, None, None] <= (at + np.arange(n))[None, None, :, None],
                    scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(out, np.einsum("bhnt,bhtd->bnhd", probs, vv), rtol=1e-5, atol=1e-5)


def test_a_decoding_loop_casts_the_kernels_once_to_the_same_tokens():
  """A bfloat16 model of float32 weights: the loop's model holds its matmul kernels in bfloat16
  (cast once, not at every new token), its norms' scales as they were, and decodes the tokens
  (and logits) the model casting at each use does."""
  cfg = LanguageConfig(dim=32, layers=2, heads=4, kv_heads=2, mlp_dim=64)
  graphdef, state = nnx.split(nnx.eval_shape(
      lambda: LanguageModel(nnx.Rngs(params=0), cfg, 17, jnp.bfloat16)))
  rng = np.random.default_rng(0)
  model = nnx.merge(graphdef, jax.tree.map(
      lambda a: jnp.asarray(rng.normal(0.0, 0.5, a.shape), a.dtype), state))
  assert model.blocks.mlp.down.kernel[...].dtype == jnp.float32  # master weights
  cast = generate._kernels_cast(model)  # pylint: disable=protected-access
  dtypes = {jax.tree_util.keystr(p): x.dtype
            for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(cast))[0]}
  assert dtypes["['blocks']['mlp']['down']['kernel'].value"] == jnp.bfloat16, dtypes
  assert dtypes["['head']['kernel'].value"] == jnp.bfloat16, dtypes
  assert dtypes["['blocks']['norm1']['scale'].value"] == jnp.float32, dtypes
  x = model.embed(jnp.asarray(rng.integers(0, 17, (2, 5))))
  mask = jnp.ones((2, 5), bool).at[1, :2].set(False)
  np.testing.assert_array_equal(generate.decode(model, x, mask, 6),
                                generate.decode(cast, x, mask, 6))
  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
  valid = jnp.concatenate([mask, jnp.ones((2, 6), bool)], axis=1)
  logits = lambda m: m.logits(m.decode(x, positions, m.init_cache(valid, x.dtype))[0])
  np.testing.assert_array_equal(logits(model), logits(cast))



def test_a_bfloat16_model_decodes_under_xlas_default_cpu_options():
  """XLA's CPU backend runs only some forms of a bfloat16 matmul with a float32 result when its
  matmuls run multi-threaded, its default (the suite turns that off, conftest.py; the program
  here turns it back on): the cache's attention is one of them, so a bfloat16 model decodes on a
  CPU as on a GPU."""
  model = LanguageModel(nnx.Rngs(params=0), LanguageConfig(), 17, jnp.bfloat16)
  graphdef, state = nnx.split(model)
  x = model.embed(jnp.asarray(np.arange(10).reshape(2, 5) % 17))
  run = jax.jit(lambda s, x: generate.decode(nnx.merge(graphdef, s), x, jnp.ones((2, 5), bool), 4),
                compiler_options={"xla_cpu_multi_thread_eigen": True})
  tokens = np.asarray(run(state, x))
  assert tokens.shape == (2, 4) and ((tokens >= 0) & (tokens < 17)).all(), tokens
