#!/usr/bin/env python3
"""Build the tiny reference checkpoints under tests/fixtures/tiny and record their outputs.

Every checkpoint here has random weights and a tiny byte-level BPE tokenizer trained on the text
embedded below. The reference outputs are what Hugging Face transformers computes in float32 on
exactly the weights stored in the file (bf16 and GGUF weights are first widened or dequantized to
float32), so a correct loader plus correct kernels must reproduce them to float32 rounding.

The script is deterministic: fixed seeds, a single CPU thread, and no timestamps in any file, so a
re-run with the same library versions rewrites byte-identical files. It is run by hand; the outputs
are committed. See scripts/README.md.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers.utils import logging as hf_logging
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "tiny"

# Shapes shared by every checkpoint (the brief's "tiny" size). Every GGUF row length (hidden 64,
# intermediate 128) is a multiple of 32, the block size of Q4_0, Q4_1 and Q8_0.
HIDDEN = 64
INTERMEDIATE = 128
HEADS = 4
KV_HEADS = 2
MAX_POSITION = 256
TOKENIZER_VOCAB = 384

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2

# The standard ChatML template, as shipped by Qwen2/SmolLM2 style checkpoints.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the tokenizer. Plain English with some digits and punctuation so the byte-level
# merges look like a real vocabulary (common words and word pieces, with a leading-space marker).
TRAINING_TEXT = """\
The river runs past the old mill and under the stone bridge before it turns toward the sea. In the
morning the water is grey and still, and the fishermen walk along the bank with their nets over
their shoulders. By noon the light has changed, the water is green, and the children of the town
come down to the river to throw stones and watch the rings spread out across the surface.

A good kitchen is a quiet place in the hour before dinner. The bread is in the oven, the soup is on
the stove, and the table has been set for eight people. Someone is always late. The cook tastes the
soup, adds a little salt, and tastes it again. When the door finally opens and the last guest comes
in out of the rain, the whole house seems to warm up at once.

The train left the station at 7:45 and arrived in the city two hours later, at 9:52. Most of the
passengers were reading; a few were asleep. The woman by the window counted the fields as they went
past: 12 of wheat, 9 of corn, and 31 that had been left to grow wild. She wrote the numbers in a
small notebook, closed it, and looked out at the hills for the rest of the journey.

Learning to play the piano takes patience. The hands have to learn to move on their own while the
mind listens to the music. At first every note is a decision; later the notes come in phrases, and
the phrases come in songs. The teacher says that the most important thing is to practice a little
every day, and to listen to what the instrument is telling you.

When the storm came in from the west, the sky turned dark and the wind bent the tall trees over the
road. The farmers brought the animals into the barn and closed the doors. It rained for three days.
On the fourth day the sun came out, the fields were green again, and the river was higher than
anyone in the village could remember.
"""

# The fixed prompt every model is run on, and a second, shorter one for the batched record.
PROMPT_TEXT = "The river is green in the morning."
SECOND_PROMPT_TEXT = "The water is still"
# A conversation whose ChatML rendering and ids are recorded as a chat-template and special-token
# test vector.
CHAT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where does the river go?"},
]
# The tiny mixture of experts: experts, experts per token, one expert's width.
MOE_EXPERTS = 4
MOE_TOP_K = 2
MOE_INTERMEDIATE = 32
GREEDY_STEPS = 16
TOPK = 5
# Chunked prefill splits the prompt into these chunk lengths (the last chunk takes the remainder).
CHUNK_PREFIX = [5, 4]

# Weight initialisation. Transformers' default (normal, std 0.02; norms exactly 1) makes a tiny
# random model's logits almost flat, so the top tokens are near-ties and any float32 rounding
# difference can flip a greedy choice or a top-k order. A larger std spreads the logits over a few
# units, and noisy norm weights make a loader that drops a norm weight (or uses 1.0) fail loudly.
MATRIX_STD = 0.2
BIAS_STD = 0.2
NORM_MEAN = 1.0
NORM_STD = 0.2


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def build_tokenizer() -> Tokenizer:
    """Train the tiny byte-level BPE; the special tokens get ids 0, 1, 2 in SPECIAL_TOKENS order."""
    tok = Tokenizer(models.BPE())
    # Byte-level with the GPT-2 split regex: this is what llama.cpp calls the "gpt-2" pre-tokenizer.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(token)
        if got != expected_id:
            raise RuntimeError(f"special token {token} got id {got}, expected {expected_id}")
    if tok.get_vocab_size() != TOKENIZER_VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {TOKENIZER_VOCAB}")
    return tok


def tokenizer_vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    """The token strings in id order and the merges as "left right" strings (GGUF's spelling)."""
    data = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    merges = []
    for merge in data["model"]["merges"]:
        merges.append(merge if isinstance(merge, str) else f"{merge[0]} {merge[1]}")
    return tokens, merges


@dataclass
class Prompt:
    """A prompt and its ids under the tiny tokenizer (the ids double as a tokenizer test)."""

    text: str
    ids: list[int]


@dataclass
class GenerationDefaults:
    """What goes into generation_config.json besides the token ids."""

    eos_token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)


def write_tokenizer_files(out_dir: Path, tok: Tokenizer, generation: GenerationDefaults) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML) and generation_config.json."""
    tok.save(str(out_dir / "tokenizer.json"))
    added = {}
    for idx, token in enumerate(SPECIAL_TOKENS):
        added[str(idx)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    tokenizer_config = {
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": MAX_POSITION,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    eos: int | list[int] = generation.eos_token_ids
    if len(generation.eos_token_ids) == 1:
        eos = generation.eos_token_ids[0]
    generation_config: dict[str, Any] = {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": eos,
        "pad_token_id": ENDOFTEXT_ID,
    }
    generation_config.update(generation.sampling)
    write_json(out_dir / "generation_config.json", generation_config)


def chat_record(tok: Tokenizer) -> dict[str, Any]:
    """CHAT_MESSAGES rendered with ChatML plus the generation prompt, and its ids."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT_MESSAGES)
    text += "<|im_start|>assistant\n"
    return {"messages": CHAT_MESSAGES, "text": text, "ids": tok.encode(text).ids}


