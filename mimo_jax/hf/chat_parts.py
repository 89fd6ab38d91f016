"""An exported chat template that also takes a message's content as transformers' list of parts.

A language model's chat template renders a message's content as a string: the training records
held `"<image>\\nWhat is in it?"`. A processor's `apply_chat_template` is usually given the
content as a list of parts instead (`[{"type": "image"}, {"type": "text", "text": "What is in
it?"}]`), which such a template prints as a Python list, leaving the processor no `<image>` to
expand. `wrap` puts a preamble before the template that writes each such content as the string
the records held, part by part in order: a media part (`{"type": "image"}`) as its text
(`"<image>\\n"`), a text part as its text; a part of another type is an error
(`raise_exception`). Content given as a string, or none, reaches the template as it was: the
same messages render as before. A template that reads parts itself (it tests whether content
`is string`, or reads a part's `type`) is left as it is (`reads_parts`).
"""

from __future__ import annotations

import json
import pathlib
import re

from mimo_jax.hf.source import HFError

# What a template that handles parts itself says: a test of the content's kind, or a part's type.
_READS_PARTS = re.compile(r"""is\s+string|is\s+not\s+string|\[\s*['"]type['"]\s*\]|\.type\b""")


def reads_parts(template: str) -> bool:
  """Whether `template` reads a message's content as parts itself."""
  return bool(_READS_PARTS.search(template))


def wrap(template: str, media: dict[str, str]) -> str:
  """`template` with the preamble that writes a list of parts as a string (module docstring);
  `media`: a media part's type -> its text (e.g. {"image": "<image>\\n"})."""
  cases = "".join(
      f"{{%- {'if' if i == 0 else 'elif'} part['type'] == {json.dumps(kind)} -%}}"
      f"{{%- set text.value = text.value + {json.dumps(said)} -%}}"
      for i, (kind, said) in enumerate(media.items()))
  known = ", ".join(["text", *media])
  preamble = (
      "{#- A message's content as a list of parts ([{\"type\": \"image\"}, {\"type\": \"text\", "
      "\"text\": ...}]) is written as the string the model was trained on, then rendered as "
      "below. -#}\n"
      "{%- set parts = namespace(messages=[]) -%}\n"
      "{%- for message in messages -%}\n"
      "{%- if message['content'] is string or message['content'] is none -%}\n"
      "{%- set parts.messages = parts.messages + [message] -%}\n"
      "{%- else -%}\n"
      "{%- set text = namespace(value='') -%}\n"
      "{%- for part in message['content'] -%}\n"
      f"{cases}"
      "{%- elif part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}"
      "{%- else -%}{{- raise_exception('a message content part of type ' + part['type'] "
      f"+ ' (this model reads parts of type {known})') -}}}}"
      "{%- endif -%}\n"
      "{%- endfor -%}\n"
      "{%- set parts.messages = parts.messages + [dict(message, content=text.value)] -%}\n"
      "{%- endif -%}\n"
      "{%- endfor -%}\n"
      "{%- set messages = parts.messages %}\n")
  return preamble + template


def wrap_any(source, media: dict[str, str]):
  """A chat template as tokenizer_config.json or chat_template.json holds it (a string, or a list
  of named templates `{"name": ..., "template": ...}`), each template wrapped unless it reads
  parts itself."""
  one = lambda t: t if not isinstance(t, str) or reads_parts(t) else wrap(t, media)
  if isinstance(source, list):
    return [dict(t, template=one(t.get("template"))) if isinstance(t, dict) else t
            for t in source]
  return one(source)


def export_templates(path: pathlib.Path, config: dict,
                     media: dict[str, str]) -> tuple[dict, dict[str, str]]:
  """The chat templates of the tokenizer directory `path` as an export writes them, each wrapped
  (`wrap_any`): tokenizer_config.json's `config` (its dict, as the export writes it) with its
  chat_template wrapped, and file name -> text for the directory's chat_template.jinja and
  chat_template.json (where it has them)."""
  config = dict(config)
  if config.get("chat_template"):
    config["chat_template"] = wrap_any(config["chat_template"], media)
  texts = {}
  jinja = path / "chat_template.jinja"
  if jinja.is_file():
    texts[jinja.name] = wrap_any(jinja.read_text(), media)
  named = path / "chat_template.json"
  if named.is_file():
    try:
      content = json.loads(named.read_text())
    except ValueError as e:
      raise HFError(f"{named}: not JSON ({e}).") from None
    if isinstance(content, dict) and content.get("chat_template"):
      content = dict(content, chat_template=wrap_any(content["chat_template"], media))
    texts[named.name] = json.dumps(content, indent=2) + "\n"
  return config, texts
