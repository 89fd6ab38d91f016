"""The peer baseline: a training step of HF transformers' LLaVA in PyTorch at configs/vlm.py's
sizes, on a GPU (needs torch and transformers: `pip install -e '.[hf]'`).

  python -m tools.hf_llava_bench [--compile [--compile_mode MODE]] [--fp8] [--liger] [--mb 8]
      [--micro 4] [--steps 5] [--feature_layer -1]

The model: a CLIP ViT-L/14 at 336 px (24 layers of width 1024; class token dropped: 576 tokens an
image), LLaVA's two-layer GELU projector and a Llama decoder of 16 layers of width 2048 (32
heads, 8 key-value heads, SwiGLU 8192, vocabulary 32000), randomly initialised. The projector
takes the tower's last layer (`--feature_layer -1`), as configs/vlm.py's 24-layer tower gives it
its last: the same model. LLaVA-1.5's `--feature_layer -2` leaves the last layer's output unused
(its backward pass is not run, and torch.compile may drop its forward): a tower of 23 layers in
effect, less work than mimo_jax's. A step is `--micro` microbatches of `--mb` samples, each
sample `--images` images and text filling it to 2048 tokens, with the loss on every text token; float32 weights, bfloat16
autocast, SDPA attention, fused AdamW, gradients accumulated over the microbatches. `--compile`
runs the model under `torch.compile` (`--compile_mode`: its mode). The peer's own speed-ups, so
that it is measured at its best:

* `--fp8`: torchao's float8 training (`convert_to_float8_training`, tensorwise dynamic scaling)
  on every `nn.Linear` of both towers and the projector except `lm_head` (and the patch
  embedding, a convolution), as mimo_jax's FP8 step leaves its output projection in bfloat16.
* `--liger`: Liger Kernel's Triton RMSNorm, SwiGLU and RoPE in the Llama decoder
  (`apply_liger_kernel_to_llama`); not its fused linear cross-entropy, which fails under
  `torch.compile`.

Neither package comes with torch: `pip install torchao==0.18.0 liger-kernel==0.8.5` (torchao 0.18
needs torch >= 2.11); for a host without network, `pip download --no-deps` those pins on one
with it and `pip install` the wheels there. Prints the compile time (the first warmup step's wall
time, which compiles under `--compile`; every warmup step's too), s/step (median of `--steps` after
`--warmup`), tokens/s and peak memory: the figures mimo_jax's `tools.bench` is set beside
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

SEQ, IMAGE_TOKENS, VOCAB = 2048, 576, 32_000
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
NEEDS = {"fp8": ("torchao", "torchao==0.18.0"), "liger": ("liger_kernel", "liger-kernel==0.8.5")}


def check_packages(args) -> None:
  """Exits with the install line when a requested option's package is missing (before torch
  loads, and before any model is built)."""
  for option, (module, pin) in NEEDS.items():
    if getattr(args, option) and importlib.util.find_spec(module) is None:
      raise SystemExit(
          f"hf_llava_bench: --{option} needs the {module} package, which is not installed: "
          f"pip install {pin} (or on a host without network: pip download --no-deps {pin} on "
          "one with it, then pip install the wheel).")


def feature_layer(text: str) -> int:
  """--feature_layer's value: a layer of the 24, counted from the end."""
  try:
    k = int(text)
  except ValueError:
    k = 0
  if not -24 <= k <= -1:
    raise argparse.ArgumentTypeError(f"{text!r}: give -24 to -1 (-1: the tower's last layer)")
  return k


