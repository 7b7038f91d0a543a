"""CheckpointCatalog lookup (DESIGN §7): the longest cataloged exact prefix, strictly shorter than
the prompt, whatever else is cataloged or bound to the session."""

from __future__ import annotations

from ninfer_jax.engine.catalog import CheckpointCatalog

STREAM = tuple(range(100, 140))


def _catalog(*frontiers: int) -> CheckpointCatalog:
    catalog = CheckpointCatalog()
    for n in frontiers:
        catalog.add(f"ckpt{n}", STREAM[:n])
    catalog.add("elsewhere", tuple(range(1, 31)))  # long, but no prefix of STREAM
    return catalog


def _found(catalog, tokens, session=None):
    entry = catalog.lookup(tokens, session)
    return None if entry is None else entry.ckpt


def test_lookup_returns_the_longest_prefix():
    for frontiers in ((3, 8, 17), (17, 8, 3), (8, 3, 17)):  # whatever the insertion order
        catalog = _catalog(*frontiers)
        assert _found(catalog, STREAM) == "ckpt17"
        assert _found(catalog, STREAM[:18]) == "ckpt17"
        assert _found(catalog, STREAM[:17]) == "ckpt8"  # the frontier must be below the length
        assert _found(catalog, STREAM[:12] + (0,) * 20) == "ckpt8"  # diverges after 12
        assert _found(catalog, STREAM[:5]) == "ckpt3"
        assert _found(catalog, STREAM[:3]) is None
        assert _found(catalog, (0,) + STREAM) is None


def test_a_session_binding_never_beats_a_longer_prefix():
    catalog = _catalog(3, 8, 17)
    catalog.bind_session("chat", catalog.get(STREAM[:3]), publication_order=0)
    assert _found(catalog, STREAM, "chat") == "ckpt17"
    catalog.bind_session("branch", catalog.add("branch20", STREAM[:19] + (0,)), 1)
    assert _found(catalog, STREAM, "branch") == "ckpt17"  # the binding is no prefix here
    assert _found(catalog, STREAM[:19] + (0, 5), "branch") == "branch20"


def test_touch_moves_an_entry_to_the_end_of_the_eviction_order():
    catalog = CheckpointCatalog()
    a, b, c = (catalog.add(i, (i, i + 1)) for i in range(3))
    assert catalog.eviction_order() == [a, b, c] and catalog.least_recent() is a
    catalog.touch(a)
    assert catalog.eviction_order() == [b, c, a] and catalog.least_recent() is b
    catalog.record_use(b)
    assert catalog.eviction_order() == [c, a, b]
    assert catalog.eviction_order(keep=c) == [a, b]
