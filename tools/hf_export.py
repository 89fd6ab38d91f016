"""`python -m tools.hf export` (tools/hf.py says what it does): a checkpoint written as a complete
HF directory, or its LoRA adapters as a PEFT one, staged and renamed into place."""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import signal
import sys

import numpy as np

from mimo_jax import checkpoint_reader, output, run_paths
from mimo_jax.config import Config, from_dict
from mimo_jax.config_run import DIGITS_VOCAB
from mimo_jax.hf import audio as hf_audio
from mimo_jax.hf import chat_parts
from mimo_jax.hf import export as hf_files
from mimo_jax.hf import vision as hf_vision
from tools.hf_import import fail

SHARD_BYTES = 5 * 1024**3


def _read_checkpoint(workdir: str, step: int | None) -> tuple[Config, dict, int, dict]:
  """(config, parameters by module on the host, step, import record) of a workdir's step, read
  as tools.ckpt reads it: committed steps only, beside a live run, checked against the
  fingerprints saved with it."""
  reader = checkpoint_reader.Reader(workdir)
  reader.note("tools.hf")

  def read(s: int) -> tuple[dict, dict]:
    meta = reader.meta(s)
    return meta, reader.params_tree(s, meta)
  try:
    step, (meta, params) = checkpoint_reader.newest(reader, step, read, tool="tools.hf")
  finally:
    reader.close()
  record_file = pathlib.Path(workdir) / "hf_import.json"
  record = json.loads(record_file.read_text()) if record_file.is_file() else {}
  return from_dict(meta["config"]), params, step, record


def export(args) -> None:
  from absl import logging  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.ERROR)  # orbax's notes on opening a checkpoint read-only
  try:
    with output.interrupts_as_exceptions():
      _export(args)
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (output.Interrupted)
    print("tools.hf: export interrupted; " + (
        f"{args.out} was complete before it came: the export is whole"
        if output.published(args.out) else f"nothing was written to {args.out}"), file=sys.stderr)
    sys.exit(128 + getattr(e, "signum", signal.SIGINT))


def _run_data(workdir: str, cfg: Config) -> dict:
  """What the run's converted data (data.task conversations or digits: its manifest) says of the
  tokenizer, the image processor, the image token and pad to square; {} without one. A relative
  data.dir (a run saved before checkpoints stored it absolute) is looked for where the run was
  launched from, in the workdir, then here."""
  from mimo_jax.data import conversations, digits  # pylint: disable=import-outside-toplevel
  d, where = cfg.data, run_paths.bases(run_paths.launch_dir(workdir, cfg), workdir)
  if d.task == "conversations":
    directory = pathlib.Path(run_paths.resolve(d.dir, conversations.MANIFEST, where) or d.dir)
  elif d.task == "digits":
    root = (run_paths.resolve(d.dir, "", where) or d.dir) if d.dir else ""
    directory = digits.directory(root, d.train_samples, d.eval_samples, d.probs())
  else:
    return {}
  if not (directory / conversations.MANIFEST).is_file():
    return {}
  m = conversations.manifest(str(directory))
  return {"tokenizer": conversations.source_path(str(directory), m["tokenizer"]),
          "processor": conversations.source_path(str(directory), m["processor"]),
          "image_token": m.get("image_token"), "pad_to_square": bool(m.get("pad_to_square")),
          "where": str(directory / conversations.MANIFEST)}


