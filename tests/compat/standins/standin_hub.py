"""Write a local Hugging Face hub cache with tiny, seeded stand-ins for the examples' models.

``python standin_hub.py CACHE_DIR`` fills ``CACHE_DIR`` (use it as ``HF_HUB_CACHE`` with
``HF_HUB_OFFLINE=1``) with ``bert-base-cased`` (a 2-layer ``BertForSequenceClassification``
with 2 labels) and ``HuggingFaceTB/SmolLM-360M`` (a 2-layer ``LlamaForCausalLM``), both with a
word-level tokenizer over the stand-in data's words. The weights come from a fixed seed, so
every build is the same and a script's ``from_pretrained`` loads every weight (nothing is left
to random initialisation).
"""

from __future__ import annotations

import sys
from pathlib import Path

_COMMIT = "0" * 40


def _snapshot(cache: Path, repo_id: str) -> Path:
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(_COMMIT)
    snap = folder / "snapshots" / _COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def _tokenizer(eos: bool):  # type: ignore[no-untyped-def]
    from transformers import BertTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from datasets import _WORDS

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *dict.fromkeys(_WORDS)]
    extra = {"eos_token": "[SEP]", "bos_token": "[CLS]"} if eos else {}
    tok = BertTokenizer(
        vocab={w: i for i, w in enumerate(vocab)},
        do_lower_case=False,
        model_max_length=128,
        **extra,
    )
    return tok, len(vocab)


def build(cache: Path) -> Path:
    """Write both stand-in models into ``cache``; returns ``cache``."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tok, size = _tokenizer(eos=False)
    torch.manual_seed(0)
    bert = BertForSequenceClassification(
        BertConfig(
            vocab_size=size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            num_labels=2,
            initializer_range=0.5,  # inputs give visibly different logits, so metrics move
        )
    )
    with torch.no_grad():
        # Logits close to the decision boundary: the examples' few small steps (lr 2e-5) flip
        # predictions, so the printed metrics change from epoch to epoch and show a divergence.
        bert.classifier.weight.mul_(1e-3)
    snap = _snapshot(cache, "bert-base-cased")
    bert.save_pretrained(snap)
    tok.save_pretrained(snap)

    tok, size = _tokenizer(eos=True)
    torch.manual_seed(1)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            initializer_range=0.2,
        )
    )
    snap = _snapshot(cache, "HuggingFaceTB/SmolLM-360M")
    llama.save_pretrained(snap)
    tok.save_pretrained(snap)
    return cache


if __name__ == "__main__":
    build(Path(sys.argv[1]))
