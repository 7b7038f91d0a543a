"""Damaged or inconsistent weights never load silently: per-tensor digests, shape/dtype checks
against the manifest, no casting of int/bool HF tensors, NaN/inf refused, format 1 handling."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from safetensors.numpy import load_file, save_file

from ninfer_jax import load_model
from ninfer_jax.artifact import digests
from ninfer_jax.artifact import format as format_
from ninfer_jax.artifact.convert import convert
from ninfer_jax.artifact.upgrade import upgrade
from ninfer_jax.errors import CheckpointError
from ninfer_jax.loader import DEFAULT_MODEL
from ninfer_jax.models.qwen3_6.weights import from_legacy_layout
from tests.conftest import FIXTURES


def _named(params) -> dict[str, np.ndarray]:
    return {n: np.asarray(a) for n, a in digests.named_leaves(params).items()}


@pytest.fixture(scope="module")
def demo():
    return _named(load_model(verify=False).params)


@pytest.fixture
def art(tmp_path) -> pathlib.Path:
    dst = tmp_path / "demo"
    shutil.copytree(DEFAULT_MODEL, dst)
    return dst


def _edit_manifest(path: pathlib.Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(edit(manifest) or manifest))


def _flip_a_byte_of(path: pathlib.Path, name: str) -> None:
    """Flips one byte inside the stored (zstd-compressed) chunk of tensor `name`: orbax keeps
    each array chunk as a value in its OCDBT key-value store (key `<name>/0.0...`), and OCDBT
    appends values to data files under `weights/ocdbt.process_0/d/`."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path / 'weights'}/"}).result()
    keys = [k for k in kv.list().result() if k.startswith(f"{name}/".encode())
            and not k.endswith(b".zarray")]
    assert len(keys) == 1, keys
    value = bytes(kv.read(keys[0]).result().value)
    hits = [(f, data.find(value)) for f in (path / "weights").rglob("*") if f.is_file()
            for data in [f.read_bytes()] if data.find(value) >= 0]
    assert len(hits) == 1, hits
    file, offset = hits[0]
    data = bytearray(file.read_bytes())
    data[offset + len(value) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def test_the_demo_loads_verified_and_equals_the_fast_path(art, demo):
    manifest = json.loads((DEFAULT_MODEL / "manifest.json").read_text())
    # The shipped demo is format 3 (orbax), still read; format 4 (one safetensors file per
    # leaf, streamed) is covered by test_streaming_load.py.
    assert manifest["format_version"] == 3 < format_.FORMAT_VERSION
    assert set(manifest["tensors"]) == set(demo)
    verified = _named(load_model(art).params)
    assert verified.keys() == demo.keys()
    for name in demo:
        np.testing.assert_array_equal(verified[name], demo[name])


def test_one_flipped_byte_in_the_weights_is_named_and_verify_false_skips_the_check(art, demo):
    _flip_a_byte_of(art, "embed")
    with pytest.raises(CheckpointError, match=r"tensor 'embed' does not match its digest in "
                       r".*manifest.json \(recorded [0-9a-f]{64}, found [0-9a-f]{64}\)"):
        load_model(art)
    # Without verification the damaged bytes load: only `embed` differs from the good copy.
    damaged = _named(load_model(art, verify=False).params)
    changed = [n for n in demo if not np.array_equal(damaged[n], demo[n], equal_nan=True)]
    assert changed == ["embed"]


@pytest.mark.parametrize("consistent", [False, True])
def test_a_config_that_disagrees_with_the_weight_shapes_is_named(art, consistent):
    def edit(m):
        m["config"]["vocab_size"] = 4000
        if consistent:  # the manifest agrees with itself; only the stored weights disagree
            m["tensors"]["embed"]["shape"] = [4000, 192]

    _edit_manifest(art, edit)
    where = r"weights" if consistent else r"manifest.json's 'tensors'"
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=rf"tensor 'embed' in .*{where}: found shape "
                           r"\(4096, 192\) dtype float32, expected shape \(4000, 192\) dtype "
                           r"float32"):
            load_model(art, verify=verify)


@pytest.mark.parametrize("consistent", [False, True])
def test_a_manifest_dtype_that_disagrees_is_named(art, consistent):
    def edit(m):
        m["dtype"] = "bfloat16"
        if consistent:
            for record in m["tensors"].values():
                record["dtype"] = "bfloat16"

    _edit_manifest(art, edit)
    where = r"weights" if consistent else r"manifest.json's 'tensors'"
    with pytest.raises(CheckpointError, match=rf"tensor 'attention.input_norm' in .*{where}: "
                       r"found shape \(1, 192\) dtype float32, expected shape \(1, 192\) dtype "
                       r"bfloat16"):
        load_model(art, verify=False)


