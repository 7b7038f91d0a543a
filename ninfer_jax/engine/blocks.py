"""How a prefix checkpoint becomes content-addressed store blocks (DESIGN §7, §11).

Owns the block ids, the K/V blocks' tags and the state image's envelope; imports no jax. Every
block has the same size, `block_bytes`: one K/V page over all attention layers (`page_bytes`)
and a tag, so one store configuration holds them all:

- K/V blocks. A checkpoint at frontier F has ceil(F / page_size) pages. Page i < last is a
  *full* block; its id chains the previous block's id, the page's tokens and the `lookahead`
  tokens after it (with MTP the head's K/V at a page's last position depends on the next token,
  so a full block is determined by tokens [0, (i + 1) * page_size + lookahead)). The last page is
  a *tail* block: its id chains the previous id and the tokens of the page below F, and the
  Program zeroes what is not determined by them (positions >= F, and the head's K/V at F - 1),
  so one id means one content (G1). Two checkpoints sharing a prefix share its full blocks.
  Each K/V block ends with a tag, a blake2b of its bytes keyed by its id, checked when a reload
  reads it: a store that serves another block's bytes, or damaged ones, causes a miss.
- State blocks. The GDN state image (plus the MTP context) is keyed by the digest of the whole
  prefix, wrapped in an envelope (magic, frontier, prefix digest, length, blake2b of the image)
  and split into blocks of the same size. The envelope is checked when a reload assembles them,
  so a mixed-up or corrupted image is a miss, never a wrong state.

Ids start from a seed of the model identity (weights digest, dtype, page layout) and the cache
scope (a tenant): engines of one model share blocks, tenants and models never do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np

_ENVELOPE = struct.Struct("<8sQ16sQ32s")  # magic, frontier, prefix digest, image bytes, blake2b
_MAGIC = b"NICKPT01"
TAG_BYTES = 16


class ImageError(ValueError):
    """A state image that does not match what its envelope promises."""


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _tokens(tokens) -> bytes:
    return np.asarray(tokens, np.int32).tobytes()


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    identity: bytes  # the model package: weights digest, dtype, page layout
    page_size: int
    lookahead: int  # positions after a page its K/V depend on (1 with MTP, else 0)
    page_bytes: int  # one K/V page over all attention layers
    state_bytes: int  # one GDN state image (+ MTP context)

    @property
    def block_bytes(self) -> int:
        """What every block stores: a page and its tag."""
        return self.page_bytes + TAG_BYTES

    @property
    def state_blocks(self) -> int:
        return -(-(self.state_bytes + _ENVELOPE.size) // self.block_bytes)

    def seed(self, scope: str | None) -> bytes:
        tenant = b"" if scope is None else b"scope:" + scope.encode("utf-8", "surrogatepass")
        return _h(b"ninfer-blocks-v1", self.identity, tenant)

    def full_ids(self, tokens, scope: str | None, limit: int) -> list[bytes]:
        """Ids of full blocks 0, 1, ... whose tokens lie within tokens[:limit]."""
        ps, ids, prev = self.page_size, [], self.seed(scope)
        i = 0
        while (i + 1) * ps + self.lookahead <= limit:
            prev = _h(b"kv", prev, _tokens(tokens[i * ps:(i + 1) * ps + self.lookahead]))
            ids.append(prev)
            i += 1
        return ids

    def tail_id(self, tokens, frontier: int, full: list[bytes], scope: str | None) -> bytes:
        """The last page of a checkpoint at `frontier` (full: at least its full blocks' ids)."""
        last = (frontier - 1) // self.page_size
        prev = full[last - 1] if last else self.seed(scope)
        return _h(b"tail", prev, _tokens(tokens[last * self.page_size:frontier]))

    def prefix_digests(self, tokens, scope: str | None, frontiers) -> dict[int, bytes]:
        """The prefix digest of tokens[:F] for each F, one pass over the tokens."""
        wanted = sorted(set(frontiers))
        h = hashlib.blake2b(digest_size=16)
        h.update(self.seed(scope))
        out, done = {}, 0
        for f in wanted:
            h.update(_tokens(tokens[done:f]))
            done = f
            out[f] = h.copy().digest()
        return out

    def state_ids(self, digest: bytes, count: int | None = None) -> list[bytes]:
        """Ids of the state image's blocks (the first `count` of them)."""
        n = self.state_blocks if count is None else count
        return [_h(b"state", digest, j.to_bytes(4, "little")) for j in range(n)]

    def checkpoint_ids(self, tokens, scope: str | None) -> tuple[list[bytes], list[bytes]]:
        """(K/V block ids in page order, state block ids) of a checkpoint of `tokens`."""
        f = len(tokens)
        full = self.full_ids(tokens, scope, f)[: (f - 1) // self.page_size]
        kv = full + [self.tail_id(tokens, f, full, scope)]
        return kv, self.state_ids(self.prefix_digests(tokens, scope, [f])[f])

    @staticmethod
    def tag(block_id: bytes, buffers) -> np.ndarray:
        """The tag of a K/V block: blake2b of its page bytes, keyed by its id."""
        h = hashlib.blake2b(digest_size=TAG_BYTES, key=block_id)
        for buffer in buffers:
            h.update(np.ascontiguousarray(buffer).reshape(-1).view(np.uint8))
        return np.frombuffer(h.digest(), np.uint8).copy()

    def check(self, block_id: bytes, block: np.ndarray) -> bool:
        """Whether a K/V block read back carries its own tag."""
        page = block[: self.page_bytes]
        return bool(np.array_equal(self.tag(block_id, [page]), block[self.page_bytes:]))

    def seal(self, state: np.ndarray, frontier: int, digest: bytes) -> np.ndarray:
        """The state image in its envelope, padded to whole blocks: [state_blocks, block_bytes]."""
        raw = np.ascontiguousarray(state).reshape(-1).view(np.uint8)
        if raw.nbytes != self.state_bytes:
            raise ImageError(f"state image has {raw.nbytes} bytes, expected {self.state_bytes}")
        out = np.zeros((self.state_blocks, self.block_bytes), np.uint8)
        flat = out.reshape(-1)
        flat[: _ENVELOPE.size] = np.frombuffer(_ENVELOPE.pack(
            _MAGIC, frontier, digest, raw.nbytes,
            hashlib.blake2b(raw.tobytes(), digest_size=32).digest()), np.uint8)
        flat[_ENVELOPE.size:_ENVELOPE.size + raw.nbytes] = raw
        return out

    def open(self, blocks: np.ndarray, frontier: int, digest: bytes) -> np.ndarray:
        """The state image out of its envelope; ImageError if anything disagrees."""
        flat = blocks.reshape(-1)
        magic, f, d, n, check = _ENVELOPE.unpack(flat[: _ENVELOPE.size].tobytes())
        if magic != _MAGIC or f != frontier or d != digest or n != self.state_bytes:
            raise ImageError(f"state image envelope does not match frontier {frontier}")
        raw = flat[_ENVELOPE.size:_ENVELOPE.size + n]
        if hashlib.blake2b(raw.tobytes(), digest_size=32).digest() != check:
            raise ImageError(f"state image of frontier {frontier} fails its checksum")
        return raw.copy()
