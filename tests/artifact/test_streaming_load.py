"""Conversion and loading stream: host peak memory stays about one shard, whatever the model.

A synthetic sharded bf16 HF checkpoint (`synthetic.py`: real head sizes, big widths, few
layers) is converted to an artifact and loaded, each in a fresh process, and the process's peak
RSS (VmHWM, reset after the imports) is compared with its RSS at that point. What is measured:
- convert: everything the conversion holds (no device involved).
- load: `load_params` with a placement that keeps no device copy (it returns a 0-d stand-in),
  so the figure is the host memory the loading itself takes; with a real placement the device
  buffers come on top (on the CPU backend they are host memory: the whole model).
Each must stay under 1.3 x the largest shard file. The small variant (~350 MB) runs in the
default tier; the ~2.4 GB one (7 shards of ~400 MB) is slow. Both also check that what loads
is what the checkpoint holds.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

from ninfer_jax.artifact import digests
from ninfer_jax.artifact import format as format_
from ninfer_jax.artifact.convert import convert
from ninfer_jax.artifact.hf import SafetensorsSource
from ninfer_jax.errors import CheckpointError
from ninfer_jax.loader import load_model, load_params
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.weights import params_from_hf
from tests.artifact import synthetic
from tests.conftest import FIXTURES, REPO

BOUND = 1.3  # x the largest shard file


def _probe(what: str, src: pathlib.Path, out: pathlib.Path | str = "-") -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "tests.artifact.synthetic", "probe", what,
                           str(src), str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_bounds(config: dict, shard_bytes: int, compare: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="ninfer_stream_") as tmp:
        hf, art = pathlib.Path(tmp) / "hf", pathlib.Path(tmp) / "art"
        shards = synthetic.write_checkpoint(hf, config, shard_bytes)
        limit = BOUND * max(shards)
        runs = [_probe("convert", hf, art), _probe("load_params", art),
                _probe("load_params", hf)]
        for run in runs:
            used = run["peak"] - run["baseline"]
            print(f"{run['what']}: peak - baseline {used / 2**20:.0f} MiB (limit "
                  f"{limit / 2**20:.0f} MiB, model {run['held'] / 2**20:.0f} MiB) in "
                  f"{run['seconds']:.1f} s")
            assert used < limit, (run, shards)
        assert runs[1]["held"] == runs[2]["held"] > 2 * max(shards)  # bigger than a shard
        if compare:  # what streams out is what the checkpoint holds, bit for bit
            cfg = ModelConfig.from_hf_dict(config)
            whole, _ = params_from_hf(cfg, SafetensorsSource(hf))
            keep = load_params(art, "bfloat16", placement=lambda p, a: a).params
            from_hf = load_params(hf, "bfloat16", placement=lambda p, a: a).params
            for name, want in digests.named_leaves(whole).items():
                for got in (digests.named_leaves(keep)[name], digests.named_leaves(from_hf)[name]):
                    assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_convert_and_load_of_a_sharded_checkpoint_hold_about_one_shard():
    _check_bounds(synthetic.dense_config(1024, 4096, 4, 32768), 100 << 20, compare=True)


@pytest.mark.slow
def test_convert_and_load_of_a_2_gb_checkpoint_hold_about_one_shard():
    _check_bounds(synthetic.dense_config(2048, 8192, 12, 65536), 420_000_000, compare=False)


@pytest.fixture(scope="module")
def art4(tmp_path_factory) -> pathlib.Path:
    return convert(FIXTURES / "dense", tmp_path_factory.mktemp("art") / "dense")[0]


def test_format_4_stores_one_safetensors_file_per_leaf_with_the_digests_of_a_whole_scan(art4):
    manifest = json.loads((art4 / "manifest.json").read_text())
    assert manifest["format_version"] == format_.FORMAT_VERSION == 4
    _, params, _ = format_.read_artifact(art4)
    tensors = {n: np.asarray(a) for n, a in digests.named_leaves(params).items()}
    sums, _ = digests.scan(tensors)
    assert {n: r["digest"] for n, r in manifest["tensors"].items()} == sums
    assert sorted(p.name for p in (art4 / "weights").iterdir()) == sorted(
        f"{n}.safetensors" for n in tensors)
    # The stream equals the HF checkpoint read whole, in every dtype it is loaded in.
    cfg = ModelConfig.from_hf_dict(json.loads((FIXTURES / "dense" / "config.json").read_text()))
    whole, _ = params_from_hf(cfg, SafetensorsSource(FIXTURES / "dense"))
    for dtype in ("float32", "bfloat16"):
        for path in (art4, FIXTURES / "dense"):
            got = digests.named_leaves(load_model(path, dtype).params)
            for name, want in digests.named_leaves(whole).items():
                np.testing.assert_array_equal(np.asarray(got[name]),
                                              want.astype(jax.numpy.dtype(dtype)))


def test_placement_sees_every_key_path_once_with_host_arrays_in_the_dtype(art4):
    seen = []

    def place(path, host):
        assert isinstance(host, np.ndarray) and host.dtype == np.dtype(jax.numpy.bfloat16)
        seen.append(path)
        return jax.device_put(host)

    loaded = load_params(art4, "bfloat16", placement=place)
    flat = jax.tree_util.tree_flatten_with_path(loaded.params)[0]
    assert seen == [tuple(k.key for k in p) for p, _ in flat]
    assert ("attention", "mixer", "q") in seen


def test_a_flipped_byte_in_a_format_4_leaf_is_named_and_verify_false_skips_it(art4, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(art4, art)
    file = art / "weights" / "linear.mixer.in_qkv.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor 'linear.mixer.in_qkv' does not match its "
                       r"digest in .*manifest.json"):
        load_model(art)
    load_model(art, verify=False)
    file.unlink()
    with pytest.raises(CheckpointError, match=r"tensor 'linear.mixer.in_qkv' is missing from "
                       r".*weights"):
        load_model(art, verify=False)
