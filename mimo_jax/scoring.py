"""How a generated answer is scored against its references: small functions registered by name
(`tools.eval --metric NAME`, the training eval's `eval.metric`).

A metric takes the prediction and the sample's references (one or more strings) and returns a
score in [0, 1]; a run's figure is the mean over samples (a per-item metric's: over the samples'
items, each sample weighing its item count). Registered:

  exact_match      the normalised prediction equals a normalised reference (lower case, no
                   punctuation, no articles a/an/the, spaces collapsed)
  vqa              VQA accuracy: the official VQA evaluation's answer normalisation (numbers as
                   digits, articles, punctuation, contractions) and min(#matching references / 3,
                   1) averaged over every subset that leaves one reference out, as it scores its
                   ten answers (one reference: whether it matches); see `vqa` for where the
                   official script differs
  multiple_choice  the option letter of the prediction ("B", "(B)", "B. cat", "The answer is B")
                   equals the reference's
  contains         a normalised reference occurs in the normalised prediction as whole words
  digit_accuracy   per item: of the sample's items (images, clips), the fraction the prediction
                   names right, its k-th word against the reference's k-th; the digits tasks'
                   eval_accuracy, over their digits
"""

from __future__ import annotations

import re
import string
from typing import Callable, Sequence

Metric = Callable[..., float]
METRICS: dict[str, Metric] = {}
PER_ITEM: set[str] = set()  # metrics of a sample's items (images, clips), not of the sample


def register(name: str, per_item: bool = False) -> Callable[[Metric], Metric]:
  """Makes a metric available by `name`. A `per_item` metric is called with the sample's item
  count too, scores no sample without items, and a run's figure is its mean over items."""
  def add(fn: Metric) -> Metric:
    METRICS[name] = fn
    if per_item:
      PER_ITEM.add(name)
    return fn
  return add


def get(name: str) -> Metric:
  if name not in METRICS:
    raise ValueError(f"no metric {name!r}; registered: {', '.join(sorted(METRICS))}.")
  return METRICS[name]


def score(name: str, prediction: str, references: Sequence[str], items: int = 0) -> float | None:
  """Metric `name` of one prediction of a sample with `items` items (None: a per-item metric of a
  sample without any); references must not be empty."""
  if not references:
    raise ValueError("a sample without references cannot be scored.")
  fn = get(name)
  if name not in PER_ITEM:
    return float(fn(prediction, list(references)))
  return float(fn(prediction, list(references), items)) if items else None


def figure(name: str, scores: Sequence[float | None], items: Sequence[int]) -> tuple[float, int]:
  """(A run's figure of metric `name`, what it counts) from its samples' scores and item counts:
  the mean over the samples, or a per-item metric's over their items."""
  if name not in PER_ITEM:
    return (sum(scores) / len(scores) if scores else 0.0), len(scores)
  scored = [(s, n) for s, n in zip(scores, items) if s is not None]
  counted = sum(n for _, n in scored)
  return sum(s * n for s, n in scored) / max(counted, 1), counted


# Plain normalisation (exact match, contains).

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def normalise(text: str) -> str:
  """Lower case, punctuation as spaces, no articles, single spaces."""
  return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


@register("exact_match")
def exact_match(prediction: str, references: Sequence[str]) -> float:
  p = normalise(prediction)
  return float(any(p == normalise(r) for r in references))


@register("contains")
def contains(prediction: str, references: Sequence[str]) -> float:
  p = f" {normalise(prediction)} "
  return float(any(normalise(r) and f" {normalise(r)} " in p for r in references))


# The VQA answer normalisation, as the official evaluation script (vqaEval.py of the VQA
# repository) has it: punctuation, then numbers, articles and contractions word by word.

_VQA_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<",
              "@", "`", ",", "?", "!"]  # not the apostrophe ("girl's") nor the colon ("2:50 pm")
