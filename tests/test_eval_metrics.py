"""The registered metrics on hand-made cases, the VQA normalisation on the examples the VQA
evaluation publishes."""

import pytest

from mimo_jax import scoring


@pytest.mark.parametrize("raw,normalised", [
    # The four examples of the VQA evaluation page (visualqa.org/evaluation.html):
    ("dont", "don't"),  # a contraction missing its apostrophe gets it
    ("girl's", "girl's"),  # the apostrophe stays: no possessive turns plural
    ("2:50 pm", "2:50 pm"),  # the colon stays: times
    ("100,978", "100978"),  # a comma between digits goes without a space
    ("Two", "2"),  # number words as digits
    ("none", "0"),
    ("ten", "10"),
    ("the dog", "dog"),  # articles removed
    ("a man with an umbrella", "man with umbrella"),
    ("isnt it", "isn't it"),
    ("couldve", "could've"),
    ("couldnt've", "couldn't've"),  # the script's half-written spellings
    ("itd've", "it'd've"),
    ("y'allll", "y'all'll"),
    ("somebody'd", "somebodyd"),  # the script's table, as it is
    ("im", "im"),  # its I'm, I've are capitalised and never match a lower-cased word
    ("couldntve", "couldntve"),  # nor is every spelling listed
    ("don't", "don't"),  # the apostrophe is kept
    ("yes.", "yes"),  # periods go, except before a digit
    ("3.5", "3.5"),
    (".5", ".5"),
    ("yes" + "." * 33, "yes."),  # the script's count: 32 periods at most
    ("black-and-white", "black and white"),  # a mark inside a word separates it
    ("red, white", "red white"),  # a mark beside a space goes
    ("1,000 (approx)", "1000 approx"),  # with a comma between digits every mark goes
    ("10:30", "10:30"),
    ("  Yes\n", "yes"),
])
def test_vqa_normalisation(raw, normalised):
  assert scoring.vqa_normalise(raw) == normalised


@pytest.mark.parametrize("matches,expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0)])
def test_vqa_accuracy_over_ten_references(matches, expected):
  """min(#matches / 3, 1) over the 10 subsets of 9: 1 match 0.3, 2 0.6, 3 0.9, 4 or more 1."""
  refs = ["yes"] * matches + ["no"] * (10 - matches)
  assert scoring.score("vqa", "Yes.", refs) == pytest.approx(expected)


def test_vqa_accuracy_normalises_both_sides_and_one_reference_is_a_match():
  """Unlike the official script, which leaves both sides as they are when the ten references
  agree (it scores these 0), the answers are normalised whatever the references."""
  assert scoring.score("vqa", "Two", ["2"] * 10) == 1.0
  assert scoring.score("vqa", "Yes.", ["yes"] * 10) == 1.0
  assert scoring.score("vqa", "the dog", ["dog"]) == 1.0
  assert scoring.score("vqa", "dogs", ["dog"]) == 0.0


@pytest.mark.parametrize("prediction,references,expected", [
    ("The Cat.", ["cat"], 1.0),
    ("a  cat", ["dog", "Cat"], 1.0),
    ("cats", ["cat"], 0.0),
    ("", ["cat"], 0.0),
])
def test_exact_match(prediction, references, expected):
  assert scoring.score("exact_match", prediction, references) == expected


@pytest.mark.parametrize("prediction,references,expected", [
    ("I think it is a cat, sitting.", ["cat"], 1.0),
    ("a category", ["cat"], 0.0),  # whole words only
    ("New York City", ["new york"], 1.0),
    ("dog", ["cat", "dog"], 1.0),
    ("anything", [""], 0.0),  # an empty reference is in no answer
])
def test_contains(prediction, references, expected):
  assert scoring.score("contains", prediction, references) == expected


@pytest.mark.parametrize("text,letter", [
    ("B", "B"), ("(C)", "C"), ("A. a cat", "A"), ("D) a dog", "D"), ("B: red", "B"),
    ("The answer is C.", "C"), ("answer: (B)", "B"), ("I pick (D) here", "D"),
    ("C because it is red", "C"), ("no letter here", ""),
])
def test_choice_letter(text, letter):
  assert scoring.choice_letter(text) == letter


def test_multiple_choice():
  assert scoring.score("multiple_choice", "The answer is B.", ["B"]) == 1.0
  assert scoring.score("multiple_choice", "(A) a cat", ["B. a dog"]) == 0.0
  assert scoring.score("multiple_choice", "I cannot tell", ["A"]) == 0.0


def test_unknown_metric_and_no_references_are_errors():
  with pytest.raises(ValueError, match="no metric 'bleu'.*exact_match"):
    scoring.score("bleu", "a", ["a"])
  with pytest.raises(ValueError, match="without references"):
    scoring.score("exact_match", "a", [])


def test_a_registered_metric_is_used_by_name():
  @scoring.register("first_word")
  def first_word(prediction, references):
    return float(prediction.split()[:1] == references[0].split()[:1])
  try:
    assert scoring.score("first_word", "cat sits", ["cat"]) == 1.0
  finally:
    scoring.METRICS.pop("first_word")


@pytest.mark.parametrize("prediction,references,items,expected", [
    ("seven two", ["seven two"], 2, 1.0),
    ("seven one", ["seven two"], 2, 0.5),  # each item's word in its place
    ("two seven", ["seven two"], 2, 0.0),
    ("seven", ["seven two"], 2, 0.5),  # a word not said is not named
    ("seven two nine", ["seven two"], 2, 1.0),  # words past the items do not count
    ("eight", ["eight"], 0, None),  # a sample without items (`after seven`) is not scored
])
def test_digit_accuracy_scores_each_item(prediction, references, items, expected):
  assert scoring.score("digit_accuracy", prediction, references, items) == expected


def test_a_per_item_figure_is_over_items_and_a_sample_figure_over_samples():
  """The digits' accuracy: digits named right / digits, whatever samples hold them."""
  scores, items = [1.0, 0.5, None, 1 / 3], [1, 2, 0, 3]
  assert scoring.figure("digit_accuracy", scores, items) == (pytest.approx(3 / 6), 6)
  assert scoring.figure("exact_match", [1.0, 0.0, 0.0], [0, 1, 2]) == (pytest.approx(1 / 3), 3)
