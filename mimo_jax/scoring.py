"""How a generated answer is scored against its references: small functions registered by name
(`tools.eval --metric NAME`, the training eval's `eval.metric`).

A metric takes the prediction and the sample's references (one or more strings) and returns a
score in [0, 1]; a run's figure is the mean over samples. Registered:

  exact_match      the normalised prediction equals a normalised reference (lower case, no
                   punctuation, no articles a/an/the, spaces collapsed)
  vqa              VQA accuracy: the VQA answer normalisation (numbers as digits, articles,
                   punctuation, contractions) and min(#matching references / 3, 1) averaged over
                   every subset that leaves one reference out, as the official VQA evaluation
                   does with its ten answers (one reference: whether it matches)
  multiple_choice  the option letter of the prediction ("B", "(B)", "B. cat", "The answer is B")
                   equals the reference's
  contains         a normalised reference occurs in the normalised prediction as whole words
"""

from __future__ import annotations

import re
import string
from typing import Callable, Sequence

Metric = Callable[[str, Sequence[str]], float]
METRICS: dict[str, Metric] = {}


def register(name: str) -> Callable[[Metric], Metric]:
  """Makes a metric available by `name`."""
  def add(fn: Metric) -> Metric:
    METRICS[name] = fn
    return fn
  return add


def get(name: str) -> Metric:
  if name not in METRICS:
    raise ValueError(f"no metric {name!r}; registered: {', '.join(sorted(METRICS))}.")
  return METRICS[name]


def score(name: str, prediction: str, references: Sequence[str]) -> float:
  """Metric `name` of one prediction; references must not be empty."""
  if not references:
    raise ValueError("a sample without references cannot be scored.")
  return float(get(name)(prediction, list(references)))


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


# The VQA answer normalisation: punctuation, then numbers, articles and contractions word by word.

_VQA_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<",
              "@", "`", ",", "?", "!"]  # not the apostrophe nor the colon
_DIGIT_COMMA = re.compile(r"(\d)(,)(\d)")
_PERIOD = re.compile(r"\.(?!\d)")  # a period that is no decimal point
_NUMBERS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten".split())} | {"none": "0"}
# Contractions written without their apostrophe, given it back (punctuation removal takes it).
_CONTRACTED = """aint arent cant couldve couldnt couldntve didnt doesnt dont hadnt hadntve hasnt
havent hed hedve hes howd howll hows idve im ive isnt itd itdve itll maam mightnt mightntve mightve
mustnt mustve neednt notve oclock oughtnt shant shedve shes shouldve shouldnt shouldntve
somebodyd somebodydve somebodyll somebodys someoned someonedve someonell someones somethingd
somethingdve somethingll thats thered theredve therere theres theyd theydve theyll theyre theyve
twas wasnt wedve weve werent whatll whatre whats whatve whens whered wheres whereve whod whodve
wholl whos whove whyll whyre whys wont wouldve wouldnt wouldntve yall yallll yalldve youd youdve
youll youre youve""".split()


def _apostrophe(word: str) -> str:
  """A contraction's written form: the apostrophe before its last part (n't, 've, 'll, ...)."""
  special = {"maam": "ma'am", "oclock": "o'clock", "twas": "'twas", "yall": "y'all",
             "yallll": "y'all'll", "yalldve": "y'all'd've", "im": "i'm", "wont": "won't",
             "cant": "can't", "shant": "shan't", "aint": "ain't", "idve": "i'd've", "ive": "i've",
             "notve": "not've"}
  if word in special:
    return special[word]
  for tail, written in (("ntve", "n't've"), ("dve", "'d've")):
    if word.endswith(tail) and not word.endswith("ldve"):  # could've, not coul'd've
      return word[:-len(tail)] + written
  for tail, written in (("nt", "n't"), ("ve", "'ve"), ("ll", "'ll"), ("re", "'re"), ("s", "'s"),
                        ("d", "'d")):
    if word.endswith(tail):
      return word[:-len(tail)] + written
  return word


CONTRACTIONS = {w: _apostrophe(w) for w in _CONTRACTED}


def vqa_normalise(text: str) -> str:
  """An answer as the VQA evaluation compares it."""
  text = text.replace("\n", " ").replace("\t", " ").strip()
  out = text
  joined = _DIGIT_COMMA.search(text) is not None
  for p in _VQA_PUNCT:
    # Next to a space (or in a number with thousands commas) a mark goes; inside a word it splits.
    out = out.replace(p, "" if (p + " " in text or " " + p in text or joined) else " ")
  out = _PERIOD.sub("", out)
  words = [_NUMBERS.get(w, w) for w in out.lower().split()]
  return " ".join(CONTRACTIONS.get(w, w) for w in words if w not in ("a", "an", "the"))


@register("vqa")
def vqa(prediction: str, references: Sequence[str]) -> float:
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
