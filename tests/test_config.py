"""Every bad config value is one clear error naming its field, before anything compiles."""

import pytest

from configs import digits, vlm
from mimo_jax import topology
from mimo_jax.config import Config, ConfigError
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.validation import validate
from tests.configs import tiny

CASES = [
    ("model.dtype", "float16", "model.dtype"),
    ("model.attention", "flash", "model.attention"),
    ("model.language.vocab_size", 100, "model.language.vocab_size"),  # digits has 17 words
    ("model.vision.downsample", 3, "model.vision.downsample"),  # 2 patches a side
    ("data.task", "captions", "data.task"),
    ("model.vision.image_size", 16, "model.vision.image_size"),  # digits images are 8x8
    ("topology.language.remat", "some", "topology.language.remat"),
    ("topology.language.virtual", 2, "topology.language.virtual"),  # needs pp > 1
    ("model.vision.patch_size", 3, "model.vision.patch_size"),
    ("model.vision.heads", 5, "model.vision.heads"),
    ("model.language.kv_heads", 3, "model.language.kv_heads"),
    ("model.language.heads", 0, "model.language.heads"),
    ("data.global_batch", 0, "data.global_batch"),
    ("data.microbatches", 3, "data.microbatches"),
    ("model.vision.max_images", 0, "model.vision.max_images"),
    ("data.image_probs", "0.5,0.5", "data.image_probs"),
    ("data.image_probs", "0.5,0.5,0.5,0.5", "data.image_probs"),
    ("data.image_probs", "a,b,c,d", "data.image_probs"),
    ("data.seq_len", 10, "data.seq_len"),
    ("model.vision.image_slots", 7, "model.vision.image_slots"),
    ("optim.lr", 0.0, "optim.lr"),
    ("optim.freeze", "vit", "optim.freeze"),
    ("optim.freeze", "vision,vision_projector,language", "optim.freeze"),  # nothing to train
    ("optim.lr_mult", "vision:2", "optim.lr_mult"),
    ("optim.lr_mult", "vision=x", "optim.lr_mult"),
    ("train.steps", 0, "train.steps"),
    ("train.seed", -1, "train.seed"),
    ("train.seed", 2**32, "train.seed"),  # jax's key of 2**32 is 0's
    ("data.seed", -1, "data.seed"),  # grain's shuffle takes 32-bit seeds
    ("eval.every", -1, "eval.every"),
    ("run.progress", "fancy", "run.progress"),
    ("run.log_every", 0, "run.log_every"),
    ("run.cpu_devices", 100_000, "run.cpu_devices"),
    ("topology.language.dp", 3, "topology.language.dp"),
    ("topology.vision.pp", 3, "topology.vision.pp"),  # 2 layers do not split into 3 stages
    ("model.language.kv_heads", 1, "topology.language.tp"),  # tp=2 cannot split 1 kv head
    ("topology.vision.offset", 7, "topology.vision.offset"),  # past 8 devices
    ("data.microbatch_fill", "best", "data.microbatch_fill"),
    ("data.microbatch_fill", "pack", "data.microbatch_fill"),  # no row or slot buckets to trim
    ("optim.b1", 1.0, "optim.b1"),  # AdamW's bias correction 1 - b1^t would divide by zero
    ("optim.b2", 1.0, "optim.b2"),
    ("optim.b2", -0.5, "optim.b2"),
    ("optim.weight_decay", -5.0, "optim.weight_decay"),
    ("optim.lr_mult", "vision=inf", "optim.lr_mult"),
    # Range errors before anything that divides by (or sizes with) the field: data.seq_len's
    # bounds take eval.batch, eval.samples and the data's batch.
    ("eval.batch", 0, "eval.batch"),  # was a ZeroDivisionError
    ("eval.batch", -1, "eval.batch"),
    ("eval.samples", 0, "eval.samples"),
    ("data.microbatches", 0, "data.microbatches"),
    ("data.eval_samples", 0, "data.eval_samples"),
    ("data.text_token_cost", -1, "data.text_token_cost"),  # was named data.image_token_cost
    ("model.language.rope_theta", -1.0, "model.language.rope_theta"),  # was a NaN loss at step 1
    ("checkpoint.base", "/no/such/folder", "checkpoint.base"),  # was ignored
]


def _set(cfg: Config, path: str, value) -> None:
  *parents, leaf = path.split(".")
  obj = cfg
  for p in parents:
    obj = getattr(obj, p)
  setattr(obj, leaf, value)


