"""Every `ninfer` command ends bad input with exactly one `error:` line and its exit status.

The table runs `cli.main` in this process (the console script is `sys.exit(main(sys.argv))`);
the cases that need a process of their own (stdout on a full disk, a read-only directory, an
unreadable file) run the real command as a subprocess. As root, the subprocess drops its
CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH so that file modes bind it as they bind a user.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import pytest

from ninfer_jax.gateway import cli
from tests.conftest import FIXTURES, REPO

USAGE, RUNTIME = cli.EXIT_USAGE, cli.EXIT_RUNTIME


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
    d = tmp_path_factory.mktemp("inputs")
    paths = {
        "jsonl": d / "in.jsonl", "not_utf8": d / "latin1.txt", "not_json": d / "bad.json",
        "object": d / "object.json", "bad_model": d / "bad_model", "out_dir": d / "out",
        "empty": d / "empty.txt",
    }
    paths["empty"].write_text("\n  \n")
    paths["jsonl"].write_text(json.dumps({"text": "the cat"}) + "\n")
    paths["not_utf8"].write_bytes("caf\xe9 au lait".encode("latin-1"))
    paths["not_json"].write_text("[{'role': 'user'}")
    paths["object"].write_text(json.dumps({"role": "user", "content": "hi"}))
    paths["bad_model"].mkdir()
    (paths["bad_model"] / "config.json").write_bytes(b"{\"vocab_size\": \xff}")
    (paths["bad_model"] / "model.safetensors").write_bytes(b"")
    paths["out_dir"].mkdir()
    return paths


def _busy_port() -> tuple[socket.socket, int]:
    sock = socket.create_server(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


# (argv after `ninfer`, exit status, a fragment of the error line); {name} is a `files` path.
CASES = [
    ([], USAGE, "no command"),
    (["bogus"], USAGE, "unknown command 'bogus'"),
    (["serve", "--port=70000"], USAGE, "--port=70000"),
    (["serve", "--port=-1"], USAGE, "--port=-1"),
    (["serve", "--port=eighty"], USAGE, "--port=eighty"),
    (["score", "--bogus=1"], USAGE, "'bogus'"),
    (["score", "stray"], USAGE, "unexpected arguments ['stray']"),
    (["score", "--chunk_records=0"], USAGE, "--chunk_records=0"),
    (["score", "--max_batch_tokens=-5"], USAGE, "--max_batch_tokens=-5"),
    (["score", "--window=0"], USAGE, "--window=0"),
    (["score"], USAGE, "--input"),
    (["score", "--input={out_dir}/missing.jsonl", "--output={out_dir}/a.jsonl"], RUNTIME,
     "--input"),
    (["score", "--input={out_dir}", "--output={out_dir}/a.jsonl"], RUNTIME, "not a regular file"),
    (["score", "--input=/dev/zero", "--output={out_dir}/a.jsonl"], RUNTIME, "not a regular file"),
    (["score", "--input={jsonl}", "--output=/dev/full"], RUNTIME, "not a regular file"),
    (["score", "--input={jsonl}", "--output={out_dir}/no/such/dir.jsonl"], RUNTIME,
     "No such file or directory"),
    (["score", "--perplexity={not_utf8}"], RUNTIME, "not UTF-8: byte 0xe9 at offset 3"),
    (["score", "--perplexity={out_dir}/missing.txt"], RUNTIME, "--perplexity"),
    (["score", "--input={jsonl}", "--output={out_dir}/b.jsonl", "--model={out_dir}/none"],
     RUNTIME, "does not exist"),
    (["generate"], USAGE, "--prompt"),
    (["generate", "--prompt=x", "--max_concurrency=0"], USAGE, "--max_concurrency=0"),
    (["generate", "--prompt=x", "--max_concurrency=65"], USAGE, "--max_concurrency=65"),
    (["generate", "--prompt=x", "--max_new_tokens=0"], USAGE, "--max_new_tokens=0"),
    (["generate", "--prompt=x", "--seed=-1"], USAGE, "--seed=-1"),
    (["generate", "--prompt=x", "--top_p=1.5"], USAGE, "top_p must be"),
    (["generate", "--prompt=x", "--temperature=nan"], USAGE, "temperature must be"),
    (["generate", "--messages={out_dir}/missing.json"], RUNTIME, "--messages"),
    (["generate", "--messages={not_utf8}"], RUNTIME, "not UTF-8"),
    (["generate", "--messages={not_json}"], RUNTIME, "not valid JSON"),
    (["generate", "--messages={object}"], RUNTIME, "a JSON list of messages"),
    (["generate", "--input_jsonl={out_dir}/missing.jsonl"], RUNTIME, "--input_jsonl"),
    (["generate", "--prompt=x", "--model={out_dir}/none"], RUNTIME, "does not exist"),
    (["generate", "--prompt=x", "--num_speculative_tokens=2"], USAGE,
     "--num_speculative_tokens needs --speculative=mtp"),
    (["generate", "--prompt=x", "--speculative=mtp", "--num_speculative_tokens=6"], USAGE,
     "--num_speculative_tokens=6"),
    (["generate", "--prompt=x", "--speculative=dflash", "--num_speculative_tokens=16"], USAGE,
     "--num_speculative_tokens=16"),
    (["generate", "--prompt=x", "--drafter=/nowhere"], USAGE,
     "--drafter needs --speculative=dflash"),
    (["chat", "--speculative=mtp", "--draft_head=selector"], USAGE,
     "--draft_head needs --speculative=dflash"),
    (["generate", "--prompt=x", "--speculative=dflash", "--draft_head=top"], USAGE,
     "--draft_head"),
    (["generate", "--prompt=x", "--speculative=dflash", "--drafter=/nowhere"], RUNTIME,
     "checkpoint directory '/nowhere' does not exist"),
    (["generate", "--prompt=x", "--speculative=eagle"], USAGE, "--speculative=eagle"),
    (["chat", "--num_speculative_tokens=1"], USAGE,
     "--num_speculative_tokens needs --speculative=mtp"),
    (["serve", "--port=0", "--num_speculative_tokens=3"], USAGE,
     "--num_speculative_tokens needs --speculative=mtp"),
    (["chat", "--max_seq_len=1"], USAGE, "--max_seq_len=1"),
    (["chat", "--model={bad_model}"], RUNTIME, "not UTF-8"),
    (["logits"], USAGE, "--prompt_ids"),
    (["logits", "--prompt_ids=1,two"], USAGE, "--prompt_ids must be integers"),
    (["logits", "--prompt_ids=1", "--top=0"], USAGE, "--top=0"),
    (["logits", "--prompt_ids=1", "--model={out_dir}/none"], RUNTIME, "does not exist"),
    (["convert"], USAGE, "--hf_dir"),
    (["convert", "--hf_dir={out_dir}/none", "--out={out_dir}/art"], RUNTIME, "does not exist"),
    (["export-hf"], USAGE, "--out"),
    (["export-hf", "--model={out_dir}/none", "--out={out_dir}/hf"], RUNTIME, "does not exist"),
    (["serve", "--port=0", "--model={out_dir}/none"], RUNTIME, "does not exist"),
    (["serve", "--api_key_file={out_dir}/missing.txt"], RUNTIME, "--api_key_file"),
    (["serve", "--api_key_file={not_utf8}"], RUNTIME, "not UTF-8"),
    (["serve", "--api_key_file={empty}"], USAGE, "holds no key"),
    (["serve", "--header_timeout_s=0"], USAGE, "header_timeout_s"),
    (["serve", "--max_connections=0"], USAGE, "max_connections"),
]


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv, status, fragment", CASES, ids=lambda c: str(c)[:60])
def test_bad_input_is_one_error_line(argv, status, fragment, files, capsys):
    argv = [a.format(**files) for a in argv]
    assert cli.main(["ninfer", *argv]) == status
    assert fragment in _one_error_line(capsys.readouterr().err)


def test_a_port_in_use_is_refused_before_the_model_loads(capsys):
    sock, port = _busy_port()
    with sock:
        assert cli.main(["ninfer", "serve", f"--port={port}", "--model=/nonexistent"]) == RUNTIME
    assert f"--port {port}: cannot listen" in _one_error_line(capsys.readouterr().err)


# As root, drop the capabilities that bypass file modes from the bounding set, then exec the
# command: it runs without them (a user has none to drop). Done in a small exec'd stub rather
# than a preexec_fn, which would fork this (multithreaded, jax) process.
_DROP_DAC_THEN_EXEC = """
import ctypes, os, sys
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
os.execv(sys.argv[1], sys.argv[1:])
"""


def ninfer(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """The real command in a subprocess, bound by file modes even as root."""
    cmd = [sys.executable, "-c", _DROP_DAC_THEN_EXEC, sys.executable, "-m",
           "ninfer_jax.gateway.cli", *args]
    return subprocess.run(cmd, check=False, cwd=REPO, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=300)


def test_stdout_on_a_full_disk():
    with open("/dev/full", "w") as full:
        done = ninfer("logits", "--prompt_ids=1,2,3", stdout=full)
    assert done.returncode == RUNTIME
    assert "cannot write to stdout: No space left on device" in _one_error_line(done.stderr)


def test_read_only_directory_and_unreadable_input(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "the cat"}) + "\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    done = ninfer("score", f"--input={src}", f"--output={ro / 'out.jsonl'}")
    assert done.returncode == RUNTIME
    assert "Permission denied" in _one_error_line(done.stderr)
    assert list(ro.iterdir()) == []
    for args in (["export-hf", f"--out={ro / 'hf'}"],
                 ["convert", f"--hf_dir={FIXTURES / 'dense'}", f"--out={ro / 'artifact'}"]):
        done = ninfer(*args)
        assert done.returncode == RUNTIME
        assert "Permission denied" in _one_error_line(done.stderr)
    assert list(ro.iterdir()) == []
    src.chmod(0)
    done = ninfer("generate", f"--input_jsonl={src}")
    assert done.returncode == RUNTIME
    line = _one_error_line(done.stderr)
    assert "--input_jsonl" in line and "Permission denied" in line


def test_a_command_that_ran_a_model_ends_its_process_at_once(monkeypatch):
    """`ninfer` ends a process that ran a model (the executables module is loaded) with
    os._exit and the command's status once its output is flushed: no interpreter teardown of
    the XLA runtime, no wait for a background compile; other commands exit as usual."""
    import ninfer_jax.program.executables  # noqa: F401 - as after a command that ran a model

    ended = []

    class Ended(Exception):
        pass

    def fake_exit(code):
        ended.append(code)
        raise Ended

    monkeypatch.setattr(sys, "argv", ["ninfer", "no-such-command"])
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    with pytest.raises(Ended):
        cli.run()
    assert ended == [USAGE]
    monkeypatch.delitem(sys.modules, "ninfer_jax.program.executables")
    with pytest.raises(SystemExit) as e:
        cli.run()
    assert e.value.code == USAGE and ended == [USAGE]
