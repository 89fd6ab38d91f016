"""Models: a ViT encoder with its projector, a Llama-style decoder, and the merge joining them."""
