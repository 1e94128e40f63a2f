"""Writes a tiny random-weight Llama that real vLLM serves on CPUs, with no downloads:
hidden 128, 2 layers, 2 heads of 64 (vLLM's CPU attention rejects head_dim 16), float32
safetensors, a small byte-level BPE tokenizer trained here (tokenizer.json) and a Llama-3-like
chat template in tokenizer_config.json.

    python scripts/vllm-tiny-model.py OUT_DIR [--seed N]

Run it with the vLLM venv's python (scripts/vllm-venv.sh prints it): it needs torch,
transformers and tokenizers. The same seed writes the same folder.
"""
import argparse
import json
import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
WORDS = (
    "the fleet routes every request to an engine that holds its prefix in cache while long prompts "
    "wait their turn and decode batches keep their pace under load prefill pools grow when the time "
    "to first token rises and shrink when it falls agents call tools and come back with more context "
    "a control plane that knows what each engine caches saves the work of computing it again"
).split()


def corpus(rng, lines=4000):
    for _ in range(lines):
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tok.save(os.path.join(args.out, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|eot_id|>")

    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "model_max_length": 512,
                "chat_template": CHAT_TEMPLATE,
            },
            f,
            indent=1,
        )

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(args.out, safe_serialization=True)
    print(args.out)


if __name__ == "__main__":
    main()
