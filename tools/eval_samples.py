"""tools.eval's samples (tools/eval.py says what it does): a prompt of token ids, the encoders'
items and the references, from a converted directory's split or a LLaVA-format JSON; laid out
in the eval's rows, and named in errors as the user knows them (a record's line in the file)."""

from __future__ import annotations

import itertools
import json
import pathlib
import re
import sys

import numpy as np

from mimo_jax.config import Config, ConfigError
from tools.display import count


def converted_samples(args, tok) -> list[dict]:
  """The samples of a converted directory's split (ids: the records' own, where the conversion
  kept them)."""
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax import eval_set
  from mimo_jax.data import conversations  # pylint: disable=import-outside-toplevel
  m = conversations.manifest(args.data, "--data")
  path = pathlib.Path(args.data) / f"{args.split}.array_record"
  if not path.is_file():
    raise ConfigError(f"--split {args.split}: {path} not found; a converted directory holds "
                      f"{' and '.join(conversations.SPLITS)}.")
  if m.get("vocab_size") not in (None, tok.tokenizer.get_vocab_size()):
    # The tokenizer is the model's (check_vocab held it to the run's): the data is another's.
    raise ConfigError(f"--data {args.data} was tokenized with {m['vocab_size']} tokens, but this "
                      f"model's tokenizer {tok.path} has {tok.tokenizer.get_vocab_size()}: the "
                      "data was converted for another model; evaluate it with that model's run, "
                      f"or convert it again with `python -m tools.convert ... --tokenizer "
                      f"{tok.path}`.")
  samples = eval_set.converted(str(path), tok, args.samples)
  if any(s["id"] is None for s in samples):
    print(f"note: {args.data} was converted before the records' ids were kept: its rows' id is "
          "null and their position in the split names them; convert it again for the ids.",
          file=sys.stderr)
  return samples


def audio_settings(args, cfg: Config, tok, found: dict):
  """The JSON's clips' settings (audio_records.Settings) and the placeholder's id, checked
  against the model's; (None, None) for a model without an audio encoder."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import audio_records
  from tools.prompts import window_seconds
  a = getattr(cfg.model, "audio", None)
  if a is None:
    return None, None
  token = args.audio_token or found["audio_token"]
  markers = args.audio_markers or (audio_records.QWEN2_AUDIO if token ==
                                   audio_records.QWEN2_AUDIO_TOKEN else token)
  if token not in markers:
    raise ConfigError(f"--audio_markers {markers!r} does not hold the audio token {token!r}.")
  folder = args.audio or str(pathlib.Path(args.data).parent)
  # The tower's window (tools.convert --audio_window, as tools.generate reads a clip), not 30 s.
  settings = audio_records.Settings(folder=folder, token=token, markers=markers,
                                    mel_bins=a.mel_bins, pool=a.pool, allow_outside=True,
                                    window_s=window_seconds(a, f"--data {args.data}"))
  if tok.tokenizer.token_to_id(token) is None:
    return settings, None
  if tok.token_id(token) != a.audio_token:
    raise ConfigError(f"the tokenizer {tok.path}'s {token} is id {tok.token_id(token)} where the "
                      f"model's audio placeholder (model.audio.audio_token) is {a.audio_token}; "
                      "give the model's tokenizer (--tokenizer) or its token (--audio_token).")
  return settings, a.audio_token


def json_samples(args, cfg: Config, tok, proc, image_token: str, audio=(None, None),
                 progress=None) -> list[dict]:
  """The samples of a LLaVA-format JSON: each record's conversation up to its last assistant
  turn, its images prepared by the processor `proc()` (opened at the first image), its clips
  as `audio` (`audio_settings`) has them read. `progress(total)`: an object whose `update(n)`
  is told of each record read. A record's error names it by its number, id and line in the file
  (`named`)."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import conversion
  from mimo_jax.data.record_error import RecordError, record_id
  try:
    records = conversion.records_of(pathlib.Path(args.data))
  except ConfigError as e:
    raise ConfigError(str(e).replace("--json", "--data")) from None
  reader = _JsonReader(args, cfg, tok, proc, image_token, audio)
  out, seen = [], set()
  records = records[:args.samples or None]
  lines = progress(len(records)) if progress else None
  for i, r in enumerate(records):
    if lines and i:
      lines.update(1)
    key = None  # until its id is read
    try:  # its errors name its line in the file too, found only when one is raised
      try:
        key = record_id(r, f"--data {args.data}: record {i}")
      except RecordError as e:  # rows are kept by id, in JSON
        raise ConfigError(str(e)) from None
      key = i if key is None else key
      where = f"--data {args.data}: record {i} (id {key!r})"
      if json.dumps(key) in seen:
        raise ConfigError(f"{where}: its id is another record's too; rows are kept by id, so give "
                          "each record its own.")
      seen.add(json.dumps(key))
      out.append({"id": key, "record": i, **reader.sample(r, where)})
    except ConfigError as e:
      raise ConfigError(_lined(args, i, key, str(e))) from None
  return out


