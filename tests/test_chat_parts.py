"""An exported chat template that also takes a message's content as transformers' list of parts
(mimo_jax/hf/chat_parts.py), rendered in the sandbox that transformers sets up (data/chat.py);
tests/test_export.py checks an export's template on the fixture models."""

import pytest
from jinja2.exceptions import TemplateError

from mimo_jax.data import chat
from mimo_jax.hf import chat_parts

# A text template that reads a message's other fields too.
PLAIN = ("{% for m in messages %}[{{ m['role'] }}{% if m['name'] %}:{{ m['name'] }}{% endif %}] "
         "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
# One that reads parts itself (as LLaVA's Hub templates do).
OWN_PARTS = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
             "{% for p in m['content'] %}{{ p['type'] }}{% endfor %}{% endif %}{% endfor %}")
MEDIA = {"image": "<image>\n", "audio": "<audio>"}


def _render(template: str, messages: list[dict], add_generation_prompt: bool = True) -> str:
  return chat._environment().from_string(template).render(  # pylint: disable=protected-access
      messages=messages, add_generation_prompt=add_generation_prompt)


def test_parts_render_as_the_string_the_records_held_and_strings_as_before():
  as_text = [{"role": "system", "content": "Be brief."},
             {"role": "user", "name": "ann", "content": "<image>\nWhat?<audio> And this?"},
             {"role": "assistant", "content": None}]
  as_parts = [as_text[0],
              {"role": "user", "name": "ann", "content": [
                  {"type": "image", "url": "x.png"}, {"type": "text", "text": "What?"},
                  {"type": "audio"}, {"type": "text", "text": " And this?"}]},
              as_text[2]]
  wrapped = chat_parts.wrap(PLAIN, MEDIA)
  want = _render(PLAIN, as_text)
  assert "[user:ann] <image>\nWhat?<audio> And this?" in want
  assert _render(wrapped, as_text) == _render(wrapped, as_parts) == want
  assert _render(wrapped, [], False) == _render(PLAIN, [], False) == ""


def test_a_part_of_another_type_is_one_error_naming_it_and_the_types_read():
  wrapped = chat_parts.wrap(PLAIN, {"image": "<image>\n"})
  with pytest.raises(TemplateError, match=r"^a message content part of type video \(this model "
                                          r"reads parts of type text, image\)$"):
    _render(wrapped, [{"role": "user", "content": [{"type": "video"}]}])


def test_a_template_that_reads_parts_itself_is_kept_and_named_templates_are_each_wrapped():
  assert chat_parts.reads_parts(OWN_PARTS) and not chat_parts.reads_parts(PLAIN)
  assert chat_parts.wrap_any(OWN_PARTS, MEDIA) == OWN_PARTS
  named = [{"name": "default", "template": PLAIN}, {"name": "own", "template": OWN_PARTS}]
  assert chat_parts.wrap_any(named, MEDIA) == [
      {"name": "default", "template": chat_parts.wrap(PLAIN, MEDIA)},
      {"name": "own", "template": OWN_PARTS}]
