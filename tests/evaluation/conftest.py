"""Fixtures for the evaluation tests: a real tiny Llama checkpoint and one shared evaluation.

lm-eval takes seconds to import and BLiMP alone loads 67 datasets, so the shipped tasks are
evaluated once per session (``shipped_results``) and several tests read that result.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DATA_DIR = Path(os.environ["PLAB_DATA_DIR"])  # set by tests/conftest.py
LIMIT = 5  # documents per task (per BLiMP paradigm) in the shared evaluation
BATCH_SIZE = 32


def build_tiny_checkpoint(dest: Path, *, seed: int = 0) -> Path:
    """A random-init LlamaForCausalLM (hidden 64, 2 layers) + a byte-level BPE tokenizer
    trained on the first 20 KB of Tiny Shakespeare, saved with save_pretrained."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    text = (DATA_DIR / "tinyshakespeare" / "input.txt").read_text()[:20_000]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([text], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def shipped_results(tiny_checkpoint) -> dict:
    """Every shipped task on the tiny checkpoint, LIMIT documents each, CPU, batch size BATCH_SIZE."""
    from training.evaluation import SHIPPED_TASKS, evaluate_checkpoint

    return evaluate_checkpoint(tiny_checkpoint, list(SHIPPED_TASKS), limit=LIMIT, device="cpu", batch_size=BATCH_SIZE)