def history(workdir: str, cfg: Config, record: dict,
            stages: list[tuple[pathlib.Path, int | None]] | None = None
            ) -> tuple[dict, dict[str, list[str]]]:
  """The import record (hf_import.json) and the HF directories each module came from (nearest
  first), of this run and of the runs it started from (init_from=WORKDIR: training stages; each
  run's workdir and the step the next stage started from appended to `stages`, this one's first
  with None). Relative paths (of runs and imports saved before they were stored absolute) are
  looked for where each run was launched from, in its workdir, then here."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax.checkpoint import Checkpointer
  from mimo_jax.checkpoint_steps import complete_steps
  from mimo_jax.config import run_source, start_spec
  sources: dict[str, list[str]] = {"vision": [], "language": []}
  todo, seen = [(pathlib.Path(workdir), cfg, record, None)], set()
  while todo:
    path, c, rec, step = todo.pop(0)
    if path.resolve() in seen:
      continue
    seen.add(path.resolve())
    if stages is not None:
      stages.append((path, step))
    record = record or rec
    where = run_paths.bases(run_paths.launch_dir(str(path), c), path)
    for module, p in rec.get("sources", {}).items():
      sources.setdefault(module, []).append(run_paths.resolve(p, "", where) or p)
    for module in ("vision", "language"):
      if module not in c.model.encoders and module != "language":
        continue  # a run without a vision encoder (audio and language)
      _, spec = start_spec(c, module, lambda s: run_paths.resolve_spec(s, where) if s else s)
      run = run_source(spec)
      if run is None:
        if spec:
          sources[module].append(spec)
        continue
      try:  # an earlier stage: its config and record, if it can still be read
        ckpt = Checkpointer(run[0], [], read_only=True)
        read = run[1] if run[1] is not None else max(complete_steps(run[0]))
        meta = ckpt.read_meta(read)
        earlier = pathlib.Path(run[0]).parent
        rec_file = earlier / "hf_import.json"
        todo.append((earlier, from_dict(meta["config"]),
                     json.loads(rec_file.read_text()) if rec_file.is_file() else {}, read))
      except Exception:  # pylint: disable=broad-except
        continue
  return record, {m: list(dict.fromkeys(p)) for m, p in sources.items()}


def source_context(record: dict, sources: dict[str, list[str]]) -> int | None:
  """The language model's max_position_embeddings: the import's record, else its source's."""
  if record.get("max_position_embeddings"):
    return int(record["max_position_embeddings"])
  for path in sources["language"]:
    try:
      c = json.loads((pathlib.Path(path) / "config.json").read_text())
    except (OSError, ValueError):
      continue
    c = c.get("text_config", {}) if c.get("model_type") in ("llava", "qwen2_audio") else c
    if isinstance(c.get("max_position_embeddings"), int):
      return c["max_position_embeddings"]
  return None


def _image_processor(sources: dict[str, list[str]], data: dict) -> tuple[dict | None, str]:
  """The image processor config the run's images were prepared with, and its file: the data's,
  else the tower's source directory's (preprocessor_config.json, or processor_config.json's
  image_processor as transformers 5 writes it)."""
  for path in ([data["processor"]] if data.get("processor") else []) + sources["vision"]:
    for name, key in (("preprocessor_config.json", None), ("processor_config.json",
                                                           "image_processor")):
      f = pathlib.Path(path) / name
      if f.is_file():
        try:
          c = json.loads(f.read_text())
        except ValueError as e:
          fail(f"{f}: not JSON ({e}).")
        c = c.get(key) if key else c
        if isinstance(c, dict) and "image_processor_type" in c:
          return c, str(f)
  return None, ""


def _tokenizer(args, sources: dict[str, list[str]], data: dict) -> "hf_files.Tokenizer":
  """The tokenizer the run used: --tokenizer, the data's, else the language model's source's."""
  if args.tokenizer:
    return hf_files.Tokenizer(args.tokenizer)
  for path in ([data["tokenizer"]] if data.get("tokenizer") else []) + sources["language"]:
    if (pathlib.Path(path) / "tokenizer.json").is_file():
      return hf_files.Tokenizer(path)
  fail(f"{args.workdir}: neither its run's data nor an import names a directory with the "
        "tokenizer's tokenizer.json; pass --tokenizer DIR (the tokenizer the model was trained "
        "with).")


