"""A real, small Hugging Face tokenizer for the tests: a WordLevel vocabulary trained with the
`tokenizers` library (every id of the tiny model's 512 decodes to a word), saved as
tokenizer.json + tokenizer_config.json (with a chat template) beside the model's safetensors, as
a Hugging Face model directory holds them."""

from __future__ import annotations

import json
from pathlib import Path

from dualpath_ray.config import DualPathConfig
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.model.weights import write_checkpoint

SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SENTENCES = [
    "the agent reads the file and calls the tool again",
    "a trainer updates the policy weights between two rollout steps",
    "prefill reads stored blocks from the storage network of both nodes",
    "decode engines persist each full block through the node reader",
    "the scheduler balances storage network and compute load across paths",
    "tell me a story about a cat that sat on the warm mat",
]


def train_tokenizer(vocab_size: int) -> object:
    """A WordLevel tokenizer of exactly `vocab_size` tokens: the corpus words plus filler words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = {w for s in SENTENCES for w in s.split()}
    fillers = [f"w{i}" for i in range(vocab_size - len(words) - len(SPECIAL_TOKENS))]
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tokenizer.train_from_iterator([*SENTENCES, " ".join(fillers)], trainer=trainer)
    return tokenizer


def model_dir_with_tokenizer(cfg: DualPathConfig, directory: Path) -> Path:
    """`directory` as a Hugging Face model directory for `cfg.model`: its (seeded random)
    weights as safetensors, tokenizer.json and tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    write_checkpoint(DecoderModel(cfg.model).checkpoint_tensors(), directory)
    tokenizer = train_tokenizer(cfg.model.vocab_size)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}
    ))
    return directory