def test_weights_with_nan_and_a_matching_digest_are_refused_when_verifying(art, demo):
    bad = {**demo, "final_norm": demo["final_norm"].copy()}
    bad["final_norm"][7] = np.nan
    shutil.rmtree(art / "weights")
    tree = {}
    for name, a in bad.items():  # dotted names back to the nested params dict
        *parents, leaf = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = a
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(art / "weights", tree)
    sums, _ = digests.scan(bad)
    _edit_manifest(art, lambda m: m["tensors"]["final_norm"].update(digest=sums["final_norm"]))
    with pytest.raises(CheckpointError, match=r"tensor 'final_norm' in .*weights holds NaN"):
        load_model(art)
    assert np.isnan(np.asarray(load_model(art, verify=False).params["final_norm"])[7])


def test_write_refuses_params_with_nan(tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "dense", src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"][3] = np.inf
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model.norm.weight' in .* holds NaN or inf"):
        convert(src, tmp_path / "art")
    with pytest.raises(CheckpointError, match=r"tensor 'model.norm.weight' .* holds NaN or inf"):
        load_model(src)
    assert np.isinf(np.asarray(load_model(src, verify=False).params["final_norm"])[3])
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_])
def test_an_int_or_bool_tensor_in_an_hf_checkpoint_is_named_not_cast(tmp_path, dtype):
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "dense", src)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.linear_attn.A_log"
    tensors[name] = np.ones(tensors[name].shape, dtype)
    save_file(tensors, str(src / "model.safetensors"))
    match = (rf"tensor '{name}' has dtype {np.dtype(dtype).name}, expected a floating-point "
             r"weight .* it is not cast")
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=match):
            load_model(src, verify=verify)
    with pytest.raises(CheckpointError, match=match):
        convert(src, tmp_path / "art")


def _as_format_2(path: pathlib.Path) -> None:
    """Rewrites the artifact at `path` as format 2 wrote it: linear weights [in, out], digests
    of the tensors as stored."""
    manifest = json.loads((path / "manifest.json").read_text())
    stored = from_legacy_layout(load_model(path).params)
    shutil.rmtree(path / "weights")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "weights", jax.tree.map(np.asarray, stored))
    tensors = _named(stored)
    sums, _ = digests.scan(tensors)
    files = [*manifest["frontend_files"],
             *(f.relative_to(path).as_posix() for f in (path / "weights").rglob("*")
               if f.is_file())]
    _edit_manifest(path, lambda m: {**m, "format_version": 2, "files": sorted(files),
                                    "tensors": format_.tensor_records(tensors, sums)})


def test_a_format_2_artifact_loads_in_todays_layout_and_upgrade_rewrites_it(art, demo):
    _as_format_2(art)
    assert load_model(art).params["linear"]["mixer"]["in_qkv"].shape == \
        demo["linear.mixer.in_qkv"].shape
    for name, value in _named(load_model(art).params).items():
        np.testing.assert_array_equal(value, demo[name])
    upgrade(art)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["format_version"] == format_.FORMAT_VERSION
    assert manifest["tensors"] == json.loads((DEFAULT_MODEL / "manifest.json").read_text())[
        "tensors"]
    for name, value in _named(load_model(art).params).items():
        np.testing.assert_array_equal(value, demo[name])
    assert not [p for p in art.parent.iterdir() if p.name.startswith(".")]


def test_a_format_1_artifact_is_refused_when_verifying_and_upgrade_adds_digests(art, demo):
    _as_format_2(art)
    _edit_manifest(art, lambda m: {k: v for k, v in {**m, "format_version": 1}.items()
                                   if k not in ("tensors", "files", "tensor_digest")})
    with pytest.raises(CheckpointError, match="format_version 1 records no tensor digests"):
        load_model(art)
    for name, value in _named(load_model(art, verify=False).params).items():
        np.testing.assert_array_equal(value, demo[name])
    upgrade(art)
    assert json.loads((art / "manifest.json").read_text())["tensors"] == json.loads(
        (DEFAULT_MODEL / "manifest.json").read_text())["tensors"]
    for name, value in _named(load_model(art).params).items():
        np.testing.assert_array_equal(value, demo[name])


