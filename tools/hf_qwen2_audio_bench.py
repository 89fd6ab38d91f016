"""The audio peer baseline: a training step of HF transformers' Qwen2-Audio in PyTorch at
configs/avlm.py's audio-tower and language-model sizes, on a GPU (needs torch and transformers).

  python -m tools.hf_qwen2_audio_bench [--compile] [--mb 8] [--micro 4] [--steps 5]

The model: Qwen2-Audio's tower at Whisper-large-v3's shape (32 layers of width 1280, 20 heads,
MLP 5120, 128 mel bins, 30 s windows: 750 tokens a full window after pooling), its linear
projector and a Qwen2 decoder of configs/avlm.py's language sizes (16 layers of width 2048, 32
heads, 8 key-value heads, SwiGLU 8192, vocabulary 32000), randomly initialised. A step is
`--micro` microbatches of `--mb` samples, each one clip of 7.5-30 s (its audio frames drawn as
configs/avlm.py's synthetic data draws them; the tower runs the whole window with the padding
masked, its padding's tokens dropped: 188-750 tokens) and text filling it to 2048 tokens, with
the loss on every text token; float32 weights, bfloat16 autocast, SDPA attention,
fused AdamW, gradients accumulated over the microbatches. `--compile` runs the model under
`torch.compile`. Prints s/step (median of `--steps` after `--warmup`), tokens/s and peak memory,
to set beside `tools.bench --config=configs/avlm.py:audio` (the same model in mimo_jax).
"""

from __future__ import annotations

import argparse
import statistics
import time

SEQ, VOCAB, FRAMES, MELS = 2048, 32_000, 3000, 128


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.hf_qwen2_audio_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mb", type=int, default=8, help="samples a microbatch")
  parser.add_argument("--micro", type=int, default=4, help="microbatches a step")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed steps first (the first one compiles under --compile)")
  parser.add_argument("--steps", type=int, default=5, help="timed steps: s/step is their median")
  parser.add_argument("--compile", action="store_true", help="torch.compile the model")
  args = parser.parse_args(argv)
  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import (Qwen2AudioConfig, Qwen2AudioEncoderConfig,
                            Qwen2AudioForConditionalGeneration, Qwen2Config)
  audio_token = VOCAB - 1
  audio = Qwen2AudioEncoderConfig(num_mel_bins=MELS, encoder_layers=32, encoder_attention_heads=20,
                                  encoder_ffn_dim=5120, d_model=1280, max_source_positions=1500)
  text = Qwen2Config(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=VOCAB,
                     rope_theta=500_000.0, max_position_embeddings=4096,
                     tie_word_embeddings=False)
  config = Qwen2AudioConfig(audio_config=audio.to_dict(), text_config=text.to_dict(),
                            audio_token_index=audio_token)
  for c in (config, config.audio_config, config.text_config):
    c._attn_implementation = "sdpa"  # pylint: disable=protected-access
  torch.manual_seed(0)
  model = Qwen2AudioForConditionalGeneration(config).cuda()
  params = sum(p.numel() for p in model.parameters())
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
  forward = torch.compile(model) if args.compile else model

  frames = torch.randint(FRAMES // 4, FRAMES + 1, (args.mb,))
  kept = (((frames - 1) // 2 + 1) - 2) // 2 + 1  # Qwen2-Audio's tokens of each clip
  ids = torch.randint(0, VOCAB - 1, (args.mb, SEQ))
  labels = ids.clone()
  for b, k in enumerate(kept.tolist()):
    ids[b, :k] = audio_token
    labels[b, :k] = -100  # no loss on audio positions
  ids, labels = ids.cuda(), labels.cuda()
  mel = torch.randn(args.mb, MELS, FRAMES, device="cuda")
  mel_mask = (torch.arange(FRAMES)[None] < frames[:, None]).long().cuda()

  def step() -> float:
    for _ in range(args.micro):
      with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = forward(input_ids=ids, input_features=mel, feature_attention_mask=mel_mask,
                       labels=labels).loss / args.micro
      loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().item()

  for _ in range(args.warmup):
    step()
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    loss = step()  # .item() waits for the step
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  tokens = args.mb * args.micro * SEQ
  print(f"hf_qwen2_audio compile={args.compile}: {params / 1e9:.3f} B parameters, "
        f"{seconds:.3f} s/step, {tokens / seconds:,.0f} tokens/s, loss {loss:.3f}, peak "
        f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
  main()
