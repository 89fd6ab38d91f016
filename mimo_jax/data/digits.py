"""The digits-captioning task (README), written as LLaVA-format conversations and converted by the
same path as any conversation data (conversion.py).

A sample is 0..k images of scikit-learn's 8x8 handwritten digits plus text. With images the user
turn is the images (`<img> <img>`) and the assistant names the digits in order (`seven two`);
without, the user asks `after seven` and the assistant answers `eight`. Train and eval samples
draw from disjoint image sets, so eval accuracy measures recognition of digits never seen in
training.

`build` writes, once per parameter set, a directory under `data.dir`:

  source/conversations.jsonl   the samples as LLaVA-format records (train first, then eval)
  source/images/{train,eval}/NNNN.png   the digit images, 8x8 grayscale (0..16 scaled to 0..255)
  source/tokenizer/            a word-level tokenizer.json (built with `tokenizers`), its
                               tokenizer_config.json with a chat template, and the "tower's"
                               preprocessor_config.json (8x8, one channel)
  train.array_record, ...      what `conversion.convert` makes of them (manifest included)

The chat template renders a conversation as `<bos>{user} : {assistant} <eos>`, which gives the
token ids of the digits vocabulary (tokenizer.py) with `<img>` = 3 as the image token, and a loss
mask on the answer words and `<eos>`: a user's own tokenizer and data go through the same code.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

from mimo_jax import run_paths, workdir
from mimo_jax.data import conversations, conversion, conversion_record
from mimo_jax.data.tokenizer import DIGIT_WORDS, SPECIALS, Tokenizer

FORMAT_VERSION = 2
EVAL_IMAGES = 297  # held out from the 1,797 images, split once with a fixed seed
SPLIT_SEED = 20240815
IMAGE_TOKEN = "<img>"
# A user turn, then " : ", then the assistant's answer and <eos>; the generation prompt is " :".
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                 "{{ m['content'] }} :{% elif m['role'] == 'assistant' %} {{ m['content'] }} "
                 "{{ eos_token }}{% endif %}{% endfor %}")


def default_dir() -> str:
  return run_paths.cache_dir("digits")


def split_images() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The task's images (scikit-learn's 8x8 digits, values 0..16) and labels, split once with
  SPLIT_SEED: train images, train labels, eval images (EVAL_IMAGES), eval labels."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  images = digits.images.astype(np.uint8)  # values 0..16
  order = np.random.default_rng(SPLIT_SEED).permutation(len(images))
  ev, tr = order[:EVAL_IMAGES], order[EVAL_IMAGES:]
  return images[tr], digits.target[tr], images[ev], digits.target[ev]


def _draw(labels: np.ndarray, n: int, probs: list[float], seed: int):
  """n samples as (image indices, question, answer); sample i has k ~ probs images."""
  rng = np.random.default_rng(seed)
  for _ in range(n):
    k = int(rng.choice(len(probs), p=probs))
    if k == 0:
      d = int(rng.integers(10))
      if rng.random() < 0.5:
        yield [], f"after {DIGIT_WORDS[d]}", DIGIT_WORDS[(d + 1) % 10]
      else:
        yield [], f"before {DIGIT_WORDS[d]}", DIGIT_WORDS[(d - 1) % 10]
      continue
    idx = [int(j) for j in rng.integers(len(labels), size=k)]
    yield idx, " ".join([IMAGE_TOKEN] * k), " ".join(DIGIT_WORDS[int(labels[j])] for j in idx)


def make_samples(images: np.ndarray, labels: np.ndarray, n: int, probs: list[float],
                 seed: int) -> list[dict]:
  """Draws n samples as text (`<img> <img> : seven two`) with their images [k, 8, 8] (0..16),
  the form the layout also reads."""
  return [{"id": i, "images": np.asarray([images[j] for j in idx], np.uint8).reshape(-1, 8, 8),
           "text": f"{question} : {answer}"}
          for i, (idx, question, answer) in enumerate(_draw(labels, n, probs, seed))]


def pixels(image: np.ndarray) -> np.ndarray:
  """A digit's values 0..16 as 0..255 grayscale."""
  return np.round(image.astype(np.float32) * (255 / 16)).astype(np.uint8)


