"""The peer baseline of a LoRA fine-tune: HF transformers' LLaVA with PEFT's LoRA on the language
model, the vision tower frozen and the projector trained, at configs/vlm.py:llm8b_lora's sizes
(needs torch, transformers and peft).

  python -m tools.hf_lora_bench [--compile] [--rank 16] [--mb 4] [--micro 8] [--steps 5]
  python -m tools.hf_lora_bench --tiny   # a few-layer model on the CPU: the tool's own check

The model: a CLIP ViT-L/14 at 336 px (24 layers of width 1024; LLaVA's features from layer -2,
576 tokens an image), LLaVA's two-layer GELU projector and an 8B-class Llama-3 decoder (32 layers
of width 4096, 32 heads, 8 key-value heads, SwiGLU 14336, vocabulary 128256), randomly
initialised. The frozen weights are held in bfloat16, the adapters (rank `--rank`, alpha twice the
rank, on q/k/v/o/gate/up/down of every decoder layer) and the projector in float32 with
bfloat16 autocast; fused AdamW over the trained parameters alone. A step is `--micro`
microbatches of `--mb` samples, one image a sample and text filling 2048 tokens.

Prints s/step (median of `--steps` after `--warmup`), tokens/s, peak memory and MFU against
`--peak` FLOP/s (H200 bfloat16 dense: 989e12) counting the FLOPs the step needs (`needed_flops`):
the frozen weights' gradients are not computed, so the language model costs 4 FLOPs a parameter
a token (forward, and the gradient of its inputs on the way to the adapters and the projector),
the adapters 6, the projector 6 an image token and the frozen tower 2 (forward only), plus
attention. mimo_jax's run of the same model is `python -m tools.bench
--config=configs/vlm.py:llm8b_lora`; its s/step gives its MFU by the same count (`--mimo-s`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclasses.dataclass(frozen=True)
class Sizes:
  vit_dim: int = 1024
  vit_layers: int = 24
  vit_heads: int = 16
  vit_mlp: int = 4096
  image: int = 336
  patch: int = 14
  dim: int = 4096
  layers: int = 32
  heads: int = 32
  kv_heads: int = 8
  mlp: int = 14336
  vocab: int = 128_256
  projector: int = 4096  # LLaVA's projector hidden width is the language width
  seq: int = 2048

  @property
  def image_tokens(self) -> int:
    return (self.image // self.patch) ** 2


TINY = Sizes(vit_dim=32, vit_layers=2, vit_heads=4, vit_mlp=64, image=28, patch=14, dim=64,
             layers=2, heads=4, kv_heads=2, mlp=128, vocab=512, projector=64, seq=64)


def needed_flops(s: Sizes, rank: int, samples: int) -> dict[str, float]:
  """FLOPs of a LoRA step of `samples` samples (one image each), by part (see the docstring)."""
  hd = s.dim // s.heads
  attn = s.dim * hd * (s.heads + 2 * s.kv_heads) + s.heads * hd * s.dim
  lm = s.layers * (attn + 3 * s.dim * s.mlp) + s.dim * s.vocab
  adapters = s.layers * rank * (2 * s.dim + 2 * (s.dim + s.kv_heads * hd) +
                                (hd * s.heads + s.dim) + 3 * (s.dim + s.mlp))
  vit = s.vit_layers * (4 * s.vit_dim**2 + 2 * s.vit_dim * s.vit_mlp)
  proj = s.vit_dim * s.projector + s.projector * s.dim
  p = s.image_tokens
  return {
      "language": samples * s.seq * (4 * lm + 2 * 2 * s.layers * s.seq * s.dim * 3 // 2),
      "adapters": samples * s.seq * 6 * adapters,
      "projector": samples * p * 6 * proj,
      "tower": samples * p * (2 * vit + 4 * s.vit_layers * p * s.vit_dim),
  }


def _model(s: Sizes, rank: int, device: str):
  # pylint: disable=import-outside-toplevel
  import peft
  import torch
  from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                            LlavaForConditionalGeneration)
  vision = CLIPVisionConfig(hidden_size=s.vit_dim, intermediate_size=s.vit_mlp,
                            num_hidden_layers=s.vit_layers, num_attention_heads=s.vit_heads,
                            image_size=s.image, patch_size=s.patch)
  text = LlamaConfig(hidden_size=s.dim, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                     num_key_value_heads=s.kv_heads, intermediate_size=s.mlp,
                     vocab_size=s.vocab, rope_theta=500_000.0, max_position_embeddings=2 * s.seq,
                     tie_word_embeddings=False)
  config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=s.vocab - 1,
                       projector_hidden_act="gelu", vision_feature_layer=-2,
                       vision_feature_select_strategy="default", image_seq_length=s.image_tokens)
  for c in (config, vision, text):
    c._attn_implementation = "sdpa"  # pylint: disable=protected-access
  torch.manual_seed(0)
  model = LlavaForConditionalGeneration(config).to(device=device, dtype=torch.bfloat16)
  lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS)
  model = peft.get_peft_model(model, lora)  # adapters in float32 (autocast_adapter_dtype)
  for name, p in model.named_parameters():
    if "multi_modal_projector" in name:
      p.data = p.data.float()
      p.requires_grad_(True)
  return model


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.hf_lora_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha: twice it)")
  parser.add_argument("--mb", type=int, default=4, help="samples a microbatch")
  parser.add_argument("--micro", type=int, default=8, help="microbatches a step")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed steps first (the first one compiles under --compile)")
  parser.add_argument("--steps", type=int, default=5, help="timed steps: s/step is their median")
  parser.add_argument("--peak", type=float, default=989e12, help="the device's FLOP/s")
  parser.add_argument("--compile", action="store_true", help="torch.compile the model")
  parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU")
  parser.add_argument("--mimo-s", type=float, default=0.0,
                      help="mimo_jax's s/step at these sizes: print its MFU by the same count")
  args = parser.parse_args(argv)
  import torch  # pylint: disable=import-outside-toplevel
  s = TINY if args.tiny else Sizes()
  device = "cpu" if args.tiny else "cuda"
  model = _model(s, args.rank, device)
  trained = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=not args.tiny)
  forward = torch.compile(model) if args.compile else model
  ids = torch.randint(0, s.vocab - 1, (args.mb, s.seq), device=device)
  ids[:, :s.image_tokens] = s.vocab - 1
  labels = ids.clone()
  labels[:, :s.image_tokens] = -100
  pixels = torch.randn(args.mb, 3, s.image, s.image, device=device, dtype=torch.bfloat16)

  def step() -> float:
    for _ in range(args.micro):
      with torch.autocast(device, dtype=torch.bfloat16):
        loss = forward(input_ids=ids, pixel_values=pixels, labels=labels).loss / args.micro
      loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().item()

  cuda = device == "cuda"
  for _ in range(args.warmup):
    step()
  if cuda:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    loss = step()  # .item() waits for the step
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  samples = args.mb * args.micro
  flops = sum(needed_flops(s, args.rank, samples).values())
  peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
  n_trained = sum(p.numel() for p in trained)
  n_all = sum(p.numel() for p in model.parameters())
  print(f"hf_lora compile={args.compile} rank={args.rank}: {n_all / 1e9:.3f} B parameters "
        f"({n_trained / 1e6:.1f} M trained), {seconds:.3f} s/step, "
        f"{samples * s.seq / seconds:,.0f} tokens/s, MFU {flops / seconds / args.peak:.1%} "
        f"({flops / 1e12:.1f} TFLOP needed a step), loss {loss:.3f}, peak {peak:.1f} GiB")
  if args.mimo_s > 0:
    print(f"mimo_jax at {args.mimo_s:.3f} s/step: {samples * s.seq / args.mimo_s:,.0f} tokens/s, "
          f"MFU {flops / args.mimo_s / args.peak:.1%} by the same count")


if __name__ == "__main__":
  main()