def check_tokenizer_dir(out_dir: Path, tok: Tokenizer) -> None:
    """The saved files load in transformers, encode like the trained tokenizer, render ChatML."""
    hf_tok = AutoTokenizer.from_pretrained(str(out_dir))
    for text in (PROMPT_TEXT, SECOND_PROMPT_TEXT, "Hello, world! 123"):
        want = tok.encode(text).ids
        got = hf_tok(text, add_special_tokens=True)["input_ids"]
        if got != want:
            raise RuntimeError(f"{out_dir}: transformers encodes {text!r} as {got}, want {want}")
    if hf_tok.eos_token_id != IM_END_ID or hf_tok.bos_token is not None:
        raise RuntimeError(f"{out_dir}: eos {hf_tok.eos_token_id} bos {hf_tok.bos_token}")
    rendered = hf_tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    if rendered != "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n":
        raise RuntimeError(f"{out_dir}: chat template renders {rendered!r}")
    chat = chat_record(tok)
    rendered = hf_tok.apply_chat_template(
        chat["messages"], tokenize=False, add_generation_prompt=True
    )
    ids = hf_tok(rendered, add_special_tokens=False)["input_ids"]
    if rendered != chat["text"] or ids != chat["ids"]:
        raise RuntimeError(f"{out_dir}: chat renders {rendered!r} as {ids}, want {chat}")
    if ids.count(IM_START_ID) != 3 or ids.count(IM_END_ID) != 2:
        raise RuntimeError(f"{out_dir}: special tokens are not single ids in {ids}")


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def zero_centered_norm(model: PreTrainedModel, name: str) -> bool:
    """Whether parameter `name` is a norm weight applied as `1 + weight` (Qwen3.5's RMSNorm); the
    gated norm inside its linear-attention layers multiplies by the weight itself."""
    return model.config.model_type == "qwen3_5_text" and "norm" in name and "linear_attn.norm" not in name


