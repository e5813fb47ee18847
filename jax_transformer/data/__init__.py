"""Text in: parallel files and TSVs read with file:line errors (`corpus`), the tokenizers (`tokenizer`), ids and
batches (`batching`), training files encoded once into memory-mapped token arrays (`token_arrays`), and the built-in
English->French numbers task (`default_task`). numpy only: no model, no jax.

May import: errors, files, checks, settings.
"""
