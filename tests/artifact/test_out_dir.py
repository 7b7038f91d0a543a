"""`--out` safety of `ninfer convert` and `ninfer export-hf`: nothing foreign is ever removed,
replacement needs `--overwrite` and is atomic, and a failed or killed write leaves the old
output as it was. The failures are real: a file-size limit (RLIMIT_FSIZE) makes the kernel fail
or kill the writer while it copies a frontend file into its temporary directory.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from ninfer_jax import load_model
from ninfer_jax.artifact import staging
from ninfer_jax.artifact.convert import convert
from ninfer_jax.artifact.export import export_hf
from ninfer_jax.errors import CheckpointError
from tests.conftest import FIXTURES, REPO

RUN_CLI = "from ninfer_jax.gateway.cli import run; run()"
FSIZE_LIMIT = 256 << 10
# The CLI under a file-size limit: a write past it fails with EFBIG (Python ignores SIGXFSZ).
LIMITED = ("import resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
           f"resource.setrlimit(resource.RLIMIT_FSIZE, ({FSIZE_LIMIT}, {FSIZE_LIMIT})); ")
# The same with SIGXFSZ at its default action: the kernel kills the process mid-write.
KILLABLE = LIMITED + "import signal; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); "


def _cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", prelude + RUN_CLI, *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300, check=False,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def _snapshot(root: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _web_project(path: pathlib.Path) -> dict[str, bytes]:
    (path / "src").mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"name": "my web app", "start_url": "/"}))
    (path / "src" / "app.js").write_text("console.log('hello');\n")
    return _snapshot(path)


def _assert_error_line(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode != 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert lines, done.stderr[-2000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]


@pytest.mark.parametrize("command", ["convert", "export-hf"])
def test_a_users_directory_with_a_manifest_survives_and_the_command_fails(tmp_path, command):
    web = tmp_path / "site"
    before = _web_project(web)
    source = (f"--hf_dir={FIXTURES / 'dense'}" if command == "convert"
              else f"--model={FIXTURES / 'dense'}")
    done = _cli(command, source, f"--out={web}", "--overwrite")
    _assert_error_line(done, str(web), "is not empty and is not", "'manifest.json'", "'src'")
    assert _snapshot(web) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # no temporary left behind


def test_library_calls_refuse_a_foreign_directory_with_or_without_overwrite(tmp_path):
    web = tmp_path / "site"
    before = _web_project(web)
    cfg = load_model(FIXTURES / "dense").config
    params = load_model(FIXTURES / "dense").params
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match="is not empty and is not a ninfer artifact"):
            convert(FIXTURES / "dense", web, overwrite=overwrite)
        with pytest.raises(CheckpointError, match="is not a checkpoint written by"):
            export_hf(cfg, params, web, overwrite=overwrite)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        convert(FIXTURES / "dense", tmp_path / "file")
    assert _snapshot(web) == before


def test_an_empty_directory_is_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    convert(FIXTURES / "dense", out)
    np.testing.assert_array_equal(load_model(out).params["embed"],
                                  load_model(FIXTURES / "dense").params["embed"])
    hf = tmp_path / "empty_hf"
    hf.mkdir()
    export_hf(load_model(out).config, load_model(out).params, hf)
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "empty_hf"]


def test_reconvert_over_our_own_artifact_needs_overwrite_and_replaces_it_whole(tmp_path):
    out = tmp_path / "art"
    convert(FIXTURES / "dense", out)
    first = _snapshot(out)
    with pytest.raises(CheckpointError, match="already holds a ninfer artifact; pass --overwrite"):
        convert(FIXTURES / "dense", out, dtype="bfloat16")
    assert _snapshot(out) == first
    convert(FIXTURES / "dense", out, dtype="bfloat16", overwrite=True)
    assert load_model(out, dtype="bfloat16").params["embed"].dtype == "bfloat16"
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # old copy and temporary gone
    # One file the converter did not write makes the directory foreign again.
    (out / "weights" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="it holds 'weights/notes.txt'"):
        convert(FIXTURES / "dense", out, overwrite=True)
    assert (out / "weights" / "notes.txt").read_text() == "mine"


def test_re_export_over_our_own_checkpoint_needs_overwrite(tmp_path):
    model = load_model(FIXTURES / "dense")
    out = tmp_path / "hf"
    export_hf(model.config, model.params, out)
    first = _snapshot(out)
    with pytest.raises(CheckpointError, match="already holds a checkpoint written by"):
        export_hf(model.config, model.params, out)
    assert _snapshot(out) == first
    doubled = jax.tree.map(lambda a: a * 2, model.params)
    export_hf(model.config, doubled, out, overwrite=True)
    np.testing.assert_array_equal(load_model(out).params["embed"], doubled["embed"])
    (out / "README.md").write_text("mine")
    with pytest.raises(CheckpointError, match="it holds 'README.md'"):
        export_hf(model.config, model.params, out, overwrite=True)
    assert (out / "README.md").read_text() == "mine"


@pytest.fixture
def old_artifact(tmp_path):
    """(HF source with a frontend file larger than FSIZE_LIMIT, its artifact, the bytes)."""
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "dense", src)
    (src / "tokenizer.json").write_text(json.dumps({"pad": "x" * (2 * FSIZE_LIMIT)}))
    out = tmp_path / "art"
    convert(src, out)
    return src, out, _snapshot(out)


def test_a_write_failing_part_way_leaves_the_old_artifact_and_no_temporary(old_artifact):
    src, out, before = old_artifact
    done = _cli("convert", f"--hf_dir={src}", f"--out={out}", "--overwrite", prelude=LIMITED)
    _assert_error_line(done, "writing --out", "File too large", "left as it was")
    assert _snapshot(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["art", "hf"]
    load_model(out)


def test_a_writer_killed_part_way_leaves_the_old_artifact_and_a_marked_temporary(old_artifact):
    src, out, before = old_artifact
    done = _cli("convert", f"--hf_dir={src}", f"--out={out}", "--overwrite", prelude=KILLABLE)
    assert done.returncode == -signal.SIGXFSZ, done.stderr[-2000:]
    assert _snapshot(out) == before
    load_model(out)
    leftovers = [p for p in out.parent.iterdir() if p.name not in ("art", "hf")]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".art.ninfer-tmp-"), leftovers
    assert (leftovers[0] / "tokenizer.json").is_file()  # it died while copying this file
    left = _snapshot(leftovers[0])
    # The next run neither trips over nor touches it.
    convert(src, out, overwrite=True)
    load_model(out)
    assert _snapshot(leftovers[0]) == left


@pytest.mark.parametrize("start", ["new", "empty"])
def test_a_foreign_directory_appearing_in_out_while_converting_survives(tmp_path, monkeypatch,
                                                                        start):
    """Someone else fills `--out` after the first check, while the artifact is being written:
    the second check (just before the rename) refuses, and their files stay as they were."""
    out = tmp_path / "art"
    if start == "empty":
        out.mkdir()
    real_fsync_tree = staging._fsync_tree
    appeared = {}

    def fill_out_then_fsync(root):
        if out.exists():
            (out / "manifest.json").write_text('{"name": "theirs"}')
        else:
            _web_project(out)
        appeared.update(_snapshot(out))
        real_fsync_tree(root)

    monkeypatch.setattr(staging, "_fsync_tree", fill_out_then_fsync)
    with pytest.raises(CheckpointError, match="is not empty and is not a ninfer artifact"):
        convert(FIXTURES / "dense", out)
    assert appeared and _snapshot(out) == appeared
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # the temporary is removed