def init_weights(model: PreTrainedModel, seed: int) -> None:
    """Overwrite every parameter from a seeded generator, in sorted name order (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if zero_centered_norm(model, name):
                # The effective scale 1 + weight is then distributed as every other norm's.
                p.copy_(NORM_MEAN - 1.0 + NORM_STD * noise)
            elif "norm" in name:
                p.copy_(NORM_MEAN + NORM_STD * noise)
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * noise)
            else:
                p.copy_(MATRIX_STD * noise)


def llama_config(layers: int, rope_parameters: dict[str, Any], tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITION,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters,
        tie_word_embeddings=tied,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
    )


def llama3_rope(theta: float) -> dict[str, Any]:
    # original_max_position_embeddings 64 puts the llama3 wavelength cut-offs (16 and 64 tokens)
    # inside head_dim 16's range of wavelengths, so some frequencies are kept, some smoothed and
    # some divided by the factor: the scaling changes the outputs at these sizes.
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def default_rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITION,
        rms_norm_eps=1e-6,
        rope_parameters=default_rope(1_000_000.0),
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
    )


def qwen3_config() -> Qwen3Config:
    # head_dim 32 != hidden / heads (16): q_proj is 64 -> 128 and o_proj 128 -> 64.
    return Qwen3Config(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=32,
        max_position_embeddings=MAX_POSITION,
        rms_norm_eps=1e-6,
        rope_parameters=default_rope(1_000_000.0),
        tie_word_embeddings=True,
        use_sliding_window=False,
        attention_bias=False,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
    )


def qwen3_moe_config() -> Qwen3MoeConfig:
    # Four experts of width 32, two per token, renormalized; layer 1 of 3 is dense through
    # mlp_only_layers, so both FFN kinds run. head_dim 32 as in qwen3.
    return Qwen3MoeConfig(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        moe_intermediate_size=MOE_INTERMEDIATE,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=32,
        max_position_embeddings=MAX_POSITION,
        rms_norm_eps=1e-6,
        rope_parameters=default_rope(1_000_000.0),
        tie_word_embeddings=False,
        use_sliding_window=False,
        attention_bias=False,
        output_router_logits=False,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
    )


@torch.no_grad()
def check_routing(model: PreTrainedModel, ids: list[int], name: str) -> None:
    """Every sparse layer's routing must be robust and must use every expert.

    The top-k choice is discontinuous: a token whose k-th and (k+1)-th router probabilities were
    nearly equal could pick another expert under float32 rounding of a different summation order,
    and the test would compare two different functions. Each expert must also serve some token and
    miss some other, so a loader that swaps or drops an expert changes the outputs.
    """
    logits: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, inp, _out: logits.append(
                torch.nn.functional.linear(inp[0].reshape(-1, inp[0].shape[-1]), _m.weight)
            )
        )
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
    ]
    try:
        logits_of(model, ids)
    finally:
        for h in hooks:
            h.remove()
    if not logits:
        raise RuntimeError(f"{name}: no sparse layer ran")
    k = model.config.num_experts_per_tok
    for i, layer_logits in enumerate(logits):
        probs = torch.softmax(layer_logits.to(torch.float32), dim=-1)
        ranked = torch.sort(probs, dim=-1, descending=True).values
        gap = float((ranked[:, k - 1] - ranked[:, k]).min())
        if gap < 1e-3:
            raise RuntimeError(f"{name}: sparse layer #{i} has a near tie in its top-{k} ({gap})")
        chosen = torch.topk(probs, k, dim=-1).indices
        used = torch.zeros(probs.shape[-1], dtype=torch.long)
        for e in chosen.reshape(-1).tolist():
            used[e] += 1
        if bool((used == 0).any()) or bool((used == len(ids)).any()):
            raise RuntimeError(f"{name}: sparse layer #{i} uses its experts {used.tolist()}")


def qwen3_5_config() -> Qwen3_5TextConfig:
    # The hybrid: layer_types from full_attention_interval 4 give three gated delta-net layers and
    # one full-attention layer. Full attention: head_dim 32 with a quarter of it rotated (partial
    # rotary 0.25, as Qwen3.5 ships), q_proj doubled for the output gate. Linear attention: 2 key
    # heads of 16 shared by 4 value heads of 16 (grouped as in the 27B), a 4-tap causal conv.
    return Qwen3_5TextConfig(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=MAX_POSITION,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "partial_rotary_factor": 0.25,
        },
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
    )


def mistral_config() -> MistralConfig:
    return MistralConfig(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITION,
        rms_norm_eps=1e-5,
        rope_parameters=default_rope(1_000_000.0),
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
    )


def build_model(cls: type[PreTrainedModel], config: PretrainedConfig, seed: int) -> PreTrainedModel:
    config._attn_implementation = "eager"
    if getattr(config, "num_experts", 0):
        # The plain per-expert loop: the grouped kernel has no float64 path for the f64 check.
        config._experts_implementation = "eager"
    model = cls(config).to(torch.float32)
    init_weights(model, seed)
    model.eval()
    return model


def load_model(path: Path) -> PreTrainedModel:
    """Load a saved directory back in float32 (bf16 weights are widened exactly)."""
    kwargs: dict[str, Any] = {}
    if json.loads((path / "config.json").read_text()).get("num_experts"):
        kwargs["experts_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", **kwargs
    )
    model.eval()
    return model


# ----------------------------------------------------------------------------------------------
# Reference outputs
# ----------------------------------------------------------------------------------------------


def floats(t: torch.Tensor) -> list[float]:
    """float32 values as Python floats (each one exactly the float32 value)."""
    return [float(x) for x in t.detach().to(torch.float32).reshape(-1).tolist()]


@torch.no_grad()
def logits_of(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logits of one full forward pass without any cache."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0]


@torch.no_grad()
def reference(model: PreTrainedModel, prompt: Prompt, chat: dict[str, Any]) -> dict[str, Any]:
    prompt_ids = prompt.ids
    logits = logits_of(model, prompt_ids)
    logprobs = torch.log_softmax(logits, dim=-1)
    topk = []
    for row in logprobs:
        values, indices = torch.topk(row, TOPK)
        topk.append([{"id": int(i), "logprob": float(v)} for v, i in zip(values, indices)])

    # Greedy continuation by a plain loop of full forward passes, so the record does not depend on
    # transformers' KV cache.
    ids = list(prompt_ids)
    margins = []
    generated = []
    for _ in range(GREEDY_STEPS):
        last = logits_of(model, ids)[-1]
        top2 = torch.topk(last, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        next_id = int(top2.indices[0])
        generated.append(next_id)
        ids.append(next_id)

    # Chunked prefill through transformers' cache: the same last-position distribution must come
    # out whichever way the prompt is split.
    chunk_sizes = CHUNK_PREFIX + [len(prompt_ids) - sum(CHUNK_PREFIX)]
    past = None
    start = 0
    for size in chunk_sizes:
        chunk = torch.tensor([prompt_ids[start : start + size]])
        out = model(input_ids=chunk, cache=past, use_cache=True)
        past = out.cache
        start += size
    chunked_last = torch.log_softmax(out.logits[0, -1], dim=-1)
    chunked_gap = float((chunked_last - logprobs[-1]).abs().max())
    if chunked_gap > 1e-4:
        raise RuntimeError(f"chunked prefill differs from one pass by {chunked_gap}")

    # The same forward in float64 measures how far float32 rounding alone moves the log-probs; it
    # is recorded so the tolerance used by the Rust tests is grounded in a number.
    model64 = copy.deepcopy(model).to(torch.float64)
    if getattr(model64.config, "num_experts", 0):
        # A copied config forgets its experts implementation; the grouped kernel has no float64.
        model64.set_experts_implementation("eager")
    logprobs64 = torch.log_softmax(logits_of(model64, prompt_ids), dim=-1)
    f64_gap = float((logprobs.to(torch.float64) - logprobs64).abs().max())

    return {
        "prompt_text": prompt.text,
        "prompt_ids": list(prompt_ids),
        "topk": topk,
        "last_logprobs": floats(logprobs[-1]),
        "greedy": {"ids": generated, "margins": margins},
        "chunked": {"chunk_sizes": chunk_sizes, "last_logprobs": floats(chunked_last)},
        "f32_vs_f64_max_abs_logprob": f64_gap,
        "chat": chat,
    }


@torch.no_grad()
def batch_reference(model: PreTrainedModel, prompts: list[Prompt]) -> list[dict[str, Any]]:
    """Each prompt alone (no padding): what a batched forward must reproduce per sequence."""
    records = []
    for prompt in prompts:
        logprobs = torch.log_softmax(logits_of(model, prompt.ids)[-1], dim=-1)
        records.append(
            {
                "prompt_text": prompt.text,
                "prompt_ids": list(prompt.ids),
                "last_logprobs": floats(logprobs),
            }
        )
    return records


@torch.no_grad()
def assert_same_outputs(a: PreTrainedModel, b: PreTrainedModel, ids: list[int], what: str) -> None:
    la = logits_of(a, ids)
    lb = logits_of(b, ids)
    if not torch.equal(la, lb):
        raise RuntimeError(f"{what}: logits differ by {float((la - lb).abs().max())}")


@torch.no_grad()
def assert_different_outputs(
    a: PreTrainedModel, b: PreTrainedModel, ids: list[int], what: str
) -> None:
    gap = float((logits_of(a, ids) - logits_of(b, ids)).abs().max())
    if gap < 1e-2:
        raise RuntimeError(f"{what}: outputs only differ by {gap}")
    print(f"{what}: changes the logits by up to {gap:.3f}")


# ----------------------------------------------------------------------------------------------
# Hugging Face directories
# ----------------------------------------------------------------------------------------------


@dataclass
class HfFixture:
    """One Hugging Face model directory to write."""

    name: str
    model_class: type[PreTrainedModel]
    config: PretrainedConfig
    seed: int
    dtype: torch.dtype
    generation: GenerationDefaults
    max_shard_size: str | None = None
    # Rewrites config.json after saving (for spellings transformers no longer writes).
    rewrite_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    with_batch: bool = False


def to_old_spelling(config: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters -> rope_theta + rope_scaling, dtype -> torch_dtype (pre-v5 configs)."""
    out = {}
    for key, value in config.items():
        if key == "rope_parameters":
            scaling = {k: v for k, v in value.items() if k != "rope_theta"}
            out["rope_scaling"] = None if scaling.get("rope_type") == "default" else scaling
            out["rope_theta"] = value["rope_theta"]
        elif key == "dtype":
            out["torch_dtype"] = value
        else:
            out[key] = value
    return dict(sorted(out.items()))


