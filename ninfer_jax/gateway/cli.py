"""The `ninfer` command line (absl flags): `ninfer <command> --flag=value ...`.

Owns flags, exit codes and what goes to stdout (answers) versus stderr (progress, timing).
Commands: convert (HF checkpoint -> artifact), logits (next-token predictions of a model),
generate and chat (the Generation purpose, `gateway/generate.py`), serve (the HTTP server,
`gateway/server.py`), score (causal scoring, `gateway/score.py`), export-hf (a model -> HF
checkpoint).

A command that cannot do its work ends with exactly one `error: ...` line on stderr (never a
traceback) and one of these exit statuses:

    0    done
    1    runtime error: an input file or the model is missing, unreadable, not UTF-8 or
         malformed; an output is not writable or the disk is full; an output belongs to another
         job; the Engine failed; some requests of a generate/chat run failed
    2    usage error: an unknown command or flag, a flag value out of its range, a missing or
         conflicting flag, a setting the model cannot take
    3    internal error: a bug (`--traceback` prints its traceback)
    130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback

from absl import app, flags, logging

from ninfer_jax.errors import ConfigError, NinferError
from ninfer_jax.gateway import generate, score
from ninfer_jax.gateway.files import CommandError, os_reason, read_text

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "convert: the HF checkpoint directory to read")
flags.DEFINE_string("out", None, "convert: the artifact directory to write; export-hf: the HF "
                    "checkpoint directory to write")
flags.DEFINE_bool("overwrite", False, "convert, export-hf: replace --out when it holds exactly "
                  "what the same command wrote before (the old copy goes only once the new one "
                  "is in place)")
flags.DEFINE_bool("verify_weights", True, "every command that loads a model: check the weights' digests "
                  "and finiteness while loading; --noverify_weights skips it")
flags.DEFINE_string("model", None,
                    "artifact or HF checkpoint directory (default: the embedded demo model)")
flags.DEFINE_enum("quantize", None, ["int8", "int4", "fp8"],
                  "convert: write the decoder's projections as group-wise (128) symmetric "
                  "weight-only int8 or int4 (ninfer_jax.quant; an FP8 checkpoint stays FP8); "
                  "generate, chat, serve, score: quantize them as the model loads (int8, "
                  "int4); plan: weights held so (int8, int4, fp8)")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"],
                  "weights/activations dtype; auto: bf16 on GPU, fp32 on CPU (convert and "
                  "export-hf: fp32)")
flags.DEFINE_list("prompt_ids", None, "logits: comma-separated prompt token ids")
flags.DEFINE_integer("top", 5, "logits: how many top next tokens to print", lower_bound=1)
flags.DEFINE_string("host", "127.0.0.1", "serve: the address to listen on")
flags.DEFINE_integer("port", 8000, "serve: the TCP port to listen on (0: any free port)",
                     lower_bound=0, upper_bound=65535)
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
flags.DEFINE_list("allowed_origins", [], "serve: browser origins allowed by CORS, comma-separated "
                  "(`*` or https://host[:port]); CORS is off when empty")
flags.DEFINE_string("allowed_media_dir", None, "serve: a directory whose images requests may "
                    "name by file:// URL (a vision model); without it only data URLs are read")
flags.DEFINE_float("media_fetch_timeout_s", 0.0, "serve: fetch http(s) image URLs within this "
                   "many seconds, 64 MiB at most (0: never fetch)", lower_bound=0.0)
flags.DEFINE_enum("model_preset", None, ["qwen3_6_27b", "qwen3_6_35b_a3b"],
                  "plan: a published Qwen3.6 size instead of --model")
flags.DEFINE_integer("tensor_parallel", 1, "generate/chat/serve/plan: devices the model is "
                     "split over by head (on CPU, that many host devices)", lower_bound=1)
flags.DEFINE_float("device_gb", 141.0, "plan: memory of one device in GB (141: an H200)",
                   lower_bound=0.001)
flags.DEFINE_bool("traceback", False, "print the traceback of an internal error")
app.define_help_flags()

COMMANDS = ("convert", "logits", "generate", "chat", "serve", "export-hf", "score", "plan")
EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 1, 2, 3, 130


def _convert() -> int:
    from ninfer_jax.artifact.convert import convert

    if not FLAGS.hf_dir or not FLAGS.out:
        raise app.UsageError("convert needs --hf_dir=DIR and --out=DIR")
    start = time.perf_counter()
    dtype = "float32" if FLAGS.dtype == "auto" else FLAGS.dtype  # a lossless artifact
    path, notes = convert(FLAGS.hf_dir, FLAGS.out, dtype=dtype, overwrite=FLAGS.overwrite,
                          progress=sys.stderr.isatty(), drafter=FLAGS.drafter,
                          quantize=FLAGS.quantize)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {path} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)
    return 0


def _logits() -> int:
    import numpy as np

    from ninfer_jax import load_model
    from ninfer_jax.program.config import resolve_dtype

    if not FLAGS.prompt_ids:
        raise app.UsageError("logits needs --prompt_ids=1,2,3 (and --model=DIR, default: demo)")
    try:
        ids = np.array([[int(t) for t in FLAGS.prompt_ids]], np.int64)
    except (ValueError, OverflowError) as e:
        raise app.UsageError(f"--prompt_ids must be integers: {e}") from e
    start = time.perf_counter()
    model = load_model(FLAGS.model, dtype=resolve_dtype(FLAGS.dtype),
                       verify=FLAGS.verify_weights)
    vocab = model.config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        raise app.UsageError(f"--prompt_ids must be token ids in [0, {vocab}), got "
                             f"{int(ids.min() if ids.min() < 0 else ids.max())}")
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
        text = read_text("api_key_file", FLAGS.api_key_file)
        keys += [line.strip() for line in text.splitlines() if line.strip()]
        if len(keys) == len(FLAGS.api_key):
            raise app.UsageError(f"--api_key_file {FLAGS.api_key_file} holds no key")
    return keys


def _check_listen(host: str, port: int) -> None:
    """Fails early, before the model loads, when `host:port` cannot be listened on (as uvicorn
    binds: IPv6 when the host has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        raise CommandError(f"--host {host!r} --port {port}: cannot listen: "
                           f"{os_reason(e)}") from None


def _serve() -> int:
    from ninfer_jax.gateway.http.connections import ConnectionLimits, positive_seconds
    from ninfer_jax.gateway.server import run_serve

    # Bad settings and key files are reported before the address is tried (run_serve checks
    # the settings too), and all of it before the model loads.
    ConnectionLimits(FLAGS.header_timeout_s, FLAGS.keepalive_timeout_s, FLAGS.max_connections)
    positive_seconds("body_timeout_s", FLAGS.body_timeout_s)
    keys = _api_keys()
    from ninfer_jax.gateway.server import check_origins

    origins = check_origins(FLAGS.allowed_origins) or None
    _check_listen(FLAGS.host, FLAGS.port)
    return run_serve(model=FLAGS.model, host=FLAGS.host, port=FLAGS.port,
                     api_key=keys or None, max_concurrency=FLAGS.max_concurrency,
                     max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype, kv_dtype=FLAGS.kv_dtype,
                     quantize=FLAGS.quantize,
                     verify_weights=FLAGS.verify_weights, **generate.speculative_settings(),
                     **generate.parallel_settings(), **generate.store_settings(),
                     header_timeout_s=FLAGS.header_timeout_s, body_timeout_s=FLAGS.body_timeout_s,
                     keepalive_timeout_s=FLAGS.keepalive_timeout_s,
                     max_connections=FLAGS.max_connections, allowed_origins=origins,
                     local_media=FLAGS.allowed_media_dir or False,
                     media_fetch_timeout_s=FLAGS.media_fetch_timeout_s)


def _export_hf() -> int:
    from ninfer_jax import load_model
    from ninfer_jax.artifact.export import check_out, export_hf

    if not FLAGS.out:
        raise app.UsageError("export-hf needs --out=DIR (--model=DIR defaults to the demo model)")
    start = time.perf_counter()
    check_out(FLAGS.out, FLAGS.overwrite)
    dtype = "float32" if FLAGS.dtype == "auto" else FLAGS.dtype
    model = load_model(FLAGS.model, dtype=dtype, verify=FLAGS.verify_weights)
    path = export_hf(model.config, model.params, FLAGS.out, frontend_dir=model.path,
                     overwrite=FLAGS.overwrite)
    print(f"wrote {path} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)
    return 0


def _plan() -> int:
    import dataclasses

    from ninfer_jax.models.qwen3_6.config import ModelConfig
    from ninfer_jax.presets import PRESETS
    from ninfer_jax.program.config import ProgramConfig, engine_pools
    from ninfer_jax.program.plan import format_plan, memory_plan

    if (FLAGS.model_preset is None) == (FLAGS.model is None):
        raise app.UsageError("plan needs exactly one of --model_preset=NAME and --model=DIR "
                             "(an HF checkpoint directory)")
    if FLAGS.model_preset is not None:
        name, cfg = FLAGS.model_preset, PRESETS[FLAGS.model_preset]
    else:
        name, cfg = FLAGS.model, ModelConfig.from_hf_dir(FLAGS.model)
    dtype = "bfloat16" if FLAGS.dtype == "auto" else FLAGS.dtype  # planned for accelerators
    settings = generate.speculative_settings()
    if settings.get("speculative") == "dflash":
        raise app.UsageError("plan covers --speculative=off and mtp (a DFlash drafter's "
                             "context pools are not planned yet)")
    if settings:
        settings.setdefault("num_speculative_tokens", 1)  # Engine.open's MTP default
    pcfg = ProgramConfig(max_concurrency=FLAGS.max_concurrency, max_seq_len=FLAGS.max_seq_len,
                         dtype=dtype, kv_dtype=FLAGS.kv_dtype, attention_impl="reference",
                         gdn_impl="reference", **settings)
    pcfg = dataclasses.replace(pcfg, **engine_pools(pcfg))  # what Engine.open allocates
    plan = memory_plan(cfg, pcfg, tensor_parallel=FLAGS.tensor_parallel,
                       device_bytes=int(FLAGS.device_gb * 1e9), quantize=FLAGS.quantize)
    print(format_plan(name, cfg, pcfg, plan, FLAGS.quantize))
    return 0


_RUNNERS = {"convert": _convert, "logits": _logits, "generate": generate.run_generate,
            "chat": generate.run_chat, "serve": _serve, "score": score.run_score,
            "export-hf": _export_hf, "plan": _plan}


def _error(status: int, message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


class _Stdout:
    """sys.stdout while a command runs: a failed write (full disk, closed pipe) becomes a
    CommandError naming stdout, and the rest of the buffer goes to /dev/null so the exit does
    not fail a second time flushing it."""

    def __init__(self, stream):
        self._stream = stream

    def _failed(self, e: OSError) -> CommandError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)
        return CommandError(f"cannot write to stdout: {os_reason(e)}")

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise self._failed(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise self._failed(e) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _run(command: str) -> int:
    from ninfer_jax.compile_cache import enable_persistent_cache

    enable_persistent_cache()
    status = _RUNNERS[command]()
    sys.stdout.flush()  # a full disk behind a buffered stdout shows here
    return status


def _dispatch(command: str) -> int:
    """Runs one command and maps every way it can fail to one `error:` line and a status."""
    stdout, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        return _run(command)
    except (app.UsageError, ConfigError) as e:
        return _error(EXIT_USAGE, str(e))
    except NinferError as e:
        return _error(EXIT_RUNTIME, str(e))
    except OSError as e:
        return _error(EXIT_RUNTIME, os_reason(e) if e.filename is None
                      else f"{e.filename}: {os_reason(e)}")
    except UnicodeDecodeError as e:
        return _error(EXIT_RUNTIME, f"a file is not UTF-8 text: {e}")
    except KeyboardInterrupt:
        return _error(EXIT_INTERRUPTED, "interrupted")
    except Exception as e:  # noqa: BLE001 - a bug still ends with one error line
        if FLAGS.traceback:
            traceback.print_exc()
        return _error(EXIT_INTERNAL, f"internal error: {type(e).__name__}: {e} (a bug; "
                      "--traceback prints where)")
    finally:
        sys.stdout = stdout


def main(argv: list[str]) -> int:
    """`ninfer <command> --flags`: `argv` as sys.argv holds it; returns the exit status."""
    if len(argv) < 2 or argv[1] not in COMMANDS:
        given = f"unknown command {argv[1]!r}" if len(argv) > 1 else "no command"
        return _error(EXIT_USAGE, f"{given}; usage: ninfer <{'|'.join(COMMANDS)}> [--flags]")
    command = argv[1]
    FLAGS.unparse_flags()  # every call starts from the defaults
    try:
        rest = FLAGS([argv[0], *argv[2:]])
    except flags.Error as e:
        return _error(EXIT_USAGE, f"{e} (ninfer {command} --helpshort lists the flags)")
    if len(rest) != 1:
        return _error(EXIT_USAGE, f"unexpected arguments {rest[1:]}; flags are --name=value")
    logging.use_absl_handler()
    logging.set_verbosity(logging.WARNING)
    return _dispatch(command)


def run() -> None:
    """Console-script entry. A command that ran a model ends its process as soon as its output
    is written and its Engine closed (store writes flushed): the interpreter's teardown of the
    XLA runtime took ~0.6 s after the last token, and a background compile still running (of
    an executable no request used) would be waited for."""
    code = main(sys.argv)
    if "ninfer_jax.program.executables" in sys.modules:  # a command ran a model
        logging.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can be written
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
