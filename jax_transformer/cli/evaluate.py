"""Validation loss and BLEU/chrF of a checkpoint, over one decoding or a table of them (`evaluate`)."""

from __future__ import annotations

import json
import sys
import time

from jax_transformer.cli import flags, output


def add(sub) -> None:
    e = sub.add_parser(
        "evaluate",
        help="validation loss, perplexity, accuracy, BLEU and chrF of a checkpoint",
        description="Validation loss, perplexity, token accuracy, and sacreBLEU BLEU/chrF (cased, detokenized, "
        "13a) with their signatures, plus the lowercased 13a-tokenized BLEU tutorials report. Several "
        "--beam-size/--alpha values give a table of every combination (beam 1 is greedy; alpha does not apply "
        "to it), to choose the decoding on the validation set.",
    )
    flags.checkpoint_flags(e, compute=True, mesh=True, ensemble=True)
    flags.language_flags(e)
    flags.evaluation_data_flags(e)
    flags.compilation_flags(e)
    flags.decoding_flags(e, several=True, more=("samples",))
    e.add_argument(
        "--output",
        metavar="FILE",
        help="also write the translations to FILE, one per line (with several decodings: the best one's)",
    )
    e.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.decoding import evaluation, loading
    from jax_transformer.settings.config import LoopConfig, check_decoding
    from jax_transformer.settings.resolve import evaluation_decoding
    from jax_transformer.training import trainer

    flags.use_compilation_cache(args)
    loaded = flags.load(args)
    ensemble = flags.ensemble(args, loaded)  # None for one checkpoint
    valid = flags.evaluation_data(args, loaded)
    eval_step = trainer.make_eval_step(loaded.config, loaded.optim.get("label_smoothing", 0.1))
    result = {"step": loaded.step, **trainer.evaluate_loss(loaded.params, eval_step, valid.batches)}
    output.say(
        f"step {loaded.step}: loss {result['loss']:.3f}, perplexity {result['ppl']:.2f}, token accuracy "
        f"{100 * result['accuracy']:.1f}% ({len(valid.sources)} sentences)"
    )
    params, config = loaded.params, loaded.config
    if ensemble is not None:  # the loss above is the first checkpoint's; BLEU is the ensemble's
        params, config = ensemble.params, ensemble.config
        result["ensemble"] = {"checkpoints": list(ensemble.names), "weights": list(ensemble.weights)}
        output.say(f"ensemble of {len(ensemble.names)}: {', '.join(ensemble.names)} (the loss is the first's)")
    rows, outputs = [], []
    for decode in loading.decodings(loaded, flags.given(args, "decode")):
        if ensemble is not None:  # against the ensemble's limits too (the shortest max_len)
            check_decoding(config, decode, {"--beam-size": [decode.beams]})
        print(f"decoding: {decode.describe()}", file=sys.stderr)
        began = time.time()
        scores, hypotheses = evaluation.evaluate_translations(
            params,
            config,
            loaded.tokenizer,
            valid.sources,
            valid.references,
            evaluation_decoding(decode),
            languages=valid.languages,
        )
        row = {**scores, "beam_size": decode.beam_size, "alpha": decode.alpha}
        rows.append({**row, "seconds": round(time.time() - began, 1)})
        outputs.append(hypotheses)
    best = max(range(len(rows)), key=lambda i: rows[i]["bleu"])
    hypotheses = outputs[best]
    samples = flags.given(args, "loop").get("samples", LoopConfig().samples)
    for i in evaluation.spread_indices(len(hypotheses), samples):
        output.say(f"  source:    {valid.sources[i]}\n  reference: {valid.references[i]}\n  model:     {hypotheses[i]}")
    for line in evaluation.describe_sweep(rows, best):
        output.say(line)
    if args.output:  # the translations of the best row
        from jax_transformer import files

        files.write_text(args.output, "".join(h + "\n" for h in hypotheses))
    result["sentences"] = len(valid.sources)
    if len(rows) == 1:
        result.update({k: v for k, v in rows[0].items() if k != "seconds"})
    else:
        result.update(sweep=rows, best={k: rows[best][k] for k in ("beam_size", "alpha", "bleu", "chrf")})
    output.say(json.dumps(result))
    return 0