def write_hf_fixture(
    out_root: Path, spec: HfFixture, tok: Tokenizer, prompts: list[Prompt]
) -> None:
    out_dir = out_root / spec.name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)

    model = build_model(spec.model_class, spec.config, spec.seed)
    # Round the float32 parameters to the stored dtype first, so the float32 model in memory holds
    # exactly the stored values. Casting the module itself would also round the rotary inv_freq
    # buffer, which transformers recomputes in float32 on load.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(spec.dtype).to(torch.float32))
    kwargs: dict[str, Any] = {}
    if spec.max_shard_size is not None:
        kwargs["max_shard_size"] = spec.max_shard_size
    copy.deepcopy(model).to(spec.dtype).save_pretrained(str(out_dir), **kwargs)
    # save_pretrained writes its own generation_config.json; ours replaces it below.
    write_tokenizer_files(out_dir, tok, spec.generation)
    check_tokenizer_dir(out_dir, tok)

    # The reference is computed on the reloaded checkpoint, in float32: for bf16 this is exactly
    # the stored bf16 values widened, and it proves the directory loads back.
    reloaded = load_model(out_dir)
    assert_same_outputs(model, reloaded, prompts[0].ids, f"{spec.name} reload")

    if spec.rewrite_config is not None:
        config_path = out_dir / "config.json"
        original = json.loads(config_path.read_text())
        write_json(config_path, spec.rewrite_config(original))
        rewritten = load_model(out_dir)
        if rewritten.config.rope_parameters != reloaded.config.rope_parameters:
            raise RuntimeError(
                f"{spec.name}: old spelling loads as {rewritten.config.rope_parameters}, "
                f"new as {reloaded.config.rope_parameters}"
            )
        assert_same_outputs(reloaded, rewritten, prompts[0].ids, f"{spec.name} old spelling")
        reloaded = rewritten

    record = reference(reloaded, prompts[0], chat_record(tok))
    if spec.with_batch:
        record["batch"] = batch_reference(reloaded, prompts)
    write_json(out_dir / "reference.json", record)


# ----------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------

GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in GGUF_LAYER_NAMES:
        return f"blk.{parts[2]}.{GGUF_LAYER_NAMES[parts[3]]}"
    raise KeyError(f"no GGUF name for {hf_name}")


def hf_name(gguf_tensor: str) -> str:
    if gguf_tensor == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_tensor == "output_norm.weight":
        return "model.norm.weight"
    if gguf_tensor == "output.weight":
        return "lm_head.weight"
    _, layer, rest = gguf_tensor.split(".", 2)
    for hf_suffix, g_suffix in GGUF_LAYER_NAMES.items():
        if g_suffix == rest:
            return f"model.layers.{layer}.{hf_suffix}"
    raise KeyError(f"no HF name for {gguf_tensor}")


def permute_for_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row permutation.

    HF llama rotates dimension i with i + head_dim/2 (NeoX halves); llama.cpp's llama arch rotates
    adjacent pairs (2i, 2i+1). Interleaving the two halves of each head's rows makes the two agree.
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


Q = gguf.GGMLQuantizationType


@dataclass
class GgufFixture:
    """One GGUF file to write, from a fresh random HF model."""

    name: str
    arch: str  # "llama" or "qwen2"
    model_class: type[PreTrainedModel]
    config: PretrainedConfig
    seed: int
    file_type: gguf.LlamaFileType
    # Picks the storage type of each GGUF tensor by name.
    tensor_type: Callable[[str], gguf.GGMLQuantizationType]
    # llama.cpp's llama arch wants Q/K permuted; qwen2 is NeoX style and is stored as is.
    permute_qk: bool
    write_key_length: bool


def llama_q_types(name: str) -> gguf.GGMLQuantizationType:
    if name.endswith("norm.weight"):
        return Q.F32
    if name in ("token_embd.weight", "output.weight"):
        return Q.Q8_0
    if ".attn_" in name:
        return Q.Q4_0
    if ".ffn_" in name:
        return Q.Q4_1
    raise KeyError(name)


def f16_types(name: str) -> gguf.GGMLQuantizationType:
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return Q.F32
    return Q.F16


def bf16_types(name: str) -> gguf.GGMLQuantizationType:
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return Q.F32
    return Q.BF16


