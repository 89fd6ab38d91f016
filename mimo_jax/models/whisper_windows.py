"""Whisper's window arithmetic: the tokens a window of log-mel frames yields. It imports nothing,
so the tower (models/whisper.py, on the device) and the host's audio data code (data/audio.py)
share the one formula without the models importing the data code."""


def window_tokens(frames, pool: int = 1):
  """Encoder tokens of a window whose first `frames` (>= 0) frames hold audio: Whisper's stride-2
  convolution makes ceil(frames / 2) positions, then (Qwen2-Audio: pool 2) average pooling keeps
  a token of every whole `pool` of them (transformers' _get_feat_extract_output_lengths:
  (conv - pool) // pool + 1, which is conv // pool). 3000 frames → 1500 tokens, 750 with pool 2.
  The one formula of the project: integers, NumPy and JAX arrays alike (models/whisper.py uses it
  on device)."""
  return (frames + 1) // 2 // pool