def write_tokenizer(directory: pathlib.Path) -> None:
  """The digits vocabulary (tokenizer.py) as an HF tokenizer directory, with the chat template
  and an 8x8 one-channel image processor."""
  # pylint: disable-next=import-outside-toplevel
  import tokenizers
  tok = Tokenizer()
  t = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(tok.vocab)}))
  t.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  t.add_special_tokens(list(SPECIALS))
  directory.mkdir(parents=True, exist_ok=True)
  t.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
       "chat_template": CHAT_TEMPLATE}, indent=1))
  (directory / "preprocessor_config.json").write_text(json.dumps(
      {"image_processor_type": "SiglipImageProcessor", "do_resize": True,
       "size": {"height": 8, "width": 8}, "resample": 4, "do_rescale": True,
       "rescale_factor": 1 / 255, "do_normalize": False, "do_convert_rgb": False}, indent=1))


def _write_source(root: pathlib.Path, train_samples: int, eval_samples: int,
                  probs: list[float]) -> None:
  """The LLaVA-format source of the task under root/source: train records first, then eval."""
  # pylint: disable-next=import-outside-toplevel
  from PIL import Image
  src = root / "source"
  write_tokenizer(src / "tokenizer")
  tr_x, tr_y, ev_x, ev_y = split_images()
  records = []
  for split, x, y, n, seed in (("train", tr_x, tr_y, train_samples, 1),
                               ("eval", ev_x, ev_y, eval_samples, 2)):
    folder = src / "images" / split
    folder.mkdir(parents=True)
    for j, image in enumerate(x):
      Image.fromarray(pixels(image), mode="L").save(folder / f"{j:04d}.png")
    for idx, question, answer in _draw(y, n, probs, seed):
      records.append({"id": f"{split}-{len(records)}",
                      "image": [f"{split}/{j:04d}.png" for j in idx],
                      "conversations": [{"from": "human", "value": question},
                                        {"from": "gpt", "value": answer}]})
  with open(src / "conversations.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records)


def directory(root: str, train_samples: int, eval_samples: int, probs: list[float]) -> pathlib.Path:
  """The directory of one parameter set: its name encodes every parameter, so a changed config
  never reads a stale build."""
  key = f"v{FORMAT_VERSION}-n{train_samples}-e{eval_samples}-p{'_'.join(f'{p:g}' for p in probs)}"
  return pathlib.Path(root or default_dir()) / f"digits-{key}"


def complete(path: pathlib.Path) -> bool:
  return (path / conversations.MANIFEST).exists() and all(
      (path / f"{s}.array_record").exists() for s in conversations.SPLITS)


def build(root: str, train_samples: int, eval_samples: int, probs: list[float]) -> str:
  """Builds (once) the task's converted directory under `root` and returns it.

  It is written under a temporary name and renamed when complete, so a crash never leaves a
  partial build; an incomplete one (a shard deleted because it was damaged) is built again."""
  final = directory(root, train_samples, eval_samples, probs)
  if complete(final):
    return str(final)

  def write(tmp: pathlib.Path) -> None:
    _write_source(tmp, train_samples, eval_samples, probs)
    src = tmp / "source"
    workers = min(os.cpu_count() or 1, 4) if train_samples > 4000 else 1
    opts = conversion_record.Options(tokenizer=str(src / "tokenizer"), images=str(src / "images"),
                                     image_token=IMAGE_TOKEN, on_error="fail", workers=workers)
    evals = range(train_samples, train_samples + eval_samples)  # the records after train's
    conversion.convert(src / "conversations.jsonl", tmp, opts, eval_ids=evals, progress=False)
  return built(final, "digits: building the task's records in {} (once; about 10 s on 2 cores)",
               write)


def built(final: pathlib.Path, saying: str, write) -> str:
  """`final` made by `write(tmp)` into a temporary directory beside it, renamed when complete
  (another process may have built it first); `saying` (with {} for `final`) is printed first. A
  failure or a signal midway leaves nothing: the temporary directory goes, and so do the folders
  above `final` that this made (`data.dir`), if empty."""
  made = workdir.Made(str(final.parent))  # the folders above `final` that do not exist yet
  final.parent.mkdir(parents=True, exist_ok=True)
  print(saying.format(final), flush=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
  mask = os.umask(0)
  os.umask(mask)
  os.chmod(tmp, 0o777 & ~mask)  # as a directory made by mkdir, not mkdtemp's owner-only
  try:
    write(tmp)
    if final.exists() and not complete(final):
      shutil.rmtree(final)
    try:
      os.rename(tmp, final)
    except OSError:  # another process built it first
      if not complete(final):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    if not complete(final):
      made.remove_unused(None)  # each if empty (another process's, or the user's since, stays)
  return str(final)
