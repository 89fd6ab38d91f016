"""A language model's own tokenizer and chat template, without transformers.

`ChatTokenizer.open(DIR)` reads an HF tokenizer directory: `tokenizer.json` (the `tokenizers`
library) and the chat template from `tokenizer_config.json` (or `chat_template.jinja`), rendered
with jinja2 in a sandbox set up as transformers' `apply_chat_template` sets it up (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML), with the special tokens of tokenizer_config.json as variables.

`encode(messages)` gives a conversation's token ids (the rendered text tokenized without adding
special tokens: the template writes them; with `strict`, a word the vocabulary lacks, which the
tokenizer would encode as its unknown token, is an error) and a 0/1 loss mask: 1 on the tokens
of every assistant turn, its end-of-turn token included, as LLaVA trains. A turn's tokens are
found by rendering the conversation up to it with `add_generation_prompt=True` and up to its
end: what the second adds to the first is the turn (trailing whitespace, such as the newline
after ChatML's `<|im_end|>`, is not). A template for which the first is no prefix of the second
is an error (`AssistantFirst` where the turn opens the conversation). LLaVA-format records
(`{"from": "human" | "gpt" | "system", "value": ...}`) map to roles with `messages()`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import re

import numpy as np

from mimo_jax.words import json_kind

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system"}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatError(ValueError):
  """A tokenizer directory or a conversation that cannot be encoded; the message names it."""


class TokenizeError(ChatError):
  """A rendered conversation the tokenizer cannot encode (a word outside a vocabulary that has no
  unknown token); `words`: those it cannot encode, where they were found."""

  def __init__(self, message: str, words: tuple[str, ...] = ()):
    super().__init__(message)
    self.words = words


class UnknownToken(TokenizeError):
  """A rendered conversation with words outside the vocabulary, which the tokenizer encodes as its
  unknown token (`encode(..., strict=True)`): the model would learn to read and say [UNK]."""


class AssistantFirst(ChatError):
  """A conversation that opens with an assistant turn, which the chat template renders only after
  another turn."""


def messages(conversation: list[dict], where: str = "") -> list[dict]:
  """LLaVA-format turns -> chat messages ({"role", "content"}); an unknown or missing role, a
  turn that is not an object, a missing value or one that is not text is an error, as are turns
  that are not a list (a string's characters would be taken for its turns)."""
  if not isinstance(conversation, list):
    raise ChatError(f"{where}\"conversations\" is {json_kind(conversation)}, not a list of turns.")
  out = []
  for i, turn in enumerate(conversation):
    if not isinstance(turn, dict):
      raise ChatError(f"{where}turn {i} is {json_kind(turn)}, not an object with \"from\" "
                      "and \"value\".")
    who = turn.get("from", turn.get("role"))
    if who is None and ("from" in turn or "role" in turn):
      raise ChatError(f"{where}turn {i}: its \"{'from' if 'from' in turn else 'role'}\" is null; "
                      f"give its speaker ({', '.join(ROLES)}).")
    if who is None:
      raise ChatError(f"{where}turn {i} has no \"from\" (its speaker: {', '.join(ROLES)}); its "
                      f"keys: {', '.join(map(str, turn)) or 'none'}.")
    if not isinstance(who, str) or who not in ROLES:
      raise ChatError(f"{where}turn {i}: unknown role {who!r}; known: {', '.join(ROLES)}.")
    text = turn.get("value", turn.get("content"))
    if text is None and ("value" in turn or "content" in turn):
      raise ChatError(f"{where}turn {i}: its \"{'value' if 'value' in turn else 'content'}\" is "
                      "null; give its text.")
    if text is None:
      raise ChatError(f"{where}turn {i} has no \"value\" (its text); its keys: "
                      f"{', '.join(map(str, turn))}.")
    if not isinstance(text, str):
      raise ChatError(f"{where}turn {i}: its value is {json_kind(text)}, not text.")
    out.append({"role": ROLES[who], "content": text})
  return out


def _unknown_token(tokenizer) -> tuple[int, str] | None:
  """The id and text of `tokenizer`'s unknown token (a WordLevel, WordPiece or BPE model's
  unk_token, a Unigram model's unk_id); None where it has none (a byte-level BPE encodes every
  text)."""
  text = getattr(tokenizer.model, "unk_token", None)
  if text is None and type(tokenizer.model).__name__ == "Unigram":
    try:
      model = json.loads(tokenizer.to_str())["model"]
      text = model["vocab"][model["unk_id"]][0]
    except (KeyError, IndexError, TypeError, ValueError):
      return None
  i = tokenizer.token_to_id(text) if text else None
  return None if i is None else (i, text)


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # an AddedToken as transformers writes it
    return value.get("content")
  return value


def _environment():
  # pylint: disable=import-outside-toplevel
  import jinja2
  from jinja2 import ext, sandbox

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


@dataclasses.dataclass
class ChatTokenizer:
  path: pathlib.Path
  tokenizer: object  # tokenizers.Tokenizer
  template: object  # jinja2.Template
  specials: dict[str, str]
  unknown: tuple[int, str] | None = None  # the unknown token's id and text, where it has one

  @classmethod
  def open(cls, path) -> "ChatTokenizer":
    # pylint: disable-next=import-outside-toplevel
    import tokenizers
    path = pathlib.Path(path)
    tok_file, cfg_file = path / "tokenizer.json", path / "tokenizer_config.json"
    if not tok_file.exists():
      raise ChatError(f"{tok_file}: missing; a tokenizer directory holds tokenizer.json (the "
                      "`tokenizers` format that transformers' fast tokenizers save).")
    try:
      tokenizer = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:  # pylint: disable=broad-except
      raise ChatError(f"{tok_file}: not a tokenizers file ({e}).") from None
    config = {}
    if cfg_file.exists():
      try:
        config = json.loads(cfg_file.read_text())
      except ValueError as e:
        raise ChatError(f"{cfg_file}: not JSON ({e}).") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
      source = next((t["template"] for t in source if t.get("name") == "default"), None)
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
      source = jinja_file.read_text()
    if not source:
      raise ChatError(f"{cfg_file}: no chat_template (nor {jinja_file.name}); a base model's "
                      "tokenizer has none: use its instruct model's tokenizer directory.")
    try:
      template = _environment().from_string(source)
    except Exception as e:  # pylint: disable=broad-except
      raise ChatError(f"{cfg_file}: the chat template does not compile ({e}).") from None
    specials = {k: _token_text(config[k]) for k in SPECIAL_KEYS if config.get(k) is not None}
    return cls(path, tokenizer, template, specials, _unknown_token(tokenizer))

  def token_id(self, text: str) -> int:
    """The id of a token given by its text (e.g. `<image>`); an error if it is not one token, or
    if the tokenizer splits it inside text (then it is no special token)."""
    i = self.tokenizer.token_to_id(text)
    inside = []
    for probe in (f"a {text} a", text):  # a word-level vocabulary may lack "a"
      try:
        inside = self.tokenizer.encode(probe, add_special_tokens=False).ids
        break
      except Exception:  # pylint: disable=broad-except
        continue
    if i is None or inside.count(i) != 1:
      raise ChatError(f"{self.path / 'tokenizer.json'}: {text!r} is not one token of the "
                      f"vocabulary; give one the tokenizer has ({self._special_tokens(text)}), "
                      "or add it as a special token.")
    return i

  def _special_tokens(self, rejected: str, shown: int = 6) -> str:
    """"its special tokens: <image>, <|im_start|>, ...": the tokenizer's added tokens but
    `rejected`, those naming a medium (image, audio) first; or "it has no special tokens"."""
    named = [t.content for _, t in sorted(self.tokenizer.get_added_tokens_decoder().items())
             if t.content != rejected]
    if not named:
      return "it has no special tokens"
    media = ("image", "img", "vision", "audio", "aud")
    named.sort(key=lambda t: not any(m in t.lower() for m in media))  # stable
    more = ", ..." if len(named) > shown else ""
    return f"its special tokens: {', '.join(named[:shown])}{more}"

  def render(self, msgs: list[dict], add_generation_prompt: bool = False) -> str:
    try:
      return self.template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                  **self.specials)
    except Exception as e:  # pylint: disable=broad-except
      raise ChatError(f"the chat template of {self.path} failed: {e}") from None

  def check_known(self, text: str, enc) -> None:
    """UnknownToken where the encoding `enc` of `text` holds the unknown token for a word of the
    text (the unknown token written out in the text is itself); nothing for a tokenizer without
    one."""
    if self.unknown is None:
      return
    unk, unk_text = self.unknown
    lost = list(dict.fromkeys(text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets)
                              if i == unk and text[a:b] != unk_text))
    if lost:
      one = len(lost) == 1
      shown = ", ".join(repr(w) for w in lost[:5]) + (" ..." if len(lost) > 5 else "")
      raise UnknownToken(f"{'the word' if one else 'the words'} {shown} "
                         f"{'is' if one else 'are'} not in the vocabulary of "
                         f"{self.path / 'tokenizer.json'}, which encodes "
                         f"{'it' if one else 'them'} as its unknown token {unk_text!r}; fix "
                         "the text or add the words to the tokenizer.")

  def unencodable(self, text: str) -> list[str]:
    """The words of `text` the tokenizer cannot encode, each once, in order: the pieces its
    pre-tokenizer makes of the text between its added tokens, a `<...>` mark taken whole."""
    added = sorted((t.content for t in self.tokenizer.get_added_tokens_decoder().values()),
                   key=len, reverse=True)
    parts = re.split("|".join(map(re.escape, added)), text) if added else [text]
    pre, words = self.tokenizer.pre_tokenizer, []
    for part in parts:
      for chunk in re.split(r"(<[^<>\s]+>)", part):
        if re.fullmatch(r"<[^<>\s]+>", chunk):
          words.append(chunk)
        elif pre is not None:  # the text's own spans: a piece may be rewritten (Metaspace's ▁)
          words.extend(chunk[a:b] for _, (a, b) in pre.pre_tokenize_str(chunk))
        else:
          words.extend(chunk.split())
    bad = []
    for w in dict.fromkeys(w for w in words if w.strip()):
      try:
        self.tokenizer.encode(w, add_special_tokens=False)
      except Exception:  # pylint: disable=broad-except
        bad.append(w)
    return bad

  def cannot_encode(self, text: str, error: Exception, shown: int = 5,
                    listed: int = 50) -> TokenizeError:
    """The error for `text`, which the tokenizer failed to encode with `error`: the words it
    cannot encode, and its vocabulary where it has at most `listed` tokens."""
    where = self.path / "tokenizer.json"
    bad = self.unencodable(text)
    if not bad:
      return TokenizeError(f"{where} cannot encode it ({error}).")
    one = len(bad) == 1
    words = ", ".join(map(repr, bad[:shown])) + (", ..." if len(bad) > shown else "")
    vocab = self.tokenizer.get_vocab(with_added_tokens=True)
    small = f": {' '.join(sorted(vocab, key=vocab.get))}" if len(vocab) <= listed else ""
    return TokenizeError(f"{where} cannot encode {'the word' if one else 'the words'} {words}: "
                         f"{'it is' if one else 'they are'} not in its vocabulary, which has no "
                         f"unknown token to stand for {'it' if one else 'them'}; use words of "
                         f"its vocabulary ({len(vocab)} tokens{small}).", tuple(bad))

  def encode(self, msgs: list[dict], strict: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [n] (int32) and the loss mask [n] (int32, 1 on assistant turns); with `strict`,
    UnknownToken where a word of the text is encoded as the unknown token (the unknown token
    written out in the text is itself)."""
    text = self.render(msgs)
    spans = []
    for k, m in enumerate(msgs):
      if m["role"] != "assistant":
        continue
      before = self.render(msgs[:k], add_generation_prompt=True)
      upto = self.render(msgs[:k + 1])
      if not upto.startswith(before) or not text.startswith(upto):
        if k == 0:  # nothing before it: the usual cause, said plainly
          raise AssistantFirst(f"assistant turn 0 comes first: a conversation starts with a user "
                               f"(or system) turn (the chat template of {self.path} renders no "
                               "assistant turn without one before it).")
        raise ChatError(f"the chat template of {self.path} does not render assistant turn {k} "
                        "after the conversation before it (no prefix); its loss cannot be "
                        "located.")
      spans.append((len(before), len(upto.rstrip())))
    try:
      enc = self.tokenizer.encode(text, add_special_tokens=False)
    except Exception as e:  # pylint: disable=broad-except
      raise self.cannot_encode(text, e) from None
    ids = np.asarray(enc.ids, np.int32)
    if strict:
      self.check_known(text, enc)
    offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
    start, end = offsets[:, :1], offsets[:, 1:]
    span = np.asarray(spans, np.int64).reshape(1, -1, 2)
    inside = (span[..., 0] <= start) & (end <= span[..., 1]) & (start < end)
    return ids, inside.any(axis=1).astype(np.int32)
