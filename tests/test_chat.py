"""A language model's tokenizer.json and chat template give transformers' token ids and assistant
masks (fixtures written by tools/chat_fixtures.py with transformers; none needed here)."""

import json
import pathlib

import numpy as np
import pytest

from mimo_jax.data.chat import ChatError, ChatTokenizer, UnknownToken, messages
from mimo_jax.data.layout import sample_tokens
from mimo_jax.data.tokenizer import Tokenizer
from tests.helpers import CHAT_IMAGE_TOKENS

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "chat"


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_ids_and_loss_masks_match_transformers(family):
  tok = ChatTokenizer.open(FIXTURES / family)
  image = tok.token_id("<image>")
  refs = json.loads((FIXTURES / family / "reference.json").read_text())
  assert {r["id"] for r in refs} == {"text-only", "one-image", "multi-turn-system",
                                     "three-images"}
  for ref in refs:
    ids, mask = tok.encode(messages(ref["conversations"]))
    np.testing.assert_array_equal(ids, ref["input_ids"], err_msg=ref["id"])
    np.testing.assert_array_equal(mask, ref["loss_mask"], err_msg=ref["id"])
    images = ref.get("image", [])
    images = [images] if isinstance(images, str) else images
    assert int((ids == image).sum()) == len(images), ref["id"]
    assert mask.sum() > 0 and not mask[ids == image].any()


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_image_expansion_matches_the_llava_processor(family):
  """The layout expands each image token of a converted sample to that image's tokens, where
  transformers' LlavaProcessor expands `<image>` in the text: the same ids (the loss mask never
  falls on an image's tokens)."""
  tok = ChatTokenizer.open(FIXTURES / family)
  image = tok.token_id("<image>")
  for ref in json.loads((FIXTURES / family / "reference.json").read_text()):
    ids, mask = tok.encode(messages(ref["conversations"]))
    count = int((ids == image).sum())
    sample = {"tokens": ids, "loss_mask": mask, "images": [None] * count}
    words, loss = sample_tokens(Tokenizer(), sample, {image: [CHAT_IMAGE_TOKENS] * count})
    np.testing.assert_array_equal(words, ref["processor_ids"], err_msg=ref["id"])
    assert not loss[np.asarray(words[1:]) == image].any()


def test_unknown_roles_and_bad_directories_are_one_error(tmp_path):
  with pytest.raises(ChatError, match=r"turn 1: unknown role 'bot'"):
    messages([{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}])
  # A turn's text under another key is no empty turn, nor is a turn without a speaker.
  with pytest.raises(ChatError, match=r'turn 1 has no "value" \(its text\); its keys: from, text'):
    messages([{"from": "human", "value": "hi"}, {"from": "gpt", "text": "hello"}])
  with pytest.raises(ChatError, match=r'turn 0 has no "from" \(its speaker: human, '):
    messages([{"value": "hi"}])
  with pytest.raises(ChatError, match=r'^turn 1: its "value" is null; give its text\.$'):
    messages([{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}])
  with pytest.raises(ChatError, match=r'^turn 0: its "from" is null; give its speaker \(human, '):
    messages([{"from": None, "value": "hi"}])
  with pytest.raises(ChatError, match=r"tokenizer\.json: missing"):
    ChatTokenizer.open(tmp_path)
  (tmp_path / "tokenizer.json").write_text((FIXTURES / "llama3" / "tokenizer.json").read_text())
  with pytest.raises(ChatError, match=r"no chat_template"):
    ChatTokenizer.open(tmp_path)
  tok = ChatTokenizer.open(FIXTURES / "qwen2")
  with pytest.raises(ChatError, match=r"'<video>' is not one token"):
    tok.token_id("<video>")


def test_a_word_outside_the_vocabulary_is_an_error_when_strict():
  """A WordLevel tokenizer with an unknown token encodes a word it lacks as [UNK]: strict, that is
  an UnknownToken naming the words (each once); [UNK] written out in the text is itself."""
  tok = ChatTokenizer.open(FIXTURES.parent / "hf_audio" / "qwen2_audio_chat")
  turns = [{"role": "user", "content": "hello [UNK]"},
           {"role": "assistant", "content": "zebra and zebra or giraffe"}]
  ids, _ = tok.encode(turns)  # not strict: as the tokenizer encodes it
  assert (ids == 0).sum() == 5  # [UNK], zebra twice, or, giraffe
  with pytest.raises(UnknownToken, match=r"the words 'zebra', 'or', 'giraffe' are not in the "
                     r"vocabulary of .*, which encodes them as its unknown token '\[UNK\]'"):
    tok.encode(turns, strict=True)
  turns[1]["content"] = "there"
  assert (tok.encode(turns, strict=True)[0] == 0).sum() == 1
  assert ChatTokenizer.open(FIXTURES / "qwen2").unknown is None  # byte-level: encodes any text


def test_a_word_the_tokenizer_cannot_encode_is_named_with_a_small_vocabulary(tmp_path):
  # The digits tokenizer has no unknown token: tokenizers' own error names no word.
  from mimo_jax.data import digits  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.chat import TokenizeError  # pylint: disable=import-outside-toplevel
  digits.write_tokenizer(tmp_path / "tok")
  tok = ChatTokenizer.open(tmp_path / "tok")
  with pytest.raises(TokenizeError) as e:
    tok.encode([{"role": "user", "content": "<img> <image> what seven"},
                {"role": "assistant", "content": "seven"}])
  assert e.value.words == ("<image>", "what"), e.value.words
  message = str(e.value)
  assert "cannot encode the words '<image>', 'what': they are not in its vocabulary" in message
  assert "(17 tokens: <pad> <bos> <eos> <img> :" in message and "\n" not in message, message
