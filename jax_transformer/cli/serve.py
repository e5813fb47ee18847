"""The HTTP translation service (`serve`)."""

from __future__ import annotations

import sys

from jax_transformer.cli import flags


def add(sub) -> None:
    from jax_transformer.settings.config import ServeConfig

    sv = sub.add_parser(
        "serve",
        help="an HTTP translation service (LibreTranslate's API, a native JSON API with scores) on 127.0.0.1",
        description="Keeps the model and its compiled decoders in one process and answers HTTP requests: "
        "LibreTranslate's POST /translate, GET /languages and POST /detect, so its clients work unchanged; POST "
        "/v1/translate with every decoding option and the scores; GET /health. Requests that arrive within "
        "--batch-window-ms share a batch, up to --max-tokens source tokens. Text is split into sentences with its "
        "layout kept. SIGTERM stops taking requests, finishes those in flight and exits. docs/serving.md.",
    )
    flags.checkpoint_flags(sv, compute=True, mesh=True)
    flags.decoding_flags(sv)
    flags.compilation_flags(sv)
    flags.add_settings(sv, ServeConfig, "serve", "service")
    sv.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.serving import service
    from jax_transformer.settings.config import ServeConfig

    settings = ServeConfig.from_dict(flags.given(args, "serve"), source="serve flags")
    api_key = service.read_api_key(settings)  # a missing or empty key file is said before the model loads
    flags.use_compilation_cache(args)
    found = service.build(flags.translator(args), settings, api_key=api_key)
    service.serve(found, print_fn=lambda line: print(line, file=sys.stderr, flush=True))
    return 0
