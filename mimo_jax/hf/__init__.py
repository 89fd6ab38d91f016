"""Hugging Face checkpoints: config.json <-> our config fields, safetensors <-> our parameters.

Supported: language models of the Llama (Llama-3, 3.1, 3.2) and Qwen2 (Qwen2, 2.5) architectures
(this package's generic code), and each encoder's checkpoints through its mapping (mapping.py:
hf/<name>.py for encoder <name>, found by module name), alone or combined with a language model
(e.g. SigLIP and CLIP towers, and LLaVA: a tower, its projector and a language model). Names are
matched after the prefixes that transformers' versions and the model classes put in front of them
(`model.language_model.`, `language_model.model.`, an encoder's own, ...), so files written by
`save_pretrained` of any of those classes read alike.

Tensors are read one at a time (`safe_open`), converted to float32 and to our layout (kernels
[in, out], a module's layers stacked on a leading axis); `leaves` yields them leaf by leaf, so
the caller can place each on its devices before the next is read (state.py, for `init_from`).
One table per module (`Tensor`: our leaf, the HF name and shape, the layout map) serves reading
and writing (export.py).

Every problem is one `HFError` naming the file or tensor and the fix: a config.json field that
is missing, null or of another type (`field`), a tensor of the wrong shape or dtype, a tensor
holding NaN or infinity (checked as it is read).

source.py reads a directory, fields.py maps config.json to config fields, tensors.py maps tensors
to parameters, export.py writes them back; mapping.py is what an encoder's mapping provides.
"""

from mimo_jax.hf.fields import (check_fields, config_section, configure, fields, language_fields,
                                reader, text_config)
from mimo_jax.hf.mapping import Mapping, mappings
from mimo_jax.hf.source import (ACTIVATIONS, HEADS, LANGUAGE_PREFIXES, LANGUAGE_TYPES, HFError,
                                Source, field)
from mimo_jax.hf.tensors import (Leaf, Tensor, flatten, language_tensors, leaves, load, nest,
                                 prefixes, stored_bytes, tensors)
