"""Other frameworks' models and files: the weight map between this model and its PyTorch twin (`port`), the
pretrained families' configs and weight maps (`pretrained`), importing and exporting transformers, fairseq and peft
models (`hub`, `peft`), a new language code in a multilingual model (`languages`), the twin's weight files
(`export`), and a trained checkpoint checked against its twin (`verify`).

May import: errors, files, checks, compilation, settings, model, data, checkpoint, decoding.
"""
