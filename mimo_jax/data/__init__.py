"""Data: the digits-captioning task, its tokenizer, the slot layout and the grain loader."""
