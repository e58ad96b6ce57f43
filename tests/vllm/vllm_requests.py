"""Real vLLM `Request` objects for the pool-level tests, hashed the way vLLM's own tests do."""

from __future__ import annotations

import itertools

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

init_none_hash(sha256)
_ids = itertools.count()


def make_request(tokens: list[int], hash_block_size: int, *, max_tokens: int = 64) -> Request:
    """A request over ``tokens`` whose block hashes chain every ``hash_block_size`` tokens."""
    return Request(
        request_id=f"req{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )
