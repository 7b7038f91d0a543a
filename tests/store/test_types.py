"""Types, keys, request facts, the error model and config reading (G1, G10, G15)."""

import pytest

from ninfer_jax.store import (
    AddressedToken,
    BlockId,
    BlockPayload,
    ErrorCode,
    General,
    InvalidParam,
    JobDescriptor,
    NoSpace,
    NotFound,
    OsApiError,
    RequestContext,
    StoreError,
)
from ninfer_jax.store.config import get_int, get_int_list, get_str, reject_unknown
from ninfer_jax.store.types import as_block_ids, byte_view, require_unique
from tests.store.helpers import bid, ids


def test_block_id_is_16_bytes_hashable_and_ordered():
    a, b = bid(1), bid(2)
    assert len(a.to_bytes()) == 16
    assert {a: 1}[BlockId(a.to_bytes())] == 1
    assert sorted([b, a]) == sorted([a, b])
    assert a == BlockId(bytearray(a.to_bytes()))


@pytest.mark.parametrize("raw", [b"", b"x" * 15, b"x" * 17, "x" * 16, 5])
def test_block_id_rejects_wrong_size(raw):
    with pytest.raises(InvalidParam, match="16 bytes"):
        BlockId(raw)


def test_packed_keys_are_16_bytes_each_in_order():
    keys = ids(3, 1, 2)
    assert as_block_ids(b"".join(k.to_bytes() for k in keys)) == keys
    assert as_block_ids(keys) == keys


def test_packed_keys_must_be_a_multiple_of_16():
    with pytest.raises(InvalidParam, match="multiple of 16"):
        as_block_ids(b"x" * 20)


def test_keys_list_must_hold_block_ids():
    with pytest.raises(InvalidParam, match=r"keys\[1\]"):
        as_block_ids([bid(1), b"x" * 16])


def test_require_unique_names_the_repeated_id():
    with pytest.raises(InvalidParam, match=bid(2).hex()):
        require_unique(ids(1, 2, 2), "pin")


def test_request_context_snapshot_is_a_copy_with_unknown_facts():
    ctx = RequestContext()
    ctx.request_id, ctx.ttl_ms, ctx.total_block_count = "r", 5, 7
    ctx.priority = 3  # a fact no reader knows
    snap = ctx.validated()
    ctx.ttl_ms = 99
    assert (snap.request_id, snap.ttl_ms, snap.total_block_count, snap.priority) == ("r", 5, 7, 3)


@pytest.mark.parametrize("field,value", [("request_id", None), ("request_id", ""),
                                         ("ttl_ms", -1), ("ttl_ms", "5"),
                                         ("total_block_count", True)])
def test_request_context_validation_names_the_field(field, value):
    ctx = RequestContext("r")
    setattr(ctx, field, value)
    with pytest.raises(InvalidParam, match=field):
        ctx.validated()


def test_token_keys_normalised_and_payload_bytes():
    token = AddressedToken(b"".join(k.to_bytes() for k in ids(1, 2)), bytearray(b"ab"))
    assert token.keys == tuple(ids(1, 2)) and token.payload == b"ab"


def test_job_descriptor_pairs_ids_and_payloads():
    with pytest.raises(InvalidParam, match="2 block ids but 1 payloads"):
        JobDescriptor(ids(1, 2), [BlockPayload([bytearray(4)])])


def test_payload_views_flatten_multiple_buffers():
    import numpy as np

    p = BlockPayload([np.zeros((2, 3), np.float32), bytearray(5)])
    assert p.nbytes == 2 * 3 * 4 + 5
    with pytest.raises(InvalidParam, match="C-contiguous"):
        byte_view(np.zeros((4, 4))[:, 1])


@pytest.mark.parametrize("cls,code", [(InvalidParam, ErrorCode.INVALID_PARAM),
                                      (NotFound, ErrorCode.NOT_FOUND),
                                      (OsApiError, ErrorCode.OS_API_ERROR),
                                      (NoSpace, ErrorCode.NO_SPACE),
                                      (General, ErrorCode.GENERAL)])
def test_errors_are_classified(cls, code):
    err = cls("block abc")
    assert isinstance(err, StoreError) and err.code is code
    assert str(err) == f"{code.value}: block abc"


def test_config_readers_name_owner_and_field():
    with pytest.raises(InvalidParam, match="cache: config field 'capacity' is required"):
        get_int({}, "capacity", "cache")
    with pytest.raises(InvalidParam, match="'capacity' must be >= 1"):
        get_int({"capacity": 0}, "capacity", "cache", minimum=1)
    with pytest.raises(InvalidParam, match="must be an int"):
        get_int({"capacity": True}, "capacity", "cache")
    with pytest.raises(InvalidParam, match="one of"):
        get_str({"policy": "mru"}, "policy", "cache", choices=["lru"])
    with pytest.raises(InvalidParam, match="list of ints"):
        get_int_list({"thresholds": []}, "thresholds", "ttl")
    with pytest.raises(InvalidParam, match=r"unknown config field\(s\) \['capcity'\]"):
        reject_unknown({"capcity": 1}, ["capacity"], "cache")
    assert get_int({}, "n", "x", default=4) == 4