@pytest.mark.parametrize("path,value,field", CASES, ids=[f"{p}={v}" for p, v, _ in CASES])
def test_bad_value_names_its_field(path, value, field):
  cfg = digits.get_config()  # vision dp4 on devices 0-3, language dp2 tp2 on 4-7
  _set(cfg, path, value)
  with pytest.raises(ConfigError, match=rf"^config\.{field.replace('.', r'[.]')}: ") as e:
    validate(cfg, num_devices=8)
  assert "\n" not in str(e.value)


NON_FINITE = [("optim.lr", "inf"), ("optim.lr", "nan"), ("optim.lr", "-inf"),
              ("optim.clip_norm", "inf"), ("optim.clip_norm", "nan"), ("optim.b2", "nan"),
              ("optim.min_lr_ratio", "nan"), ("model.language.rope_theta", "inf"),
              ("model.vision.norm_eps", "inf"), ("data.image_token_cost", "inf"),
              ("run.device_memory_gb", "nan")]


@pytest.mark.parametrize("path,value", NON_FINITE, ids=[f"{p}={v}" for p, v in NON_FINITE])
def test_non_finite_floats_name_their_field(path, value):
  """NaN and infinity pass checks like `lr > 0` (inf) or come back as the wrong complaint (nan):
  any float field of the config is refused as not finite, first."""
  cfg = digits.get_config()
  _set(cfg, path, float(value))
  with pytest.raises(ConfigError, match=rf"^config\.{path.replace('.', '[.]')}: must be a finite "
                     rf"number, got {value}\.$"):
    validate(cfg, num_devices=8)


@pytest.mark.parametrize("mean,std,field", [("nan", "0.5", "pixel_mean"),
                                             ("0.5", "inf", "pixel_std")])
def test_non_finite_pixel_norm_names_its_field(mean, std, field):
  cfg = digits.get_config()
  cfg.model.vision.pixel_mean, cfg.model.vision.pixel_std = mean, std
  with pytest.raises(ConfigError, match=rf"^config\.model\.vision\.{field}: '(nan|inf)': values "
                     "must be finite numbers"):
    validate(cfg, num_devices=8)


def test_seq_len_past_host_memory_names_it(monkeypatch):
  """Rows the machine cannot hold are refused up front, not after start-up with a MemoryError:
  the eval set (48 rows of the digits config: 3 batches of 16) and a step (32 rows) at 28 bytes
  a position."""
  from mimo_jax import validation  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(validation, "host_memory", lambda: 16 * 1024**3)
  cfg = tiny.get_config()
  validate(cfg, num_devices=8)
  cfg.data.seq_len = 10**9
  with pytest.raises(ConfigError, match=r"^config\.data\.seq_len: 1000000000 positions a row make "
                     r"the loader's text arrays alone 2,086 GiB \(48 eval rows, 32 a step, 28 bytes "
                     r"a position\), more than this machine's 16 GiB"):
    validate(cfg, num_devices=8)
  cfg.data.seq_len = 16 * 1024**3 // (80 * 28)  # exactly what fits
  validate(cfg, num_devices=8)
  cfg.data.seq_len += 1
  with pytest.raises(ConfigError, match=r"^config\.data\.seq_len: "):
    validate(cfg, num_devices=8)


def test_microbatch_fill_pack_refuses_a_pipelined_module():
  cfg = digits.get_config()
  cfg.data.microbatch_fill, cfg.data.slot_buckets = "pack", 2
  validate(cfg, num_devices=8)
  cfg.topology.language.tp, cfg.topology.language.pp = 1, 2
  with pytest.raises(ConfigError, match=r"^config\.data\.microbatch_fill: pack: a pipelined"):
    validate(cfg, num_devices=8)


def test_default_config_is_valid():
  validate(digits.get_config(), num_devices=8)
  validate(digits.get_config("single"), num_devices=1)


@pytest.mark.parametrize("variant", ["default", "encoder_heavy", "dynamic", "tuned", "llm8b",
                                     "llm8b_lora"])
def test_vlm_variants_are_valid(variant):
  validate(vlm.get_config(variant), num_devices=1)


def test_vlm_unknown_variant_names_them():
  with pytest.raises(ValueError,
                     match="use default, encoder_heavy, dynamic, tuned, llm8b or llm8b_lora"):
    vlm.get_config("fast")


