"""Hugging Face checkpoints in and out of mimo_jax.

  python -m tools.hf import --hf DIR [--hf DIR] --out WORKDIR [--config=FILE[:ARG]] [--config.a.b=v ...]
  python -m tools.hf export WORKDIR [--step N] --out DIR [--model llava|qwen2_audio] [--module vision|audio|language] [--tokenizer DIR] [--peft] [--overwrite]
  python -m tools.hf check --hf DIR [--dtype float32|bfloat16]

`import` reads an HF model directory (config.json and safetensors, sharded with an index or not):
a SigLIP or CLIP vision tower, a Llama-3.x or Qwen2 language model, or a LLaVA checkpoint (both);
`--hf` twice takes a tower and a language model from two directories.
It takes the model fields of the modules it holds from config.json (and the pixel mean and std
from preprocessor_config.json), the rest from `--config` (default configs/vlm.py, sized for GPUs;
configs/llava_cpu.py for a run on CPUs) and the `--config.a.b=v` overrides, and writes
WORKDIR/config.py (with WORKDIR/config.json, and hf_import.json with the directories' absolute
paths) and a step-0 checkpoint, each tensor streamed from its file into its devices. It prints
the launch command, with placeholders for the data the run still needs (data.dir, and
data.image_token unless a LLaVA's config.json gives it), and a note when the default base is used
on a machine with CPUs only.
An override that contradicts config.json is an error naming both values; so is a config.json
field that is missing, null or of another type, a LLaVA's image_token_index past its
text_config.vocab_size, a tensor holding NaN or infinity (refused as it is read), an --out that
is a file or a non-empty directory (a WORKDIR that holds checkpoints among them), or too little
free space: each before anything is written. The workdir is written
in a staging directory beside it that becomes WORKDIR in one rename with config.py in it; an
import that fails, is interrupted (Ctrl-C) or killed (SIGTERM) leaves nothing (exit status
130 or 143).

`export` writes a checkpoint as a complete HF directory that transformers loads with its own
classes: the whole model as LlavaForConditionalGeneration (vision and language) or as
Qwen2AudioForConditionalGeneration (`--model qwen2_audio`: audio and language, the default for
a run without a vision encoder or whose language model came from a Qwen2-Audio directory; with
WhisperFeatureExtractor's preprocessor_config.json, Qwen2AudioProcessor's processor_config.json,
the audio token `--audio_token_index`, else model.audio.audio_token), or one module:
SiglipVisionModel / CLIPVisionModel (`--module vision`), a WhisperModel holding the audio encoder
(`--module audio`, with WhisperFeatureExtractor's preprocessor_config.json; its decoder is not the
run's: transformers initialises it on loading), LlamaForCausalLM / Qwen2ForCausalLM
(`--module language`). Float32 weights, sharded at 5 GB with an index; config.json with the
source's max_position_embeddings; the image processor the run's images were prepared with
(preprocessor_config.json); LlavaProcessor's processor_config.json; the tokenizer's files with
its chat template (the run's data's tokenizer, else the language model's source's, else
`--tokenizer DIR`; a LLaVA or Qwen2-Audio export's also takes a message's content as a list
of parts, mimo_jax/hf/chat_parts.py) and generation_config.json with its bos, eos and pad. The
image token is `--image_token_index`, else the run's data.image_token, else the imported
LLaVA's, else the tokenizer's <image>. A tower imported beside a language model (`--hf` twice)
is read as LLaVA reads one (no final norm; a projector as wide as the language model), so it
exports as LLaVA.
Written staged and renamed into place (a failed write, Ctrl-C or SIGTERM leaves nothing: one
line, exit status 2, 130 or 143); a non-empty --out is refused unless it holds a complete
export and `--overwrite` is given; NaN or Inf weights are refused. A module with LoRA adapters
(model.<module>.lora) is written merged: the plain model.

`export --peft` writes the run's LoRA adapters instead, as a PEFT adapter directory
(adapter_config.json, adapter_model.safetensors with PEFT's names; mimo_jax/hf/peft.py) that
`peft.PeftModel.from_pretrained(base, DIR)` loads over the base the export without --peft would
write from the step the run started from: LLaVA's tower and language model adapters (the
default), or `--module language` / `--module vision` alone; a trained projector goes with them
whole (PEFT's modules_to_save). A module that trains its own weights has no place in an adapter:
the export is refused, naming it.

`check` (needs torch and transformers: `pip install -e '.[hf]'`) runs the same random inputs
through transformers and mimo_jax and prints the largest absolute and relative differences of the
logits (language models, LLaVA) or hidden states (towers).
"""

