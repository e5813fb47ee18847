"""Training: the optimiser, train state and steps (`trainer`, the twin of torch_reference/training.py), the losses
(`losses`), what a fine-tuning run trains (`finetuning`), devices and processes (`distributed`), the memory plan
(`plan`), the loop (`loop`), setting up a run (`run`), its curves (`curves`), and glibc's malloc kept for the next
step (`host_memory`).

May import: errors, files, checks, compilation, settings, model, data, checkpoint, decoding, interop.
"""