@pytest.mark.parametrize("vision,language,ok", [
    ((0, 4, 1), (4, 2, 2), True),  # disjoint
    ((0, 4, 1), (0, 2, 2), True),  # colocated, different dp/tp
    ((0, 4, 1), (2, 2, 2), False),  # partial overlap
    ((4, 4, 1), (0, 2, 1), True),  # language first in device order
    ((0, 4, 1), (6, 2, 2), False),  # past the device count
])
def test_device_ranges(vision, language, ok):
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  for t, (offset, dp, tp) in ((cfg.topology.vision, vision), (cfg.topology.language, language)):
    t.offset, t.dp, t.tp = offset, dp, tp
  if ok:
    topo = topology.build(cfg)
    assert [d.id for d in topo.meshes["vision"].devices.flat] == list(
        range(vision[0], vision[0] + vision[1] * vision[2]))
  else:
    with pytest.raises(ConfigError, match=r"^config\.topology\.(vision|language)\.offset: "):
      topology.build(cfg)


def test_eval_batch_must_split_over_dp():
  cfg = digits.get_config()
  cfg.eval.batch = 6  # vision dp 4
  with pytest.raises(ConfigError, match=r"^config\.eval\.batch: "):
    validate(cfg, num_devices=8)


def test_too_few_samples_for_one_batch():
  cfg = digits.get_config()
  cfg.data.train_samples = 16  # global_batch 32
  with pytest.raises(ConfigError, match=r"^config\.data\.train_samples: 16 samples cannot fill"):
    validate(cfg, num_devices=8)


def test_layout_strings():
  from mimo_jax.config import set_layout
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  set_layout(cfg, "vision=0/4/1, language=4/1/2/2/2")
  assert (cfg.topology.vision.dp, cfg.topology.language.pp, cfg.topology.language.virtual) == (
      4, 2, 2)
  for bad in ("audio=0/1/1", "vision=0/1", "vision=a/b/c"):
    with pytest.raises(ConfigError, match=r"^config\.topology"):
      set_layout(cfg, bad)


def test_a_data_field_an_encoder_took_over_names_its_new_place():
  from configs import digits  # pylint: disable=import-outside-toplevel
  from mimo_jax import configfile  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match=r"config\.data\.max_images is now "
                     r"model\.vision\.max_images .* --config\.model\.vision\.max_images"):
    configfile.apply(digits.get_config(), ["--config.data.max_images=2"])


@pytest.mark.parametrize("line,said", [
    ("c.optim.learning_rate = 1e-4", "unknown config field 'learning_rate'; config.optim has lr,"),
    ("c.model.vision.patch = 16", "unknown config field 'patch'; config.model.vision has "),
    ("c.train.steps = '30'", "config.train.steps: '30' is not an int."),
    ("c.train.steps = True", "config.train.steps: True is not an int."),
    ("c.topology.vision.dp = 2.0", "config.topology.vision.dp: 2.0 is not an int."),
    ("c.run.progress = None", "config.run.progress: None is not a str."),
    ("c.eval = None", "config.eval is a section (EvalConfig), not None; set its fields instead."),
])
def test_a_config_file_is_checked_as_its_overrides_are(tmp_path, line, said):
  # A misspelt field in a file used to be ignored, a value of the wrong type to fail later with a
  # traceback; an int for a float is taken as that float.
  from mimo_jax import configfile  # pylint: disable=import-outside-toplevel
  file = tmp_path / "c.py"
  body = "from configs.digits import get_config as base\n\ndef get_config(arg=None):\n  c = base()\n"
  file.write_text(body + f"  {line}\n  return c\n")
  with pytest.raises(ConfigError) as e:
    configfile.load_file(str(file))
  assert str(e.value).startswith(f"--config={file}: ") and said in str(e.value)
  file.write_text(body + "  c.optim.lr = 1\n  return c\n")
  lr = configfile.load_file(str(file)).optim.lr
  assert (lr, type(lr)) == (1.0, float)


