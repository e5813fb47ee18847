"""`serve`: an HTTP translation service (LibreTranslate's API and a native one) whose requests are batched for the
decoders of one loaded model. Nothing of training.

May import: errors, files, checks, compilation, settings, model, data, checkpoint, decoding.
"""
