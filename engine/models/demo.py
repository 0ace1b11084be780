"""The demo model: a tiny Llama checkpoint built from nothing, byte-identical everywhere.

No machine here can reach a model hub, so `build_demo_model` makes a complete
Hugging Face checkpoint from a seed: a byte-level BPE tokenizer trained on a
corpus generated in code, seeded random weights, a ChatML chat template.

Two properties matter downstream:
- Determinism: the same seed gives the same bytes on every machine and run, so
  a checkpoint's sha256 can be pinned and tests need no stored artifacts.
- Separated logits: tests compare our engine's greedy tokens with transformers'.
  Random weights at the usual small init give near-tied logits, where float
  rounding picks a different argmax; large weights spread the logits over
  several units instead (see `_init_std`).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "hidden_act": "silu",
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "pad_token_id": 0,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

# Ids 0..2 in this order: <|endoftext|> is bos and pad, <|im_end|> is eos.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part over "
    "new sound take only little work know place year live me back give most very after thing "
    "our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put "
    "end does another well large must big even such because turn here why ask went men read "
    "need land different home us move try kind hand picture again change off play spell air "
    "away animal house point page letter mother answer found study still learn should world "
    "model token adapter tenant request cache block batch server gateway engine prompt reply "
    "system user assistant function return value list string error result query price city "
    "capital country river mountain ocean music science history language computer network"
)
_WORDS = _WORD_TEXT.split()

_NON_ASCII = (
    "café naïve résumé façade déjà vu",
    "Grüße aus München, schöne Straße",
    "El niño comió piñata en España",
    "日本語のテキストです。東京は晴れ。",
    "中文文本测试，你好世界",
    "안녕하세요 세계",
    "Привет, мир! Как дела?",
    "Γειά σου κόσμε",
    "مرحبا بالعالم",
    "🙂 😀 🚀 ❤️ 👍🏽 🎉",
    "½ ° € £ ¥ — “quoted” ‘single’ … • ±",
)

_ONSETS = (
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "cl",
    "dr",
    "fl",
    "gr",
    "pl",
    "pr",
    "sh",
    "sl",
    "st",
    "th",
    "tr",
)
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "ie", "oo", "ou")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "x", "nd", "ng", "rk", "st", "th")


def build_demo_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Build the demo Llama checkpoint (Hugging Face layout) into `out_dir` and return it.

    Writes config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and special_tokens_map.json. Existing files are overwritten;
    the same seed always gives the same bytes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(seed)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out_dir / "special_tokens_map.json",
        {
            "bos_token": SPECIAL_TOKENS[0],
            "eos_token": SPECIAL_TOKENS[2],
            "pad_token": SPECIAL_TOKENS[0],
            "unk_token": SPECIAL_TOKENS[0],
        },
    )
    _write_json(out_dir / "config.json", DEMO_CONFIG)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": DEMO_CONFIG["bos_token_id"],
            "eos_token_id": DEMO_CONFIG["eos_token_id"],
            "pad_token_id": DEMO_CONFIG["pad_token_id"],
            "do_sample": False,
        },
    )
    _save_weights(out_dir / "model.safetensors", seed)
    return out_dir


def _write_json(path: Path, obj: object) -> None:
    # Written by hand, not by transformers' save_pretrained: no version stamp, sorted
    # keys, so the bytes do not change with the library.
    path.write_text(
        json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "add_eos_token": False,
        # Cleaning spaces would break the byte-exact round trip of decode(encode(s)).
        "clean_up_tokenization_spaces": False,
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
    }


# --- tokenizer -------------------------------------------------------------------------


def _train_tokenizer(seed: int) -> Tokenizer:
    # The BPE trainer is deterministic for a given corpus: word counts are sums and
    # merge ties break on pair ids. Checked: identical tokenizer.json bytes with
    # RAYON_NUM_THREADS 1, 2 and 7 and any PYTHONHASHSEED.
    tokenizer = Tokenizer(models.BPE())
    # Byte-level on both sides: every string, any script or emoji, round-trips exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=int(DEMO_CONFIG["vocab_size"]),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    if tokenizer.get_vocab_size() != DEMO_CONFIG["vocab_size"]:
        raise RuntimeError(
            f"demo tokenizer has {tokenizer.get_vocab_size()} tokens, "
            f"expected {DEMO_CONFIG['vocab_size']}: enlarge the corpus"
        )
    return tokenizer


def _corpus(seed: int, num_lines: int = 12_000) -> list[str]:
    """English-like prose, numbers, JSON, code and non-ASCII text, all from `seed`."""
    # random.Random is portable: same stream on every platform and Python 3 version.
    rng = random.Random(seed)
    # Made-up words give the trainer enough distinct strings to reach the full vocab.
    lexicon = [_pseudo_word(rng) for _ in range(6000)]
    lines: list[str] = []
    for _ in range(num_lines):
        kind = rng.random()
        if kind < 0.6:
            lines.append(_sentence(rng, lexicon))
        elif kind < 0.72:
            lines.append(_numbers_line(rng, lexicon))
        elif kind < 0.84:
            lines.append(_json_line(rng, lexicon))
        elif kind < 0.92:
            lines.append(_code_line(rng, lexicon))
        else:
            lines.append(rng.choice(_NON_ASCII) + " " + _sentence(rng, lexicon))
    return lines


def _pseudo_word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.randint(1, 3))
    )


def _word(rng: random.Random, lexicon: list[str]) -> str:
    if rng.random() < 0.65:
        return rng.choice(_WORDS)
    # Skewed towards the front of the lexicon: a Zipf-like tail, as in real text.
    return lexicon[int(len(lexicon) * rng.random() ** 2)]


def _sentence(rng: random.Random, lexicon: list[str]) -> str:
    words = [_word(rng, lexicon) for _ in range(rng.randint(4, 16))]
    if len(words) > 6 and rng.random() < 0.4:
        words[rng.randint(2, len(words) - 3)] += ","
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".......?!:")


def _numbers_line(rng: random.Random, lexicon: list[str]) -> str:
    year, month, day = rng.randint(1900, 2099), rng.randint(1, 12), rng.randint(1, 28)
    return (
        f"The {_word(rng, lexicon)} costs ${rng.randint(0, 99_999):,}.{rng.randint(0, 99):02d} "
        f"on {year}-{month:02d}-{day:02d} at {rng.randint(0, 23)}:{rng.randint(0, 59):02d}, "
        f"{rng.randint(0, 100)}% of {rng.randint(2, 10 ** rng.randint(2, 9))} items."
    )


def _json_line(rng: random.Random, lexicon: list[str]) -> str:
    obj: dict[str, object] = {}
    for _ in range(rng.randint(1, 5)):
        key, kind = _word(rng, lexicon), rng.randint(0, 5)
        if kind == 0:
            obj[key] = rng.randint(-1000, 100_000)
        elif kind == 1:
            obj[key] = round(rng.random() * 100, rng.randint(1, 4))
        elif kind == 2:
            obj[key] = rng.choice((True, False, None))
        elif kind == 3:
            obj[key] = [_word(rng, lexicon) for _ in range(rng.randint(0, 4))]
        else:
            obj[key] = " ".join(_word(rng, lexicon) for _ in range(rng.randint(1, 4)))
    return json.dumps(obj, ensure_ascii=False, indent=rng.choice((None, 2)))


def _code_line(rng: random.Random, lexicon: list[str]) -> str:
    name, arg = _word(rng, lexicon), _word(rng, lexicon)
    return (
        f"def {name}_{arg}({arg}: int) -> int:\n"
        f"    if {arg} <= {rng.randint(0, 9)}:\n"
        f"        return {arg} * {rng.randint(2, 99)}\n"
        f"    return {name}_{arg}({arg} - 1) + {rng.randint(1, 9)}  # {_word(rng, lexicon)}\n"
    )


# --- weights ---------------------------------------------------------------------------


def _weight_shapes() -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama parameter names and shapes for `DEMO_CONFIG`."""
    hidden = int(DEMO_CONFIG["hidden_size"])
    inter = int(DEMO_CONFIG["intermediate_size"])
    vocab = int(DEMO_CONFIG["vocab_size"])
    head_dim = int(DEMO_CONFIG["head_dim"])
    q_dim = int(DEMO_CONFIG["num_attention_heads"]) * head_dim
    kv_dim = int(DEMO_CONFIG["num_key_value_heads"]) * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(int(DEMO_CONFIG["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of the random init for one parameter.

    Embeddings at std 1 and projections at 1/sqrt(fan_in) keep every activation
    near unit scale through the layers. lm_head is larger: after the final norm
    the hidden state has norm sqrt(hidden), so logits get std 0.35 * 16 = 5.6 and
    the top two logits sit well apart (tests compare argmaxes across
    implementations).
    """
    if name == "model.embed_tokens.weight":
        return 1.0
    if name == "lm_head.weight":
        return 0.35
    if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
        # Sharper attention than 1/sqrt(fan_in): heads that prefer some positions
        # give the continuation more dependence on context than on the last token.
        return 2.0 / math.sqrt(shape[1])
    return 1.0 / math.sqrt(shape[1])


def _save_weights(path: Path, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _weight_shapes().items():
        # torch.rand's floats are k / 2**24 from the Mersenne twister's integers, so
        # they match bit for bit on every CPU; torch.randn's vectorised Box-Muller uses
        # SLEEF transcendentals chosen per ISA and may differ in the last bit.
        # (2u - 1) is exact in float32; one multiply rounds once. A uniform of the same
        # std is as good an init as a normal (it is nn.Linear's default).
        u = torch.rand(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + (2.0 * u - 1.0) * 0.05  # ones, slightly perturbed
        else:
            tensors[name] = (2.0 * u - 1.0) * (_init_std(name, shape) * math.sqrt(3.0))
    save_file(tensors, str(path), metadata={"format": "pt"})