from __future__ import annotations

import argparse
import re

from mimo_jax import output
from mimo_jax.config import ConfigError
from tools import hf_export, hf_import
from tools.common import Parser, number, path_flag
from tools.hf_import import CPU_BASE, DEFAULT_BASE, fail

TOOL = "tools.hf"


def main(argv: list[str] | None = None) -> None:
  parser = Parser(TOOL, prog="python -m tools.hf", allow_abbrev=False,
                  description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog=__doc__.split("\n\n", 1)[1])
  verbs = parser.add_subparsers(dest="verb", required=True)
  sub = {"tool": TOOL, "allow_abbrev": False}  # each verb's errors one line, as the tool's
  override = lambda arg: bool(re.match(r"--?(no)?config\.", arg))  # import checks the rest
  p = verbs.add_parser("import", help="an HF directory -> a workdir with a step-0 checkpoint",
                       takes=override, **sub)
  p.add_argument("--hf", required=True, action="append",
                 help="an HF model directory; repeat for a tower and a language model")
  p.add_argument("--out", required=True, type=path_flag,
                 help="the workdir to write: absent or an empty directory")
  p.add_argument("--config", default=None,
                 help="config file[:variant] for the fields config.json does not set (default "
                 f"{DEFAULT_BASE}, sized for GPUs; {CPU_BASE} for a run on CPUs)")
  p = verbs.add_parser("export", help="a checkpoint -> an HF directory", **sub)
  p.add_argument("workdir")
  p.add_argument("--step", type=number(int, least=0), default=None, help="default: the newest")
  p.add_argument("--out", required=True, type=path_flag)
  p.add_argument("--module", choices=("vision", "audio", "language"), default=None,
                 help="one module alone (default: the whole model, as --model)")
  p.add_argument("--model", choices=("llava", "qwen2_audio"), default=None,
                 help="the whole model's class: LLaVA (the vision encoder) or Qwen2-Audio (the "
                 "audio encoder) with the language model (default: Qwen2-Audio for a run "
                 "without a vision encoder or imported from Qwen2-Audio, else LLaVA)")
  p.add_argument("--image_token_index", type=number(int, least=0), default=None,
                 help="LLaVA's image token id (default: the run's data.image_token, else the "
                 "imported LLaVA's, else the tokenizer's <image>)")
  p.add_argument("--audio_token_index", type=number(int, least=0), default=None,
                 help="Qwen2-Audio's audio token id (default: model.audio.audio_token)")
  p.add_argument("--tokenizer", default="",
                 help="the tokenizer directory to copy (default: the run's data's, else the "
                 "language model's source)")
  p.add_argument("--peft", action="store_true",
                 help="write the run's LoRA adapters as a PEFT adapter directory (default: the "
                 "merged model)")
  p.add_argument("--base", default="",
                 help="with --peft: the adapter's base_model_name_or_path (default: the HF "
                 "directory the run's frozen weights were imported from, if they are still its; "
                 "else none, with a note naming the run to export as the base)")
  p.add_argument("--overwrite", action="store_true",
                 help="replace --out if it holds a complete export")
  p = verbs.add_parser("check", help="transformers vs mimo_jax on the same random inputs", **sub)
  p.add_argument("--hf", required=True)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  args, extra = parser.parse_known_args(argv)
  # import's leftovers are its --config.a.b=v overrides (it names a stray value itself); any
  # other leftover is a flag argparse refused.
  unknown = [a for a in extra if args.verb != "import" or a.startswith("-") and not override(a)]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  try:
    if args.verb == "import":
      hf_import.import_(args, extra)
    elif args.verb == "export":
      hf_export.export(args)
    else:
      from tools import hf_check  # pylint: disable=import-outside-toplevel
      hf_check.check(args.hf, args.dtype)
  except ConfigError as e:
    fail(str(e))


if __name__ == "__main__":
  output.run_main(main)
