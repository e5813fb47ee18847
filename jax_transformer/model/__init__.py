"""The model: the Flax Transformer (`transformer`) and its parts (sinusoid `positions`, `masks`, hashed `dropout`),
int8 weights (`quantization`), LoRA adapters beside its matrices (`lora`), and where its arrays live on a device
mesh (`sharding`). It knows nothing of data files or of training.

May import: errors, files, checks, compilation, settings.
"""
