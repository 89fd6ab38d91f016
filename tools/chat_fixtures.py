"""Tiny tokenizer directories with Llama-3's and Qwen2's chat templates, and transformers' token
ids and assistant masks for conversations in them, for the chat tests.

  python -m tools.chat_fixtures [--out tests/fixtures/chat]

Needs transformers (`pip install -e '.[hf]'`); the tests that read the fixtures do not. Each
tokenizer is a byte-level BPE trained on a few sentences with the model family's special tokens
and `<image>`; `tokenizer_config.json` holds the family's chat template as its instruct models
ship it. `reference.json` lists LLaVA-format conversations (multi-turn, a system prompt, 0, 1 and
3 images) with `apply_chat_template`'s ids and, from the same template with `{% generation %}`
around each assistant turn's content and end-of-turn token, `return_assistant_tokens_mask`'s mask,
and `LlavaProcessor`'s ids for the rendered conversation and its images (each `<image>` expanded to
IMAGE_TOKENS image tokens).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

from tests.helpers import CHAT_IMAGE_TOKENS as IMAGE_TOKENS  # what tests/test_chat.py expects

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The chat templates of Meta-Llama-3-8B-Instruct and Qwen2-7B-Instruct (tokenizer_config.json).
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same with the assistant's content and end-of-turn token marked for transformers' mask.
LLAMA3_MARKED = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
                 "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
                 "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
                 "{% if message['role'] == 'assistant' %}{% generation %}"
                 "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
                 "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}"
                 "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_MARKED = ("{% for message in messages %}"
                "{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
                "{{ '<|im_start|>' + message['role'] + '\n' }}"
                "{% if message['role'] == 'assistant' %}{% generation %}"
                "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
                "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")

FAMILIES = {
    "llama3": dict(template=LLAMA3, marked=LLAMA3_MARKED, bos="<|begin_of_text|>",
                   eos="<|eot_id|>", specials=["<|begin_of_text|>", "<|end_of_text|>",
                                               "<|start_header_id|>", "<|end_header_id|>",
                                               "<|eot_id|>", "<image>"]),
    "qwen2": dict(template=QWEN2, marked=QWEN2_MARKED, bos=None, eos="<|im_end|>",
                  specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]),
}

CORPUS = [
    "What is shown in this picture? A red bus parked next to a small tree.",
    "Describe the image in detail. Two dogs are playing in the snow near a fence.",
    "How many people are there? There are three people, one holding an umbrella.",
    "You are a careful assistant that answers briefly.",
    "Compare the images. The first is a cat, the second a bird and the third a boat.",
    "Thanks! Anything else? No, that is all I can see.",
]

CONVERSATIONS = [
    {"id": "text-only", "conversations": [
        {"from": "human", "value": "Hello, who are you?"},
        {"from": "gpt", "value": "A careful assistant."}]},
    {"id": "one-image", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is shown in this picture?"},
        {"from": "gpt", "value": "A red bus parked next to a small tree."}]},
    {"id": "multi-turn-system", "image": "b.png", "conversations": [
        {"from": "system", "value": "You are a careful assistant that answers briefly."},
        {"from": "human", "value": "Describe the image.\n<image>"},
        {"from": "gpt", "value": "Two dogs are playing in the snow."},
        {"from": "human", "value": "How many people are there?"},
        {"from": "gpt", "value": "  None, only dogs.  "}]},
    {"id": "three-images", "image": ["a.png", "b.png", "c.png"], "conversations": [
        {"from": "human", "value": "<image> <image> <image>\nCompare the images."},
        {"from": "gpt", "value": "The first is a cat, the second a bird and the third a boat."},
        {"from": "human", "value": "Thanks! Anything else?"},
        {"from": "gpt", "value": "No, that is all I can see."}]},
]


def _tokenizer(specials: list[str]):
  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  return tok


def _processor_ids(out: pathlib.Path, hf, msgs: list[dict], record: dict) -> list[int]:
  """LlavaProcessor's ids for the rendered conversation and its images: each `<image>` expanded
  to IMAGE_TOKENS image tokens."""
  # pylint: disable=import-outside-toplevel
  import numpy as np
  from PIL import Image
  from transformers import LlavaProcessor, SiglipImageProcessorPil
  processor = LlavaProcessor(image_processor=SiglipImageProcessorPil(size={"height": 8,
                                                                           "width": 8}),
                             tokenizer=hf, patch_size=4, vision_feature_select_strategy="full",
                             num_additional_image_tokens=0, image_token="<image>")
  files = record.get("image", [])
  files = [files] if isinstance(files, str) else files
  images = [Image.fromarray(np.full((11, 9, 3), 40 * i, np.uint8)) for i in range(len(files))]
  text = hf.apply_chat_template(msgs, tokenize=False)
  got = processor(text=text, images=images or None, add_special_tokens=False)
  del out
  return [int(i) for i in np.asarray(got["input_ids"]).reshape(-1)]


def build(root: pathlib.Path) -> None:
  # pylint: disable-next=import-outside-toplevel
  from transformers import AutoTokenizer
  from mimo_jax.data.chat import messages  # pylint: disable=import-outside-toplevel
  for name, fam in FAMILIES.items():
    out = root / name
    if out.exists():
      shutil.rmtree(out)
    out.mkdir(parents=True)
    _tokenizer(fam["specials"]).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": fam["template"],
              "eos_token": fam["eos"], "bos_token": fam["bos"], "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf = AutoTokenizer.from_pretrained(str(out))
    refs = []
    for record in CONVERSATIONS:
      msgs = messages(record["conversations"])
      ids = hf.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
      marked = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                      chat_template=fam["marked"],
                                      return_assistant_tokens_mask=True)
      if list(marked["input_ids"]) != list(ids):
        raise SystemExit(f"{name}: the marked template renders {record['id']} differently.")
      refs.append(dict(record, input_ids=list(ids), loss_mask=list(marked["assistant_masks"]),
                       processor_ids=_processor_ids(out, hf, msgs, record)))
      print(f"{name} {record['id']}: {len(ids)} tokens, {sum(marked['assistant_masks'])} with loss")
    (out / "reference.json").write_text(json.dumps(refs, indent=1) + "\n")


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.chat_fixtures",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "chat"))
  args = parser.parse_args()
  build(pathlib.Path(args.out))


if __name__ == "__main__":
  main()