class _JsonReader:
  """One JSON record at a time into an eval sample (`json_samples`); every error a ConfigError
  that begins with `where`, the record's name."""

  def __init__(self, args, cfg: Config, tok, proc, image_token: str, audio):
    self.args, self.cfg, self.tok, self.proc, self.image_token = args, cfg, tok, proc, image_token
    self.settings, self.audio_id = audio
    self.folder = pathlib.Path(args.images or pathlib.Path(args.data).parent)
    self.image_id = (tok.token_id(image_token) if tok.tokenizer.token_to_id(image_token)
                     is not None else None)
    self.opened = []  # the processor, once an image needs it

  def sample(self, r: dict, where: str) -> dict:
    """The record's eval sample, prompt ids and references."""
    # pylint: disable=import-outside-toplevel
    from mimo_jax import eval_set
    from mimo_jax.data import audio_records, conversations
    from mimo_jax.data.record_error import RecordError
    before, turn, references = self._turns(r, where)
    pixels = self._images(r, where)
    before, clips = self._clips(r, before, where)
    prompt, answer = self._tokens(before, turn, where)
    if prompt.count(self.image_id) != len(pixels):
      raise ConfigError(f"{where}: its prompt has {prompt.count(self.image_id)} "
                        f"{self.image_token} for {count(len(pixels), 'image')}.")
    if clips:
      try:
        audio_records.check_tokens(np.asarray(prompt), self.audio_id, clips, where,
                                   self.settings)
      except RecordError as e:
        raise ConfigError(str(e)) from None
    items = {conversations.IMAGES: pixels, **audio_records.fields(clips)}
    return {"sample": eval_set.eval_sample(prompt, answer, items), "prompt_ids": prompt,
            "references": references}

  @staticmethod
  def _turns(r: dict, where: str) -> tuple[list[dict], str, list[str]]:
    """The turns before its answer, the answer's turn (the first reference where it has none)
    and the references (its "answers", else that turn's text)."""
    from mimo_jax.data.chat import ChatError, messages  # pylint: disable=import-outside-toplevel
    try:
      msgs = messages(r.get("conversations") or [], f"{where}: ")
    except ChatError as e:
      raise ConfigError(str(e)) from None
    last = max((k for k, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    answers = r.get("answers")
    if "answers" in r and (not isinstance(answers, list)
                           or not all(isinstance(a, str) for a in answers)):
      raise ConfigError(f"{where}: \"answers\" is {json.dumps(answers)[:60]}, not a list of "
                        "strings; give its reference answers as one (or leave the key out: the "
                        "assistant turn is then the reference).")
    if "answers" in r and (not answers or not all(a.strip() for a in answers)):
      raise ConfigError(f"{where}: \"answers\" is {json.dumps(answers)[:60]}: "
                        f"{'no answer' if not answers else 'an empty answer'}; give each "
                        "reference a text (or leave the key out: the assistant turn is then the "
                        "reference).")
    if last is None and not answers:
      raise ConfigError(f"{where}: no assistant turn and no \"answers\": nothing to compare an "
                        "answer with; give each record a reference.")
    before = msgs[:last] if last is not None else msgs
    if not before:
      raise ConfigError(f"{where}: nothing before its answer to prompt with.")
    references = answers or [msgs[last]["content"].strip()]
    return before, msgs[last]["content"] if last is not None else references[0], references

  def _images(self, r: dict, where: str) -> list[np.ndarray]:
    """The record's images, prepared by the processor (opened at the first one)."""
    # pylint: disable=import-outside-toplevel
    from mimo_jax.data import images
    from tools.prompts import bands_refused, check_shape
    files = r.get("image") or []
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
      raise ConfigError(f"{where}: \"image\" is {json.dumps(r.get('image'))[:60]}, not a path or "
                        "a list of paths.")
    pixels, args, folder = [], self.args, self.folder
    for f in files:
      if not self.opened:
        self.opened.append(self.proc())
      try:
        pixels.append(images.load(folder / f, self.opened[0]))
      except FileNotFoundError:
        fix = (f"it is not in --images {args.images}: give the folder that holds it"
               if args.images else
               "give the image folder with --images DIR (the default is the JSON's folder)")
        raise ConfigError(f"{where}: image {folder / f} not found; {fix}.") from None
      except images.TOO_LARGE as e:  # as tools.convert and tools.generate say it
        raise ConfigError(f"{where}: image {folder / f} is {images.too_large(e)}.") from None
      except Exception as e:  # pylint: disable=broad-except
        bands = bands_refused(folder / f, self.opened[0], self.cfg)
        raise ConfigError(f"{where}: image {folder / f} "
                          f"{f'is {bands}' if bands else f'cannot be read ({e})'}.") from None
      if "vision" in self.cfg.model.encoders:  # here, not when a batch is laid out: nothing written
        check_shape(f"{where}: image {folder / f}", pixels[-1].shape, self.cfg)
    return pixels

  def _clips(self, r: dict, before: list[dict], where: str) -> tuple[list[dict], list]:
    """The turns with each <audio> mark as the model's markers, and the record's clips read."""
    # pylint: disable=import-outside-toplevel
    from mimo_jax.data import audio_records
    from mimo_jax.data.record_error import RecordError
    try:
      if audio_records.listed([r]) and self.settings is None:
        raise RecordError("audio", f"{where}: it lists audio clips but the model has no audio "
                          "encoder (model.audio).")
      if self.settings is None:
        return before, []
      return audio_records.convert(r, before, where, self.settings)
    except RecordError as e:
      fix = "; give the audio folder with --audio DIR." if "missing" in e.reason else ""
      raise ConfigError(f"{str(e).rstrip('.') if fix else e}{fix}") from None

  def _tokens(self, before: list[dict], turn: str, where: str):
    """The prompt's ids and the answer's, split where the answer's turn begins."""
    # pylint: disable=import-outside-toplevel
    from mimo_jax import eval_set
    from mimo_jax.data.chat import ChatError, TokenizeError
    from tools.prompts import with_marks
    try:
      # strict: a word the tokenizer has no token for would reach the model as its unknown token
      # (tools.convert skips such records, tools.generate refuses such prompts)
      ids, mask = self.tok.encode(before + [{"role": "assistant", "content": turn or "."}],
                                  strict=True)
    except TokenizeError as e:
      text = " ".join(m["content"] for m in before + [{"content": turn or ""}])
      raise ConfigError(f"{where}: {with_marks(e, text, self.tok, self.image_token)}") from None
    except ChatError as e:
      raise ConfigError(f"{where}: {e}") from None
    return eval_set.split_answer(ids, mask, where)


def record_line(path, index: int) -> int | None:
  """The line (1-based) on which record `index` (0-based, as the records are read) of the JSON
  or JSONL file `path` begins; None where it cannot be told."""
  try:
    text = pathlib.Path(path).read_bytes().decode("utf-8-sig")
  except (OSError, ValueError):
    return None
  if not text.lstrip().startswith("["):  # JSONL: a record a line, blank lines skipped
    lines = (k for k, line in enumerate(text.splitlines(), 1) if line.strip())
    return next(itertools.islice(lines, index, None), None)
  decoder, at, start = json.JSONDecoder(), text.index("[") + 1, 0
  for _ in range(index + 1):
    while at < len(text) and (text[at].isspace() or text[at] == ","):
      at += 1
    try:
      start, (_, at) = at, decoder.raw_decode(text, at)
    except ValueError:
      return None
  return text.count("\n", 0, start) + 1


def _lined(args, index: int, key, message: str) -> str:
  """`message`, an error of record `index` of the JSON said of it by number and id (`key`; None
  where its id could not be read: by number alone), naming the line the record begins on too
  (`named`); as it is where that line cannot be told, or it is said of no record."""
  head = f"--data {args.data}: record {index}"
  if key is not None and message.startswith(f"{head} (id {key!r})"):
    return named(args, {"record": index, "id": key}) + message[len(f"{head} (id {key!r})"):]
  line = record_line(args.data, index) if key is None and message.startswith(head) else None
  return f"{head} (line {line}){message[len(head):]}" if line else message


# How the samples fit the eval's rows, and how an error names one.

def named(args, s: dict) -> str:
  """Sample `s` as the user knows it: a JSON's record by its number, id and line in the file; a
  converted split's sample by its position there and id."""
  if "record" in s:
    line = record_line(args.data, s["record"])
    return (f"--data {args.data}: record {s['record']} (id {s['id']!r}"
            f"{f', line {line}' if line else ''})")
  from mimo_jax import eval_set  # pylint: disable=import-outside-toplevel
  return f"--data {args.data} (--split {args.split}): {eval_set.named(s)}"


def _too_long(args, layout, s: dict) -> str | None:
  """Where sample `s`'s prompt, its items expanded, needs more positions than the eval's rows
  hold: the error naming its record (`named`), what takes them and the fix; else None."""
  tokens = [(e.noun, [e.item_tokens(size, 0) for size in e.sizes(s["sample"])])
            for e in layout.encoders]
  items = sum(sum(t) for _, t in tokens)
  n = len(s["sample"]["tokens"]) - 1 + items - sum(len(t) for _, t in tokens)
  if n <= layout.seq_len:
    return None
  held = "".join(f", {sum(t)} for its {noun if len(t) == 1 else count(len(t), noun)}"
                 for noun, t in tokens if t)
  return (f"{named(args, s)} needs {n} positions ({n - items} for its text{held}), more than "
          f"the eval's rows hold ({layout.seq_len}, --seq_len); give --seq_len {n} or more, or "
          "shorten the record.")


def check_lengths(args, layout, samples: list[dict]) -> None:
  """The first sample too long for the eval's rows (`_too_long`), before anything is written."""
  for s in samples:
    try:
      message = _too_long(args, layout, s)
    except ValueError as e:  # an item the encoder cannot take, said of "sample 0"
      raise ConfigError(f"{named(args, s)}{str(e).removeprefix('sample 0')}") from None
    if message:
      raise ConfigError(message)


def batch(chunk: list[dict], args, layout, bsz: int):
  """The samples `chunk` laid out as one batch; a sample the layout refuses is named as the user
  knows it (`named`, not by its place in the batch), a row too short for it said of --seq_len,
  which sets the eval's rows (data.seq_len is the run's)."""
  from mimo_jax import eval_set  # pylint: disable=import-outside-toplevel
  where = f"--data {args.data}"
  try:
    return eval_set.batches(chunk, layout, bsz, where)[0]
  except ConfigError as e:
    found = re.match(r"sample (\d+)(: | )(.*)", str(e).removeprefix(f"{where}: "), re.S)
    if not found or int(found[1]) >= len(chunk):
      raise
    s = chunk[int(found[1])]
    message = _too_long(args, layout, s) if "data.seq_len" in found[3] else None
    raise ConfigError(message or f"{named(args, s)}{found[2]}{found[3]}") from None


def fit_windows(cfg: Config, samples: list[dict], say) -> None:
  """A clip longer than the run's `model.audio.max_windows` (a data setting, not the tower's)
  gets the windows it spans in this eval's slots, as tools.generate encodes it whole: said by
  `say`. Packed slots (`slot_frames`) keep their size: a longer clip is an error naming it."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.audio_records import FRAMES
  from mimo_jax.encoders.audio import clip_windows
  a = cfg.model.encoders.get("audio")
  if a is None or a.slot_frames:
    return
  need = max((len(clip_windows(int(f), a.frames)) for s in samples
              for f in s["sample"].get(FRAMES, ())), default=0)
  if need > a.max_windows:
    say(f"the longest clip spans {need} windows of {a.frames} frames: this eval's slots hold "
        f"{need} (the run's model.audio.max_windows is {a.max_windows})")
    a.max_windows = need
