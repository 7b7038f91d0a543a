"""Block ids and the state envelope of checkpoints in the context store (engine/blocks.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ninfer_jax.engine.blocks import BlockLayout, ImageError

LAYOUT = BlockLayout(b"model", page_size=4, lookahead=0, page_bytes=48, state_bytes=150)
MTP = BlockLayout(b"model", page_size=4, lookahead=1, page_bytes=48, state_bytes=150)

tokens = st.lists(st.integers(0, 50), min_size=1, max_size=40)


@given(tokens, tokens)
def test_shared_prefixes_share_full_blocks_and_nothing_else(a, b):
    for layout in (LAYOUT, MTP):
        kv_a, _ = layout.checkpoint_ids(a, None)
        kv_b, _ = layout.checkpoint_ids(b, None)
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for i, (x, y) in enumerate(zip(kv_a[:-1], kv_b[:-1])):
            # a full block depends on the tokens up to its end (plus the lookahead)
            assert (x == y) == ((i + 1) * 4 + layout.lookahead <= common)
        assert len(set(kv_a)) == len(kv_a)  # the tail never equals a full block
        assert (kv_a[-1] == kv_b[-1]) == (a == b)


def test_ids_separate_models_and_scopes():
    seq = list(range(10))
    base = LAYOUT.checkpoint_ids(seq, None)
    other_model = BlockLayout(b"other", 4, 0, 48, 150).checkpoint_ids(seq, None)
    tenant = LAYOUT.checkpoint_ids(seq, "tenant")
    for ids in (other_model, tenant):
        assert not set(ids[0] + ids[1]) & set(base[0] + base[1])
    assert LAYOUT.checkpoint_ids(seq, None) == base  # deterministic


def test_checkpoint_has_a_page_per_block_and_whole_state_blocks():
    kv, state = LAYOUT.checkpoint_ids(list(range(9)), None)
    assert len(kv) == 3 and len(state) == LAYOUT.state_blocks == 4  # (150 + envelope) / 64
    assert LAYOUT.full_ids(list(range(9)), None, 9) == kv[:2]
    digests = LAYOUT.prefix_digests(list(range(9)), None, [3, 9, 5])
    assert LAYOUT.state_ids(digests[9]) == state
    assert len({digests[3], digests[5], digests[9]}) == 3


def test_seal_and_open_round_trip_and_refuse_anything_else():
    state = (np.arange(150) % 251).astype(np.uint8)
    digest = LAYOUT.prefix_digests([1, 2, 3], None, [3])[3]
    sealed = LAYOUT.seal(state, 3, digest)
    assert sealed.shape == (LAYOUT.state_blocks, 64)
    assert np.array_equal(LAYOUT.open(sealed, 3, digest), state)
    with pytest.raises(ImageError, match="frontier 4"):
        LAYOUT.open(sealed, 4, digest)
    with pytest.raises(ImageError):
        LAYOUT.open(sealed, 3, bytes(16))
    flipped = sealed.copy()
    flipped.reshape(-1)[100] ^= 1
    with pytest.raises(ImageError, match="checksum"):
        LAYOUT.open(flipped, 3, digest)
    with pytest.raises(ImageError, match="149 bytes"):
        LAYOUT.seal(state[:-1], 3, digest)


def test_a_k_v_block_carries_a_tag_bound_to_its_id():
    kv, _ = LAYOUT.checkpoint_ids(list(range(9)), None)
    page = [np.arange(20, dtype=np.uint8), np.arange(28, dtype=np.uint8)]  # 48 bytes in two
    block = np.concatenate([*page, LAYOUT.tag(kv[0], page)])
    assert block.nbytes == LAYOUT.block_bytes and LAYOUT.check(kv[0], block)
    assert not LAYOUT.check(kv[1], block)  # another block's bytes
    damaged = block.copy()
    damaged[5] ^= 1
    assert not LAYOUT.check(kv[0], damaged)