def _image_token(args, cfg: Config, record: dict, data: dict, tok) -> tuple[int, str]:
  """LLaVA's image token (id, text): --image_token_index, the run's data (data.image_token, set,
  or the digits task's built-in), the import's record (a LLaVA's image_token_index), else the
  tokenizer's <image>."""
  trained = cfg.data.task == "digits" or (cfg.data.task == "conversations" and
                                          cfg.data.image_token >= 0)
  if args.image_token_index is not None:
    token, where = args.image_token_index, "--image_token_index"
    if trained and token != cfg.data.placeholder:  # the processor would mark other text
      fail(f"--image_token_index {token}: the run trained with image token "
           f"{cfg.data.placeholder} (config.data.image_token, {data.get('where', 'run')}); give "
           "that, or leave --image_token_index out.")
  elif trained:
    token, where = cfg.data.placeholder, f"config.data.image_token ({data.get('where', 'run')})"
  elif record.get("image_token_index") is not None:
    token, where = int(record["image_token_index"]), "hf_import.json's image_token_index"
  else:
    token, where = tok.tokenizer.token_to_id("<image>"), f"{tok.path}'s <image>"
    if token is None:
      fail(f"LLaVA needs the id of its image token and {tok.path / 'tokenizer.json'} has no "
            "<image> token: pass --image_token_index ID.")
  text = tok.tokenizer.id_to_token(token)
  if text is None or token >= cfg.model.language.vocab_size:
    fail(f"image token {token} (from {where}) is not among the ids of "
          f"{tok.path / 'tokenizer.json'} ({tok.tokenizer.get_vocab_size()}) and of the model's "
          f"vocabulary ({cfg.model.language.vocab_size}); pass --image_token_index ID.")
  return token, text


def _default_model(cfg: Config, sources: dict[str, list[str]]) -> str:
  """The whole model's HF class by default: Qwen2-Audio for a run without a vision encoder, or
  whose language model came from a Qwen2-Audio directory; LLaVA otherwise."""
  if "audio" in cfg.model.encoders and "vision" not in cfg.model.encoders:
    return "qwen2_audio"
  for path in sources.get("language", [])[:1]:
    with contextlib.suppress(OSError, ValueError):
      c = json.loads((pathlib.Path(path) / "config.json").read_text())
      if c.get("model_type") == "qwen2_audio" and "audio" in cfg.model.encoders:
        return "qwen2_audio"
  return "llava"


def _audio_token(args, cfg: Config, tok) -> tuple[int, str]:
  """Qwen2-Audio's audio token (id, text): --audio_token_index, else model.audio.audio_token;
  one token of the tokenizer."""
  token = cfg.model.audio.audio_token if args.audio_token_index is None \
      else args.audio_token_index
  where = "--audio_token_index" if args.audio_token_index is not None \
      else "config.model.audio.audio_token"
  text = tok.tokenizer.id_to_token(token)
  if text is None or token >= cfg.model.language.vocab_size:
    fail(f"audio token {token} (from {where}) is not a token of {tok.path / 'tokenizer.json'} "
          f"and of the model's {cfg.model.language.vocab_size}; pass --audio_token_index ID.")
  return token, text


def _export_peft(args) -> None:
  """`export --peft`: the run's adapters (and a trained projector) as a PEFT adapter."""
  from mimo_jax.hf import peft  # pylint: disable=import-outside-toplevel
  out = pathlib.Path(args.out)
  output.check_target(out, peft.WHAT, "--out", complete=peft.WEIGHTS, replace=args.overwrite,
                      replace_flag="--overwrite")
  cfg, params, step, record = _read_checkpoint(args.workdir, args.step)
  if not cfg.model.language.vocab_size:  # 0: the digits task's own vocabulary
    cfg.model.language.vocab_size = DIGITS_VOCAB
  modules = ((args.module,) if args.module else
             ("vision", "language") if "vision" in cfg.model.encoders else ("language",))
  stages: list[tuple[pathlib.Path, int | None]] = []
  _, sources = history(args.workdir, cfg, record, stages)
  base, trained = args.base, None
  if not base:
    base = next(iter(sources.get(modules[-1]) or []), "")
    trained = _trained_base(args.workdir, step, stages, modules)
    if trained:
      base = ""
  peft.write(out, cfg, params, base=base, replace=args.overwrite, modules=modules)
  print(f"wrote {out}: a PEFT adapter of {' and '.join(modules)} from step {step}"
        f"{f' over {base}' if base else ''}")
  if trained:
    run, hf, started = trained
    print(f"note: its frozen weights are not {hf}'s: {run} trained them, so the adapter names "
          "no base model (base_model_name_or_path is empty). Load it over that run's export "
          f"(python -m tools.hf export {run} --step {started} --out BASE), or pass --base BASE "
          "to record it.")


