"""Translating with a model: the one search loop with its rules as strategies (`search`), how a batch runs through
it (`schedule`), the decoders callers use (`decoders`), text in and text out (`translation`), documents with their
layout kept (`documents`), HTML and XML with their markup kept (`markup`), the log-probs of given translations
(`scoring`), word alignments from cross-attention (`alignment`), BLEU and chrF (`evaluation`), attention maps
(`attention`), a model loaded to decode (`loading`), and the front door for Python users (`translator`). Nothing of
training.

May import: errors, files, checks, compilation, settings, model, data, checkpoint.
"""
