"""The `ninfer` command line (absl flags): `ninfer <command> --flag=value ...`.

Owns flags, exit codes and what goes to stdout (answers) versus stderr (progress, timing).
Commands: convert (HF checkpoint -> artifact), logits (next-token predictions of a model),
generate and chat (the Generation purpose, `gateway/generate.py`), serve (the HTTP server,
`gateway/server.py`), export-hf (a model -> HF checkpoint).
"""

from __future__ import annotations

import sys
import time

from absl import app, flags, logging

from ninfer_jax.gateway import generate, score

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "convert: the HF checkpoint directory to read")
flags.DEFINE_string("out", None, "convert: the artifact directory to write; export-hf: the HF "
                    "checkpoint directory to write")
flags.DEFINE_bool("overwrite", False, "convert, export-hf: replace --out when it holds exactly "
                  "what the same command wrote before (the old copy goes only once the new one "
                  "is in place)")
flags.DEFINE_bool("verify_weights", True, "generate, chat, export-hf: check the weights' digests "
                  "and finiteness while loading; --noverify_weights skips it")
flags.DEFINE_string("model", None,
                    "artifact or HF checkpoint directory (default: the embedded demo model)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights/activations dtype")
flags.DEFINE_list("prompt_ids", None, "logits: comma-separated prompt token ids")
flags.DEFINE_integer("top", 5, "logits: how many top next tokens to print")
flags.DEFINE_string("host", "127.0.0.1", "serve: the address to listen on")
flags.DEFINE_integer("port", 8000, "serve: the TCP port to listen on")
flags.DEFINE_multi_string("api_key", [], "serve: when set, requests need `Authorization: Bearer "
                          "KEY` or `x-api-key`; repeat for several keys, one tenant each "
                          "(prefix caches never shared between tenants)")
flags.DEFINE_string("api_key_file", None, "serve: a file with one API key per line (keeps keys "
                    "out of the process list); adds to --api_key")
flags.DEFINE_float("header_timeout_s", 60.0, "serve: a request head must be complete within "
                   "this many seconds of the connection opening (or of its first byte after a "
                   "keep-alive response)")
flags.DEFINE_float("body_timeout_s", 60.0,
                   "serve: a request body must be complete within this many seconds (else 408)")
flags.DEFINE_float("keepalive_timeout_s", 5.0,
                   "serve: an idle keep-alive connection closes after this many seconds")
flags.DEFINE_integer("max_connections", 512, "serve: open connections at most; a new one "
                     "beyond it evicts the one waiting longest for a request head, or is "
                     "closed at once")

COMMANDS = ("convert", "logits", "generate", "chat", "serve", "export-hf", "score")


def _convert() -> int:
    from ninfer_jax.artifact.convert import convert

    if not FLAGS.hf_dir or not FLAGS.out:
        raise app.UsageError("convert needs --hf_dir=DIR and --out=DIR")
    start = time.perf_counter()
    path, notes = convert(FLAGS.hf_dir, FLAGS.out, dtype=FLAGS.dtype, overwrite=FLAGS.overwrite)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {path} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)
    return 0


def _logits() -> int:
    import numpy as np

    from ninfer_jax import load_model

    if not FLAGS.prompt_ids:
        raise app.UsageError("logits needs --prompt_ids=1,2,3 (and --model=DIR, default: demo)")
    try:
        ids = np.array([[int(t) for t in FLAGS.prompt_ids]], np.int32)
    except ValueError as e:
        raise app.UsageError(f"--prompt_ids must be integers: {e}") from e
    start = time.perf_counter()
    model = load_model(FLAGS.model, dtype=FLAGS.dtype)
    logits = model.logits(ids)[0, -1]
    print(f"loaded and ran in {time.perf_counter() - start:.2f}s", file=sys.stderr)
    top = np.argsort(-logits)[: FLAGS.top]
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    for t in top:
        print(f"{int(t)}\t{logp[t]:.4f}")
    return 0


def _api_keys() -> list[str]:
    keys = list(FLAGS.api_key)
    if FLAGS.api_key_file:
        with open(FLAGS.api_key_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip()]
        if len(keys) == len(FLAGS.api_key):
            raise app.UsageError(f"--api_key_file {FLAGS.api_key_file} holds no key")
    return keys


def _serve() -> int:
    from ninfer_jax.gateway.server import run_serve

    return run_serve(model=FLAGS.model, host=FLAGS.host, port=FLAGS.port,
                     api_key=_api_keys() or None, max_concurrency=FLAGS.max_concurrency,
                     max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype,
                     header_timeout_s=FLAGS.header_timeout_s, body_timeout_s=FLAGS.body_timeout_s,
                     keepalive_timeout_s=FLAGS.keepalive_timeout_s,
                     max_connections=FLAGS.max_connections)


def _export_hf() -> int:
    from ninfer_jax import load_model
    from ninfer_jax.artifact.export import check_out, export_hf

    if not FLAGS.out:
        raise app.UsageError("export-hf needs --out=DIR (--model=DIR defaults to the demo model)")
    start = time.perf_counter()
    check_out(FLAGS.out, FLAGS.overwrite)
    model = load_model(FLAGS.model, dtype=FLAGS.dtype, verify=FLAGS.verify_weights)
    path = export_hf(model.config, model.params, FLAGS.out, frontend_dir=model.path,
                     overwrite=FLAGS.overwrite)
    print(f"wrote {path} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)
    return 0


def _main(argv: list[str]) -> int:
    from ninfer_jax.compile_cache import enable_persistent_cache
    from ninfer_jax.errors import NinferError

    if len(argv) != 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    enable_persistent_cache()
    logging.set_verbosity(logging.WARNING)
    try:
        return {"convert": _convert, "logits": _logits, "generate": generate.run_generate,
                "chat": generate.run_chat, "serve": _serve, "score": score.run_score,
                "export-hf": _export_hf}[_COMMAND]()
    except NinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


_COMMAND = ""


def run() -> None:
    """Console-script entry: the first argument picks the command."""
    global _COMMAND
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: ninfer <{'|'.join(COMMANDS)}> [--flags]", file=sys.stderr)
        sys.exit(2)
    _COMMAND = sys.argv.pop(1)
    app.run(_main)


if __name__ == "__main__":
    run()