def _trained_base(workdir: str, step: int, stages: list[tuple[pathlib.Path, int | None]],
                  modules: tuple[str, ...]) -> tuple[str, str, int] | None:
  """(the run this one started from, the import's HF directory, the step it started from) where
  the frozen weights
  under the run's adapters (its step's base, checkpoint.py's `name_base`) are not those its
  import's step 0 holds (an earlier stage trained them); None where they are, or nothing tells
  (no frozen weights, no import among the stages)."""
  reader = checkpoint_reader.Reader(workdir)
  try:
    held = reader.meta(step).get("base", {}).get("fingerprints", {})
  finally:
    reader.close()
  imports = [p for p, _ in stages[1:] if (p / "hf_import.json").is_file()]
  if not any(held.get(m) for m in modules) or not imports:
    return None
  reader = checkpoint_reader.Reader(str(imports[0]))
  try:
    imported = reader.meta(0).get("fingerprints", {})
  except Exception:  # pylint: disable=broad-except  (no step 0 to read: nothing tells)
    return None
  finally:
    reader.close()
  same = all(imported.get(m, {}).get(k, fp) == fp for m in modules
             for k, fp in held.get(m, {}).items())
  if same:
    return None
  source = json.loads((imports[0] / "hf_import.json").read_text()).get("sources", {})
  hf = source.get(modules[-1]) or source.get("language") or str(imports[0])
  return str(stages[1][0]), hf, stages[1][1]


def _files(args, cfg, kind: str, record: dict, sources, data: dict, tok):
  """What an export of `kind` writes beside its tensors: config.json's content, the other JSON
  files (name -> content), the files written as text (the chat templates) and what its last
  line says of the media token."""
  context = source_context(record, sources)
  files: dict[str, dict] = {}
  media, said = None, ""  # the processor's content parts (mimo_jax/hf/chat_parts)
  if kind == "llava":
    token, text = _image_token(args, cfg, record, data, tok)
    config = hf_vision.llava_config_json(cfg, token, context)
    files["processor_config.json"] = hf_vision.llava_processor_json(cfg.model.vision, text)
    media, said = {"image": text + "\n"}, f"; image token {token} ({text})"  # as records hold it
  elif kind == "qwen2_audio":
    token, text = _audio_token(args, cfg, tok)
    config = hf_audio.qwen2_audio_config_json(cfg, token, context)
    known = lambda t: t if tok.tokenizer.token_to_id(t) is not None else None
    bos, eos = known("<|audio_bos|>"), known("<|audio_eos|>")
    files["processor_config.json"] = hf_audio.qwen2_audio_processor_json(text, bos, eos)
    extractor = hf_audio.feature_extractor_json(cfg.model.audio)
    if extractor is None:
      fail(f"model.audio: windows of {cfg.model.audio.frames} frames are no whole number of "
            "seconds, which Qwen2-Audio's WhisperFeatureExtractor needs.")
    files["preprocessor_config.json"] = extractor
    # A clip as tools.convert's default markers, those the processor's config names.
    media = {"audio": (bos or "") + text + (eos or "") + "\n"}
    said = f"; audio token {token} ({text})"
  elif kind == "tower":
    config = hf_vision.vision_config_json(cfg.model.vision)
  elif kind == "audio":
    config = hf_audio.whisper_config_json(cfg.model.audio)
    extractor = hf_audio.feature_extractor_json(cfg.model.audio)
    if extractor is None:
      print(f"note: no preprocessor_config.json: a window of {cfg.model.audio.frames} frames is "
            "no whole number of seconds, which WhisperFeatureExtractor needs", flush=True)
    else:
      files["preprocessor_config.json"] = extractor
  else:
    config = hf_files.language_config_json(cfg.model.language, context)
  if kind in ("llava", "tower"):
    base, where = _image_processor(sources, data)
    files["preprocessor_config.json"] = hf_vision.preprocessor_json(
        cfg.model.vision, base, data.get("pad_to_square", False), where)
  texts: dict[str, str] = {}  # files written as they are
  if tok is not None:
    files["tokenizer_config.json"] = tok.config_json(
        {"llava": "LlavaProcessor", "qwen2_audio": "Qwen2AudioProcessor"}.get(kind))
    files["generation_config.json"] = hf_files.generation_json(tok)
    if media is not None:
      files["tokenizer_config.json"], texts = chat_parts.export_templates(
          tok.path, files["tokenizer_config.json"], media)
  return config, files, texts, said