def test_a_config_file_without_get_config_or_variant_and_data_dir_a_file(tmp_path):
  """One line each that says what to do, not a Python exception's name: a file with no
  get_config, a variant a config file does not have, data.dir naming the JSON file itself."""
  from mimo_jax import configfile  # pylint: disable=import-outside-toplevel
  from mimo_jax.validation import data_source  # pylint: disable=import-outside-toplevel
  (tmp_path / "c.py").write_text("x = 1\n")
  with pytest.raises(ConfigError, match=r"c\.py defines no get_config\(arg=None\) returning a "
                     r"Config; add one \(as configs/digits\.py does\)\.$"):
    configfile.load_file(str(tmp_path / "c.py"))
  (tmp_path / "c.py").write_text("import sys\nsys.exit(0)\n")  # was an exit, status 0, silent
  with pytest.raises(ConfigError, match=r"c\.py called sys\.exit\(0\) while it was read; a "
                     r"config file defines get_config and returns a Config\.$"):
    configfile.load_file(str(tmp_path / "c.py"))
  with pytest.raises(ConfigError) as e:
    configfile.load_file("configs/digits.py:singel")
  assert str(e.value) == ("configs/digits.py: unknown variant 'singel'; use 'default' or "
                          "'single'.")
  cfg = configfile.load_file("configs/llava_cpu.py")
  cfg.data.task, cfg.data.dir = "conversations", str(tmp_path / "c.py")
  with pytest.raises(ConfigError, match=r"c\.py is a file, not a directory; .* reads the "
                     r"directory that `python -m tools\.convert --json FILE --out DIR` writes"):
    data_source(cfg)


def test_overrides_split_as_flags_are_written():
  from mimo_jax import configfile  # pylint: disable=import-outside-toplevel
  spec, overrides, rest = configfile.split_args(
      ["--config", "configs/digits.py:single", "--config.train.steps", "7", "--config.run.progress=lines",
       "--config.model.vision.fp8", "--noconfig.topology.vision.unroll", "--debug"])
  assert spec == "configs/digits.py:single" and rest == ["--debug"]
  assert overrides == ["--config.train.steps=7", "--config.run.progress=lines",
                       "--config.model.vision.fp8", "--noconfig.topology.vision.unroll"]
  cfg = configfile.load(spec, overrides)
  assert (cfg.train.steps, cfg.model.vision.fp8, cfg.topology.vision.unroll) == (7, True, False)


def test_the_built_in_token_constants_are_the_digits_tokenizers():
  # pylint: disable=import-outside-toplevel
  from mimo_jax.config_run import BUILTIN_IMAGE_TOKEN, DIGITS_VOCAB
  from mimo_jax.data.tokenizer import IMG, Tokenizer  # pylint: disable=import-outside-toplevel
  assert (BUILTIN_IMAGE_TOKEN, DIGITS_VOCAB) == (IMG, Tokenizer().vocab_size)


def test_an_init_from_that_is_neither_a_directory_nor_a_run_step_names_its_field(tmp_path):
  from mimo_jax import init_from  # pylint: disable=import-outside-toplevel
  from mimo_jax.checkpoint_config import CheckpointError  # pylint: disable=import-outside-toplevel
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  cfg = digits.get_config()
  cfg.model.language.init_from = str(tmp_path / "gone")
  with pytest.raises(ConfigError, match=r"^config\.model\.language\.init_from: .*gone: not a "
                     r"directory; name an HF model directory .* or a mimo_jax run"):
    validate(cfg, num_devices=8)
  cfg.model.language.init_from = f"{run}:last"
  with pytest.raises(ConfigError, match=r"^config\.model\.language\.init_from: .*:last': the "
                     r"step 'last' is not a number"):
    validate(cfg, num_devices=8)
  cfg.model.language.init_from, cfg.model.init_from = "", f"{run}:abc"
  with pytest.raises(CheckpointError, match=r"^config\.model\.init_from: .*:abc': the step 'abc' "
                     r"is not a number"):
    init_from.sources(cfg, ["language"])


def test_noconfig_on_a_field_that_is_no_bool_and_a_config_that_is_a_directory(tmp_path):
  from mimo_jax import configfile  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match=r"^--noconfig\.optim\.lr: --noconfig sets a bool field "
                     r"false, and config\.optim\.lr is a float: give --config\.optim\.lr=VALUE\.$"):
    configfile.apply(digits.get_config(), ["--noconfig.optim.lr"])
  assert not configfile.apply(digits.get_config(),
                              ["--noconfig.topology.vision.unroll"]).topology.vision.unroll
  with pytest.raises(ConfigError, match=rf"^--config: '{tmp_path}' is a directory; name a config "
                     r"file in it"):
    configfile.load_file(str(tmp_path))


def test_a_tp_that_divides_no_head_count_is_named_before_the_range_it_moves():
  # vision dp4 tp3 would span [0, 12) and overlap the language model's [4, 8): the tp is the fault.
  cfg = digits.get_config()
  cfg.topology.vision.tp = 3
  with pytest.raises(ConfigError, match=r"^config\.topology\.vision\.tp: 3 must divide "
                     r"model\.vision\.heads"):
    validate(cfg)
