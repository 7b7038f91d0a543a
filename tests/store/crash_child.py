"""Child process for the crash test: dumps blocks to a posix store until it is killed."""

import random
import sys

from ninfer_jax.store import BlockPayload, JobDescriptor
from ninfer_jax.store.posix import PosixStore
from tests.store.helpers import block_data, ids

BLOCK = 64 * 1024


def main(root: str, seed: int) -> None:
    rng = random.Random(seed)
    store = PosixStore()
    store.setup({"root": root, "num_threads": 2})
    print("ready", flush=True)
    sys.stdout.close()
    job = 0
    while True:
        batch = rng.sample(range(16), 3)
        store.dump(job, JobDescriptor(ids(*batch),
                                      [BlockPayload([block_data(i, BLOCK)]) for i in batch]))
        store.wait([job])
        job += 1