def _export(args) -> None:
  if args.base and not args.peft:
    fail(f"--base={args.base} names a PEFT adapter's base model: give it with --peft, or leave "
         "it out.")
  if args.peft:
    _export_peft(args)
    return
  out = pathlib.Path(args.out)
  if (out / "config.json").is_file() and not args.overwrite:
    fail(f"--out={args.out} holds an export already (config.json); pass --overwrite to replace "
          "it, or choose another --out.")
  output.check_target(out, "HF export", "--out", complete="config.json", replace=args.overwrite,
                      replace_flag="--overwrite")
  cfg, params, step, record = _read_checkpoint(args.workdir, args.step)
  if not cfg.model.language.vocab_size:  # 0: the digits task's own vocabulary
    cfg.model.language.vocab_size = DIGITS_VOCAB
  record, sources = history(args.workdir, cfg, record)
  whole = args.model or _default_model(cfg, sources)
  kind = {"vision": "tower", "audio": "audio", "language": "language", None: whole}[args.module]
  if args.module is not None and args.model:
    fail(f"--model {args.model} is the whole model; --module {args.module} exports one module: "
          "give one of them.")
  wanted = {"llava": "vision", "qwen2_audio": "audio"}.get(kind, args.module)
  if wanted is not None and wanted not in cfg.model.encoders and wanted != "language":
    fail(f"{args.workdir}: the run has no {wanted} module (model.{wanted}); export one "
          f"of {', '.join([*cfg.model.encoders, 'language'])}.")
  data = _run_data(args.workdir, cfg)
  tok = _tokenizer(args, sources, data) if kind not in ("tower", "audio") else None
  if tok is not None and tok.vocab_size > cfg.model.language.vocab_size:
    fail(f"{tok.path / 'tokenizer.json'}: {tok.vocab_size} tokens, more than the model's "
          f"vocabulary of {cfg.model.language.vocab_size}; pass the run's --tokenizer DIR.")
  config, files, texts, said = _files(args, cfg, kind, record, sources, data, tok)
  modules = (args.module,) if args.module else (wanted, "language")
  tensors = dict(hf_files.export_tensors(modules, cfg, params))
  bad = [k for k, x in tensors.items() if not np.isfinite(x).all()]
  if bad:
    fail(f"{args.workdir} step {step}: {len(bad)} tensors hold NaN or Inf ({', '.join(bad[:3])}"
          f"{', ...' if len(bad) > 3 else ''}); export an earlier step with --step N.")
  total = sum(x.nbytes for x in tensors.values())
  output.check_space(out, total + sum(f.stat().st_size for f in (tok.files if tok else [])),
                     "the export")
  # A full disk or a file size limit midway (safetensors' SafetensorError, a copy's OSError): one
  # line, and the staging directory removed.
  with output.write_errors(f"--out={args.out!r}"), \
      output.staged(out, "HF export", "--out", complete="config.json",
                    replace=args.overwrite, replace_flag="--overwrite") as tmp:
    _write_safetensors(tmp, tensors)
    for f in tok.files if tok else []:
      if f.name not in files and f.name not in texts:
        shutil.copyfile(f, tmp / f.name)
    for name, content in files.items():
      (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
    for name, text_ in texts.items():
      (tmp / name).write_text(text_)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: complete
  extra = (f"; tokenizer from {tok.path}" if tok else "") + said
  print(f"wrote {out}: {config['architectures'][0]} from step {step}, {len(tensors)} tensors, "
        f"{total / 1e6:.1f} MB{extra}")


def _write_safetensors(out: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
  """One model.safetensors, or shards of at most SHARD_BYTES with model.safetensors.index.json."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  shards, current, size = [], {}, 0
  for name in sorted(tensors):
    x = tensors[name]
    if current and size + x.nbytes > SHARD_BYTES:
      shards.append(current)
      current, size = {}, 0
    current[name] = x
    size += x.nbytes
  shards.append(current)
  if len(shards) == 1:
    save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, str(out / file), metadata={"format": "pt"})
    weight_map.update({name: file for name in shard})
  (out / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
       "weight_map": weight_map}, indent=2) + "\n")