# The script's two patterns, ASCII digits as its Python 2 patterns match. The period's starts with
# a lookahead, not a lookbehind, that never fails: a period goes unless a digit follows it.
_COMMA_STRIP = re.compile(r"(\d)(\,)(\d)", re.ASCII)
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)", re.ASCII)
_PERIODS = 32  # the script passes re.UNICODE (32) where `sub` takes its count: 32 periods at most
_NUMBERS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten".split())} | {"none": "0"}
# The script's contraction table, by written form: each spelling after the colon becomes it. Its
# capitalised spellings (Id've, I'dve, Im, Ive) never meet a lower-cased word and its let's and
# she's are themselves, so they are left out; somebody'd -> somebodyd is the script's own.
_CONTRACTION_TABLE = """
ain't: aint; aren't: arent; can't: cant; could've: couldve; couldn't: couldnt;
couldn't've: couldn'tve couldnt've; didn't: didnt; doesn't: doesnt; don't: dont; hadn't: hadnt;
hadn't've: hadnt've hadn'tve; hasn't: hasnt; haven't: havent; he'd: hed; he'd've: hed've he'dve;
he's: hes; how'd: howd; how'll: howll; how's: hows; isn't: isnt; it'd: itd;
it'd've: itd've it'dve; it'll: itll; ma'am: maam; mightn't: mightnt;
mightn't've: mightnt've mightn'tve; might've: mightve; mustn't: mustnt; must've: mustve;
needn't: neednt; not've: notve; o'clock: oclock; oughtn't: oughtnt;
'ow's'at: ow's'at 'ows'at 'ow'sat; shan't: shant; she'd've: shed've she'dve; should've: shouldve;
shouldn't: shouldnt; shouldn't've: shouldnt've shouldn'tve; somebodyd: somebody'd;
somebody'd've: somebodyd've somebody'dve; somebody'll: somebodyll; somebody's: somebodys;
someone'd: someoned; someone'd've: someoned've someone'dve; someone'll: someonell;
someone's: someones; something'd: somethingd; something'd've: somethingd've something'dve;
something'll: somethingll; that's: thats; there'd: thered; there'd've: thered've there'dve;
there're: therere; there's: theres; they'd: theyd; they'd've: theyd've they'dve; they'll: theyll;
they're: theyre; they've: theyve; 'twas: twas; wasn't: wasnt; we'd've: wed've we'dve; we've: weve;
weren't: werent; what'll: whatll; what're: whatre; what's: whats; what've: whatve; when's: whens;
where'd: whered; where's: wheres; where've: whereve; who'd: whod; who'd've: whod've who'dve;
who'll: wholl; who's: whos; who've: whove; why'll: whyll; why're: whyre; why's: whys; won't: wont;
would've: wouldve; wouldn't: wouldnt; wouldn't've: wouldnt've wouldn'tve; y'all: yall;
y'all'll: yall'll y'allll; y'all'd've: yall'd've y'alld've y'all'dve; you'd: youd;
you'd've: youd've you'dve; you'll: youll; you're: youre; you've: youve"""
CONTRACTIONS = {spelling: written.strip() for entry in _CONTRACTION_TABLE.split(";")
                for written, spellings in [entry.split(":")] for spelling in spellings.split()}


def vqa_normalise(text: str) -> str:
  """An answer as the VQA evaluation compares it."""
  text = text.replace("\n", " ").replace("\t", " ").strip()
  out = text
  joined = _COMMA_STRIP.search(text) is not None
  for p in _VQA_PUNCT:
    # Next to a space (or in a number with thousands commas) a mark goes; inside a word it splits.
    out = out.replace(p, "" if (p + " " in text or " " + p in text or joined) else " ")
  out = _PERIOD_STRIP.sub("", out, count=_PERIODS)
  words = [_NUMBERS.get(w, w) for w in out.lower().split()]
  return " ".join(CONTRACTIONS.get(w, w) for w in words if w not in ("a", "an", "the"))


@register("vqa")
def vqa(prediction: str, references: Sequence[str]) -> float:
  """VQA accuracy, both answers normalised always. The official script normalises neither when
  all the references are the same string (VQA's stored answers are normalised already), so there
  "Two" or "Yes" against ten "2" or "yes" scores 0; here, as the evaluation page describes the
  processing, a raw answer scores 1. One reference (the script scores only several): a match."""
  p = vqa_normalise(prediction)
  refs = [vqa_normalise(r) for r in references]
  if len(refs) == 1:
    return float(p == refs[0])
  # Each reference left out once: min(matches among the others / 3, 1), averaged.
  hits = [r == p for r in refs]
  return sum(min((sum(hits) - h) / 3, 1.0) for h in hits) / len(refs)


# Multiple choice: the option letter.

_LETTER_PATTERNS = [
    re.compile(r"^\s*\(?([A-Z])\)?\s*$"),  # "B", "(B)"
    re.compile(r"^\s*\(?([A-Z])[).:]"),  # "B.", "(B) cat", "B: cat"
    re.compile(r"answer\s*(?:is|:)?\s*(?:option\s*)?\(?([A-Z])\b", re.IGNORECASE),
    re.compile(r"\(([A-Z])\)"),
    re.compile(r"^\s*([A-Z])\s"),  # "B cat"
]


def choice_letter(text: str) -> str:
  """The option letter a text names ("" if none)."""
  for pattern in _LETTER_PATTERNS:
    m = pattern.search(text)
    if m:
      return m.group(1).upper()
  return ""


@register("multiple_choice")
def multiple_choice(prediction: str, references: Sequence[str]) -> float:
  letter = choice_letter(prediction)
  return float(bool(letter) and any(letter == choice_letter(r) for r in references))


# The digits tasks: an answer names its sample's items in order.

@register("digit_accuracy", per_item=True)
def digit_accuracy(prediction: str, references: Sequence[str], items: int) -> float:
  """Of a sample's `items`, the fraction whose word in the prediction is the reference's (the
  first `items` words of each, in order; the best reference)."""
  said = prediction.split()[:items]
  return max(sum(a == b for a, b in zip(said, r.split()[:items])) for r in references) / items
