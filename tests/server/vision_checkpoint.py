"""A tiny random Gemma 3 vision-language checkpoint built by transformers' own classes
(SigLIP tower, projector, Gemma 3 text model), with a character-level tokenizer, a chat
template that writes `<start_of_image>` where an image stood, and the image processor's
config: what transformers' `Gemma3Processor` and `generate` read, and what the server
serves."""

import json
from pathlib import Path

SPECIALS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
IMAGE_SIZE, PATCH_SIZE, IMAGE_TOKENS = 28, 7, 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<start_of_image>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build(path: Path) -> Path:
    """Write the checkpoint, tokenizer and processor configs into `path`."""
    import torch
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    ids = {token: i for i, token in enumerate((*SPECIALS, *CHARS))}
    tokenizer = Tokenizer(models.WordLevel(ids, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=list(SPECIALS[4:]),
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)
    text = {
        "vocab_size": len(ids),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 512,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 512,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "vision_use_head": False,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random, not zeros: the image must move the logits
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    model.save_pretrained(path)
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "rescale_factor": 1 / 255,
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": IMAGE_TOKENS})
    )
    return path
