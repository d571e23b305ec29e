"""Chained block hashes for the prefix cache.

hash(block i) = blake2b-128(hash(block i-1) || tokens of block i as int64 LE)
hash(block -1) = blake2b-128(domain tag || cache_key)   (the model identity)

A 128-bit cryptographic hash makes a collision (two different prefixes sharing KV)
negligible, so a hit needs no token comparison. Cost: about 1 us per full block,
paid once per block when it is committed (decode: once every block_size tokens).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_DIGEST_SIZE = 16
_DOMAIN_TAG = b"specserve.kv.v1\x00"


def root_hash(cache_key: str, block_size: int) -> bytes:
    """The parent hash of a request's first block: ties the chain to one model cache."""
    data = _DOMAIN_TAG + block_size.to_bytes(4, "little") + cache_key.encode()
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE).digest()


class BlockHasher:
    """Hashes full blocks of `block_size` token ids; one precompiled struct, no per-token
    Python work."""

    __slots__ = ("block_size", "_pack")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pack = struct.Struct(f"<{block_size}q").pack

    def extend(self, hashes: list[bytes], root: bytes, token_ids: Sequence[int], upto: int) -> None:
        """Append to `hashes` the chained hashes of full blocks len(hashes)..upto-1.

        token_ids covers at least upto * block_size tokens.
        """
        bs = self.block_size
        pack = self._pack
        blake2b = hashlib.blake2b
        parent = hashes[-1] if hashes else root
        for i in range(len(hashes), upto):
            data = parent + pack(*token_ids[i * bs : (i + 1) * bs])
            parent = blake2b(data, digest_size=_DIGEST_SIZE).digest()
            hashes.append(parent)