def encode_tensor(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.F32:
        return data.astype(np.float32)
    if qtype == Q.F16:
        return data.astype(np.float16)
    if data.ndim == 2 and data.shape[1] % 32 != 0:
        raise ValueError(f"row length {data.shape[1]} is not a multiple of the 32-element block")
    return gguf.quants.quantize(data.astype(np.float32), qtype)


def decode_tensor(tensor: Any) -> np.ndarray:
    """A GGUFReader tensor as float32 in numpy (HF) order, via gguf's own dequantizers."""
    qtype = Q(int(tensor.tensor_type))
    rows_cols = [int(x) for x in reversed(tensor.shape.tolist())]
    if qtype == Q.F32:
        return np.array(tensor.data, dtype=np.float32).reshape(rows_cols)
    if qtype == Q.F16:
        return np.array(tensor.data, dtype=np.float16).astype(np.float32).reshape(rows_cols)
    values = gguf.quants.dequantize(np.array(tensor.data), qtype)
    return values.astype(np.float32).reshape(rows_cols)


def write_gguf_fixture(
    out_root: Path, spec: GgufFixture, tok: Tokenizer, prompt: Prompt
) -> None:
    path = out_root / f"{spec.name}.gguf"
    cfg = spec.config
    model = build_model(spec.model_class, cfg, spec.seed)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(spec.name)
    writer.add_file_type(spec.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if spec.arch == "llama":
        # convert_hf_to_gguf.py writes these for llama: vocab size and the rotary dimension.
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if spec.write_key_length:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    add_gguf_tokenizer(writer, tok)

    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    written_types = {}
    for hf in state_order(state):
        name = gguf_name(hf)
        data = state[hf]
        if spec.permute_qk and name.endswith("attn_q.weight"):
            data = permute_for_llama_cpp(data, cfg.num_attention_heads)
        elif spec.permute_qk and name.endswith("attn_k.weight"):
            data = permute_for_llama_cpp(data, cfg.num_key_value_heads)
        qtype = spec.tensor_type(name)
        encoded = encode_tensor(data, qtype)
        raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
        writer.add_tensor(name, encoded, raw_dtype=raw_dtype)
        written_types[name] = qtype
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # Read the file back and rebuild the HF model from its dequantized tensors: the reference is
    # what transformers computes on exactly the values a GGUF loader will see.
    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields["general.architecture"]
    if bytes(arch_field.parts[arch_field.data[0]]).decode() != spec.arch:
        raise RuntimeError(f"{path}: architecture did not round-trip")
    loaded = {}
    for tensor in reader.tensors:
        if Q(int(tensor.tensor_type)) != written_types[tensor.name]:
            raise RuntimeError(f"{path}: {tensor.name} stored as {tensor.tensor_type}")
        data = decode_tensor(tensor)
        if spec.permute_qk and tensor.name.endswith("attn_q.weight"):
            data = unpermute_from_llama_cpp(data, cfg.num_attention_heads)
        elif spec.permute_qk and tensor.name.endswith("attn_k.weight"):
            data = unpermute_from_llama_cpp(data, cfg.num_key_value_heads)
        loaded[hf_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(data))
    if set(loaded) != set(state):
        raise RuntimeError(f"{path}: tensors {sorted(set(state) ^ set(loaded))} did not round-trip")

    dequantized = build_model(spec.model_class, copy.deepcopy(cfg), spec.seed)
    missing, unexpected = dequantized.load_state_dict(loaded, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"{path}: missing {missing}, unexpected {unexpected}")
    lm_head_ptr = dequantized.lm_head.weight.data_ptr()
    if cfg.tie_word_embeddings and lm_head_ptr != dequantized.model.embed_tokens.weight.data_ptr():
        raise RuntimeError(f"{path}: lm_head is not tied after loading")
    record = reference(dequantized, prompt, chat_record(tok))
    record["tensor_types"] = {name: qtype.name for name, qtype in written_types.items()}
    gap = check_against_numpy(path, record)
    print(f"{spec.name}.gguf: numpy llama.cpp-style forward within {gap:.2e} of the reference")
    write_json(out_root / f"{spec.name}.reference.json", record)


def write_moe_gguf_fixture(out_root: Path, name: str, seed: int, tok: Tokenizer, prompt: Prompt) -> None:
    """A qwen3moe GGUF as llama.cpp's converter lays it out, with its transformers reference.

    llama.cpp's qwen3moe has a router (`ffn_gate_inp`) and stacked experts (`ffn_{gate,up,down}_exps`,
    numpy shape [experts, rows, cols]) on every layer and always renormalizes the top-k weights, so
    the model here is sparse throughout with norm_topk_prob. Matrices are F16 (norms and the router
    F32, as the converter keeps them); the model is rounded to those values before the reference.
    """
    path = out_root / f"{name}.gguf"
    cfg = qwen3_moe_config()
    cfg.mlp_only_layers = []
    cfg.num_hidden_layers = 2
    model = build_model(Qwen3MoeForCausalLM, cfg, seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" not in pname and not pname.endswith("mlp.gate.weight"):
                p.copy_(p.to(torch.float16).to(torch.float32))

    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    add_gguf_tokenizer(writer, tok)

    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    tensors: dict[str, np.ndarray] = {}
    inter = cfg.moe_intermediate_size
    for hf, data in state.items():
        if ".mlp.experts." in hf:
            layer = hf.split(".")[2]
            if hf.endswith("gate_up_proj"):  # [experts, 2 * inter, hidden]: gate rows, then up rows
                tensors[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :inter, :]
                tensors[f"blk.{layer}.ffn_up_exps.weight"] = data[:, inter:, :]
            elif hf.endswith("down_proj"):  # [experts, hidden, inter]
                tensors[f"blk.{layer}.ffn_down_exps.weight"] = data
            else:
                raise KeyError(hf)
        elif hf.endswith(".mlp.gate.weight"):
            tensors[f"blk.{hf.split('.')[2]}.ffn_gate_inp.weight"] = data
        else:
            tensors[gguf_name(hf)] = data
    for tname in sorted(tensors):
        data = np.ascontiguousarray(tensors[tname])
        f32 = tname.endswith("norm.weight") or tname.endswith("ffn_gate_inp.weight")
        writer.add_tensor(tname, data.astype(np.float32 if f32 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # The file must hold exactly the model's (rounded) values.
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        want = tensors[t.name]
        got = np.array(t.data).astype(np.float32).reshape(want.shape)
        if not np.array_equal(got, want):
            raise RuntimeError(f"{path}: {t.name} did not round-trip")
    if {t.name for t in reader.tensors} != set(tensors):
        raise RuntimeError(f"{path}: the tensor set did not round-trip")

    record = reference(model, prompt, chat_record(tok))
    check_routing(model, prompt.ids + record["greedy"]["ids"], name)
    write_json(out_root / f"{name}.reference.json", record)


# Hugging Face part names of a qwen3_5 layer and their llama.cpp `qwen35` names.
QWEN35_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}


def tiled_v_heads(x: np.ndarray, axis: int, k_heads: int, v_per_k: int, head: int) -> np.ndarray:
    """Value heads along `axis` from grouped order (every value head of key head 0, then of key head
    1, ...) to tiled order (one of each key head's, then the next of each), as llama.cpp's converter
    stores them for ggml's broadcast."""
    shape = list(x.shape)
    split = shape[:axis] + [k_heads, v_per_k, head] + shape[axis + 1 :]
    return np.ascontiguousarray(np.swapaxes(x.reshape(split), axis, axis + 1).reshape(shape))


def qwen35_gguf_tensors(model: PreTrainedModel, cfg: Qwen3_5TextConfig) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter writes a `qwen35` GGUF: norms other than the
    delta-net's stored as 1 + weight, A_log as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the
    convolution squeezed to [channels, taps], and value heads tiled in every tensor indexed by them."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    qk = 2 * nk * dk
    out: dict[str, np.ndarray] = {}
    for hf, t in model.state_dict().items():
        data = t.detach().to(torch.float32).numpy()
        if hf == "model.embed_tokens.weight":
            out["token_embd.weight"] = data
            continue
        if hf == "model.norm.weight":
            out["output_norm.weight"] = data + np.float32(1.0)
            continue
        if hf == "lm_head.weight":
            out["output.weight"] = data
            continue
        _, _, layer, part = hf.split(".", 3)
        name = f"blk.{layer}.{QWEN35_LAYER_NAMES[part]}"
        if part.endswith("norm.weight") and part != "linear_attn.norm.weight":
            data = data + np.float32(1.0)
        elif part == "linear_attn.A_log":
            data = -np.exp(data)
        elif part == "linear_attn.conv1d.weight":
            data = data.reshape(data.shape[0], data.shape[2])
        if part in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
            data = np.concatenate([data[:qk], tiled_v_heads(data[qk:], 0, nk, r, dv)])
        elif part == "linear_attn.in_proj_z.weight":
            data = tiled_v_heads(data, 0, nk, r, dv)
        elif part in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
            data = tiled_v_heads(data, 0, nk, r, 1)
        elif part in ("linear_attn.A_log", "linear_attn.dt_bias"):
            data = tiled_v_heads(data.reshape(-1, 1), 0, nk, r, 1).reshape(-1)
        elif part == "linear_attn.out_proj.weight":
            data = tiled_v_heads(data, 1, nk, r, dv)
        out[name] = np.ascontiguousarray(data)
    return out


def write_qwen35_gguf_fixture(out_root: Path, name: str, seed: int, tok: Tokenizer, prompt: Prompt) -> None:
    """The tiny hybrid as a llama.cpp `qwen35` GGUF (see qwen35_gguf_tensors), with its transformers
    reference. Matrices are F16; vectors and the convolution F32, as the converter keeps them. The
    model is rounded to those values before the reference."""
    path = out_root / f"{name}.gguf"
    cfg = qwen3_5_config()
    model = build_model(Qwen3_5ForCausalLM, cfg, seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(p.to(torch.float16).to(torch.float32))
    tensors = qwen35_gguf_tensors(model, cfg)

    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_full_attention_interval(4)
    add_gguf_tokenizer(writer, tok)
    for tname in sorted(tensors):
        data = tensors[tname]
        f16 = data.ndim == 2 and not tname.endswith("ssm_conv1d.weight")
        writer.add_tensor(tname, data.astype(np.float16 if f16 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        want = tensors[t.name]
        got = np.array(t.data).astype(np.float32).reshape(want.shape)
        if not np.array_equal(got, want):
            raise RuntimeError(f"{path}: {t.name} did not round-trip")
    if {t.name for t in reader.tensors} != set(tensors):
        raise RuntimeError(f"{path}: the tensor set did not round-trip")
    if cfg.layer_types != ["linear_attention"] * 3 + ["full_attention"]:
        raise RuntimeError(f"{path}: full_attention_interval 4 does not give {cfg.layer_types}")
    write_json(out_root / f"{name}.reference.json", reference(model, prompt, chat_record(tok)))


def add_gguf_tokenizer(writer: gguf.GGUFWriter, tok: Tokenizer) -> None:
    """The tiny tokenizer as GGUF metadata (gpt2-style BPE with ChatML)."""
    tokens, merges = tokenizer_vocab_and_merges(tok)
    token_types = [
        gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens
    ]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ENDOFTEXT_ID)
    writer.add_eos_token_id(IM_END_ID)
    writer.add_pad_token_id(ENDOFTEXT_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def numpy_forward_llama_cpp(path: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] float32 logits from the GGUF alone, in llama.cpp's conventions.

    An independent second implementation: hyperparameters come from the file's metadata, tensors
    are used as stored (Q/K still permuted), and RoPE rotates adjacent pairs for `llama` and the
    two halves (NeoX) for `qwen2`, as llama.cpp does. Agreement with the transformers reference
    checks the permutation, the metadata and the dequantization together.
    """
    reader = gguf.GGUFReader(str(path))
    meta = {key: f.contents() for key, f in reader.fields.items()}
    arch = meta["general.architecture"]
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta[f"{arch}.attention.head_count_kv"])
    n_embd = int(meta[f"{arch}.embedding_length"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", n_embd // n_head))
    eps = np.float32(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    theta = float(meta[f"{arch}.rope.freq_base"])
    w = {t.name: decode_tensor(t) for t in reader.tensors}

    def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        y = x @ w[f"{name}.weight"].T
        bias = w.get(f"{name}.bias")
        return y if bias is None else y + bias

    n = len(ids)
    pos = np.arange(n, dtype=np.float64)[:, None]
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    cos = np.cos(pos * inv_freq).astype(np.float32)[:, None, :]  # [n, 1, head_dim/2]
    sin = np.sin(pos * inv_freq).astype(np.float32)[:, None, :]

    def rope(t: np.ndarray) -> np.ndarray:  # t: [n, heads, head_dim]
        if arch == "llama":
            a, b = t[..., 0::2], t[..., 1::2]
            out = np.empty_like(t)
            out[..., 0::2] = a * cos - b * sin
            out[..., 1::2] = b * cos + a * sin
            return out
        half = head_dim // 2
        a, b = t[..., :half], t[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    x = w["token_embd.weight"][ids]  # [n, n_embd]
    mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
    for layer in range(int(meta[f"{arch}.block_count"])):
        blk = f"blk.{layer}"
        h = rms_norm(x, w[f"{blk}.attn_norm.weight"])
        q = rope(linear(h, f"{blk}.attn_q").reshape(n, n_head, head_dim))
        k = rope(linear(h, f"{blk}.attn_k").reshape(n, n_kv, head_dim))
        v = linear(h, f"{blk}.attn_v").reshape(n, n_kv, head_dim)
        heads = []
        for head in range(n_head):
            kv = head // (n_head // n_kv)
            scores = q[:, head, :] @ k[:, kv, :].T / np.float32(np.sqrt(head_dim)) + mask
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            heads.append((scores / scores.sum(axis=-1, keepdims=True)) @ v[:, kv, :])
        x = x + linear(np.concatenate(heads, axis=-1), f"{blk}.attn_output")
        h = rms_norm(x, w[f"{blk}.ffn_norm.weight"])
        gate = linear(h, f"{blk}.ffn_gate")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, f"{blk}.ffn_up"), f"{blk}.ffn_down")
    x = rms_norm(x, w["output_norm.weight"])
    output = w.get("output.weight", w["token_embd.weight"])
    return (x @ output.T).astype(np.float32)


def check_against_numpy(path: Path, record: dict[str, Any]) -> float:
    """Max |log-prob| gap between the numpy forward and the recorded reference (all positions)."""
    logits = numpy_forward_llama_cpp(path, record["prompt_ids"]).astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    gap = float(np.abs(logprobs[-1] - np.array(record["last_logprobs"])).max())
    for position, top in enumerate(record["topk"]):
        for entry in top:
            gap = max(gap, abs(float(logprobs[position, entry["id"]]) - entry["logprob"]))
    if gap > 1e-4:
        raise RuntimeError(f"{path}: numpy llama.cpp-style forward differs from reference by {gap}")
    return gap


def state_order(state: dict[str, np.ndarray]) -> list[str]:
    """llama.cpp's file order: embeddings, then each block, then the final norm and output."""

    def key(name: str) -> tuple[int, int, str]:
        if name == "model.embed_tokens.weight":
            return (0, 0, name)
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (2, 0 if name == "model.norm.weight" else 1, name)

    return sorted(state, key=key)


# ----------------------------------------------------------------------------------------------
# Self-checks and driver
# ----------------------------------------------------------------------------------------------


def check_permutation_matches_rope() -> None:
    """Adjacent-pair RoPE on permuted Q equals NeoX-halves RoPE on the original Q (one head)."""
    rng = np.random.default_rng(0)
    head_dim, hidden = 16, 8
    w = rng.standard_normal((head_dim, hidden))
    x = rng.standard_normal(hidden)
    angles = 0.7 * (10000.0 ** (-np.arange(0, head_dim, 2) / head_dim))
    cos, sin = np.cos(angles), np.sin(angles)
    q = w @ x
    half = head_dim // 2
    neox = np.concatenate([q[:half] * cos - q[half:] * sin, q[half:] * cos + q[:half] * sin])
    qp = permute_for_llama_cpp(w, 1) @ x
    pairs = np.empty_like(qp)
    pairs[0::2] = qp[0::2] * cos - qp[1::2] * sin
    pairs[1::2] = qp[1::2] * cos + qp[0::2] * sin
    # Un-permuting the adjacent-pair result must give the NeoX result.
    back = unpermute_from_llama_cpp(pairs.reshape(head_dim, 1), 1).reshape(-1)
    if not np.allclose(back, neox):
        raise RuntimeError("llama.cpp Q/K permutation does not match RoPE conventions")
    if not np.array_equal(unpermute_from_llama_cpp(permute_for_llama_cpp(w, 2), 2), w):
        raise RuntimeError("unpermute is not the inverse of permute")


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def sha256_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "SHA256SUMS"
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="write only this fixture (repeatable); the others stay as they are",
    )
    args = parser.parse_args()
    wanted = (lambda name: name in args.only) if args.only else (lambda name: True)
    out_root: Path = args.out
    out_root.mkdir(parents=True, exist_ok=True)

    # One thread and deterministic kernels: float32 sums then happen in one fixed order.
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    check_permutation_matches_rope()

    tok = build_tokenizer()
    prompt = Prompt(PROMPT_TEXT, tok.encode(PROMPT_TEXT).ids)
    second = Prompt(SECOND_PROMPT_TEXT, tok.encode(SECOND_PROMPT_TEXT).ids)
    if len(prompt.ids) <= sum(CHUNK_PREFIX) or len(prompt.ids) == len(second.ids):
        raise RuntimeError(
            f"prompt lengths {len(prompt.ids)} and {len(second.ids)} do not fit the records"
        )

    plain_eos = GenerationDefaults(eos_token_ids=[IM_END_ID])
    hf_fixtures = [
        HfFixture(
            name="llama-f32",
            model_class=LlamaForCausalLM,
            config=llama_config(layers=2, rope_parameters=llama3_rope(10000.0), tied=False),
            seed=1,
            dtype=torch.float32,
            generation=plain_eos,
            rewrite_config=to_old_spelling,
            with_batch=True,
        ),
        HfFixture(
            name="llama-bf16-sharded",
            model_class=LlamaForCausalLM,
            config=llama_config(layers=3, rope_parameters=llama3_rope(500000.0), tied=False),
            seed=2,
            dtype=torch.bfloat16,
            generation=plain_eos,
            max_shard_size="100KB",
        ),
        HfFixture(
            name="qwen2-tied",
            model_class=Qwen2ForCausalLM,
            config=qwen2_config(),
            seed=3,
            dtype=torch.float32,
            generation=GenerationDefaults(
                eos_token_ids=[IM_END_ID, ENDOFTEXT_ID],
                sampling={"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
            ),
        ),
        HfFixture(
            name="qwen3",
            model_class=Qwen3ForCausalLM,
            config=qwen3_config(),
            seed=4,
            dtype=torch.float32,
            generation=plain_eos,
        ),
        HfFixture(
            name="qwen3-moe",
            model_class=Qwen3MoeForCausalLM,
            config=qwen3_moe_config(),
            # The first seed from 8 whose routing has no near tie and uses every expert (check_routing).
            seed=33,
            dtype=torch.float32,
            generation=plain_eos,
            with_batch=True,
        ),
        HfFixture(
            name="qwen3_5",
            model_class=Qwen3_5ForCausalLM,
            config=qwen3_5_config(),
            seed=8,
            dtype=torch.float32,
            generation=plain_eos,
            with_batch=True,
        ),
        HfFixture(
            # Model #8's config in bf16 with other weights: the zero-centred norms, A_log and
            # dt_bias are rounded too, and widened exactly on load.
            name="qwen3_5-bf16",
            model_class=Qwen3_5ForCausalLM,
            config=qwen3_5_config(),
            seed=9,
            dtype=torch.bfloat16,
            generation=plain_eos,
        ),
        HfFixture(
            name="mistral",
            model_class=MistralForCausalLM,
            config=mistral_config(),
            seed=5,
            dtype=torch.float32,
            generation=plain_eos,
        ),
    ]
    for spec in hf_fixtures:
        if not wanted(spec.name):
            continue
        write_hf_fixture(out_root, spec, tok, [prompt, second])
        print(f"wrote {spec.name}")

    if wanted("qwen3-moe"):
        moe = load_model(out_root / "qwen3-moe")
        # Every position the tests run: the prompt with its greedy continuation, and the second
        # prompt of the batch record.
        record = json.loads((out_root / "qwen3-moe" / "reference.json").read_text())
        for ids in (prompt.ids + record["greedy"]["ids"], second.ids):
            check_routing(moe, ids, "qwen3-moe")
        # Renormalizing the top-k weights must change the outputs, or the fixture would not catch
        # a loader that ignores norm_topk_prob.
        plain_cfg = AutoConfig.from_pretrained(str(out_root / "qwen3-moe"))
        plain_cfg.norm_topk_prob = False
        plain_cfg._attn_implementation = "eager"
        plain_cfg._experts_implementation = "eager"
        plain = Qwen3MoeForCausalLM(plain_cfg)
        plain.load_state_dict(moe.state_dict())
        plain.eval()
        assert_different_outputs(moe, plain, prompt.ids, "norm_topk_prob")

    # The llama3 scaling must actually change the outputs at these sizes, or the fixture would not
    # catch a loader that ignores rope_scaling.
    if wanted("llama-f32"):
        scaled = load_model(out_root / "llama-f32")
        unscaled_cfg = AutoConfig.from_pretrained(str(out_root / "llama-f32"))
        unscaled_cfg.rope_parameters = default_rope(10000.0)
        unscaled_cfg._attn_implementation = "eager"
        unscaled = LlamaForCausalLM(unscaled_cfg)
        unscaled.load_state_dict(scaled.state_dict())
        unscaled.eval()
        assert_different_outputs(scaled, unscaled, prompt.ids, "llama3 rope scaling")

    # The Q/K bias of qwen2 must be non-zero (a loader that drops it must fail).
    if wanted("qwen2-tied"):
        qwen2 = load_model(out_root / "qwen2-tied")
        if float(qwen2.model.layers[0].self_attn.q_proj.bias.detach().abs().min()) == 0.0:
            raise RuntimeError("qwen2 q bias has zeros")

    gguf_fixtures = [
        GgufFixture(
            name="llama-q",
            arch="llama",
            model_class=LlamaForCausalLM,
            config=llama_config(layers=2, rope_parameters=default_rope(10000.0), tied=False),
            seed=6,
            file_type=gguf.LlamaFileType.MOSTLY_Q4_0,
            tensor_type=llama_q_types,
            permute_qk=True,
            write_key_length=True,
        ),
        GgufFixture(
            name="qwen2-f16",
            arch="qwen2",
            model_class=Qwen2ForCausalLM,
            config=qwen2_config(),
            # The same seed and config as qwen2-tied, so these are model #3's weights in F16.
            seed=3,
            file_type=gguf.LlamaFileType.MOSTLY_F16,
            tensor_type=f16_types,
            permute_qk=False,
            write_key_length=False,
        ),
        GgufFixture(
            name="llama-bf16",
            arch="llama",
            model_class=LlamaForCausalLM,
            # Tied, like SmolLM2: a llama GGUF without output.weight.
            config=llama_config(layers=2, rope_parameters=default_rope(100000.0), tied=True),
            seed=7,
            file_type=gguf.LlamaFileType.MOSTLY_BF16,
            tensor_type=bf16_types,
            permute_qk=True,
            write_key_length=True,
        ),
    ]
    for spec in gguf_fixtures:
        if not wanted(spec.name):
            continue
        write_gguf_fixture(out_root, spec, tok, prompt)
        print(f"wrote {spec.name}.gguf")

    if wanted("qwen3-moe-f16"):
        # Seed 42: the first from 40 whose routing passes check_routing.
        write_moe_gguf_fixture(out_root, "qwen3-moe-f16", 42, tok, prompt)
        print("wrote qwen3-moe-f16.gguf")

    if wanted("qwen3_5-f16"):
        write_qwen35_gguf_fixture(out_root, "qwen3_5-f16", 8, tok, prompt)
        print("wrote qwen3_5-f16.gguf")

    sums = sha256_tree(out_root)
    (out_root / "SHA256SUMS").write_text("".join(f"{h}  {p}\n" for p, h in sums.items()))
    total = sum(p.stat().st_size for p in out_root.rglob("*") if p.is_file())
    print(f"{len(sums)} files, {total / 1024 / 1024:.2f} MiB under {out_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
