"""The HTTP translation service (`serve`)."""

from __future__ import annotations

import argparse
import sys

from jax_transformer.cli import flags


def add(sub) -> None:
    from jax_transformer.settings.config import ServeConfig

    sv = sub.add_parser(
        "serve",
        help="an HTTP translation service (LibreTranslate's API, a native JSON API with scores) on 127.0.0.1",
        description="Keeps one model (--checkpoint) or several (--models FILE) and their compiled programs in one "
        "process and answers HTTP requests: LibreTranslate's POST /translate, GET /languages and POST /detect, so "
        "its clients work unchanged; POST /v1/translate with every decoding option and the scores; GET /health and "
        "GET /metrics. Every program a request may run (the service's decoding and those --allow adds, at every "
        "batch shape) is compiled before it listens. Requests that arrive within --batch-window-ms share a batch, "
        "up to --max-tokens source tokens. Text is split into sentences with its layout kept. SIGTERM drops "
        "requests whose body has not arrived, finishes those in flight and exits. docs/serving.md.",
    )
    flags.checkpoint_flags(sv, compute=True, mesh=True, required=False, ensemble=True)
    flags.decoding_flags(sv)
    flags.compilation_flags(sv)
    flags.add_settings(sv, ServeConfig, "serve", "service", skip=("allow",))
    allow = next(f for f in ServeConfig.__dataclass_fields__.values() if f.name == "allow")
    sv.add_argument(
        "--allow",
        dest="serve.allow",
        action="extend",
        nargs="+",
        default=None,
        metavar="FIELD=VALUES",
        help=f"{allow.metadata['help']}; may be given more than once (default: none)",
    )
    sv.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.errors import UsageError
    from jax_transformer.serving import service
    from jax_transformer.settings.config import ServeConfig

    chosen = flags.given(args, "serve")
    if isinstance(chosen.get("allow"), list):
        chosen["allow"] = " ".join(chosen["allow"])
    settings = ServeConfig.from_dict(chosen, source="serve flags")
    if (args.checkpoint is None) == (settings.models is None):
        raise UsageError("serve: give --checkpoint RUN (one model) or --models FILE (several), not both")
    api_key = service.read_api_key(settings)  # a missing or empty key file is said before the model loads
    prefer = {}
    if settings.models is None:
        entries = service.Entry("default", flags.translator(args))
    else:
        entries, prefer = _entries(args, settings.models)
    flags.use_compilation_cache(args)
    found = service.build(entries, settings, prefer=prefer, api_key=api_key)
    service.serve(found, print_fn=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def _entries(args: argparse.Namespace, path: str):
    """The models of a --models file, each loaded as --checkpoint would be, its entry's decoding over the flags'."""
    from jax_transformer.decoding.translator import Translator
    from jax_transformer.serving import catalogue, service

    specs, prefer = catalogue.read(path)
    compute = flags.given(args, "model")
    entries = []
    for spec in specs:
        decoding = {**flags.given(args, "decode"), **spec.decoding}
        translator = Translator(
            spec.checkpoint,
            spec.step,
            weights=spec.weights,
            mesh=flags.given(args, "parallel").get("mesh"),
            print_fn=lambda line: print(line, file=sys.stderr),
            **compute,
            **decoding,
        )
        print(f"{spec.name}: decoding: {translator.decode.describe()}", file=sys.stderr)
        entries.append(service.Entry(spec.name, translator, spec.pairs, spec.origin))
    return entries, prefer
