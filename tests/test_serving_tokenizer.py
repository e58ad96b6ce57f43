"""The servers' word-level tokenizer: one word per id of the model's vocabulary, and back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conformance.serving import with_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_serving as bs


def _tokenizer(tmp_path: Path, vocab_size: int):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return transformers.AutoTokenizer.from_pretrained(with_tokenizer(src, tmp_path / "model"))


@pytest.mark.parametrize("vocab_size", [1024, bs.GPU_VOCAB_SIZE])
def test_every_id_encodes_back_to_itself(tmp_path: Path, vocab_size: int) -> None:
    """Until 12-07 the special tokens were the words t0-t2, and a tokenizer splits every word at its
    special tokens first: "t10" came back as t1, t0 (a quarter of the ids of a 1,024 vocabulary)."""
    tok = _tokenizer(tmp_path, vocab_size)
    ids = list(range(vocab_size))
    assert tok.vocab_size == vocab_size
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_a_kept_tokenizer_of_an_older_format_is_made_again(tmp_path: Path) -> None:
    """A model directory kept from before 12-07 (specials t0-t2, no marker) is not reused."""
    transformers = pytest.importorskip("transformers")
    src, out = tmp_path / "src", tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"vocab_size": 64}))
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # what the old check took for a made tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(with_tokenizer(src, out))
    assert tok.encode("t10", add_special_tokens=False) == [10]
    assert with_tokenizer(src, out) == out  # made once: the marker matches now


def test_the_gpu_benchmarks_random_prompts_are_nearly_disjoint(tmp_path: Path) -> None:
    """vLLM's random dataset, as `vllm bench serve` draws a GPU phase: 512 prompts of 1,024 tokens.
    A prompt is a run of consecutive ids from a random start, so with the tiny models' 1,024 ids a
    fifth of its 16-token blocks repeat one before; with the GPU models' vocabulary about 1%."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.datasets import RandomDataset

    def repeated_blocks(vocab_size: int) -> float:
        tok = _tokenizer(tmp_path / str(vocab_size), vocab_size)
        seen: set[tuple[int, ...]] = set()
        repeats = total = 0
        for req in RandomDataset(random_seed=bs.PHASE_SEEDS["saturation"]).sample(
                tok, num_requests=512, input_len=1024, output_len=8, range_ratio=0.0):
            ids = tok.encode(req.prompt, add_special_tokens=False)
            assert len(ids) == 1024
            for end in range(16, len(ids) + 1, 16):  # a block is its whole prefix, as vLLM hashes it
                total += 1
                repeats += tuple(ids[:end]) in seen
                seen.add(tuple(ids[:end]))
        return repeats / total

    assert repeated_blocks(1024) > 0.15  # the control: the tiny vocabulary's prompts share blocks
    assert repeated_blocks(bs.GPU_VOCAB_SIZE) < 0.03
