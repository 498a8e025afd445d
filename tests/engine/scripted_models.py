"""Tiny checkpoints whose greedy output is scripted: a Qwen3 model built and saved with
transformers' own classes, and a tokenizer (with its chat template) written here, so that
a test knows token for token what the model writes, thinking and answer alike.

The model: one-hot embeddings, the decoder layer's MLP output zero, an LM head that maps
each token to the one the script says comes next (weight 2; unscripted tokens lead to the
EOS with weight 0.1), and second choices (`alternatives`, weight 1.2) that a grammar
falls back to when it masks the first. One token is not always context enough: a harmony
conversation writes `<|channel|>` twice, followed by `analysis` the first time and `final`
the second. So each `flags` entry is an attention head that looks for one token anywhere
before (its query the same for every token, its key nonzero only for the flag token, on
the slowest rotary pair so that distance does not matter): once the token has appeared,
the head writes 1 into a residual dimension of its own, and the LM head adds a bonus to
the tokens the flag favours. Everything else is zero; the logits then depend only on the
current token and the flags.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

STEP = 2.0  # the scripted next token's logit weight
ALTERNATIVE = 1.2  # a second choice, for when a grammar masks the first
FALLBACK = 0.1  # any token the script does not continue leads to the EOS
HEAD_DIM = 32
KEY_SCALE = 20.0  # a flag head's attention score on the flag token: ~113, all of softmax


@dataclass
class Script:
    """`special`: special tokens (skipped in text); `added`: other single-token markers
    (`<think>`); `words`: the rest of the vocabulary (prompt text may fall outside it:
    `<unk>`); `steps`: a chain of tokens, each followed by the next; `alternatives`:
    (token, second choice); `edges`: (token, next, weight) for choices the flags decide;
    `flags`: (flag token, favoured token, bonus); `stops`: more EOS tokens."""

    special: list[str]
    added: list[str]
    words: list[str]
    chat_template: str
    eos: str
    steps: list[list[str]]
    alternatives: list[tuple[str, str]] = field(default_factory=list)
    edges: list[tuple[str, str, float]] = field(default_factory=list)
    flags: list[tuple[str, str, float]] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)

    @property
    def vocab(self) -> list[str]:
        pieces = ["<unk>", *self.special, *self.added]
        return pieces + [w for w in dict.fromkeys(self.words) if w not in pieces]


def build(path: Path, script: Script) -> Path:
    """Write the checkpoint and its tokenizer into `path` (a model directory)."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = script.vocab
    ids = {piece: i for i, piece in enumerate(vocab)}
    _write_tokenizer(path, script, ids)
    _write_model(path, script, ids)
    return path


def _write_tokenizer(path: Path, script: Script, ids: dict[str, int]) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(ids, "<unk>"))
    # The longest piece that matches, else one character (an unknown word is <unk>s).
    pieces = sorted((w for w in script.words), key=len, reverse=True)
    pattern = "|".join(re.escape(p) for p in pieces) + r"|[\s\S]"
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        eos_token=script.eos,
        additional_special_tokens=[s for s in script.special if s != script.eos],
    )
    fast.add_tokens(script.added)
    fast.chat_template = script.chat_template
    fast.save_pretrained(path)
    # Every token is the piece the script names, with the id the model was built for.
    saved = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    assert all(saved.get(p, ids[p]) == i for p, i in ids.items()), "the vocabulary moved"


def _write_model(path: Path, script: Script, ids: dict[str, int]) -> None:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    vocab_size = len(ids)
    heads = max(1, len(script.flags))
    hidden = vocab_size + heads
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e12},
        tie_word_embeddings=False,
        eos_token_id=ids[script.eos],
        bos_token_id=None,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(config)
    slow = HEAD_DIM // 2 - 1  # the rotary pair that turns slowest: it hardly turns at all
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.model.norm.weight.fill_(1.0)
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.self_attn.q_norm.weight.fill_(1.0)
        layer.self_attn.k_norm.weight.fill_(KEY_SCALE)
        model.model.embed_tokens.weight[:, :vocab_size] = torch.eye(vocab_size)
        attention = layer.self_attn
        for head, (flag, _, _) in enumerate(script.flags):
            row = head * HEAD_DIM + slow
            attention.q_proj.weight[row, :vocab_size] = 1.0
            attention.k_proj.weight[row, ids[flag]] = 1.0
            # The input norm scales a one-hot by sqrt(hidden): the value comes out 1.
            attention.v_proj.weight[row, ids[flag]] = hidden**-0.5
            attention.o_proj.weight[vocab_size + head, row] = 1.0
        head_weight = model.lm_head.weight
        head_weight[ids[script.eos], :vocab_size] = FALLBACK
        for chain in script.steps:
            for current, following in itertools.pairwise(chain):
                head_weight[ids[following], ids[current]] = STEP
        for current, second in script.alternatives:
            head_weight[ids[second], ids[current]] = ALTERNATIVE
        for current, following, weight in script.edges:
            head_weight[ids[following], ids[current]] = weight
        for head, (_, favoured, bonus) in enumerate(script.flags):
            head_weight[ids[favoured], vocab_size + head] = bonus
    model.save_pretrained(path)
    eos = [ids[script.eos], *(ids[t] for t in script.stops)]
    GenerationConfig(eos_token_id=eos).save_pretrained(path)


def reference_tokens(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """What transformers' own greedy generation writes after `prompt` (the script, checked)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()