def float8_filter(module, fqn: str) -> bool:
  """The linears torchao converts to float8: all but lm_head and the patch embedding, and only
  those whose sizes the FP8 matmul takes (multiples of 16)."""
  import torch  # pylint: disable=import-outside-toplevel
  return (isinstance(module, torch.nn.Linear) and "lm_head" not in fqn
          and "patch_embed" not in fqn and module.in_features % 16 == 0
          and module.out_features % 16 == 0)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.hf_llava_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mb", type=int, default=8, help="samples a microbatch")
  parser.add_argument("--micro", type=int, default=4, help="microbatches a step")
  parser.add_argument("--images", type=int, default=3, help="images a sample")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed steps first (the first one compiles under --compile)")
  parser.add_argument("--steps", type=int, default=5, help="timed steps: s/step is their median")
  parser.add_argument("--compile", action="store_true", help="torch.compile the model")
  parser.add_argument("--compile_mode", default="default", choices=MODES,
                      help="torch.compile's mode (with --compile): max-autotune tunes Triton "
                      "GEMM templates against cuBLAS per shape, and adds CUDA graphs unless "
                      "-no-cudagraphs")
  parser.add_argument("--feature_layer", type=feature_layer, default=-1,
                      help="the tower's layer that feeds the projector, -24 to -1 from the end "
                      "(-1: the last, as configs/vlm.py's tower)")
  parser.add_argument("--fp8", action="store_true",
                      help="torchao float8 training (tensorwise) on every Linear but lm_head")
  parser.add_argument("--liger", action="store_true",
                      help="Liger Kernel RMSNorm, SwiGLU and RoPE in the decoder")
  args = parser.parse_args(argv)
  check_packages(args)
  # pylint: disable=import-outside-toplevel
  import torch
  if args.liger:  # patches transformers' Llama classes: before the model is built
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False)
  from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                            LlavaForConditionalGeneration)
  image_token = VOCAB - 1
  vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                            num_attention_heads=16, image_size=336, patch_size=14)
  text = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=VOCAB,
                     rope_theta=500_000.0, max_position_embeddings=4096,
                     tie_word_embeddings=False)
  config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                       projector_hidden_act="gelu",
                       vision_feature_layer=args.feature_layer,
                       vision_feature_select_strategy="default",
                       image_seq_length=IMAGE_TOKENS)
  for c in (config, vision, text):
    c._attn_implementation = "sdpa"  # pylint: disable=protected-access
  torch.manual_seed(0)
  model = LlavaForConditionalGeneration(config).cuda()
  params = sum(p.numel() for p in model.parameters())
  converted = 0
  if args.fp8:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    before = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=float8_filter,
                               config=Float8LinearConfig.from_recipe_name("tensorwise"))
    converted = before - sum(type(m) is torch.nn.Linear for m in model.modules())
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
  mode = None if args.compile_mode == "default" else args.compile_mode
  forward = torch.compile(model, mode=mode) if args.compile else model

  text_len = SEQ - args.images * IMAGE_TOKENS
  if text_len < 2:
    raise SystemExit(f"hf_llava_bench: {args.images} images leave no text in {SEQ} tokens")
  ids = torch.randint(0, VOCAB - 1, (args.mb, SEQ), device="cuda")
  ids[:, :args.images * IMAGE_TOKENS] = image_token
  labels = ids.clone()
  labels[:, :args.images * IMAGE_TOKENS] = -100  # no loss on image positions
  pixels = torch.randn(args.mb * args.images, 3, 336, 336, device="cuda")

  def queue_step() -> torch.Tensor:
    for _ in range(args.micro):
      with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = forward(input_ids=ids, pixel_values=pixels, labels=labels).loss / args.micro
      loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()

  def step() -> float:
    return queue_step().item()

  warmup = []
  for _ in range(args.warmup):
    start = time.perf_counter()
    step()  # .item() waits for the step
    warmup.append(time.perf_counter() - start)
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    loss = step()  # .item() waits for the step
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  # The same steps with no wait between them, as a training loop that reads its loss later runs
  # them: the time between the first's end and the last's, on the GPU's clock.
  ended = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
  torch.cuda.synchronize()
  for event in ended:
    queue_step()
    event.record()
  torch.cuda.synchronize()
  queued = ended[0].elapsed_time(ended[-1]) / 1e3 / max(args.steps - 1, 1)
  tokens = args.mb * args.micro * SEQ
  compiled = f"{args.compile} ({args.compile_mode})" if args.compile else "False"
  print(f"hf_llava compile={compiled} fp8={args.fp8} ({converted} Linear in float8) "
        f"liger={args.liger} feature_layer={args.feature_layer} {args.mb}x{args.micro}: "
        f"{params / 1e9:.3f} B parameters, "
        f"{seconds:.3f} s/step (queued {queued:.4f}), {tokens / seconds:,.0f} tokens/s, "
        f"loss {loss:.3f}, peak "
        f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; compile (first step) "
        f"{warmup[0] if warmup else 0:.1f} s, warmup steps "
        f"{', '.join(f'{w:.1f}' for w in warmup)} s")


if __name__ == "__main__":
  main()
