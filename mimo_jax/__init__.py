from mimo_jax import starting

starting.guard()  # `python -m mimo_jax.NAME`: a signal while it imports is one line (starting.py)
