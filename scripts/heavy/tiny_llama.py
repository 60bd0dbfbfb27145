"""Make a tiny Llama as a Hugging Face model directory, for a real vLLM on the CPU.

Run by scripts/heavy/tiny-llama.sh with the vLLM venv's python (transformers,
tokenizers and torch come with vLLM): ``python tiny_llama.py OUT_DIR``.

Random weights (seed 0), 2 layers, hidden 128, 4 heads of 32 (vLLM's CPU
attention wants head_dim >= 32), and a byte-level BPE tokenizer trained on
this Python's own standard library sources (local, the same on every machine of
one kind), with a chat template. Nothing comes from a hub.

Greedy output must be stable between two identical requests, one of which may
hit vLLM's prefix cache (another summation order): with the usual init (std
0.02) the logits of a random model are nearly flat and the argmax flips on
rounding. The output head is drawn with std 1 instead, so the top logit leads
by whole units.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

SEED = 0
VOCAB = 2048
SPECIALS = ["<unk>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus() -> list[str]:
    """The stdlib's top-level modules, in a fixed order (the trainer sees the same text
    in the same order every time)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))]


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus(), trainer)
    return tok


def main(out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = train_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>",
                                   unk_token="<unk>", pad_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(SEED + 1))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    # Greedy check in transformers itself: the prompt the chat template makes, a few tokens.
    ids = fast.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                   return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, do_sample=False)
    print(f"tiny llama: {sum(p.numel() for p in model.parameters())} parameters, vocab {len(fast)}, "
          f"greedy sample {fast.decode(got[0, ids.shape[1]:])!r}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
